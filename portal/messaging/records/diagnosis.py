"""One diagnosis of a send record: what happened, whether sending it again now would fail the
same way and why, what to do, and which role can do it.

Every page and endpoint that shows or acts on a record's state asks this module: the record
page's panel and its Retry, bulk retry's plan, the operator API's retries, the dead-letter and
"Needs a decision" pages, the recipient page and the API's record GET. None of them works out a
cause, advice or retry verdict of its own, so they cannot disagree. ``diagnose_many`` serves a
selection: each tier's configuration, its servers' health, the suppressions, the quotas and the
last attempts are read once for all of it; ``diagnose`` is the same for one record.

The verdict reads the causes as they are now, not the record's status or error code, in the
order an attempt would meet them; the first found answers:

1. past its ``expiresAt``: EXPIRED (a retry needs a new expiry);
2. every recipient on the tenant's suppression list: SUPPRESSED;
3. the last answer refused the recipient for good (a 5xx refusal, a hard bounce, a provider's
   "invalid number"): RECIPIENT_REFUSED;
4. preparation, by its own steps (``preparation.dry_run``), for a record not prepared yet or
   one whose server or provider is gone after CONFIG_NOT_RESOLVABLE (a retry chooses again):
   the template (NO_TEMPLATE, TEMPLATE_DISABLED, TEMPLATE_BROKEN), the content
   (CONTENT_INVALID), the choice (NO_ROUTE, NO_BINDING, SERVER_DISABLED,
   SERVER_MISCONFIGURED). The template is rendered again only for a record whose last failure
   was the render or the content (TEMPLATE_NOT_RESOLVABLE, CONTENT_INVALID); any other
   record rendered, or has not been tried;
5. the server or provider it was prepared for, missing or disabled: SERVER_DISABLED (the next
   attempt fails CONFIG_NOT_RESOLVABLE);
6. that server or provider down, as its health says it on its page (``health.states``):
   "Failing" (its recent attempts could not reach it, the breaker open or not yet) or
   "Paused by the breaker": SERVER_DOWN, naming that line;
7. what it answered last, unless its configuration was saved since: our credentials refused
   (CREDENTIALS_REFUSED), it cannot send as configured (SERVER_MISCONFIGURED), the message as
   prepared refused (MESSAGE_REFUSED);
8. the monthly quota of a record still to be charged, the selection's records counted in turn,
   oldest first: QUOTA_FULL.

Anything else (a temporary fault, a full rate-limit window, a stuck send, an error we do not
recognise) is not known to fail again. An earlier attempt that may have been delivered
(``ambiguous``) is no failure, but a retry asks first all the same: it may deliver twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import Engine, or_, select
from sqlalchemy.orm import Session

from portal.config import Settings
from portal.messaging.after_send import suppression
from portal.messaging.records.retry import REFUSAL_REASONS
from portal.messaging.sending import health, preparation, quota
from portal.messaging.sending.classify import (
    DEFERRAL_HELP,
    MARKER_HELP,
    DeferralCode,
    ErrorCategory,
    MarkerCode,
    classify,
    is_retryable,
)
from portal.messaging.sending.preparation import PreparationFailed, Shortfall, tier_of
from portal.models import (
    Channel,
    MailSendRecord,
    MailSendServerConfig,
    Role,
    SendAttempt,
    SendStatus,
    SmsProviderConfig,
    SmsSendRecord,
    Suppression,
    Tenant,
    TenantMessageUsage,
)
from portal.models.enums import RETRYABLE_BY_HAND
from portal.tenancy import PLATFORM_TENANT_ID, names_config

Record = MailSendRecord | SmsSendRecord
Config = MailSendServerConfig | SmsProviderConfig


class Reason(StrEnum):
    """Why sending a record again now would fail the same way."""

    EXPIRED = "EXPIRED"
    SUPPRESSED = "SUPPRESSED"
    RECIPIENT_REFUSED = "RECIPIENT_REFUSED"
    NO_TEMPLATE = "NO_TEMPLATE"
    TEMPLATE_DISABLED = "TEMPLATE_DISABLED"
    TEMPLATE_BROKEN = "TEMPLATE_BROKEN"
    CONTENT_INVALID = "CONTENT_INVALID"
    NO_ROUTE = "NO_ROUTE"
    NO_BINDING = "NO_BINDING"
    SERVER_DISABLED = "SERVER_DISABLED"
    SERVER_MISCONFIGURED = "SERVER_MISCONFIGURED"
    SERVER_DOWN = "SERVER_DOWN"
    CREDENTIALS_REFUSED = "CREDENTIALS_REFUSED"
    MESSAGE_REFUSED = "MESSAGE_REFUSED"
    QUOTA_FULL = "QUOTA_FULL"


# How each reason reads in a count ("3 would fail again: server down").
REASON_LABEL: dict[Reason, str] = {
    Reason.EXPIRED: "expired",
    Reason.SUPPRESSED: "recipient suppressed",
    Reason.RECIPIENT_REFUSED: "recipient refused for good",
    Reason.NO_TEMPLATE: "no such template",
    Reason.TEMPLATE_DISABLED: "template disabled",
    Reason.TEMPLATE_BROKEN: "template does not render",
    Reason.CONTENT_INVALID: "content invalid",
    Reason.NO_ROUTE: "no server or provider for it",
    Reason.NO_BINDING: "no template binding for the country",
    Reason.SERVER_DISABLED: "server or provider missing or disabled",
    Reason.SERVER_MISCONFIGURED: "server or provider misconfigured",
    Reason.SERVER_DOWN: "server or provider down",
    Reason.CREDENTIALS_REFUSED: "credentials refused",
    Reason.MESSAGE_REFUSED: "message refused",
    Reason.QUOTA_FULL: "monthly quota full",
}

# The least role that can act, by rank: a role can do what the roles below it can.
_RANK = {Role.SUPPORT: 0, Role.TENANT_ADMIN: 1, Role.PLATFORM_OPERATOR: 2}
ROLE_WORDS = {
    Role.SUPPORT: "support staff",
    Role.TENANT_ADMIN: "a tenant admin (or a platform operator)",
    Role.PLATFORM_OPERATOR: "a platform operator",
}

# What a record's cause is called, by its error code or category (the panel's heading).
MARKER_TITLE: dict[MarkerCode, str] = {
    MarkerCode.TEMPLATE_NOT_RESOLVABLE: "Template missing, disabled or broken",
    MarkerCode.CONFIG_NOT_RESOLVABLE: "Send configuration incomplete",
    MarkerCode.MONTHLY_QUOTA_EXCEEDED: "Monthly quota used up",
    MarkerCode.CONTENT_INVALID: "Content invalid",
    MarkerCode.QUOTA_EXCEEDED: "Rate-limit window full",
    MarkerCode.RATE_LIMIT_UNAVAILABLE: "Rate-limit check unavailable",
    MarkerCode.ZOMBIE_RECOVERED: "Stuck send recovered",
    MarkerCode.ZOMBIE_EXHAUSTED: "Stuck send, retries used up",
    MarkerCode.EXPIRED: "Expired before sending",
    MarkerCode.RETRY_WINDOW_EXPIRED: "Retry window ran out",
    MarkerCode.SUPPRESSED: "Recipient on the suppression list",
    MarkerCode.RESOLVED_FAILED: "Resolved as failed",
}
DEFERRAL_TITLE: dict[DeferralCode, str] = {
    DeferralCode.SERVER_UNAVAILABLE: "Waiting for the server to come back",
    DeferralCode.SERVER_BUSY: "Waiting for a slow server",
}
CATEGORY_TITLE: dict[ErrorCategory, str] = {
    ErrorCategory.TRANSIENT: "Temporary fault",
    ErrorCategory.QUOTA: "Rate limit or quota",
    ErrorCategory.UNKNOWN: "Unrecognised error",
    ErrorCategory.PERMANENT: "Recipient refused",
    ErrorCategory.INVALID_INPUT: "Invalid message or recipient",
    ErrorCategory.AUTH: "Credentials refused",
    ErrorCategory.CONFIG: "Configuration incomplete",
}
STATUS_TITLE: dict[SendStatus, str] = {
    SendStatus.PENDING: "Waiting to send",
    SendStatus.SENDING: "Sending now",
    SendStatus.SENT: "Sent",
    SendStatus.CANCELLED: "Cancelled",
    SendStatus.SUPPRESSED: "Recipient on the suppression list",
    SendStatus.UNCERTAIN: "Outcome unknown",
}

# Preparation's own markers: the error message is preparation's words for what stopped it.
_PREPARATION = frozenset(
    {
        MarkerCode.TEMPLATE_NOT_RESOLVABLE,
        MarkerCode.CONFIG_NOT_RESOLVABLE,
        MarkerCode.MONTHLY_QUOTA_EXCEEDED,
        MarkerCode.CONTENT_INVALID,
    }
)
# Markers whose record is prepared afresh with a render: the render or content failed.
_RENDER_AGAIN = frozenset({MarkerCode.TEMPLATE_NOT_RESOLVABLE, MarkerCode.CONTENT_INVALID})
_MARKERS = frozenset(m.value for m in MarkerCode)
_DEFERRALS = frozenset(d.value for d in DeferralCode)
# Transport codes for no answer at all: the server or provider could not be reached.
_UNREACHED = frozenset({"NETWORK_ERROR", "TIMEOUT"})
LONG_WAIT_S = 300.0  # a record Pending or Sending longer than this deserves a word

# The record columns a diagnosis reads (pages that load only some columns add these).
COLUMNS = (
    "id",
    "tenant_id",
    "scope",
    "status",
    "retry_count",
    "attempt_count",
    "next_retry_at",
    "error_code",
    "error_message",
    "template_id",
    "template_code",
    "variables",
    "expires_at",
    "pinned_template_version",
    "prepared_at",
    "ambiguous_attempt",
    "ambiguous_at",
    "ambiguous_reason",
    "delivery_outcome",
    "resolution",
    "created_time",
    "updated_time",
    "sent_at",
)
MAIL_COLUMNS = (
    "to_addrs",
    "cc_addrs",
    "bcc_addrs",
    "subject",
    "html_body",
    "text_body",
    "reply_to",
    "server_id",
    "server_config_id",
    "bounce_code",
)
SMS_COLUMNS = ("phone_number", "country_code", "content", "provider_config_id")


@dataclass(frozen=True)
class Diagnosis:
    """What the product knows about one record, for whoever looks or acts."""

    title: str  # what happened, in a few words ("Recipient refused")
    cause: str  # what happened, specific to this record's error and attempt
    would_fail_again: bool  # sending it again now would fail the same way
    reason: Reason | None  # why, when it would
    why: str | None  # why, in a line that ends with what to change first (bulk retry's words)
    action: str  # what to do next
    who: Role  # the least role that can do it
    retryable: bool  # its status lets a person retry it
    refusal: str | None  # why its status does not, when it does not
    ambiguous: bool  # an earlier attempt may have been delivered: a retry may deliver twice
    suppressed: dict[str, str] = field(default_factory=dict)  # its recipients on the list: why
    notes: tuple[str, ...] = ()

    @property
    def asks_first(self) -> bool:
        """A person's Retry asks before requeuing (naming the reason or the risk)."""
        return self.retryable and (self.would_fail_again or self.ambiguous)

    def can_act(self, role: Role | str) -> bool:
        """Whether ``role`` can do what ``action`` says."""
        return _RANK[Role(role)] >= _RANK[self.who]

    @property
    def who_words(self) -> str:
        """Who can act, as a sentence names them ("a platform operator")."""
        return ROLE_WORDS[self.who]


