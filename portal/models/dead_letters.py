"""Dead letters: records whose retries are used up, archived for operators to triage."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, Index, Integer, String, Text, text
from sqlalchemy.orm import Mapped, mapped_column

from portal.models.base import Base, BigId, UTCDateTime, db_now
from portal.models.enums import TriageStatus


class DeadLetterMessage(Base):
    """One archived dead letter; triage Pending -> Resolved | Discarded never resends."""

    __tablename__ = "dead_letter_message"
    __table_args__ = (
        Index("idx_dead_letter_tenant_status", "tenant_id", "status", "id"),
        Index("idx_dead_letter_event", "channel", "event_id"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(BigId)
    source: Mapped[str] = mapped_column(String(32))
    event_id: Mapped[str | None] = mapped_column(String(64))
    channel: Mapped[str | None] = mapped_column(String(8))
    provider: Mapped[str | None] = mapped_column(String(200))
    error_code: Mapped[str | None] = mapped_column(String(100))
    reason: Mapped[str | None] = mapped_column(Text)
    attempts: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    payload: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(
        String(16), default=TriageStatus.PENDING.value, server_default=text("'Pending'")
    )
    remark: Mapped[str | None] = mapped_column(Text)
    handled_by: Mapped[str | None] = mapped_column(String(320))
    handled_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    created_time: Mapped[datetime] = mapped_column(UTCDateTime, server_default=db_now())
