"""Template versions: every save of a mail or SMS template is an immutable row.

One table for both channels (``channel`` = mail | sms): a version holds the template's whole
content as JSON (subject, bodies or SMS content, Reply-To, priority, preferred server, stream,
``strictVariables``, attachments), so history, diff and restore are one piece of code.
Attachment bytes are not repeated in every version: a version names each file by the SHA-256
of its bytes, kept once in ``template_blob``. Blobs are never deleted while a version (which
is never deleted) or a record refers to them.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, ForeignKey, Index, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from portal.models.base import Base, BigId, UTCDateTime, db_now


class TemplateVersion(Base):
    """One saved version of a template; ``number`` is the template's ``version`` it made."""

    __tablename__ = "template_version"
    __table_args__ = (
        UniqueConstraint("channel", "template_id", "number", name="uq_template_version_number"),
        Index("idx_template_version_tenant", "tenant_id", "channel", "template_id"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenant.id"))
    channel: Mapped[str] = mapped_column(String(8))
    # No foreign key: a deleted template's versions stay for the records that name them.
    template_id: Mapped[int] = mapped_column(BigId)
    number: Mapped[int] = mapped_column(Integer)
    author: Mapped[str | None] = mapped_column(String(320))
    remark: Mapped[str | None] = mapped_column(Text)
    content: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_time: Mapped[datetime] = mapped_column(UTCDateTime, server_default=db_now())


class TemplateBlob(Base):
    """An attachment's bytes (base64), stored once by the SHA-256 of the bytes."""

    __tablename__ = "template_blob"

    sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    content: Mapped[str] = mapped_column(Text)
    size: Mapped[int] = mapped_column(Integer)
    created_time: Mapped[datetime] = mapped_column(UTCDateTime, server_default=db_now())