def _admin_of(tier: int) -> Role:
    """Who changes a tier's configuration, templates and suppressions."""
    return Role.PLATFORM_OPERATOR if tier == PLATFORM_TENANT_ID else Role.TENANT_ADMIN


def _when(moment: datetime | None) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC") if moment else "an unknown time"


def _frozen_config(record: Record) -> int | None:
    if isinstance(record, MailSendRecord):
        return record.server_config_id
    return record.provider_config_id


def refused_for_good(channel: Channel, code: str | None, message: str | None) -> bool:
    """Whether a server's or provider's answer refused the recipient for good: a permanent
    refusal (550, 551, 553, "no such user"), or a provider's code for a number it never
    delivers to. Our own markers are not answers."""
    normalised = (code or "").strip().upper()
    if normalised in _MARKERS or normalised in _DEFERRALS:
        return False
    if suppression.refuses_recipient(channel, code):
        return True
    return classify(code, message) is ErrorCategory.PERMANENT


# --- what the checks read, once per selection ------------------------------------------------


class _Reads:
    """What diagnoses read beyond the records, read once for a selection."""

    def __init__(
        self,
        session: Session,
        channel: Channel,
        records: Sequence[Record],
        settings: Settings,
        operator: bool,
    ) -> None:
        self.session = session
        self.channel = channel
        self.settings = settings
        self.operator = operator
        bind = session.get_bind()
        self.engine: Engine = bind if isinstance(bind, Engine) else bind.engine
        self.noun = "mail server" if channel is Channel.MAIL else "SMS provider"
        self.model: Any = MailSendServerConfig if channel is Channel.MAIL else SmsProviderConfig
        self.month = quota.current_month()
        self._names: dict[int, str] = {}
        self._quota: dict[int, tuple[int, int | None]] = {}
        self._choices: dict[tuple[Any, ...], Config | PreparationFailed] = {}
        self.configs: dict[int, Config] = {}
        self.down: dict[int, str] = {}  # config id -> its health's line, when failing
        self._health: dict[int, health.State] = {}
        self.suppressed = self._suppressions(records)
        self.last = self._last_attempts(records)
        named = {a.config_id for a in self.last.values() if a.config_id is not None}
        frozen = {c for r in records if (c := _frozen_config(r)) is not None}
        # Every server or provider the selection's tiers could choose: one read, one health.
        tiers = {tier_of(r) for r in records} | {r.tenant_id for r in records}
        self._load_configs(named | frozen, tiers | {PLATFORM_TENANT_ID})

    # -- the tiers' names and quotas --

    def tier_name(self, tier: int) -> str:
        if tier not in self._names:
            found = self.session.scalar(select(Tenant.name).where(Tenant.id == tier))
            self._names[tier] = (
                "the platform tier" if tier == PLATFORM_TENANT_ID else (found or f"tenant {tier}")
            )
        return self._names[tier]

    def quota(self, tier: int) -> tuple[int, int | None]:
        """This month's count and the ceiling in force (None: no ceiling)."""
        if tier not in self._quota:
            limit = quota.limit_for(self.session, tier, self.channel, self.settings)
            row = self.session.scalar(
                select(TenantMessageUsage).where(
                    TenantMessageUsage.tenant_id == tier, TenantMessageUsage.month == self.month
                )
            )
            used = 0
            if row is not None:
                used = row.mail_count if self.channel is Channel.MAIL else row.sms_count
            self._quota[tier] = (int(used or 0), limit)
        return self._quota[tier]

    # -- suppressions and attempts --

    def _suppressions(self, records: Sequence[Record]) -> dict[tuple[int, str], str]:
        """(tenant, address) -> why, for the selection's recipients on the list."""
        wanted: dict[int, set[str]] = {}
        for record in records:
            wanted.setdefault(record.tenant_id, set()).update(suppression.recipients(record))
        found: dict[tuple[int, str], str] = {}
        for tenant_id, addresses in wanted.items():
            if not addresses:
                continue
            lookup = {a: a for a in addresses} | {suppression.hashed(a): a for a in addresses}
            rows = self.session.execute(
                select(
                    Suppression.address,
                    Suppression.reason,
                    Suppression.created_time,
                    Suppression.detail,
                ).where(
                    Suppression.tenant_id == tenant_id,
                    Suppression.channel == self.channel.value,
                    Suppression.address.in_(list(lookup)),
                    Suppression.removed_at.is_(None),
                )
            )
            for address, reason, created, detail in rows:
                why = f"{str(reason).replace('_', ' ')} since {_when(created)}"
                if detail:
                    why += f": {detail[:200]}"
                found[(tenant_id, lookup[address])] = why
        return found

    def _last_attempts(self, records: Sequence[Record]) -> dict[int, SendAttempt]:
        """Each record's last attempt that reached the transport (its attempts' index)."""
        ids = [r.id for r in records if r.attempt_count]
        last: dict[int, SendAttempt] = {}
        for start in range(0, len(ids), 1000):
            rows = self.session.scalars(
                select(SendAttempt).where(
                    SendAttempt.channel == self.channel.value,
                    SendAttempt.record_id.in_(ids[start : start + 1000]),
                )
            )
            for row in rows:
                if row.record_id not in last or row.number > last[row.record_id].number:
                    last[row.record_id] = row
        return last

    # -- servers and providers --

    def _load_configs(self, ids: set[int], tiers: set[int] | None = None) -> None:
        """Read the configs ``ids`` and every config of ``tiers``, then their health."""
        model = self.model
        wanted = ids - set(self.configs)
        if wanted or tiers:
            query = select(model).where(
                or_(model.id.in_(wanted), model.tenant_id.in_(tiers or set()))
            )
            for row in self.session.scalars(query):
                self.configs.setdefault(row.id, row)
        self._load_down(ids | set(self.configs))

    def config(self, config_id: int | None, record: Record) -> Config | None:
        """The server or provider ``config_id`` if the record may use it (its own tier or
        the platform's)."""
        row = self.configs.get(config_id) if config_id is not None else None
        if row is None or row.tenant_id not in (record.tenant_id, PLATFORM_TENANT_ID):
            return None
        return row

    def choose(self, record: Record, *, render: bool) -> Config | PreparationFailed:
        """Preparation's choice for ``record`` now (``preparation.dry_run``); without a
        render, the same for every record of one template, tier and route, so asked once."""
        key: tuple[Any, ...] | None = None
        if not render:
            route = record.server_id if isinstance(record, MailSendRecord) else record.country_code
            key = (
                record.scope,
                tier_of(record),
                record.template_id,
                record.template_code,
                record.pinned_template_version,
                route,
            )
            if key in self._choices:
                return self._choices[key]
        try:
            found: Config | PreparationFailed = preparation.dry_run(
                self.engine, record, self.settings, render=render
            )
        except PreparationFailed as failure:
            found = failure
        if not isinstance(found, PreparationFailed):
            self.configs.setdefault(found.id, found)
            self._load_down({found.id})
        if key is not None:
            self._choices[key] = found
        return found

    def _load_down(self, ids: set[int]) -> None:
        """Which of ``ids`` are down, and why: their health (``health.states``, the answer the
        servers and providers pages show), failing or paused by the breaker. The selection's
        tiers are read at once, so a choice made later by ``choose`` is already known."""
        ids = ids - set(self._health)
        if not ids:
            return
        window = self.settings.health_window_s
        found = health.states(self.session, self.channel, ids, window_s=window)
        self._health |= {i: found.get(i, health.QUIET) for i in ids}
        self.down |= {i: state.text for i, state in found.items() if state.failing}


