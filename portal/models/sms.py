"""SMS: templates, providers, country routes, template bindings and send records."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    Float,
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
from portal.models.enums import UncertainPolicy
from portal.models.record import (
    SCAN_TABLE_STORAGE,
    STREAM_DEFAULT,
    SendRecordMixin,
    Stream,
    decision_index,
    fair_indexes,
)


class SmsTemplate(Base):
    """A tenant-authored SMS template."""

    __tablename__ = "sms_template"
    __table_args__ = (UniqueConstraint("tenant_id", "code"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenant.id"))
    code: Mapped[str] = mapped_column(String(100))
    name: Mapped[str] = mapped_column(String(200), default="")
    content: Mapped[str] = mapped_column(Text, default="")
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


class SmsProviderConfig(Base):
    """An SMS provider account a tier sends through; ``config_version`` bumps on every save."""

    __tablename__ = "sms_provider_config"
    __table_args__ = (UniqueConstraint("tenant_id", "name"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenant.id"), index=True)
    name: Mapped[str] = mapped_column(String(200))
    provider: Mapped[str] = mapped_column(String(32))
    base_url: Mapped[str | None] = mapped_column(String(500))
    account_id: Mapped[str | None] = mapped_column(String(200))
    secret_encrypted: Mapped[str | None] = mapped_column(Text)
    webhook_secret_encrypted: Mapped[str | None] = mapped_column(Text)
    sender_id: Mapped[str | None] = mapped_column(String(64))
    is_default: Mapped[bool] = mapped_column(Boolean, default=False, server_default=text("false"))
    enabled: Mapped[bool] = mapped_column(Boolean, default=True, server_default=text("true"))
    daily_send_limit: Mapped[int | None] = mapped_column(Integer)
    rate_limit_per_minute: Mapped[int | None] = mapped_column(Integer)
    # Seed 002: idempotency keys live 24 h at some providers; no automatic retry after this.
    retry_window_s: Mapped[float | None] = mapped_column(Float)
    uncertain_policy: Mapped[str] = mapped_column(
        String(16), default=UncertainPolicy.RETRY.value, server_default=text("'retry'")
    )
    settings: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    config_version: Mapped[int] = mapped_column(Integer, default=1, server_default=text("1"))
    created_time: Mapped[datetime] = mapped_column(UTCDateTime, server_default=db_now())
    updated_time: Mapped[datetime] = mapped_column(
        UTCDateTime, server_default=db_now(), onupdate=db_now()
    )

    @property
    def secret(self) -> str | None:
        """The decrypted auth token (for the adapter only; never rendered)."""
        return secretbox.decrypt(self.secret_encrypted) if self.secret_encrypted else None

    @secret.setter
    def secret(self, value: str | None) -> None:
        if value and self.secret_encrypted:
            try:
                if secretbox.decrypt(self.secret_encrypted) == value:
                    return  # unchanged: a fresh ciphertext would look like a change
            except secretbox.SecretUnavailable:
                pass  # unreadable since SECRET_KEY changed: the new value replaces it
        self.secret_encrypted = secretbox.encrypt(value) if value else None

    @property
    def webhook_secret(self) -> str | None:
        """The decrypted secret that signs this provider's webhooks."""
        if not self.webhook_secret_encrypted:
            return None
        return secretbox.decrypt(self.webhook_secret_encrypted)

    @webhook_secret.setter
    def webhook_secret(self, value: str | None) -> None:
        if value and self.webhook_secret_encrypted:
            try:
                if secretbox.decrypt(self.webhook_secret_encrypted) == value:
                    return
            except secretbox.SecretUnavailable:
                pass  # unreadable since SECRET_KEY changed: the new value replaces it
        self.webhook_secret_encrypted = secretbox.encrypt(value) if value else None


class SmsProviderRegion(Base):
    """A route row: which provider serves a country, in priority order (lower first)."""

    __tablename__ = "sms_provider_region"
    __table_args__ = (
        UniqueConstraint("provider_id", "country_code"),
        Index("idx_sms_region_tenant_country", "tenant_id", "country_code", "priority"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenant.id"))
    provider_id: Mapped[int] = mapped_column(
        ForeignKey("sms_provider_config.id", ondelete="CASCADE")
    )
    country_code: Mapped[str] = mapped_column(String(2))
    priority: Mapped[int] = mapped_column(Integer, default=100)


class SmsTemplateProviderBinding(Base):
    """An SMS template's external template id and signature at one provider.

    ``country_code`` NULL is a generic binding; an exact-region binding beats it.
    """

    __tablename__ = "sms_template_provider_binding"
    __table_args__ = (UniqueConstraint("template_id", "provider_id", "country_code"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenant.id"))
    template_id: Mapped[int] = mapped_column(
        ForeignKey("sms_template.id", ondelete="CASCADE"), index=True
    )
    provider_id: Mapped[int] = mapped_column(
        ForeignKey("sms_provider_config.id", ondelete="CASCADE")
    )
    country_code: Mapped[str | None] = mapped_column(String(2))
    external_template_id: Mapped[str | None] = mapped_column(String(200))
    signature: Mapped[str | None] = mapped_column(String(200))


class SmsSendRecord(SendRecordMixin, Base):
    """One SMS to one number."""

    __tablename__ = "sms_send_record"
    __table_args__ = (
        Index("idx_sms_send_status_updated", "status", "updated_time"),
        Index("idx_sms_send_status_retry", "status", "next_retry_at"),
        Index("idx_sms_send_recipient", "tenant_id", "phone_number", "id"),
        Index("idx_sms_send_tenant_created", "tenant_id", "id"),
        Index("idx_sms_send_tenant_status", "tenant_id", "status", "id"),
        Index("idx_sms_send_created", "created_time"),
        *fair_indexes("sms_send"),
        decision_index("sms_send"),
        UniqueConstraint("tenant_id", "business_key", name="uq_sms_send_business_key"),
        # Ids are never reused (Message-IDs and idempotency keys are built from them), also on
        # SQLite after retention purged the newest records (migration 0017).
        {"postgresql_with": SCAN_TABLE_STORAGE, "sqlite_autoincrement": True},
    )

    phone_number: Mapped[str] = mapped_column(String(20))  # E.164
    country_code: Mapped[str | None] = mapped_column(String(2))  # ISO 3166 alpha-2
    content: Mapped[str | None] = mapped_column(Text)
    # What preparation froze.
    rendered_content: Mapped[str | None] = mapped_column(Text)
    provider_config_id: Mapped[int | None] = mapped_column(BigId)
    provider_kind: Mapped[str | None] = mapped_column(String(32))
    external_template_id: Mapped[str | None] = mapped_column(String(200))
    signature: Mapped[str | None] = mapped_column(String(200))
    frozen_variables: Mapped[dict[str, Any] | None] = mapped_column(JSON)
