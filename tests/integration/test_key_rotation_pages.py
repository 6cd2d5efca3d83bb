"""After SECRET_KEY changes, stored secrets can no longer be decrypted (secretbox raises
SecretUnavailable). The mail server and SMS provider edit pages still open (no 500), say plainly
which stored secret cannot be read, and a new secret typed in simply replaces it, and works
(Flask's test client, real PostgreSQL)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from flask import Flask, current_app

from portal.extensions import db
from portal.models import MailSendServerConfig, SmsProviderConfig, secretbox
from portal.models.secretbox import SecretUnavailable
from portal.web.machine.webhooks import body_signature, twilio_signature
from tests.conftest import make_tenant
from tests.integration.test_portal_templates import Portal, user

OLD_KEY = "the-secret-key-before-the-rotation-0123456789"
UNREADABLE = "cannot be decrypted (the portal's secret key has changed since it was saved)"


def under_the_old_key(plain: str) -> str:
    """``plain`` as it was stored before SECRET_KEY changed to the app's current one."""
    current = current_app.config["SETTINGS"].secret_key
    assert current != OLD_KEY
    secretbox.configure(OLD_KEY)
    try:
        return secretbox.encrypt(plain)
    finally:
        secretbox.configure(current)


@pytest.fixture
def world(app: Flask) -> dict[str, Any]:
    acme = make_tenant("acme")
    user("admin@acme.test", "tenant_admin", acme.id)
    server = MailSendServerConfig(
        tenant_id=acme.id, name="relay", host="127.0.0.1", port=1, security="plain",
        username="user@acme.example.com", from_address="no-reply@acme.example.com",
    )  # fmt: skip
    server.password_encrypted = under_the_old_key("old-smtp-password")
    twilio = SmsProviderConfig(tenant_id=acme.id, name="tw", provider="twilio", account_id="AC1")
    twilio.secret_encrypted = under_the_old_key("old-auth-token")
    twilio.webhook_secret_encrypted = under_the_old_key("old-webhook-secret")
    generic = SmsProviderConfig(tenant_id=acme.id, name="gen", provider="http_json")
    generic.base_url = "https://sms.example.com/send"
    generic.webhook_secret_encrypted = under_the_old_key("old-webhook-secret")
    db.session.add_all([server, twilio, generic])
    db.session.commit()
    for row in (server, twilio, generic):  # the key really changed: nothing decrypts
        with pytest.raises(SecretUnavailable):
            _ = row.password if isinstance(row, MailSendServerConfig) else row.webhook_secret
    return {"server": server.id, "twilio": twilio.id, "generic": generic.id}


@pytest.fixture
def admin(app: Flask, world: dict[str, Any]) -> Portal:
    return Portal(app, "admin@acme.test")


def server_form(**changes: str) -> dict[str, str]:
    return {
        "name": "relay",
        "host": "127.0.0.1",
        "port": "1",
        "security": "plain",
        "username": "user@acme.example.com",
        "password": "",
        "from_address": "no-reply@acme.example.com",
        "enabled": "on",
        "uncertain_policy": "retry",
    } | changes


def provider_form(kind: str, **changes: str) -> dict[str, str]:
    base = {
        "name": "tw" if kind == "twilio" else "gen",
        "provider": kind,
        "account_id": "AC1" if kind == "twilio" else "",
        "base_url": "" if kind == "twilio" else "https://sms.example.com/send",
        "secret": "",
        "webhook_secret": "",
        "enabled": "on",
        "uncertain_policy": "retry",
    }
    return base | changes


def server(world: dict[str, Any]) -> MailSendServerConfig:
    db.session.expire_all()
    row = db.session.get(MailSendServerConfig, world["server"])
    assert row is not None
    return row


def provider(world: dict[str, Any], kind: str) -> SmsProviderConfig:
    db.session.expire_all()
    row = db.session.get(SmsProviderConfig, world[kind])
    assert row is not None
    return row


def test_a_mail_server_with_an_unreadable_password_opens_and_a_new_one_replaces_it(
    app: Flask, world: dict[str, Any], admin: Portal
) -> None:
    url = f"/mail-servers/{world['server']}"
    page = admin.get(f"{url}/edit")
    assert page.status_code == 200
    assert f"The stored password {UNREADABLE}" in page.text
    assert 'id="webhook-url"' in page.text  # the rest of the page is there
    tested = admin.post(f"{url}/test", htmx=True)
    assert tested.status_code == 200
    assert "The stored password cannot be decrypted: enter it again and save." in tested.text

    # A blank password keeps the unreadable one (and the page keeps saying so).
    assert admin.post(url, server_form()).status_code == 303
    assert UNREADABLE in admin.get(f"{url}/edit").text
    # A new one replaces it: no 500, and it decrypts.
    saved = admin.post(url, server_form(password="new-smtp-password"))
    assert saved.status_code == 303, saved.get_data(as_text=True)
    assert server(world).password == "new-smtp-password"
    again = admin.get(f"{url}/edit")
    assert again.status_code == 200
    assert UNREADABLE not in again.text
    assert "A value is stored. Leave this blank to keep it." in again.text
    # An invalid form with a new password is a 422 naming the field, not a 500.
    bad = admin.post(url, server_form(password="x", port="nope"))
    assert bad.status_code == 422
    assert "Port" in bad.text