# --- the diagnosis ------------------------------------------------------------------------------


@dataclass
class _Verdict:
    reason: Reason
    why: str
    action: str
    who: Role


def diagnose_many(
    session: Session,
    channel: Channel,
    records: Sequence[Record],
    settings: Settings,
    *,
    operator: bool = False,
    now: datetime | None = None,
) -> dict[int, Diagnosis]:
    """Record id -> its diagnosis, for ``records`` (already scoped by the caller).
    ``operator``: the viewer is a platform operator, who sees the platform's servers and
    providers by name (``tenancy.names_config``)."""
    reads = _Reads(session, channel, records, settings, operator)
    moment = now or datetime.now(UTC)
    found: dict[int, Diagnosis] = {}
    charged: dict[int, int] = {}  # per tier, the selection's records counted against its room
    for record in sorted(records, key=lambda r: r.id):  # the oldest first, as the claim goes
        found[record.id] = _diagnose(record, reads, moment, charged)
    return found


def diagnose(
    session: Session,
    channel: Channel,
    record: Record,
    settings: Settings,
    *,
    operator: bool = False,
) -> Diagnosis:
    """The diagnosis of one record (``diagnose_many`` of one)."""
    return diagnose_many(session, channel, [record], settings, operator=operator)[record.id]


def _diagnose(record: Record, reads: _Reads, now: datetime, charged: dict[int, int]) -> Diagnosis:
    try:
        status = SendStatus(record.status)
    except ValueError:
        status = None
    retryable = status in RETRYABLE_BY_HAND
    refusal = None if retryable else _refusal(record.status)
    mine = {
        a: why
        for a in suppression.recipients(record)
        if (why := reads.suppressed.get((record.tenant_id, a))) is not None
    }
    title, cause = _cause(record, status, reads, now)
    verdict = None
    if status not in (SendStatus.SENT, SendStatus.SENDING, SendStatus.CANCELLED, None):
        verdict = _verdict(record, reads, now, charged, mine)
    action, who, notes = _next_step(record, status, verdict, reads, now)
    return Diagnosis(
        title=title,
        cause=cause,
        would_fail_again=verdict is not None,
        reason=verdict.reason if verdict else None,
        why=verdict.why if verdict else None,
        action=action,
        who=who,
        retryable=retryable,
        refusal=refusal,
        ambiguous=bool(record.ambiguous_attempt),
        suppressed=mine,
        notes=notes,
    )


