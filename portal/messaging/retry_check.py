"""Would a manual retry fail again? Bulk retry by status alone would requeue records whose
cause is still there (a full quota, a missing template), and they would fail again at once.

``blockers`` reads the causes as they are now, not the record's status or error code: the
recipient suppressed (every one of them), and for a record that will be prepared afresh (no
``prepared_at``) its template (exists, and is enabled when named by code) and its tier's monthly
quota (used vs the ceiling in force this month, each such record of the selection counted in
turn, oldest first); for every record, a server or provider that is there and enabled (the one
it names or was prepared with, or, when that is gone or it failed for the want of one, one a
re-choice would find). The rules are preparation's
(``preparation._find_template``, ``_choose_server``, ``sms_candidates``, ``quota.limit_for``);
this module only reads. Each answer ends with what to change first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from portal.config import Settings
from portal.messaging import quota, suppression
from portal.messaging.classify import MarkerCode
from portal.models import (
    Channel,
    MailSendRecord,
    MailSendServerConfig,
    MailTemplate,
    Scope,
    SmsProviderConfig,
    SmsSendRecord,
    SmsTemplate,
    Suppression,
    Tenant,
    TenantMessageUsage,
)
from portal.tenancy import PLATFORM_TENANT_ID

Record = MailSendRecord | SmsSendRecord


def _tier(record: Record) -> int:
    """The tier whose templates, configs and quota the record uses (preparation's rule)."""
    return PLATFORM_TENANT_ID if record.scope == Scope.PLATFORM.value else record.tenant_id


class _Tiers:
    """What the checks read per tier, read once for the whole selection."""

    def __init__(self, session: Session, channel: Channel, settings: Settings) -> None:
        self.session = session
        self.channel = channel
        self.settings = settings
        self._names: dict[int, str] = {}
        self._quota: dict[int, tuple[int, int | None]] = {}
        self._templates: dict[tuple[int, str], bool | None] = {}
        self._routes: dict[int, bool] = {}
        self.month = quota.current_month()

    def name(self, tier: int) -> str:
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

    def template(self, tier: int, code: str) -> bool | None:
        """True: there and enabled; False: there but disabled; None: no such template."""
        key = (tier, code)
        if key not in self._templates:
            model: Any = MailTemplate if self.channel is Channel.MAIL else SmsTemplate
            enabled = self.session.scalar(
                select(model.enabled).where(model.tenant_id == tier, model.code == code)
            )
            self._templates[key] = None if enabled is None else bool(enabled)
        return self._templates[key]

    def has_route(self, tier: int, scope: str) -> bool:
        """Whether a re-choice finds a server (a default one) or a provider (any enabled),
        in the tier or, for a tenant's own send, the platform tier it falls back to."""
        key = tier if scope == Scope.TENANT.value else PLATFORM_TENANT_ID
        if key not in self._routes:
            tiers = [tier]
            if scope == Scope.TENANT.value and tier != PLATFORM_TENANT_ID:
                tiers.append(PLATFORM_TENANT_ID)
            if self.channel is Channel.MAIL:
                stmt = select(MailSendServerConfig.id).where(
                    MailSendServerConfig.tenant_id.in_(tiers),
                    MailSendServerConfig.is_default.is_(True),
                    MailSendServerConfig.enabled.is_(True),
                )
            else:
                stmt = select(SmsProviderConfig.id).where(
                    SmsProviderConfig.tenant_id.in_(tiers), SmsProviderConfig.enabled.is_(True)
                )
            self._routes[key] = self.session.scalar(stmt.limit(1)) is not None
        return self._routes[key]

    def config_enabled(self, config_id: int, tier: int) -> bool:
        model: Any = MailSendServerConfig if self.channel is Channel.MAIL else SmsProviderConfig
        tiers = [tier, PLATFORM_TENANT_ID]
        enabled = self.session.scalar(
            select(model.enabled).where(model.id == config_id, model.tenant_id.in_(tiers))
        )
        return bool(enabled)


def _recipients(record: Record, channel: Channel) -> set[str]:
    if isinstance(record, SmsSendRecord):
        raw = [record.phone_number] if record.phone_number else []
    else:
        raw = [*(record.to_addrs or []), *(record.cc_addrs or []), *(record.bcc_addrs or [])]
    found = set()
    for address in raw:
        try:
            found.add(suppression.normalise(channel, address))
        except suppression.InvalidAddress:
            continue
    return found


def _suppressed(
    session: Session, records: Sequence[Record], channel: Channel
) -> dict[tuple[int, str], str]:
    """(tenant, normalised address) -> why, for the selection's recipients that are suppressed."""
    wanted: dict[int, set[str]] = {}
    for record in records:
        wanted.setdefault(record.tenant_id, set()).update(_recipients(record, channel))
    found: dict[tuple[int, str], str] = {}
    for tenant_id, addresses in wanted.items():
        if not addresses:
            continue
        lookup = {a: a for a in addresses} | {suppression.hashed(a): a for a in addresses}
        rows = session.execute(
            select(Suppression.address, Suppression.reason).where(
                Suppression.tenant_id == tenant_id,
                Suppression.channel == channel.value,
                Suppression.address.in_(list(lookup)),
                Suppression.removed_at.is_(None),
            )
        )
        for address, reason in rows:
            found[(tenant_id, lookup[address])] = str(reason).replace("_", " ")
    return found


def blockers(
    session: Session, channel: Channel, records: Sequence[Record], settings: Settings
) -> dict[int, str]:
    """Record id -> why a retry now would fail again and what to change first, for those of
    ``records`` (already scoped by the caller) whose cause is still there."""
    tiers = _Tiers(session, channel, settings)
    suppressed = _suppressed(session, records, channel)
    found: dict[int, str] = {}
    charged: dict[int, int] = {}  # per tier, the selection's records counted against its room
    for record in sorted(records, key=lambda r: r.id):  # the oldest first, as the claim goes
        reason = _blocker(record, channel, tiers, suppressed)
        if reason is None and record.prepared_at is None:
            # Each one still to be prepared is charged once more: a quota with room for some
            # lets the first ones through and stops the rest.
            tier = _tier(record)
            used, limit = tiers.quota(tier)
            if limit is not None and used + charged.get(tier, 0) >= limit:
                name = tiers.name(tier)
                reason = (
                    f"the quota of {name} is full ({used:,} of {limit:,}); raise it first"
                    if used >= limit
                    else f"the quota of {name} has room for {limit - used:,} more "
                    f"({used:,} of {limit:,}) and this selection needs more; raise it first"
                )
            else:
                charged[tier] = charged.get(tier, 0) + 1
        if reason is not None:
            found[record.id] = reason
    return found


def _blocker(
    record: Record, channel: Channel, tiers: _Tiers, suppressed: dict[tuple[int, str], str]
) -> str | None:
    tier = _tier(record)
    recipients = _recipients(record, channel)
    if recipients and all((record.tenant_id, a) in suppressed for a in recipients):
        first = sorted(recipients)[0]
        why = suppressed[(record.tenant_id, first)]
        return (
            f"the recipient {first} is suppressed ({why}); remove the suppression first"
            if len(recipients) == 1
            else f"all {len(recipients)} recipients are suppressed; remove the suppressions first"
        )
    fresh = record.prepared_at is None
    if fresh and record.template_id is None and record.template_code:
        state = tiers.template(tier, record.template_code)
        if state is None:
            return f"template `{record.template_code}` does not exist"
        if state is False:
            return f"template `{record.template_code}` is disabled; enable it first"
    return _route_blocker(record, channel, tier, tiers)  # the quota: in ``blockers``


def _route_blocker(record: Record, channel: Channel, tier: int, tiers: _Tiers) -> str | None:
    noun = "mail server" if channel is Channel.MAIL else "SMS provider"
    frozen = (
        record.server_config_id if isinstance(record, MailSendRecord) else record.provider_config_id
    )
    asked = record.server_id if isinstance(record, MailSendRecord) else None
    if asked is not None and record.prepared_at is None:
        # A send that names its server gets that one or none (preparation never re-chooses).
        if not tiers.config_enabled(asked, tier):
            return f"{noun} {asked} is missing or disabled; enable it first"
        return None
    if frozen is not None and tiers.config_enabled(frozen, tier):
        return None
    # A re-choice is needed when the frozen one is gone, or when there was none and the record
    # failed for the want of one; a record that failed for another reason before a server was
    # chosen is not judged by its tier's routes (it may name a server its template prefers).
    rechoose = frozen is not None or record.error_code == MarkerCode.CONFIG_NOT_RESOLVABLE.value
    if rechoose and not tiers.has_route(tier, record.scope):
        default = " marked default" if channel is Channel.MAIL else ""
        return f"{tiers.name(tier)} has no enabled {noun}{default}; add or enable one first"
    return None
