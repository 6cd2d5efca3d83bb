"""What happened to a record that neither an attempt row nor a delivery event holds: a
failure before any attempt (preparation's cause), a stretch of deferrals, a person's retry,
cancel or resolution, the recipient suppressed, the record ended without a send (expired,
suppressed) or moved on by the stuck-send sweep. Written in the transaction that changes the
record, so a record's timeline never depends on logs.

One table for both channels (``channel`` = mail | sms), like ``send_attempt``; no foreign key:
retention deletes a record's events with it. A successful send writes none.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from sqlalchemy import Index, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from portal.models.base import Base, BigId, UTCDateTime, db_now


class RecordEventKind(StrEnum):
    """What a row says happened, as stored."""

    NOT_ATTEMPTED = "not_attempted"  # failed before reaching the transport (the cause)
    DEFERRED = "deferred"  # the first of a stretch of deferrals with one code
    ENDED = "ended"  # ended without a send: expired, past the resend window, suppressed
    SWEPT = "swept"  # an unprepared record moved on by the stuck-send sweep
    SUPPRESSED = "suppressed"  # the refused recipient put on the suppression list
    RETRIED = "retried"  # requeued by hand (one record or many)
    CANCELLED = "cancelled"
    RESOLVED = "resolved"  # an uncertain outcome decided by a person
    RESENT = "resent"  # its request sent again as a new record


class RecordEvent(Base):
    """One event of one record: when, who (a person or key; none for the worker), what."""

    __tablename__ = "record_event"
    __table_args__ = (Index("idx_record_event_record", "channel", "record_id", "id"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(BigId)
    channel: Mapped[str] = mapped_column(String(8))
    record_id: Mapped[int] = mapped_column(BigId)
    at: Mapped[datetime] = mapped_column(UTCDateTime, server_default=db_now())
    kind: Mapped[str] = mapped_column(String(16))
    code: Mapped[str | None] = mapped_column(String(100))
    message: Mapped[str | None] = mapped_column(Text)
    actor: Mapped[str | None] = mapped_column(String(400))  # as the audit log labels it