def _refusal(status: str) -> str:
    return REFUSAL_REASONS.get(status, f"its status {status} cannot be retried")


# --- what happened ----------------------------------------------------------------------------


def _where(reads: _Reads, config_id: int | None, name: str | None = None) -> str:
    """The server or provider, as this viewer may see it named (``tenancy.names_config``)."""
    if config_id is not None and config_id not in reads.configs:
        reads._load_configs({config_id})
    row = reads.configs.get(config_id) if config_id is not None else None
    name = name or (row.name if row is not None else None)
    if name is None:
        return f"the {reads.noun}"
    if names_config(row.tenant_id if row is not None else None, reads.operator):
        return f"the {reads.noun} {name!r}"
    return f"the platform {'mail' if reads.channel is Channel.MAIL else 'SMS'} service"


def _sentence(text: str) -> str:
    """``text`` as a sentence: a capital first, one full stop last."""
    text = text.strip().rstrip(".")
    return f"{text[:1].upper()}{text[1:]}." if text else ""


def _cause(
    record: Record, status: SendStatus | None, reads: _Reads, now: datetime
) -> tuple[str, str]:
    """(title, cause): what happened to the record, in its own particulars."""
    if status is None:
        return record.status, f"The status {record.status!r} is not one we know."
    if status is SendStatus.SENT:
        where = _where(reads, _frozen_config(record))
        return STATUS_TITLE[status], _sentence(
            f"{where} accepted it at {_when(record.sent_at)}, so any problem is further along"
        )
    if status is SendStatus.PENDING and not record.error_code:
        return STATUS_TITLE[status], (
            f"Accepted at {_when(record.created_time)} and waiting for a delivery worker."
        )
    if status is SendStatus.SENDING:
        return STATUS_TITLE[status], "A delivery worker is sending it right now."
    if status is SendStatus.CANCELLED:
        return STATUS_TITLE[status], "It was stopped before it was sent."
    code = (record.error_code or "").strip()
    message = (record.error_message or "").strip()
    attempt = reads.last.get(record.id)
    upper = code.upper()
    if upper in _MARKERS:
        marker = MarkerCode(upper)
        title = MARKER_TITLE[marker]
        if marker in _PREPARATION:
            cause = f"It could not be prepared: {message or MARKER_HELP[marker][0]}"
        else:
            cause = MARKER_HELP[marker][0]
            if message:
                cause += f" ({message})"
    elif upper in _DEFERRALS:
        deferral = DeferralCode(upper)
        title = DEFERRAL_TITLE[deferral]
        cause = message or DEFERRAL_HELP[deferral][0]
    elif code or message:
        title, cause = _answer(record, reads, attempt, code, message)
    else:
        title, cause = STATUS_TITLE.get(status, status.value), ""
    if record.ambiguous_attempt:
        if status is SendStatus.UNCERTAIN:
            title = STATUS_TITLE[status]
        cause = cause.rstrip(".") + (
            f". An attempt at {_when(record.ambiguous_at)} got no answer after the message was "
            "handed over, so it may have been delivered"
        )
    if status is SendStatus.RETRY and upper not in _DEFERRALS:
        cause = cause.rstrip(".") + f". It is tried again at {_when(record.next_retry_at)}"
    elif status is SendStatus.DEAD_LETTER:
        cause = cause.rstrip(".") + (
            f". Its automatic retries are used up ({record.retry_count} made)"
        )
    elif status is SendStatus.SUPPRESSED and upper != MarkerCode.SUPPRESSED.value:
        title = STATUS_TITLE[status]
    return title, _sentence(cause)


