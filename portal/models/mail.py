"""Mail: templates, send servers, send records and their recipients."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, Boolean, ForeignKey, Index, Integer, String, Text, text
from sqlalchemy.orm import Mapped, mapped_column

from portal.models.base import Base, BigId, UTCDateTime
from portal.models.channels import Secret, SendConfigBase, TemplateBase, record_table_args
from portal.models.enums import Channel, SmtpSecurity
from portal.models.record import SendRecordMixin


class MailTemplate(TemplateBase, Base):
    """A tenant-authored mail template: a subject and an HTML and/or a text body, and what a
    send that uses it takes from it unless the send gives its own."""

    __tablename__ = "mail_template"
    channel = Channel.MAIL
    noun = "mail template"
    sources = ("subject", "html_body", "text_body")

    subject: Mapped[str] = mapped_column(Text, default="")
    html_body: Mapped[str | None] = mapped_column(Text)
    text_body: Mapped[str | None] = mapped_column(Text)
    priority: Mapped[int | None] = mapped_column(Integer)
    reply_to: Mapped[str | None] = mapped_column(String(320))
    preferred_server_id: Mapped[int | None] = mapped_column(
        ForeignKey("mail_send_server_config.id", ondelete="SET NULL")
    )
    attachments: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON)


class MailSendServerConfig(SendConfigBase, Base):
    """An SMTP server a tier sends through: where it is, how to log in, and whom mail is from."""

    __tablename__ = "mail_send_server_config"

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

    password = Secret()  # for the transport only; never rendered


class MailSendRecord(SendRecordMixin, Base):
    """One mail: the caller's request, what preparation froze, and what happened."""

    __tablename__ = "mail_send_record"
    __table_args__ = record_table_args("mail_send")
    channel = Channel.MAIL

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
