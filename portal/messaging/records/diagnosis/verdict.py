"""Whether sending a record again now would fail the same way: the first cause still there
that a new attempt would meet, in the order it meets them (listed in the package's docstring),
with why, what to change first and who can."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from portal.messaging.after_send import suppression
from portal.messaging.records.diagnosis.cause import DEFERRALS, MARKERS, refused_for_good
from portal.messaging.records.diagnosis.reads import Config, Reads, Record, frozen_config, when
from portal.messaging.records.diagnosis.reasons import Reason, admin_of
from portal.messaging.sending.classify import ErrorCategory, MarkerCode, classify
from portal.messaging.sending.preparation import PreparationFailed, Shortfall, tier_of
from portal.models import Channel, Role

# Markers whose record is prepared afresh with a render: the render or content failed.
_RENDER_AGAIN = frozenset({MarkerCode.TEMPLATE_NOT_RESOLVABLE, MarkerCode.CONTENT_INVALID})


@dataclass
class Verdict:
    """A cause a new attempt would meet again: its reason, why (ending with what to change
    first), what to do and the least role that can."""

    reason: Reason
    why: str
    action: str
    who: Role


def verdict_of(
    record: Record,
    reads: Reads,
    now: datetime,
    charged: dict[int, int],
    mine: dict[str, str],
) -> Verdict | None:
    """The first cause still there that a new attempt would meet; None when none is found."""
    tier = tier_of(record)
    if record.expires_at is not None and record.expires_at <= now:
        return Verdict(
            Reason.EXPIRED,
            f"it expired at {when(record.expires_at)}; give a new expiry first",
            "If it is still wanted, retry it with a new, later expiry; or send a new message.",
            Role.SUPPORT,
        )
    everyone = suppression.recipients(record)
    if everyone and len(mine) == len(everyone):
        first = everyone[0]
        why = (
            f"the recipient {first} is suppressed ({mine[first]}); remove the suppression first"
            if len(everyone) == 1
            else f"all {len(everyone)} recipients are suppressed; remove the suppressions first"
        )
        return Verdict(
            Reason.SUPPRESSED,
            why,
            "Check the address with the recipient. If it works again, take it off the "
            "suppression list (with a reason), then retry; otherwise send a new message to "
            "the right one.",
            admin_of(record.tenant_id),
        )
    code, message = record.error_code, record.error_message
    bounced = record.delivery_outcome == "bounced"
    if bounced or refused_for_good(reads.channel, code, message):
        return Verdict(
            Reason.RECIPIENT_REFUSED,
            f"the recipient was refused for good ({code}); check the address first",
            "Check the address or number with the recipient and send a new message to the "
            "right one. Retry anyway only if you know the refusal was a mistake.",
            admin_of(record.tenant_id),
        )
    frozen = reads.config(frozen_config(record), record)
    gone_after_config = (
        record.prepared_at is not None
        and (frozen is None or not frozen.enabled)
        and record.error_code == MarkerCode.CONFIG_NOT_RESOLVABLE.value
    )
    config: Config | None = frozen
    if record.prepared_at is None or gone_after_config:
        marker = (code or "").strip().upper()
        render = record.prepared_at is None and marker in _RENDER_AGAIN
        chosen = reads.choose(record, render=render)
        if isinstance(chosen, PreparationFailed):
            return _preparation_verdict(record, reads, chosen, tier)
        config = chosen
    elif frozen_config(record) is not None and (frozen is None or not frozen.enabled):
        asked = frozen_config(record)
        name = frozen.name if frozen is not None else None
        state = "disabled" if frozen is not None else "missing"
        what = f"{reads.noun} {name!r}" if name else f"{reads.noun} {asked}"
        return Verdict(
            Reason.SERVER_DISABLED,
            f"the {what} it was prepared for is {state}; enable it first",
            f"Enable the {what} again, then retry. Or retry twice: the first attempt fails "
            "for the want of it, and a retry after that chooses another.",
            admin_of(frozen.tenant_id if frozen is not None else tier),
        )
    if config is not None:
        down = reads.down.get(config.id)
        if down is not None:
            where = reads.where(config.id, config.name)
            return Verdict(
                Reason.SERVER_DOWN,
                f"{where} is down ({down}); it must answer again first",
                f"Check {where}: is it running, and are its address and port right? Records "
                "waiting for it go out by themselves once it answers; retry this one then.",
                admin_of(config.tenant_id),
            )
        answered = _last_answer(record, reads, config)
        if answered is not None:
            return answered
    if record.prepared_at is None:
        used, limit = reads.quota(tier)
        if limit is not None and used + charged.get(tier, 0) >= limit:
            name = reads.tier_name(tier)
            why = (
                f"the quota of {name} is full ({used:,} of {limit:,}); raise it first"
                if used >= limit
                else f"the quota of {name} has room for {limit - used:,} more "
                f"({used:,} of {limit:,}) and this selection needs more; raise it first"
            )
            noun = reads.parts.noun
            return Verdict(
                Reason.QUOTA_FULL,
                why,
                f"Raise this month's {noun} quota of {name} (Quotas), then retry.",
                Role.PLATFORM_OPERATOR,
            )
        charged[tier] = charged.get(tier, 0) + 1
    return None


def _preparation_verdict(
    record: Record, reads: Reads, failure: PreparationFailed, tier: int
) -> Verdict:
    """A retry would stop at preparation again: preparation's own words, and what to add."""
    shortfall = failure.shortfall
    code = record.template_code or (f"id {record.template_id}" if record.template_id else "")
    name = reads.tier_name(tier)
    admin = admin_of(tier)
    country = (getattr(record, "country_code", None) or "").upper() or "(unknown)"
    if shortfall is Shortfall.NO_TEMPLATE:
        return Verdict(
            Reason.NO_TEMPLATE,
            f"template `{code}` does not exist",
            f"Create the template `{code}` in {name} (Templates), then retry.",
            admin,
        )
    if shortfall is Shortfall.TEMPLATE_DISABLED:
        return Verdict(
            Reason.TEMPLATE_DISABLED,
            f"template `{code}` is disabled; enable it first",
            f"Enable the template `{code}` in {name}, then retry.",
            admin,
        )
    if shortfall is Shortfall.TEMPLATE_BROKEN:
        return Verdict(
            Reason.TEMPLATE_BROKEN,
            f"{failure.message}; fix the template first",
            f"Fix the template `{code}` in {name} ({failure.message}), then retry.",
            admin,
        )
    if shortfall is Shortfall.CONTENT_INVALID:
        return Verdict(
            Reason.CONTENT_INVALID,
            f"{failure.message}; fix the content first",
            f"Fix the template `{code}` or the content the caller gives ({failure.message}); "
            "a record whose own content is wrong needs a new message."
            if code
            else f"The content the caller gave is refused ({failure.message}): send a new "
            "message with it fixed.",
            admin,
        )
    if shortfall is Shortfall.NO_BINDING:
        return Verdict(
            Reason.NO_BINDING,
            f"template `{code}` has no binding for {country} at the providers that serve "
            f"{country}; add a binding first",
            f"Add a binding for {country} to the SMS template `{code}` in {name}, at a "
            f"provider that serves {country}, then retry.",
            admin,
        )
    if shortfall is Shortfall.NO_ROUTE:
        if reads.channel is Channel.MAIL:
            return Verdict(
                Reason.NO_ROUTE,
                f"{name} has no enabled mail server marked default; add or enable one first",
                f"Mark an enabled mail server as the default in {name}, then retry.",
                admin,
            )
        return Verdict(
            Reason.NO_ROUTE,
            f"no SMS provider serves {country} in {name}: no route for it and no default "
            "provider; add one first",
            f"Add a route for {country} to an enabled SMS provider in {name}, or mark one as "
            "the default, then retry.",
            admin,
        )
    if shortfall is Shortfall.SERVER_DISABLED:
        return Verdict(
            Reason.SERVER_DISABLED,
            f"{failure.message}; enable it first",
            f"Enable it in {name} ({failure.message}): the send or its template names it, "
            "so no other is chosen. Then retry.",
            admin,
        )
    if shortfall is Shortfall.SERVER_MISCONFIGURED:
        return Verdict(
            Reason.SERVER_MISCONFIGURED,
            f"{failure.message}; fix it first",
            f"Fix the {reads.noun}'s configuration in {name} ({failure.message}), then retry.",
            admin,
        )
    # QUOTA_FULL is the charge's, which a dry run never makes: read by the caller.
    raise AssertionError(f"preparation stopped at {shortfall}, which a dry run never reaches")


