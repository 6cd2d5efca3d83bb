"""What a diagnosis reads beyond the records, once for a whole selection (``Reads``): each
tier's configuration, its servers' health, the suppressions, the quotas and the last attempts;
and how it names what it read to this viewer (a server or provider, a time)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Engine, or_, select
from sqlalchemy.orm import Session

from portal.config import Settings
from portal.messaging.after_send import suppression
from portal.messaging.sending import health, preparation, quota
from portal.messaging.sending.preparation import PreparationFailed, tier_of
from portal.models import (
    Channel,
    MailSendRecord,
    MailSendServerConfig,
    SendAttempt,
    SmsProviderConfig,
    SmsSendRecord,
    Suppression,
    Tenant,
    TenantMessageUsage,
)
from portal.models.by_channel import PARTS
from portal.tenancy import PLATFORM_TENANT_ID, names_config

Record = MailSendRecord | SmsSendRecord
Config = MailSendServerConfig | SmsProviderConfig


def when(moment: datetime | None) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC") if moment else "an unknown time"


def frozen_config(record: Record) -> int | None:
    if isinstance(record, MailSendRecord):
        return record.server_config_id
    return record.provider_config_id


class Reads:
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
        self.parts = PARTS[channel]
        self.noun = self.parts.config_noun
        self.model: Any = self.parts.config
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
        frozen = {c for r in records if (c := frozen_config(r)) is not None}
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
                why = f"{str(reason).replace('_', ' ')} since {when(created)}"
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

    def where(self, config_id: int | None, name: str | None = None) -> str:
        """The server or provider, as this viewer may see it named (``tenancy.names_config``)."""
        if config_id is not None and config_id not in self.configs:
            self._load_configs({config_id})
        row = self.configs.get(config_id) if config_id is not None else None
        name = name or (row.name if row is not None else None)
        if name is None:
            return f"the {self.noun}"
        if names_config(row.tenant_id if row is not None else None, self.operator):
            return f"the {self.noun} {name!r}"
        return f"the platform {self.parts.noun} service"
