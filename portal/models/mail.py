"""Mail: templates, send servers, send records and their recipients."""

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
from portal.models.enums import SmtpSecurity, UncertainPolicy
from portal.models.record import (
    SCAN_TABLE_STORAGE,
    STREAM_DEFAULT,
    SendRecordMixin,
    Stream,
    decision_index,
    fair_indexes,
)


class MailTemplate(Base):
    """A tenant-authored mail template (untrusted: rendered in the sandbox)."""

    __tablename__ = "mail_template"
    __table_args__ = (UniqueConstraint("tenant_id", "code"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenant.id"))
    code: Mapped[str] = mapped_column(String(100))
    name: Mapped[str] = mapped_column(String(200), default="")
    subject: Mapped[str] = mapped_column(Text, default="")
    html_body: Mapped[str | None] = mapped_column(Text)
    text_body: Mapped[str | None] = mapped_column(Text)
    enabled: Mapped[bool] = mapped_column(Boolean, default=True, server_default=text("true"))
    # The stream of a send that names this template and no stream of its own.
    stream: Mapped[str] = mapped_column(
        String(16), default=Stream.TRANSACTIONAL.value, server_default=text(STREAM_DEFAULT)
    )
    priority: Mapped[int | None] = mapped_column(Integer)
    reply_to: Mapped[str | None] = mapped_column(String(320))
    preferred_server_id: Mapped[int | None] = mapped_column(
        ForeignKey("mail_send_server_config.id", ondelete="SET NULL")
    )
    attachments: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON)
    # A strict template refuses, at acceptance, a send that lacks a variable it
    # needs; on for new templates, off for those that existed before (migration 0013).
    strict_variables: Mapped[bool] = mapped_column(
        Boolean, default=True, server_default=text("false")
    )
    # The editor's sample variables (preview, Send test, a dry run with no records yet).
    sample_variables: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    version: Mapped[int] = mapped_column(Integer, default=1, server_default=text("1"))
    created_time: Mapped[datetime] = mapped_column(UTCDateTime, server_default=db_now())
    updated_time: Mapped[datetime] = mapped_column(
        UTCDateTime, server_default=db_now(), onupdate=db_now()
    )


class MailSendServerConfig(Base):
    """An SMTP server a tier sends through; ``config_version`` is bumped by every save."""

    __tablename__ = "mail_send_server_config"
    __table_args__ = (UniqueConstraint("tenant_id", "name"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenant.id"), index=True)
    name: Mapped[str] = mapped_column(String(200))
    host: Mapped[str] = mapped_column(String(255))
    port: Mapped[int] = mapped_column(Integer, default=587)
    security: Mapped[str] = mapped_column(String(16), default=SmtpSecurity.STARTTLS.value)
    verify_tls: Mapped[bool] = mapped_column(Boolean, default=True, server_default=text("true"))
    username: Mapped[str | None] = mapped_column(String(320))
    password_encrypted: Mapped[str | None] = mapped_column(Text)
    from_address: Mapped[str | None] = mapped_column(String(320))
    from_name: Mapped[str | None] = mapped_column(String(200))
    reply_to: Mapped[str | None] = mapped_column(String(320))
    read_receipt: Mapped[bool] = mapped_column(Boolean, default=False, server_default=text("false"))
    is_default: Mapped[bool] = mapped_column(Boolean, default=False, server_default=text("false"))
    enabled: Mapped[bool] = mapped_column(Boolean, default=True, server_default=text("true"))
    daily_send_limit: Mapped[int | None] = mapped_column(Integer)
    rate_limit_per_minute: Mapped[int | None] = mapped_column(Integer)
    uncertain_policy: Mapped[str] = mapped_column(
        String(16), default=UncertainPolicy.RETRY.value, server_default=text("'retry'")
    )
    config_version: Mapped[int] = mapped_column(Integer, default=1, server_default=text("1"))
    created_time: Mapped[datetime] = mapped_column(UTCDateTime, server_default=db_now())
    updated_time: Mapped[datetime] = mapped_column(
        UTCDateTime, server_default=db_now(), onupdate=db_now()
    )

    @property
    def password(self) -> str | None:
        """The decrypted password (for the transport only; never rendered)."""
        return secretbox.decrypt(self.password_encrypted) if self.password_encrypted else None

    @password.setter
    def password(self, value: str | None) -> None:
        if value and self.password_encrypted:
            try:
                if secretbox.decrypt(self.password_encrypted) == value:
                    return  # unchanged: a fresh ciphertext would look like a change
            except secretbox.SecretUnavailable:
                pass  # unreadable since SECRET_KEY changed: the new value replaces it
        self.password_encrypted = secretbox.encrypt(value) if value else None


class MailSendRecord(SendRecordMixin, Base):
    """One mail: the caller's request, what preparation froze, and what happened."""

    __tablename__ = "mail_send_record"
    __table_args__ = (
        Index("idx_mail_send_status_updated", "status", "updated_time"),
        Index("idx_mail_send_status_retry", "status", "next_retry_at"),
        Index("idx_mail_send_tenant_created", "tenant_id", "id"),
        # The dashboard: per-tenant status counts and the last 24 hours.
        Index("idx_mail_send_tenant_status", "tenant_id", "status", "id"),
        Index("idx_mail_send_created", "created_time"),
        *fair_indexes("mail_send"),
        decision_index("mail_send"),
        UniqueConstraint("tenant_id", "business_key", name="uq_mail_send_business_key"),
        # Ids are never reused (Message-IDs and idempotency keys are built from them), also on
        # SQLite after retention purged the newest records (migration 0017).
        {"postgresql_with": SCAN_TABLE_STORAGE, "sqlite_autoincrement": True},
    )

    # The caller's request.
    to_addrs: Mapped[list[str]] = mapped_column(JSON)
    cc_addrs: Mapped[list[str] | None] = mapped_column(JSON)
    bcc_addrs: Mapped[list[str] | None] = mapped_column(JSON)
    reply_to: Mapped[str | None] = mapped_column(String(320))
    subject: Mapped[str | None] = mapped_column(Text)
    html_body: Mapped[str | None] = mapped_column(Text)
    text_body: Mapped[str | None] = mapped_column(Text)
    server_id: Mapped[int | None] = mapped_column(BigId)
    priority: Mapped[int | None] = mapped_column(Integer)
    attachments: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON)
    # What preparation froze; retries replay it as it is.
    rendered_subject: Mapped[str | None] = mapped_column(Text)
    rendered_html: Mapped[str | None] = mapped_column(Text)
    rendered_text: Mapped[str | None] = mapped_column(Text)
    final_reply_to: Mapped[str | None] = mapped_column(String(320))
    final_priority: Mapped[int | None] = mapped_column(Integer)
    final_attachments: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON)
    server_config_id: Mapped[int | None] = mapped_column(BigId)
    read_receipt: Mapped[bool] = mapped_column(Boolean, default=False, server_default=text("false"))
    message_id_header: Mapped[str | None] = mapped_column(String(255))
    refused_recipients: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    # After the send.
    bounce_code: Mapped[str | None] = mapped_column(String(64))
    read_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class MailSendRecipient(Base):
    """One address of a mail (to, cc or bcc), lower-cased, for search by recipient.

    A mail has a list of recipients; a row per address gives support staff an index lookup
    ("it never arrived" for the second cc) instead of a scan over JSON.
    """

    __tablename__ = "mail_send_recipient"
    __table_args__ = (
        # varchar_pattern_ops: equality as before, and an address prefix (``carol@``, LIKE
        # 'carol@%') as a range of this index whatever the collation (migration 0027).
        Index(
            "idx_mail_recipient_search",
            "tenant_id",
            "address",
            "record_id",
            postgresql_ops={"address": "varchar_pattern_ops"},
        ),
        {"sqlite_autoincrement": True},
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    record_id: Mapped[int] = mapped_column(
        ForeignKey("mail_send_record.id", ondelete="CASCADE"), index=True
    )
    tenant_id: Mapped[int] = mapped_column(BigId)
    address: Mapped[str] = mapped_column(String(320))
    kind: Mapped[str] = mapped_column(String(3))
