"""SMS: templates, providers, country routes, template bindings and send records."""

from __future__ import annotations

from typing import Any

from sqlalchemy import JSON, Float, ForeignKey, Index, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from portal.models.base import Base, BigId
from portal.models.channels import Secret, SendConfigBase, TemplateBase, record_table_args
from portal.models.enums import Channel
from portal.models.record import SendRecordMixin


class SmsTemplate(TemplateBase, Base):
    """A tenant-authored SMS template: the text, and its provider bindings."""

    __tablename__ = "sms_template"
    channel = Channel.SMS
    noun = "SMS template"
    sources = ("content",)

    content: Mapped[str] = mapped_column(Text, default="")


class SmsProviderConfig(SendConfigBase, Base):
    """An SMS provider account a tier sends through: the provider's API, the account's
    credentials and sender, and the provider's own resend window."""

    __tablename__ = "sms_provider_config"

    provider: Mapped[str] = mapped_column(String(32))
    base_url: Mapped[str | None] = mapped_column(String(500))
    account_id: Mapped[str | None] = mapped_column(String(200))
    secret_encrypted: Mapped[str | None] = mapped_column(Text)
    webhook_secret_encrypted: Mapped[str | None] = mapped_column(Text)
    sender_id: Mapped[str | None] = mapped_column(String(64))
    # Seed 002: idempotency keys live 24 h at some providers; no automatic retry after this.
    retry_window_s: Mapped[float | None] = mapped_column(Float)
    settings: Mapped[dict[str, Any] | None] = mapped_column(JSON)

    secret = Secret()  # the auth token, for the adapter only; never rendered
    webhook_secret = Secret()  # signs this provider's webhooks


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
    channel = Channel.SMS
    __table_args__ = record_table_args(
        "sms_send", Index("idx_sms_send_recipient", "tenant_id", "phone_number", "id")
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
