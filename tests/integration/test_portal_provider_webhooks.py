"""The SMS provider edit page's "Delivery events" section (Flask's test client, real
PostgreSQL): the absolute webhook URL of the config, the signature its provider must send and
the stored credential that checks it (named, never shown), only on a saved provider's page and
only to those who may edit providers; and the URL and credential it names are the ones the
webhook really accepts."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from flask import Flask

from portal.extensions import db
from portal.models import SmsProviderConfig
from portal.tenancy import PLATFORM_TENANT_ID
from portal.web.machine.webhooks import body_signature, twilio_signature, vonage_signature
from tests.conftest import make_tenant
from tests.integration.test_portal_templates import ROLES, Portal, user

AUTH_TOKEN = "auth-token-plain-0101"
WEBHOOK_SECRET = "webhook-secret-plain-0202"
KINDS = ("twilio", "vonage", "http_json", "test")


@pytest.fixture
def world(app: Flask) -> dict[str, Any]:
    acme, globex = make_tenant("acme"), make_tenant("globex")
    user("admin@acme.test", "tenant_admin", acme.id)
    user("support@acme.test", "support", acme.id)
    user("admin@globex.test", "tenant_admin", globex.id)
    user("operator@postroom.test", "platform_operator", PLATFORM_TENANT_ID)
    rows: dict[str, Any] = {"acme_id": acme.id}
    for kind in KINDS:
        provider = SmsProviderConfig(
            tenant_id=acme.id, name=f"acme-{kind}", provider=kind, account_id="AC1"
        )
        provider.secret = AUTH_TOKEN
        provider.webhook_secret = WEBHOOK_SECRET
        db.session.add(provider)
        db.session.flush()
        rows[kind] = provider.id
    db.session.commit()
    return rows


@pytest.fixture
def admin(app: Flask, world: dict[str, Any]) -> Portal:
    return Portal(app, "admin@acme.test")


def url_field(url: str) -> str:
    return f'id="webhook-url" type="text" value="{url}" readonly'


@pytest.mark.parametrize(
    ("kind", "signature", "credential"),
    [
        ("twilio", "X-Twilio-Signature", "auth token"),
        ("vonage", "sig parameter", "webhook secret"),
        ("http_json", "X-Postroom-Signature", "webhook secret"),
        ("test", "X-Postroom-Signature", "webhook secret"),
    ],
)
def test_the_edit_page_shows_the_webhook_url_and_names_the_credential_that_signs_it(
    app: Flask, world: dict[str, Any], admin: Portal, kind: str, signature: str, credential: str
) -> None:
    pid = world[kind]
    page = admin.get(f"/sms-providers/{pid}/edit")
    assert page.status_code == 200
    text = page.text
    assert "Delivery events" in text
    assert url_field(f"http://localhost/webhooks/sms/{kind}/{pid}") in text
    assert 'data-copy="webhook-url"' in text
    assert signature in text
    assert 'The signature is checked with the stored <a href="#f-' in text
    assert f">{credential}</a>" in text
    # The provider signs with a stored credential: nothing derived to show, nothing stored shown.
    assert 'id="webhook-secret"' not in text
    for secret in (AUTH_TOKEN, WEBHOOK_SECRET):
        assert secret not in text
    provider = db.session.get(SmsProviderConfig, pid)
    assert provider is not None
    assert provider.secret_encrypted not in text
    assert provider.webhook_secret_encrypted not in text


def test_the_url_and_credential_shown_are_the_ones_the_webhook_accepts(
    app: Flask, world: dict[str, Any], admin: Portal
) -> None:
    client = app.test_client()
    # Twilio: signed with the auth token over the exact URL shown.
    url = f"http://localhost/webhooks/sms/twilio/{world['twilio']}"
    assert url_field(url) in admin.get(f"/sms-providers/{world['twilio']}/edit").text
    params = {"MessageSid": "SM1", "MessageStatus": "delivered", "To": "+447700900123"}
    signed = twilio_signature(AUTH_TOKEN, url, list(params.items()))
    answer = client.post(url, data=params, headers={"X-Twilio-Signature": signed})
    assert answer.status_code == 200, answer.get_data(as_text=True)
    wrong = twilio_signature(WEBHOOK_SECRET, url, list(params.items()))
    assert client.post(url, data=params, headers={"X-Twilio-Signature": wrong}).status_code == 401

    # Vonage: an SMS API receipt's sig, keyed by the webhook (signature) secret.
    url = f"http://localhost/webhooks/sms/vonage/{world['vonage']}"
    assert url_field(url) in admin.get(f"/sms-providers/{world['vonage']}/edit").text
    receipt = {"messageId": "V1", "msisdn": "447700900123", "status": "delivered"}
    receipt |= {"timestamp": str(int(time.time()))}
    answer = client.post(url, data=receipt | {"sig": vonage_signature(WEBHOOK_SECRET, receipt)})
    assert answer.status_code == 200, answer.get_data(as_text=True)

    # Generic HTTP JSON and test: X-Postroom-Signature keyed by the webhook secret.
    for kind in ("http_json", "test"):
        url = f"http://localhost/webhooks/sms/{kind}/{world[kind]}"
        assert url_field(url) in admin.get(f"/sms-providers/{world[kind]}/edit").text
        body = json.dumps({"eventId": f"e-{kind}", "messageId": "m1", "event": "delivered"})
        answer = client.post(
            url,
            data=body.encode(),
            headers={
                "Content-Type": "application/json",
                "X-Postroom-Signature": body_signature(WEBHOOK_SECRET, body.encode()),
            },
        )
        assert answer.status_code == 200, answer.get_data(as_text=True)


def test_a_missing_credential_is_said_to_refuse_every_event(
    app: Flask, world: dict[str, Any], admin: Portal
) -> None:
    for kind, column in (("twilio", "secret_encrypted"), ("http_json", "webhook_secret_encrypted")):
        provider = db.session.get(SmsProviderConfig, world[kind])
        assert provider is not None
        setattr(provider, column, None)
    db.session.commit()
    twilio = admin.get(f"/sms-providers/{world['twilio']}/edit").text
    assert '<a href="#f-secret">auth token</a> is stored, so every event is refused' in twilio
    generic = admin.get(f"/sms-providers/{world['http_json']}/edit").text
    assert '<a href="#f-webhook_secret">webhook secret</a> is stored, so every event' in generic


def test_only_a_saved_provider_has_the_section(
    app: Flask, world: dict[str, Any], admin: Portal
) -> None:
    assert "webhook-url" not in admin.get("/sms-providers/new").text
    invalid = admin.post("/sms-providers/", {"name": "", "provider": "twilio"})
    assert invalid.status_code == 422
    assert "webhook-url" not in invalid.text
    # A form that comes back with errors still shows the saved provider's section.
    again = admin.post(f"/sms-providers/{world['twilio']}", {"name": "", "provider": "twilio"})
    assert again.status_code == 422
    assert url_field(f"http://localhost/webhooks/sms/twilio/{world['twilio']}") in again.text


@pytest.mark.parametrize("role", ["support", "anonymous"])
def test_only_those_who_may_edit_providers_see_the_webhook_url(
    app: Flask, world: dict[str, Any], role: str
) -> None:
    pid = world["twilio"]
    portal = Portal(app, ROLES[role])
    for url in ("/sms-providers/", f"/sms-providers/{pid}/edit", "/", "/sms-records/"):
        assert f"/webhooks/sms/twilio/{pid}" not in portal.get(url).get_data(as_text=True), url
    assert portal.get(f"/sms-providers/{pid}/edit").status_code in (302, 403)
    assert Portal(app, "admin@globex.test").get(f"/sms-providers/{pid}/edit").status_code == 404
    operator = Portal(app, ROLES["operator"])
    operator.view(world["acme_id"])
    page = operator.get(f"/sms-providers/{pid}/edit")
    assert page.status_code == 200
    assert url_field(f"http://localhost/webhooks/sms/twilio/{pid}") in page.text