def _answer(
    record: Record,
    reads: _Reads,
    attempt: SendAttempt | None,
    code: str,
    message: str,
) -> tuple[str, str]:
    """(title, cause) of a failure the server or provider answered (or did not)."""
    category = classify(code, message)
    config_id = attempt.config_id if attempt is not None else _frozen_config(record)
    where = _where(reads, config_id, attempt.config_name if attempt else None)
    at = _when(attempt.finished_at if attempt is not None else record.updated_time)
    said = " ".join(x for x in (code, message) if x)
    to = _one_recipient(record)
    if record.delivery_outcome == "bounced" and category is not ErrorCategory.AUTH:
        return "Bounced", f"It was sent, then bounced{f' for {to}' if to else ''}: {said}"
    if refused_for_good(reads.channel, code, message):
        whom = f" {to}" if to else " the recipient"
        return CATEGORY_TITLE[ErrorCategory.PERMANENT], f"{where} refused{whom} at {at}: {said}"
    if code.upper() in _UNREACHED:
        if record.ambiguous_attempt:
            return "No answer", f"{where} did not answer at {at}: {said}"
        return "Server unreachable", f"{where} could not be reached at {at}: {said}"
    verbs = {
        ErrorCategory.INVALID_INPUT: "refused the message",
        ErrorCategory.AUTH: "refused our credentials",
        ErrorCategory.CONFIG: "could not be used as configured",
        ErrorCategory.QUOTA: "refused it for a rate limit or quota",
        ErrorCategory.TRANSIENT: "answered with a temporary fault",
        ErrorCategory.UNKNOWN: "failed with an error we do not recognise",
    }
    verb = verbs.get(category, "failed")
    if attempt is None and category is ErrorCategory.UNKNOWN:
        return CATEGORY_TITLE[category], f"It failed with an error we do not recognise: {said}"
    return CATEGORY_TITLE[category], f"{where} {verb} at {at}: {said}"


