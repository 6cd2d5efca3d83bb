"""What the mail and SMS models share: a template's columns, a send configuration's (a mail
server's, an SMS provider's), the secrets a configuration keeps encrypted, and a send record
table's indexes (its columns are ``record.SendRecordMixin``). Each channel's
module (``mail``, ``sms``) adds only what is its own, and declares once what tells the channels
apart.

The bases add columns to each channel's own table; neither is a table itself, so both tables
stay as their migrations made them.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, ClassVar, overload

from sqlalchemy import JSON, Boolean, ForeignKey, Index, Integer, String, UniqueConstraint, text
from sqlalchemy.orm import Mapped, declared_attr, mapped_column

from portal.models import secretbox
from portal.models.base import BigId, UTCDateTime, db_now
from portal.models.enums import Channel, UncertainPolicy
from portal.models.record import (
    SCAN_TABLE_STORAGE,
    STREAM_DEFAULT,
    Stream,
    decision_index,
    fair_indexes,
)


class TemplateBase:
    """A tenant-authored template (untrusted: rendered in the sandbox), whatever its channel.

    A channel's template adds the columns that hold its content and declares ``channel``, the
    ``noun`` its messages use ("mail template") and ``sources``, its columns that hold Liquid
    (in the order the editor shows them).
    """

    channel: ClassVar[Channel]
    noun: ClassVar[str]
    sources: ClassVar[tuple[str, ...]]

    @declared_attr.directive
    def __table_args__(cls) -> tuple[UniqueConstraint]:
        return (UniqueConstraint("tenant_id", "code"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenant.id"))
    code: Mapped[str] = mapped_column(String(100))
    name: Mapped[str] = mapped_column(String(200), default="")
    enabled: Mapped[bool] = mapped_column(Boolean, default=True, server_default=text("true"))
    # The stream of a send that names this template and no stream of its own.
    stream: Mapped[str] = mapped_column(
        String(16), default=Stream.TRANSACTIONAL.value, server_default=text(STREAM_DEFAULT)
    )
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


class ConfigBase:
    """A configuration row of a tier, named once in it; ``config_version`` is bumped by every
    save that changes it (``portal.models``), so what is cached by it is never stale."""

    @declared_attr.directive
    def __table_args__(cls) -> tuple[UniqueConstraint]:
        return (UniqueConstraint("tenant_id", "name"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenant.id"), index=True)
    name: Mapped[str] = mapped_column(String(200))
    enabled: Mapped[bool] = mapped_column(Boolean, default=True, server_default=text("true"))
    config_version: Mapped[int] = mapped_column(Integer, default=1, server_default=text("1"))
    created_time: Mapped[datetime] = mapped_column(UTCDateTime, server_default=db_now())
    updated_time: Mapped[datetime] = mapped_column(
        UTCDateTime, server_default=db_now(), onupdate=db_now()
    )


class SendConfigBase(ConfigBase):
    """A mail server or SMS provider a tier sends through: the tier's default or not, its rate
    limits, and what becomes of a send whose outcome is uncertain."""

    is_default: Mapped[bool] = mapped_column(Boolean, default=False, server_default=text("false"))
    daily_send_limit: Mapped[int | None] = mapped_column(Integer)
    rate_limit_per_minute: Mapped[int | None] = mapped_column(Integer)
    uncertain_policy: Mapped[str] = mapped_column(
        String(16), default=UncertainPolicy.RETRY.value, server_default=text("'retry'")
    )


class Secret:
    """A secret a configuration keeps encrypted (secretbox) in its column ``<name>_encrypted``.

    Reading decrypts it (None when none is stored; ``SecretUnavailable`` when SECRET_KEY
    changed since). Writing the value already stored keeps its ciphertext, since a fresh one
    would look like a change (and bump the config's version); a stored secret that cannot be
    decrypted any more is replaced; None or "" removes it. Never rendered: for the transports.
    """

    column: str

    def __set_name__(self, owner: type, name: str) -> None:
        self.column = f"{name}_encrypted"

    @overload
    def __get__(self, row: None, owner: type) -> Secret: ...

    @overload
    def __get__(self, row: object, owner: type | None = None) -> str | None: ...

    def __get__(self, row: object, owner: type | None = None) -> Secret | str | None:
        if row is None:
            return self
        stored: str | None = getattr(row, self.column)
        return secretbox.decrypt(stored) if stored else None

    def __set__(self, row: object, value: str | None) -> None:
        stored: str | None = getattr(row, self.column)
        if value and stored:
            try:
                if secretbox.decrypt(stored) == value:
                    return  # unchanged: a fresh ciphertext would look like a change
            except secretbox.SecretUnavailable:
                pass  # unreadable since SECRET_KEY changed: the new value replaces it
        setattr(row, self.column, secretbox.encrypt(value) if value else None)


def record_table_args(prefix: str, *own: Index) -> tuple[Any, ...]:
    """A send record table's ``__table_args__``: the indexes every channel's has, named
    ``idx_<prefix>_...`` (``mail_send``, ``sms_send``), and the channel's ``own``."""
    return (
        Index(f"idx_{prefix}_status_updated", "status", "updated_time"),
        Index(f"idx_{prefix}_status_retry", "status", "next_retry_at"),
        *own,
        Index(f"idx_{prefix}_tenant_created", "tenant_id", "id"),
        # The dashboard: per-tenant status counts and the last 24 hours.
        Index(f"idx_{prefix}_tenant_status", "tenant_id", "status", "id"),
        Index(f"idx_{prefix}_created", "created_time"),
        *fair_indexes(prefix),
        decision_index(prefix),
        UniqueConstraint("tenant_id", "business_key", name=f"uq_{prefix}_business_key"),
        # Ids are never reused (Message-IDs and idempotency keys are built from them), also on
        # SQLite after retention purged the newest records (migration 0017).
        {"postgresql_with": SCAN_TABLE_STORAGE, "sqlite_autoincrement": True},
    )
