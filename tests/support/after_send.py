"""Helpers for the after-the-send tests: send records written straight into a state, provider
configs with webhook secrets, and signed webhook posts."""

from __future__ import annotations

import json
from typing import Any

from flask import Flask
from flask.testing import FlaskClient
from werkzeug.test import TestResponse

from portal.extensions import db
from portal.models import MailSendRecord, MailSendServerConfig, SmsProviderConfig, SmsSendRecord
from portal.web.machine.webhooks import body_signature, mail_webhook_secret, twilio_signature

WEBHOOK_SECRET = "whsec-test-0123456789"
TWILIO_TOKEN = "twilio-auth-token-test"
UK = "+447400123456"


def sms_config(tenant_id: int, kind: str = "http_json", **fields: Any) -> SmsProviderConfig:
    row = SmsProviderConfig(
        tenant_id=tenant_id,
        name=fields.pop("name", kind),
        provider=kind,
        base_url="http://127.0.0.1:9/",
        account_id="AC123" if kind == "twilio" else None,
        is_default=True,
        **fields,
    )
    row.secret = TWILIO_TOKEN if kind == "twilio" else "provider-secret"
    row.webhook_secret = WEBHOOK_SECRET
    db.session.add(row)
    db.session.flush()
    return row


def mail_config(tenant_id: int, **fields: Any) -> MailSendServerConfig:
    row = MailSendServerConfig(
        tenant_id=tenant_id,
        name=fields.pop("name", "smtp"),
        host="127.0.0.1",
        port=2525,
        security="plain",
        from_address="sender@smtp.test",
        is_default=True,
        **fields,
    )
    db.session.add(row)
    db.session.flush()
    return row


def sms_row(tenant_id: int, config: SmsProviderConfig | None, **fields: Any) -> SmsSendRecord:
    values: dict[str, Any] = {
        "tenant_id": tenant_id,
        "phone_number": UK,
        "country_code": "GB",
        "content": "Hello",
        "status": "Sent",
        "provider_config_id": config.id if config else None,
        "provider_kind": config.provider if config else None,
    } | fields
    row = SmsSendRecord(**values)
    db.session.add(row)
    db.session.flush()
    return row


def mail_row(tenant_id: int, config: MailSendServerConfig | None, **fields: Any) -> MailSendRecord:
    values: dict[str, Any] = {
        "tenant_id": tenant_id,
        "to_addrs": ["ann@example.com"],
        "subject": "Hello",
        "text_body": "Hi",
        "status": "Sent",
        "server_config_id": config.id if config else None,
    } | fields
    row = MailSendRecord(**values)
    db.session.add(row)
    db.session.flush()
    return row


def post_generic(
    client: FlaskClient,
    channel: str,
    provider: str,
    config_id: int,
    payload: Any,
    secret: str = WEBHOOK_SECRET,
) -> TestResponse:
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return client.post(
        f"/webhooks/{channel}/{provider}/{config_id}",
        data=body,
        headers={
            "Content-Type": "application/json",
            "X-Postroom-Signature": body_signature(secret, body),
        },
    )


def post_mail(app: Flask, client: FlaskClient, config_id: int, payload: Any) -> TestResponse:
    secret = mail_webhook_secret(app.config["SETTINGS"], config_id)
    return post_generic(client, "mail", "generic", config_id, payload, secret)


def post_twilio(
    client: FlaskClient, config_id: int, params: dict[str, str], token: str = TWILIO_TOKEN
) -> TestResponse:
    url = f"http://localhost/webhooks/sms/twilio/{config_id}"
    return client.post(
        url,
        data=params,
        headers={"X-Twilio-Signature": twilio_signature(token, url, list(params.items()))},
    )