def _one_recipient(record: Record) -> str | None:
    found = suppression.recipients(record)
    return found[0] if len(found) == 1 else None


# --- would it fail again --------------------------------------------------------------------


def _verdict(
    record: Record,
    reads: _Reads,
    now: datetime,
    charged: dict[int, int],
    mine: dict[str, str],
) -> _Verdict | None:
    """The first cause still there that a new attempt would meet; None when none is found."""
    tier = tier_of(record)
    if record.expires_at is not None and record.expires_at <= now:
        return _Verdict(
            Reason.EXPIRED,
            f"it expired at {_when(record.expires_at)}; give a new expiry first",
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
        return _Verdict(
            Reason.SUPPRESSED,
            why,
            "Check the address with the recipient. If it works again, take it off the "
            "suppression list (with a reason), then retry; otherwise send a new message to "
            "the right one.",
            _admin_of(record.tenant_id),
        )
    code, message = record.error_code, record.error_message
    bounced = record.delivery_outcome == "bounced"
    if bounced or refused_for_good(reads.channel, code, message):
        return _Verdict(
            Reason.RECIPIENT_REFUSED,
            f"the recipient was refused for good ({code}); check the address first",
            "Check the address or number with the recipient and send a new message to the "
            "right one. Retry anyway only if you know the refusal was a mistake.",
            _admin_of(record.tenant_id),
        )
    frozen = reads.config(_frozen_config(record), record)
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
    elif _frozen_config(record) is not None and (frozen is None or not frozen.enabled):
        asked = _frozen_config(record)
        name = frozen.name if frozen is not None else None
        state = "disabled" if frozen is not None else "missing"
        what = f"{reads.noun} {name!r}" if name else f"{reads.noun} {asked}"
        return _Verdict(
            Reason.SERVER_DISABLED,
            f"the {what} it was prepared for is {state}; enable it first",
            f"Enable the {what} again, then retry. Or retry twice: the first attempt fails "
            "for the want of it, and a retry after that chooses another.",
            _admin_of(frozen.tenant_id if frozen is not None else tier),
        )
    if config is not None:
        down = reads.down.get(config.id)
        if down is not None:
            where = _where(reads, config.id, config.name)
            return _Verdict(
                Reason.SERVER_DOWN,
                f"{where} is down ({down}); it must answer again first",
                f"Check {where}: is it running, and are its address and port right? Records "
                "waiting for it go out by themselves once it answers; retry this one then.",
                _admin_of(config.tenant_id),
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
            noun = "mail" if reads.channel is Channel.MAIL else "SMS"
            return _Verdict(
                Reason.QUOTA_FULL,
                why,
                f"Raise this month's {noun} quota of {name} (Quotas), then retry.",
                Role.PLATFORM_OPERATOR,
            )
        charged[tier] = charged.get(tier, 0) + 1
    return None


def _preparation_verdict(
    record: Record, reads: _Reads, failure: PreparationFailed, tier: int
) -> _Verdict:
    """A retry would stop at preparation again: preparation's own words, and what to add."""
    shortfall = failure.shortfall
    code = record.template_code or (f"id {record.template_id}" if record.template_id else "")
    name = reads.tier_name(tier)
    admin = _admin_of(tier)
    country = (getattr(record, "country_code", None) or "").upper() or "(unknown)"
    if shortfall is Shortfall.NO_TEMPLATE:
        return _Verdict(
            Reason.NO_TEMPLATE,
            f"template `{code}` does not exist",
            f"Create the template `{code}` in {name} (Templates), then retry.",
            admin,
        )
    if shortfall is Shortfall.TEMPLATE_DISABLED:
        return _Verdict(
            Reason.TEMPLATE_DISABLED,
            f"template `{code}` is disabled; enable it first",
            f"Enable the template `{code}` in {name}, then retry.",
            admin,
        )
    if shortfall is Shortfall.TEMPLATE_BROKEN:
        return _Verdict(
            Reason.TEMPLATE_BROKEN,
            f"{failure.message}; fix the template first",
            f"Fix the template `{code}` in {name} ({failure.message}), then retry.",
            admin,
        )
    if shortfall is Shortfall.CONTENT_INVALID:
        return _Verdict(
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
        return _Verdict(
            Reason.NO_BINDING,
            f"template `{code}` has no binding for {country} at the providers that serve "
            f"{country}; add a binding first",
            f"Add a binding for {country} to the SMS template `{code}` in {name}, at a "
            f"provider that serves {country}, then retry.",
            admin,
        )
    if shortfall is Shortfall.NO_ROUTE:
        if reads.channel is Channel.MAIL:
            return _Verdict(
                Reason.NO_ROUTE,
                f"{name} has no enabled mail server marked default; add or enable one first",
                f"Mark an enabled mail server as the default in {name}, then retry.",
                admin,
            )
        return _Verdict(
            Reason.NO_ROUTE,
            f"no SMS provider serves {country} in {name}: no route for it and no default "
            "provider; add one first",
            f"Add a route for {country} to an enabled SMS provider in {name}, or mark one as "
            "the default, then retry.",
            admin,
        )
    if shortfall is Shortfall.SERVER_DISABLED:
        return _Verdict(
            Reason.SERVER_DISABLED,
            f"{failure.message}; enable it first",
            f"Enable it in {name} ({failure.message}): the send or its template names it, "
            "so no other is chosen. Then retry.",
            admin,
        )
    if shortfall is Shortfall.SERVER_MISCONFIGURED:
        return _Verdict(
            Reason.SERVER_MISCONFIGURED,
            f"{failure.message}; fix it first",
            f"Fix the {reads.noun}'s configuration in {name} ({failure.message}), then retry.",
            admin,
        )
    # QUOTA_FULL is the charge's, which a dry run never makes: read by the caller.
    raise AssertionError(f"preparation stopped at {shortfall}, which a dry run never reaches")


def _last_answer(record: Record, reads: _Reads, config: Config) -> _Verdict | None:
    """What the server or provider answered last, when it would answer the same: our
    credentials, its configuration or the message as prepared refused, and its configuration
    not saved since."""
    code, message = record.error_code, record.error_message
    upper = (code or "").strip().upper()
    if upper in _MARKERS or upper in _DEFERRALS or not upper:
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
    where = _where(reads, config.id, config.name)
    admin = _admin_of(config.tenant_id)
    if category is ErrorCategory.AUTH:
        return _Verdict(
            Reason.CREDENTIALS_REFUSED,
            f"{where} refused our credentials ({code}) and they have not changed since; "
            "fix them first",
            f"Fix the username, password or API key of {where}, then retry.",
            admin,
        )
    if category is ErrorCategory.CONFIG:
        return _Verdict(
            Reason.SERVER_MISCONFIGURED,
            f"{where} cannot be used as configured ({code}) and its configuration has not "
            "changed since; fix it first",
            f"Fix the configuration of {where} ({message or code}), then retry.",
            admin,
        )
    return _Verdict(
        Reason.MESSAGE_REFUSED,
        f"{where} refused the message as prepared ({code}); it is sent the same again",
        "A retry sends the same prepared message to the same server: send a new message "
        f"with the content fixed, or change {where} to one that takes it, then retry.",
        admin,
    )


# --- what to do --------------------------------------------------------------------------------


def _next_step(
    record: Record,
    status: SendStatus | None,
    verdict: _Verdict | None,
    reads: _Reads,
    now: datetime,
) -> tuple[str, Role, tuple[str, ...]]:
    """(what to do, who can, notes)."""
    notes: list[str] = []
    waited = (now - record.updated_time).total_seconds() if record.updated_time else None
    if status is SendStatus.UNCERTAIN:
        where = _where(reads, _frozen_config(record))
        action = (
            f"Check with {where} whether it arrived (recipient, time, message id), then "
            "resolve it: mark it delivered or failed, or send it again as a new message. "
            "It is never resent by itself."
        )
        if verdict is not None:
            notes.append(f"Sending it again now would fail: {verdict.why}.")
        return action, _admin_of(record.tenant_id), tuple(notes)
    if status is SendStatus.SENT:
        action = (
            "Check the bounce code on this record (a bounce received turns it to Failed), then "
            "ask the recipient to look in their spam folder."
            if reads.channel is Channel.MAIL
            else "Check the provider's delivery receipt for the provider message id; the "
            "handset may have been off or out of coverage."
        )
        return action, Role.SUPPORT, ()
    if status is SendStatus.CANCELLED:
        return "Nothing. Send a new message if it is still wanted.", _admin_of(record.tenant_id), ()
    if status is SendStatus.SENDING:
        if waited is not None and waited > LONG_WAIT_S:
            notes.append(
                f"It has been Sending for {int(waited // 60)} minutes: the stuck-send sweep "
                "puts it back to retry within a minute or two."
            )
        return "Nothing: wait for the attempt to end.", Role.SUPPORT, tuple(notes)
    if status is SendStatus.SUPPRESSED:
        if verdict is not None and verdict.reason is Reason.SUPPRESSED:
            return (
                "Check the address with the recipient. If it works again, take it off the "
                "suppression list (with a reason), then send a new message.",
                verdict.who,
                (),
            )
        return (
            "It is no longer stopped by the list: send a new message if it is still wanted.",
            _admin_of(record.tenant_id),
            (),
        )
    if verdict is not None:
        if record.ambiguous_attempt:
            notes.append(
                "An earlier attempt got no answer and may have been delivered: before retrying, "
                "check that it did not arrive."
            )
        return verdict.action, verdict.who, tuple(notes)
    if status is SendStatus.PENDING:
        if waited is not None and waited > LONG_WAIT_S:
            notes.append(
                f"It has waited {int(waited // 60)} minutes. Check that the delivery workers "
                "are running and not all tied up by a slow server."
            )
            return (
                "Check that the delivery workers are running.",
                Role.PLATFORM_OPERATOR,
                tuple(notes),
            )
        return "Nothing: it goes out within seconds.", Role.SUPPORT, ()
    category = classify(record.error_code, record.error_message)
    if record.ambiguous_attempt:
        return (
            "Check with the server or provider that it did not arrive, then retry it: it may "
            "have been delivered, and a retry would deliver it twice.",
            Role.SUPPORT,
            (),
        )
    if status is SendStatus.RETRY:
        return (
            f"Nothing: it is tried again by itself at {_when(record.next_retry_at)}. Nothing "
            "found stops it now.",
            Role.SUPPORT,
            (),
        )
    if status is SendStatus.DEAD_LETTER and is_retryable(category):
        return (
            "Nothing found stops it now: retry it. If it keeps failing the same way, read the "
            "attempts below for what the server or provider said.",
            Role.SUPPORT,
            (),
        )
    return "Nothing found stops it now: retry it.", Role.SUPPORT, ()


def reason_counts(diagnoses: Sequence[Diagnosis]) -> list[tuple[Reason, int]]:
    """How many of ``diagnoses`` would fail again, per reason, the commonest first."""
    counts: dict[Reason, int] = {}
    for found in diagnoses:
        if found.reason is not None:
            counts[found.reason] = counts.get(found.reason, 0) + 1
    return sorted(counts.items(), key=lambda item: (-item[1], item[0].value))


def as_json(found: Diagnosis) -> dict[str, Any]:
    """The API's shape: ``{cause, wouldFailAgain: {value, reason}, action, who}``."""
    return {
        "cause": found.cause,
        "wouldFailAgain": {
            "value": found.would_fail_again,
            "reason": found.reason.value if found.reason else None,
            "why": found.why,
        },
        "action": found.action,
        "who": found.who.value,
    }
