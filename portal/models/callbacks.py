"""Status callbacks: a tenant's endpoints and the deliveries owed to them.

A ``callback_delivery`` row is written by the database itself, in the statement that changes a
record's status (triggers of migration 0015, ``messaging.after_send.callbacks.TRIGGERS``): one row
per (event, enabled endpoint subscribed to it), none when the tenant has no endpoint. The rows
are a queue like the send records: a pool claims due ones, posts them and writes the outcome.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import Mapped, mapped_column

from portal.models import secretbox
from portal.models.base import Base, BigId, UTCDateTime, db_now


class DeliveryStatus(StrEnum):
    PENDING = "pending"  # due at next_attempt_at
    SENDING = "sending"  # claimed; next_attempt_at is the lease's end
    DELIVERED = "delivered"
    DEAD = "dead"  # gave up after the retry window


class CallbackEndpoint(Base):
    """A tenant's URL that is told about its records' status changes."""

    __tablename__ = "callback_endpoint"
    __table_args__ = (UniqueConstraint("tenant_id", "name"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenant.id"))
    name: Mapped[str] = mapped_column(String(200))
    url: Mapped[str] = mapped_column(Text)
    # The subscribed event types between commas (",mail.sent,sms.sent,"): the triggers match
    # one with a substring test in both dialects.
    events: Mapped[str] = mapped_column(Text, default=",")
    enabled: Mapped[bool] = mapped_column(Boolean, default=True, server_default=text("true"))
    secret_encrypted: Mapped[str] = mapped_column(Text)
    # After a rotation the old secret signs too until previous_secret_until.
    previous_secret_encrypted: Mapped[str | None] = mapped_column(Text)
    previous_secret_until: Mapped[datetime | None] = mapped_column(UTCDateTime)
    consecutive_failures: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    paused_until: Mapped[datetime | None] = mapped_column(UTCDateTime)
    created_time: Mapped[datetime] = mapped_column(UTCDateTime, server_default=db_now())
    updated_time: Mapped[datetime] = mapped_column(
        UTCDateTime, server_default=db_now(), onupdate=db_now()
    )

    @property
    def event_list(self) -> list[str]:
        return [e for e in self.events.split(",") if e]

    @event_list.setter
    def event_list(self, value: list[str]) -> None:
        self.events = "," + "".join(f"{e}," for e in sorted(set(value)))

    @property
    def secret(self) -> str:
        """The signing secret (``whsec_...``), decrypted; shown once, never rendered again."""
        return secretbox.decrypt(self.secret_encrypted)

    @secret.setter
    def secret(self, value: str) -> None:
        self.secret_encrypted = secretbox.encrypt(value)

    @property
    def previous_secret(self) -> str | None:
        if not self.previous_secret_encrypted:
            return None
        return secretbox.decrypt(self.previous_secret_encrypted)


class CallbackDelivery(Base):
    """One event owed to one endpoint; its id is the ``webhook-id`` on every attempt."""

    __tablename__ = "callback_delivery"
    __table_args__ = (
        # The pool's claim: due rows only (a partial index, as small as the backlog).
        Index(
            "idx_callback_delivery_due",
            "next_attempt_at",
            postgresql_where=text("status IN ('pending', 'sending')"),
            sqlite_where=text("status IN ('pending', 'sending')"),
        ),
        Index("idx_callback_delivery_record", "channel", "record_id", "id"),
        Index("idx_callback_delivery_endpoint", "endpoint_id", "id"),
        # Ids are webhook-ids: never reused, also on SQLite after a purge.
        {"sqlite_autoincrement": True},
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(BigId)
    endpoint_id: Mapped[int] = mapped_column(ForeignKey("callback_endpoint.id", ondelete="CASCADE"))
    channel: Mapped[str | None] = mapped_column(String(8))  # NULL: a test event
    record_id: Mapped[int | None] = mapped_column(BigId)
    event_type: Mapped[str] = mapped_column(String(32))
    sequence: Mapped[int] = mapped_column(Integer, default=1, server_default=text("1"))
    payload: Mapped[dict[str, Any]] = mapped_column(JSON)  # the body's "data"
    occurred_at: Mapped[datetime] = mapped_column(UTCDateTime, server_default=db_now())
    status: Mapped[str] = mapped_column(
        String(16), default=DeliveryStatus.PENDING.value, server_default=text("'pending'")
    )
    attempts: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    next_attempt_at: Mapped[datetime] = mapped_column(UTCDateTime, server_default=db_now())
    # Retries stop here (NULL: created_time + CALLBACK_GIVE_UP_S); a resend moves it on.
    retry_until: Mapped[datetime | None] = mapped_column(UTCDateTime)
    last_attempt_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    last_status_code: Mapped[int | None] = mapped_column(Integer)
    last_duration_ms: Mapped[int | None] = mapped_column(Integer)
    last_error: Mapped[str | None] = mapped_column(Text)
    delivered_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    created_time: Mapped[datetime] = mapped_column(UTCDateTime, server_default=db_now())
