"""Every attempt that reached the transport: one row, written by the
statement that writes the attempt's outcome on the record.

One table for both channels (``channel`` = mail | sms), like ``delivery_event``: the record
page's timeline and the API read a record's attempts in number order along one index. A
deferral that never reached the transport (a rate limit, an open breaker, a full route) adds
no row; the record counts those (``deferral_count``). No foreign key, as for the record's
other rows: retention deletes a record's attempts with it.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from sqlalchemy import Boolean, Index, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from portal.models.base import Base, BigId, UTCDateTime, db_now


class AttemptOutcome(StrEnum):
    """How an attempt ended, as the API spells it."""

    SENT = "sent"
    RETRY = "retry"
    FAILED = "failed"
    DEAD_LETTER = "dead_letter"
    UNCERTAIN = "uncertain"
    SWEPT = "swept"  # the worker never wrote an outcome; the stuck-send sweep moved it on


class SendAttempt(Base):
    """One attempt of one record: when, where, by whom, and what the other side answered."""

    __tablename__ = "send_attempt"
    __table_args__ = (
        Index("idx_send_attempt_record", "channel", "record_id", "number"),
        # A server's recent attempts, newest last (``health.states``; migration 0030).
        Index("idx_send_attempt_config", "channel", "config_id", "finished_at"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(BigId)
    channel: Mapped[str] = mapped_column(String(8))
    record_id: Mapped[int] = mapped_column(BigId)
    number: Mapped[int] = mapped_column(Integer)  # 1 for the first attempt of the record
    started_at: Mapped[datetime] = mapped_column(UTCDateTime)
    finished_at: Mapped[datetime] = mapped_column(UTCDateTime, server_default=db_now())
    duration_ms: Mapped[int | None] = mapped_column(Integer)
    worker: Mapped[str | None] = mapped_column(String(200))  # host:pid of the worker process
    config_id: Mapped[int | None] = mapped_column(BigId)  # the mail server or SMS provider
    config_name: Mapped[str | None] = mapped_column(String(200))  # its name at the time
    outcome: Mapped[str] = mapped_column(String(16))
    ambiguous: Mapped[bool] = mapped_column(Boolean, default=False)
    # The reply: the SMTP code ("451", "550"), or the HTTP status and the provider's error
    # code ("400 21211"); the reply's text.
    code: Mapped[str | None] = mapped_column(String(100))
    message: Mapped[str | None] = mapped_column(Text)
    provider_message_id: Mapped[str | None] = mapped_column(String(200))
    # What the attempt said about the server or provider itself (``classify.unavailable``):
    # True could not reach it, False it answered, None nothing either way (``health``).
    unavailable: Mapped[bool | None] = mapped_column(Boolean)
