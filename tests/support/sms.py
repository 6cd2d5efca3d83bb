"""Helpers for SMS and rate-limit tests: provider configs on the fake provider server, SMS
acceptance, and a synchronous drain for either channel that claims and processes due records
in the test thread (the code the worker threads run), with the context the test chooses."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from flask import Flask
from sqlalchemy import select
from sqlalchemy.orm import Session

from portal.config import Settings
from portal.extensions import db
from portal.messaging.records import acceptance
from portal.messaging.sending.backoff import BackoffPolicy
from portal.messaging.sending.claim import claim_due
from portal.messaging.sending.pipeline import MailContext, SmsContext, process_mail, process_sms
from portal.messaging.sending.ratelimit import RateLimiter
from portal.models import (
    MailSendRecord,
    SendStatus,
    SmsProviderConfig,
    SmsProviderRegion,
    SmsSendRecord,
    SmsTemplate,
    SmsTemplateProviderBinding,
)
from portal.tenancy import tenant_context
from tests.support import sms_provider as fake
from tests.support.sms_provider import FakeSmsProvider

UK, US, FR = "+447400123456", "+12025550123", "+33612345678"  # GB, US, FR


def provider(
    tenant_id: int,
    kind: str,
    server: FakeSmsProvider | None,
    name: str | None = None,
    **fields: Any,
) -> SmsProviderConfig:
    """An SMS provider config pointing at the fake server, with the credentials it expects."""
    values: dict[str, Any] = {
        "tenant_id": tenant_id,
        "name": name or kind,
        "provider": kind,
        "sender_id": "+15005550006" if kind != "vonage" else "Postroom",
        "is_default": True,
    }
    if kind == "twilio" and server is not None:
        values |= {"base_url": server.base_url, "account_id": fake.TWILIO_SID}
    elif kind == "vonage" and server is not None:
        values |= {"base_url": server.base_url, "account_id": fake.VONAGE_KEY}
    elif kind == "http_json" and server is not None:
        values |= {"base_url": server.gateway_url}
    secret = {
        "twilio": fake.TWILIO_TOKEN,
        "vonage": fake.VONAGE_SECRET,
        "http_json": fake.GATEWAY_SECRET,
    }.get(kind)
    secret = fields.pop("secret", secret)
    row = SmsProviderConfig(**(values | fields))
    row.secret = secret
    db.session.add(row)
    db.session.flush()
    return row


def route(config: SmsProviderConfig, country: str, priority: int = 100) -> SmsProviderRegion:
    row = SmsProviderRegion(
        tenant_id=config.tenant_id, provider_id=config.id, country_code=country, priority=priority
    )
    db.session.add(row)
    db.session.flush()
    return row


def sms_template(tenant_id: int, code: str = "otp", **fields: Any) -> SmsTemplate:
    row = SmsTemplate(
        tenant_id=tenant_id,
        code=code,
        name=code,
        content=fields.pop("content", "Your code is {{ code }}"),
        **fields,
    )
    db.session.add(row)
    db.session.flush()
    return row


def binding(
    template: SmsTemplate,
    config: SmsProviderConfig,
    country: str | None = None,
    external_template_id: str | None = None,
    signature: str | None = None,
) -> SmsTemplateProviderBinding:
    row = SmsTemplateProviderBinding(
        tenant_id=template.tenant_id,
        template_id=template.id,
        provider_id=config.id,
        country_code=country,
        external_template_id=external_template_id,
        signature=signature,
    )
    db.session.add(row)
    db.session.flush()
    return row


def accept_sms(app: Flask, tenant_id: int | None, **body: Any) -> int:
    request = {"phoneNumber": UK, "content": "Hello from Postroom"} | body
    with tenant_context(tenant_id):
        result = acceptance.send_sms(db.session, request, settings=app.config["SETTINGS"])
    db.session.commit()
    return result.id


def sms_record(record_id: int) -> SmsSendRecord:
    db.session.expire_all()
    row = db.session.get(SmsSendRecord, record_id)
    assert row is not None
    return row


Context = MailContext | SmsContext


def sms_context(
    app: Flask,
    *,
    policy: BackoffPolicy | None = None,
    limiter: RateLimiter | None = None,
    **overrides: Any,
) -> SmsContext:
    settings: Settings = app.config["SETTINGS"].replace(**overrides)
    return SmsContext(
        engine=db.engine,
        settings=settings,
        policy=policy or BackoffPolicy.from_settings(settings),
        limiter=limiter,
    )


def mail_context(
    app: Flask, *, policy: BackoffPolicy | None = None, limiter: RateLimiter | None = None
) -> MailContext:
    settings: Settings = app.config["SETTINGS"]
    return MailContext(
        engine=db.engine,
        settings=settings,
        policy=policy or BackoffPolicy.from_settings(settings),
        limiter=limiter,
    )


def drain_with(
    ctx: Context,
    *,
    until: Callable[[], bool] | None = None,
    timeout_s: float = 10.0,
) -> int:
    """Claim and process due records of ``ctx``'s channel in this thread until none is due or
    waiting in Retry (or until ``until`` holds); the context stays open."""
    model: type[MailSendRecord] | type[SmsSendRecord] = (
        SmsSendRecord if isinstance(ctx, SmsContext) else MailSendRecord
    )
    processed = 0
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        claimed = claim_due(db.engine, model, 1)  # what a pool worker runs
        if claimed:
            if isinstance(ctx, SmsContext):
                process_sms(ctx, claimed[0])  # type: ignore[arg-type]
            else:
                process_mail(ctx, claimed[0])  # type: ignore[arg-type]
            processed += 1
            if until is not None and until():
                return processed  # before a short back-off makes the record due again
            continue
        if until is None:
            if not _waiting_retry(model):
                return processed
        elif until():
            return processed
        time.sleep(0.02)
    raise AssertionError(f"drain timed out after {timeout_s}s ({processed} processed)")


def drain_sms(
    app: Flask,
    *,
    until: Callable[[], bool] | None = None,
    timeout_s: float = 10.0,
    policy: BackoffPolicy | None = None,
    limiter: RateLimiter | None = None,
    read_timeout_s: float | None = None,
) -> int:
    """``drain_with`` on a fresh SMS context (closed afterwards); ``read_timeout_s`` shortens
    the HTTP timeouts (for answers that hang)."""
    overrides: dict[str, Any] = {}
    if read_timeout_s is not None:
        overrides = {"sms_read_timeout_s": read_timeout_s, "sms_connect_timeout_s": 0.5}
    ctx = sms_context(app, policy=policy, limiter=limiter, **overrides)
    try:
        return drain_with(ctx, until=until, timeout_s=timeout_s)
    finally:
        ctx.close()


def _waiting_retry(model: type[MailSendRecord] | type[SmsSendRecord]) -> bool:
    with Session(db.engine) as session:
        return (
            session.scalar(select(model.id).where(model.status == SendStatus.RETRY.value).limit(1))
            is not None
        )
