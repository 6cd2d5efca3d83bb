"""After the send: the suppression list, provider delivery events, and received mail."""

from __future__ import annotations

from datetime import datetime
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


class Suppression(Base):
    """A recipient a tenant must not send to on a channel (active while ``removed_at`` is NULL).

    Removal keeps the row (who, when, why), so the list is also its own history.
    """

    __tablename__ = "suppression"
    __table_args__ = (
        Index("idx_suppression_lookup", "tenant_id", "channel", "address", "removed_at"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenant.id"))
    channel: Mapped[str] = mapped_column(String(8))
    address: Mapped[str] = mapped_column(String(320))  # lower-cased email or E.164
    reason: Mapped[str] = mapped_column(String(16))  # hard_bounce | complaint | manual
    detail: Mapped[str | None] = mapped_column(Text)
    source_record_id: Mapped[int | None] = mapped_column(BigId)
    created_by: Mapped[str | None] = mapped_column(String(320))
    created_time: Mapped[datetime] = mapped_column(UTCDateTime, server_default=db_now())
    removed_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    removed_by: Mapped[str | None] = mapped_column(String(320))
    removal_reason: Mapped[str | None] = mapped_column(Text)


class DeliveryEvent(Base):
    """One provider event (webhook) or receipt, kept whether or not it matched a record.

    ``dedup_key`` is the provider's event id, or a hash of the body when it has none: a
    replayed webhook is stored once. An event that arrives before its record has the provider
    id stays unmatched (``record_id`` NULL) and is applied when the id is written.
    """

    __tablename__ = "delivery_event"
    __table_args__ = (
        UniqueConstraint("channel", "config_id", "dedup_key", name="uq_delivery_event_dedup"),
        Index("idx_delivery_event_match", "channel", "config_id", "provider_message_id"),
        Index("idx_delivery_event_record", "channel", "record_id", "id"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(BigId)
    channel: Mapped[str] = mapped_column(String(8))
    config_id: Mapped[int] = mapped_column(BigId)  # the route: mail server or SMS provider
    provider: Mapped[str] = mapped_column(String(32))
    dedup_key: Mapped[str] = mapped_column(String(200))
    provider_message_id: Mapped[str | None] = mapped_column(String(200))
    recipient: Mapped[str | None] = mapped_column(String(320))
    event_type: Mapped[str] = mapped_column(String(16))  # delivered|bounced|complained|other
    detail: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    occurred_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    received_at: Mapped[datetime] = mapped_column(UTCDateTime, server_default=db_now())
    record_id: Mapped[int | None] = mapped_column(BigId)
    applied_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class MailReceiveConfig(Base):
    """A mailbox the service reads for bounces and read receipts (IMAP or IMAPS)."""

    __tablename__ = "mail_receive_config"
    __table_args__ = (UniqueConstraint("tenant_id", "name"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenant.id"), index=True)
    name: Mapped[str] = mapped_column(String(200))
    host: Mapped[str] = mapped_column(String(255))
    port: Mapped[int] = mapped_column(Integer, default=993)
    security: Mapped[str] = mapped_column(String(16), default="ssl")  # ssl | starttls | plain
    verify_tls: Mapped[bool] = mapped_column(Boolean, default=True, server_default=text("true"))
    username: Mapped[str] = mapped_column(String(320))
    secret_encrypted: Mapped[str | None] = mapped_column(Text)
    folder: Mapped[str] = mapped_column(String(200), default="INBOX")
    enabled: Mapped[bool] = mapped_column(Boolean, default=True, server_default=text("true"))
    config_version: Mapped[int] = mapped_column(Integer, default=1, server_default=text("1"))
    created_time: Mapped[datetime] = mapped_column(UTCDateTime, server_default=db_now())
    updated_time: Mapped[datetime] = mapped_column(
        UTCDateTime, server_default=db_now(), onupdate=db_now()
    )

    @property
    def secret(self) -> str | None:
        """The decrypted password (for the IMAP client only; never rendered)."""
        return secretbox.decrypt(self.secret_encrypted) if self.secret_encrypted else None

    @secret.setter
    def secret(self, value: str | None) -> None:
        if value and self.secret_encrypted and self.secret == value:
            return
        self.secret_encrypted = secretbox.encrypt(value) if value else None


class MailReceiveState(Base):
    """The UID watermark of one (config, folder), reset when UIDVALIDITY changes, and how the
    fetch job's last run over it went.

    ``updated_time`` moves when the folder is opened or read (the portal's "last read");
    ``last_run_at`` on every run, also one that failed. A row whose folder was never opened
    (every run so far failed) has no ``uidvalidity``.
    """

    __tablename__ = "mail_receive_state"
    __table_args__ = (UniqueConstraint("config_id", "folder"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    config_id: Mapped[int] = mapped_column(ForeignKey("mail_receive_config.id", ondelete="CASCADE"))
    folder: Mapped[str] = mapped_column(String(200))
    uidvalidity: Mapped[int | None] = mapped_column(BigId)
    last_uid: Mapped[int] = mapped_column(BigId, default=0, server_default=text("0"))
    updated_time: Mapped[datetime] = mapped_column(
        UTCDateTime, server_default=db_now(), onupdate=db_now()
    )
    last_run_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # Why the last run could not read the folder, in plain words (at most 2,000 characters);
    # NULL after a run that read it. last_error_at: when this run of failures began.
    last_error: Mapped[str | None] = mapped_column(Text)
    last_error_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class ReceivedMail(Base):
    """One message read from a mailbox, stored once per config (Message-ID or content hash)."""

    __tablename__ = "received_mail"
    __table_args__ = (
        UniqueConstraint("config_id", "dedup_key", name="uq_received_mail_dedup"),
        # Retention and erasure delete a record's bounce mails with it (migration 0017).
        Index("idx_received_mail_record", "record_id"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(BigId)
    config_id: Mapped[int] = mapped_column(BigId)
    folder: Mapped[str] = mapped_column(String(200))
    uid: Mapped[int | None] = mapped_column(BigId)
    dedup_key: Mapped[str] = mapped_column(String(300))
    message_id: Mapped[str | None] = mapped_column(String(300))
    from_addr: Mapped[str | None] = mapped_column(String(320))
    subject: Mapped[str | None] = mapped_column(Text)
    size: Mapped[int] = mapped_column(Integer, default=0)
    raw: Mapped[str | None] = mapped_column(Text)
    truncated: Mapped[bool] = mapped_column(Boolean, default=False, server_default=text("false"))
    truncation_reason: Mapped[str | None] = mapped_column(Text)
    kind: Mapped[str] = mapped_column(String(16), default="other")  # bounce|read_receipt|other
    bounce_status: Mapped[str | None] = mapped_column(String(16))  # permanent | temporary
    bounce_code: Mapped[str | None] = mapped_column(String(64))
    record_id: Mapped[int | None] = mapped_column(BigId)
    error: Mapped[str | None] = mapped_column(Text)
    fetched_at: Mapped[datetime] = mapped_column(UTCDateTime, server_default=db_now())
    processed_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
