"""The monthly quota charge: one count per prepared record, in its own transaction.

The seed's count is read-check-increment under an optimistic lock, retried five times and then
given up as a temporary error. We charge with one conditional upsert instead
(``INSERT ... ON CONFLICT DO UPDATE SET n = n + 1 WHERE n < limit``, the limit read in the
same statement): the row lock serialises concurrent charges in the database, so a burst from
every worker is counted exactly, no charge has to be retried, and it costs one round trip.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Engine, Integer, bindparam, func, literal, or_, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from portal.config import Settings
from portal.models import Channel, TenantMessageQuota, TenantMessageUsage, db_now
from portal.models.direct import Direct


def current_month(now: datetime | None = None) -> str:
    return (now or datetime.now(UTC)).strftime("%Y-%m")


@dataclass(frozen=True)
class Usage:
    tenant_id: int
    month: str
    mail_used: int
    mail_limit: int | None
    sms_used: int
    sms_limit: int | None


def limit_for(session: Session, tenant_id: int, channel: Channel, settings: Settings) -> int | None:
    """The ceiling in force: the tier's quota row, else the setting's default, else none."""
    row = session.scalar(
        select(TenantMessageQuota).where(TenantMessageQuota.tenant_id == tenant_id)
    )
    if channel is Channel.MAIL:
        value = row.mail_monthly_limit if row else None
        return value if value is not None else settings.mail_monthly_default
    value = row.sms_monthly_limit if row else None
    return value if value is not None else settings.sms_monthly_default


def charge_statement(channel: Channel, dialect: str) -> Any:
    """One upsert that counts a send unless the ceiling is reached: the month's row is made
    on its first send; the ceiling is read in the same statement (the tier's quota row, else
    the default passed in), so there is nothing to read first and nothing to retry."""
    insert = pg_insert if dialect == "postgresql" else sqlite_insert
    usage_ = TenantMessageUsage
    mail = channel is Channel.MAIL
    column = usage_.mail_count if mail else usage_.sms_count
    quota_limit = (
        TenantMessageQuota.mail_monthly_limit if mail else TenantMessageQuota.sms_monthly_limit
    )
    tenant = bindparam("tenant", type_=usage_.tenant_id.type)
    limit = func.coalesce(
        select(quota_limit).where(TenantMessageQuota.tenant_id == tenant).scalar_subquery(),
        bindparam("default", type_=Integer),
    )
    first = select(
        tenant,
        bindparam("month", type_=usage_.month.type),
        literal(1 if mail else 0),
        literal(0 if mail else 1),
        literal(0),
        db_now(),
    ).where(or_(limit.is_(None), limit > 0))
    statement = (
        insert(usage_)
        .from_select(
            ["tenant_id", "month", "mail_count", "sms_count", "version", "updated_time"], first
        )
        .on_conflict_do_update(
            index_elements=["tenant_id", "month"],
            set_={column.key: column + 1, "version": usage_.version + 1, "updated_time": db_now()},
            where=or_(limit.is_(None), column < limit),
        )
        .returning(usage_.id)
    )
    return statement


def charge_params(tenant_id: int, channel: Channel, settings: Settings) -> dict[str, Any]:
    """The parameters of ``charge_statement`` for one send of ``tenant_id``'s bucket."""
    default = (
        settings.mail_monthly_default if channel is Channel.MAIL else settings.sms_monthly_default
    )
    return {"tenant": tenant_id, "month": current_month(), "default": default}


_CHARGES = {
    (channel, dialect): Direct(charge_statement(channel, dialect), [TenantMessageUsage.id])
    for channel in Channel
    for dialect in ("postgresql", "sqlite")
}


def charge(engine: Engine, tenant_id: int, channel: Channel, settings: Settings) -> bool:
    """Count one send against the bucket's month; False when the ceiling is reached."""
    statement = _CHARGES[(channel, engine.dialect.name)]
    count, _rows = statement.run(engine, **charge_params(tenant_id, channel, settings))
    return count == 1


def usage(session: Session, tenant_id: int, settings: Settings, month: str | None = None) -> Usage:
    """A bucket's counts this month and the ceilings in force."""
    month = month or current_month()
    row = session.scalar(
        select(TenantMessageUsage).where(
            TenantMessageUsage.tenant_id == tenant_id, TenantMessageUsage.month == month
        )
    )
    return Usage(
        tenant_id=tenant_id,
        month=month,
        mail_used=row.mail_count if row else 0,
        mail_limit=limit_for(session, tenant_id, Channel.MAIL, settings),
        sms_used=row.sms_count if row else 0,
        sms_limit=limit_for(session, tenant_id, Channel.SMS, settings),
    )