def _last_answer(record: Record, reads: Reads, config: Config) -> Verdict | None:
    """What the server or provider answered last, when it would answer the same: our
    credentials, its configuration or the message as prepared refused, and its configuration
    not saved since."""
    code, message = record.error_code, record.error_message
    upper = (code or "").strip().upper()
    if upper in MARKERS or upper in DEFERRALS or not upper:
        return None
    category = classify(code, message)
    if category not in (ErrorCategory.AUTH, ErrorCategory.CONFIG, ErrorCategory.INVALID_INPUT):
        return None
    attempt = reads.last.get(record.id)
    failed_at = attempt.finished_at if attempt is not None else record.updated_time
    if (
        failed_at is not None
        and config.updated_time is not None
        and config.updated_time > failed_at
    ):
        return None  # saved since: the fix may be in
    where = reads.where(config.id, config.name)
    admin = admin_of(config.tenant_id)
    if category is ErrorCategory.AUTH:
        return Verdict(
            Reason.CREDENTIALS_REFUSED,
            f"{where} refused our credentials ({code}) and they have not changed since; "
            "fix them first",
            f"Fix the username, password or API key of {where}, then retry.",
            admin,
        )
    if category is ErrorCategory.CONFIG:
        return Verdict(
            Reason.SERVER_MISCONFIGURED,
            f"{where} cannot be used as configured ({code}) and its configuration has not "
            "changed since; fix it first",
            f"Fix the configuration of {where} ({message or code}), then retry.",
            admin,
        )
    return Verdict(
        Reason.MESSAGE_REFUSED,
        f"{where} refused the message as prepared ({code}); it is sent the same again",
        "A retry sends the same prepared message to the same server: send a new message "
        f"with the content fixed, or change {where} to one that takes it, then retry.",
        admin,
    )
