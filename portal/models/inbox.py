"""The inbox: notices for a tier's admins (platform operators: tier -1).

One row per occurrence, its ``dedup_key`` unique within the tier ("quota:mail:2026-12:80",
"server-down:mail:3:<opened at>"), so a trigger seen twice writes one notice. Who has read it
is kept per user in ``notification_read``.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import ForeignKey, Index, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from portal.models.base import Base, BigId, UTCDateTime, db_now


class Notification(Base):
    __tablename__ = "notification"
    __table_args__ = (
        UniqueConstraint("tenant_id", "dedup_key", name="uq_notification_key"),
        Index("idx_notification_tenant", "tenant_id", "id"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(BigId)
    kind: Mapped[str] = mapped_column(String(32))
    dedup_key: Mapped[str] = mapped_column(String(200))
    title: Mapped[str] = mapped_column(Text)
    body: Mapped[str | None] = mapped_column(Text)
    link: Mapped[str | None] = mapped_column(Text)  # a path in the portal where it is fixed
    created_time: Mapped[datetime] = mapped_column(UTCDateTime, server_default=db_now())


class NotificationRead(Base):
    __tablename__ = "notification_read"

    notification_id: Mapped[int] = mapped_column(
        ForeignKey("notification.id", ondelete="CASCADE"), primary_key=True
    )
    user_id: Mapped[int] = mapped_column(
        ForeignKey("app_user.id", ondelete="CASCADE"), primary_key=True
    )
    read_at: Mapped[datetime] = mapped_column(UTCDateTime, server_default=db_now())