def test_an_sms_provider_with_unreadable_secrets_opens_and_new_ones_replace_them(
    app: Flask, world: dict[str, Any], admin: Portal
) -> None:
    pid = world["twilio"]
    url = f"/sms-providers/{pid}"
    page = admin.get(f"{url}/edit")
    assert page.status_code == 200
    assert f"The stored auth token {UNREADABLE}" in page.text
    assert f"The stored webhook secret {UNREADABLE}" in page.text
    # The webhook section says the credential it checks with cannot be read either.
    assert '<a href="#f-secret">auth token</a> cannot be decrypted' in page.text
    tested = admin.post(f"{url}/test", htmx=True)
    assert tested.status_code == 200
    assert "The stored auth token cannot be decrypted" in tested.text

    form = provider_form("twilio", secret="new-auth-token", webhook_secret="new-webhook-secret")
    saved = admin.post(url, form)
    assert saved.status_code == 303, saved.get_data(as_text=True)
    row = provider(world, "twilio")
    assert (row.secret, row.webhook_secret) == ("new-auth-token", "new-webhook-secret")
    again = admin.get(f"{url}/edit").text
    assert UNREADABLE not in again
    assert "cannot be decrypted" not in again
    assert "The signature is checked with the stored" in again

    # The new auth token is the one Twilio's callbacks are now checked with.
    hook = f"http://localhost/webhooks/sms/twilio/{pid}"
    params = {"MessageSid": "SM9", "MessageStatus": "delivered", "To": "+447700900123"}
    signature = twilio_signature("new-auth-token", hook, list(params.items()))
    answer = app.test_client().post(hook, data=params, headers={"X-Twilio-Signature": signature})
    assert answer.status_code == 200, answer.get_data(as_text=True)


def test_only_the_unreadable_secret_is_replaced_and_the_other_kept(
    app: Flask, world: dict[str, Any], admin: Portal
) -> None:
    pid = world["generic"]
    url = f"/sms-providers/{pid}"
    page = admin.get(f"{url}/edit")
    assert page.status_code == 200
    assert f"The stored webhook secret {UNREADABLE}" in page.text
    assert "The stored auth token" not in page.text  # none stored: nothing to say

    saved = admin.post(url, provider_form("http_json", webhook_secret="new-webhook-secret"))
    assert saved.status_code == 303, saved.get_data(as_text=True)
    row = provider(world, "generic")
    assert (row.secret, row.webhook_secret) == (None, "new-webhook-secret")
    assert UNREADABLE not in admin.get(f"{url}/edit").text

    # ... and the provider's events signed with the new secret are accepted.
    body = json.dumps({"eventId": "e1", "messageId": "m1", "event": "delivered"}).encode()
    answer = app.test_client().post(
        f"http://localhost/webhooks/sms/http_json/{pid}",
        data=body,
        headers={
            "Content-Type": "application/json",
            "X-Postroom-Signature": body_signature("new-webhook-secret", body),
        },
    )
    assert answer.status_code == 200, answer.get_data(as_text=True)


def test_the_setters_replace_an_unreadable_secret_and_keep_a_readable_unchanged_one(
    app: Flask, world: dict[str, Any]
) -> None:
    row = server(world)
    row.password = "typed-again"
    assert row.password == "typed-again"
    stored = row.password_encrypted
    row.password = "typed-again"  # the same value: no fresh ciphertext (no spurious change)
    assert row.password_encrypted == stored
    sms = provider(world, "twilio")
    sms.secret = "t"
    sms.webhook_secret = "w"
    assert (sms.secret, sms.webhook_secret) == ("t", "w")
    db.session.rollback()


@pytest.mark.parametrize("kind", ["twilio", "generic"])
def test_an_event_signed_with_an_unreadable_secret_is_refused_not_a_500(
    app: Flask, world: dict[str, Any], kind: str
) -> None:
    """Until an admin re-enters the secret, nothing can be verified: 401 naming why."""
    body = json.dumps({"id": "SM1", "status": "delivered"}).encode()
    client = app.test_client()
    if kind == "twilio":
        url = f"/webhooks/sms/twilio/{world['twilio']}"
        form = {"MessageSid": "SM1", "MessageStatus": "delivered"}
        headers = {
            "X-Twilio-Signature": twilio_signature(
                "old-auth-token", f"http://localhost{url}", list(form.items())
            )
        }
        response = client.post(url, data=form, headers=headers)
    else:
        url = f"/webhooks/sms/http_json/{world['generic']}"
        headers = {"X-Postroom-Signature": body_signature("old-webhook-secret", body)}
        response = client.post(url, data=body, headers=headers, content_type="application/json")
    assert response.status_code == 401, response.get_data(as_text=True)
    assert "can no longer be read" in response.get_json()["error"]["message"]
