"""Search side tables: what the search box looks in besides the recipient table.

``mail_send_subject`` is insert-only (triggers on mail_send_record write it, migration 0025),
so its trigram index costs nothing when a record's status changes; the record tables
themselves get no search index.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import ForeignKey, Index, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from portal.models.attempts import SendAttempt
from portal.models.base import Base, BigId, UTCDateTime, db_now
from portal.models.mail import MailSendRecipient


class MailSendSubject(Base):
    """One subject of a mail: the caller's at acceptance, the rendered one at preparation."""

    __tablename__ = "mail_send_subject"
    __table_args__ = (
        Index("idx_mail_subject_record", "record_id"),
        {"sqlite_autoincrement": True},
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    record_id: Mapped[int] = mapped_column(ForeignKey("mail_send_record.id", ondelete="CASCADE"))
    tenant_id: Mapped[int] = mapped_column(BigId)
    subject: Mapped[str] = mapped_column(Text)


class RecipientToken(Base):
    """What a recipient page's token stands for: a tenant's address or number.

    The token is an HMAC (SECRET_KEY) of tenant, channel and normalised address, so the
    address stays out of URLs, access logs and Referer headers; this row is how the page finds
    the address again. Written (insert-only, idempotent) when a page links to a recipient.
    """

    __tablename__ = "recipient_token"
    # Retention and "forget this recipient" find an address's tokens (migration 0026).
    __table_args__ = (Index("idx_recipient_token_address", "tenant_id", "channel", "address"),)

    token: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[int] = mapped_column(BigId)
    channel: Mapped[str] = mapped_column(String(8))
    address: Mapped[str] = mapped_column(String(320))
    created_time: Mapped[datetime] = mapped_column(UTCDateTime, server_default=db_now())


def _trigram(name: str, column: Any) -> Index:
    """A GIN trigram index on PostgreSQL. SQLite has no trigrams: there the migration makes it
    a plain index of the same name (its search is LIKE over the rows)."""
    return Index(name, column, postgresql_using="gin", postgresql_ops={column.key: "gin_trgm_ops"})


# ILIKE '%word%' / '%@example.com' / 'carol@%' through the trigram indexes.
_trigram("idx_mail_subject_trgm", MailSendSubject.__table__.c.subject)
_trigram("idx_mail_recipient_trgm", MailSendRecipient.__table__.c.address)
# A provider message id typed in the box: the attempt that got it (insert-only, as above).
Index("idx_send_attempt_provider_message", SendAttempt.__table__.c.provider_message_id)
