"""The monthly quota charge: one count per prepared record, in its own transaction.

The seed's count is read-check-increment under an optimistic lock, retried five times and then
given up as a temporary error. We charge with one conditional UPDATE instead
(``SET n = n + 1 WHERE n < limit``): the row lock serialises concurrent charges in the
database, so a burst from every worker is counted exactly and no charge has to be retried.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import Engine, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from portal.config import Settings
from portal.models import Channel, TenantMessageQuota, TenantMessageUsage


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


def _ensure_row(session: Session, tenant_id: int, month: str) -> None:
    insert = pg_insert if session.get_bind().dialect.name == "postgresql" else sqlite_insert
    session.execute(
        insert(TenantMessageUsage)
        .values(tenant_id=tenant_id, month=month, mail_count=0, sms_count=0, version=0)
        .on_conflict_do_nothing(index_elements=["tenant_id", "month"])
    )


def charge(engine: Engine, tenant_id: int, channel: Channel, settings: Settings) -> bool:
    """Count one send against the bucket's month; False when the ceiling is reached."""
    month = current_month()
    column = (
        TenantMessageUsage.mail_count if channel is Channel.MAIL else TenantMessageUsage.sms_count
    )
    with Session(engine) as session, session.begin():
        limit = limit_for(session, tenant_id, channel, settings)
        _ensure_row(session, tenant_id, month)
        statement = update(TenantMessageUsage).where(
            TenantMessageUsage.tenant_id == tenant_id, TenantMessageUsage.month == month
        )
        if limit is not None:
            statement = statement.where(column < limit)
        result = session.execute(
            statement.values(
                {column: column + 1, TenantMessageUsage.version: TenantMessageUsage.version + 1}
            ).execution_options(synchronize_session=False)
        )
        return bool(result.rowcount == 1)  # type: ignore[attr-defined]


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
