"""Monthly quotas and their usage counts."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import ForeignKey, Integer, String, UniqueConstraint, text
from sqlalchemy.orm import Mapped, mapped_column

from portal.models.base import Base, BigId, UTCDateTime, db_now


class TenantMessageQuota(Base):
    """A tier's monthly ceilings; NULL falls back to the setting's default (none: no ceiling)."""

    __tablename__ = "tenant_message_quota"

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenant.id"), unique=True)
    mail_monthly_limit: Mapped[int | None] = mapped_column(Integer)
    sms_monthly_limit: Mapped[int | None] = mapped_column(Integer)
    updated_by: Mapped[str | None] = mapped_column(String(320))
    created_time: Mapped[datetime] = mapped_column(UTCDateTime, server_default=db_now())
    updated_time: Mapped[datetime] = mapped_column(
        UTCDateTime, server_default=db_now(), onupdate=db_now()
    )


class TenantMessageUsage(Base):
    """One bucket's counts for one calendar month (``month`` is 'YYYY-MM'); never deleted."""

    __tablename__ = "tenant_message_usage"
    __table_args__ = (UniqueConstraint("tenant_id", "month"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenant.id"))
    month: Mapped[str] = mapped_column(String(7))
    mail_count: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    sms_count: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    version: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    updated_time: Mapped[datetime] = mapped_column(
        UTCDateTime, server_default=db_now(), onupdate=db_now()
    )
