"""Mail server and SMS provider pages over HTTP (Flask's test client, real PostgreSQL and a
real SMTP server): permissions per role, tenant isolation, CSRF, validation, write-only
secrets, Test connection, routes by country, and delete versus disable."""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from flask import Flask
from sqlalchemy import func, select

from portal.extensions import db
from portal.models import (
    MailSendRecord,
    MailSendServerConfig,
    SmsProviderConfig,
    SmsProviderRegion,
    SmsSendRecord,
)
from portal.tenancy import PLATFORM_TENANT_ID
from tests.conftest import make_tenant
from tests.integration.test_portal_templates import ROLES, Portal, user
from tests.support.smtp_server import ScriptedSmtpServer

SMTP_PASSWORD = "smtp-Pa55word-plain"
SMS_SECRET = "sms-auth-token-plain-0001"
WEBHOOK_SECRET = "webhook-signing-plain-0002"


@pytest.fixture
def world(app: Flask) -> dict[str, Any]:
    acme, globex = make_tenant("acme"), make_tenant("globex")
    user("admin@acme.test", "tenant_admin", acme.id)
    user("support@acme.test", "support", acme.id)
    user("admin@globex.test", "tenant_admin", globex.id)
    user("operator@postroom.test", "platform_operator", PLATFORM_TENANT_ID)
    rows: dict[str, Any] = {"acme_id": acme.id, "globex_id": globex.id}
    for tier, prefix in ((acme.id, "acme"), (globex.id, "globex"), (PLATFORM_TENANT_ID, "pf")):
        server = MailSendServerConfig(
            tenant_id=tier, name=f"{prefix}-smtp", host="127.0.0.1", port=1, security="plain",
            username=f"user@{prefix}.example.com", from_address=f"no-reply@{prefix}.example.com",
        )  # fmt: skip
        server.password = SMTP_PASSWORD
        provider = SmsProviderConfig(
            tenant_id=tier, name=f"{prefix}-sms", provider="test", account_id="AC1"
        )
        provider.secret = SMS_SECRET
        provider.webhook_secret = WEBHOOK_SECRET
        db.session.add_all([server, provider])
        db.session.flush()
        route = SmsProviderRegion(
            tenant_id=tier, provider_id=provider.id, country_code="GB", priority=10
        )
        db.session.add(route)
        db.session.flush()
        rows[prefix] = {"server": server.id, "provider": provider.id, "route": route.id}
    db.session.commit()
    return rows


@pytest.fixture
def admin(app: Flask, world: dict[str, Any]) -> Portal:
    return Portal(app, "admin@acme.test")


def server_form(**changes: str | None) -> dict[str, str]:
    base: dict[str, str | None] = {
        "name": "relay",
        "host": "smtp.example.com",
        "port": "587",
        "security": "starttls",
        "verify_tls": "on",
        "username": "",
        "password": "",
        "from_address": "news@example.com",
        "from_name": "News",
        "reply_to": "",
        "enabled": "on",
        "daily_send_limit": "",
        "rate_limit_per_minute": "",
        "uncertain_policy": "retry",
    } | changes
    return {k: v for k, v in base.items() if v is not None}


def provider_form(**changes: str | None) -> dict[str, str]:
    base: dict[str, str | None] = {
        "name": "twilio-main",
        "provider": "twilio",
        "base_url": "",
        "account_id": "AC123",
        "secret": "",
        "webhook_secret": "",
        "sender_id": "+15550001111",
        "enabled": "on",
        "daily_send_limit": "",
        "rate_limit_per_minute": "",
        "retry_window_s": "",
        "uncertain_policy": "retry",
    } | changes
    return {k: v for k, v in base.items() if v is not None}


def count(model: Any) -> int:
    db.session.expire_all()
    return db.session.scalar(select(func.count()).select_from(model)) or 0


ROUTES = [
    ("GET", "/mail-servers/", 200),
    ("GET", "/mail-servers/new", 200),
    ("POST", "/mail-servers/", 422),
    ("GET", "/mail-servers/{server}/edit", 200),
    ("POST", "/mail-servers/{server}", 422),
    ("POST", "/mail-servers/{server}/test", 200),
    ("GET", "/mail-servers/{server}/delete", 200),
    ("POST", "/mail-servers/{server}/delete", 200),  # without confirm=yes: the confirm page
    ("GET", "/sms-providers/", 200),
    ("GET", "/sms-providers/new", 200),
    ("POST", "/sms-providers/", 422),
    ("GET", "/sms-providers/{provider}/edit", 200),
    ("POST", "/sms-providers/{provider}", 422),
    ("POST", "/sms-providers/{provider}/test", 200),
    ("POST", "/sms-providers/{provider}/routes", 422),
    ("GET", "/sms-providers/{provider}/routes/{route}/delete", 200),
    ("POST", "/sms-providers/{provider}/routes/{route}/delete", 200),
    ("GET", "/sms-providers/{provider}/delete", 200),
    ("POST", "/sms-providers/{provider}/delete", 200),
]


@pytest.mark.parametrize("role", list(ROLES))
def test_every_route_answers_each_role_as_its_permissions_say(
    app: Flask, world: dict[str, Any], role: str
) -> None:
    portal = Portal(app, ROLES[role])
    if role == "operator":
        portal.view(world["acme_id"])
    for method, template, permitted in ROUTES:
        url = template.format(**world["acme"])
        response = portal.get(url) if method == "GET" else portal.post(url, {"name": ""})
        expected = {"anonymous": 302, "support": 403}.get(role, permitted)
        assert response.status_code == expected, f"{role} {method} {url}: {response.status_code}"


def test_another_tenants_ids_are_404_on_every_route(
    app: Flask, world: dict[str, Any], admin: Portal
) -> None:
    for other in ("globex", "pf"):
        for method, template, _ in ROUTES:
            if "{" not in template:
                continue
            url = template.format(**world[other])
            response = admin.get(url) if method == "GET" else admin.post(url, server_form())
            assert response.status_code == 404, f"{method} {url}: {response.status_code}"
    # A route of another tenant under one's own provider is not found either.
    url = f"/sms-providers/{world['acme']['provider']}/routes/{world['globex']['route']}/delete"
    assert admin.post(url).status_code == 404
    assert admin.get(f"/mail-servers/{2**63}/edit").status_code == 404
    assert count(MailSendServerConfig) == 3
    assert count(SmsProviderRegion) == 3
    lists = admin.get("/mail-servers/").text + admin.get("/sms-providers/").text
    assert "acme-smtp" in lists
    assert "globex" not in lists
    assert "pf-smtp" not in lists


def test_unsafe_requests_without_the_csrf_token_are_refused(
    app: Flask, world: dict[str, Any], admin: Portal
) -> None:
    server_id, provider_id = world["acme"]["server"], world["acme"]["provider"]
    for url, data in (
        ("/mail-servers/", server_form()),
        (f"/mail-servers/{server_id}", server_form(name="x")),
        (f"/mail-servers/{server_id}/delete", {}),
        (f"/mail-servers/{server_id}/test", {}),
        ("/sms-providers/", provider_form()),
        (f"/sms-providers/{provider_id}/routes", {"country": "FR"}),
        (f"/sms-providers/{provider_id}/delete", {}),
    ):
        assert admin.post(url, data, csrf=False).status_code == 400, url
    assert count(MailSendServerConfig) == 3
    assert count(SmsProviderConfig) == 3
    assert count(SmsProviderRegion) == 3


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"name": ""}, "Name is required"),
        ({"name": "acme-smtp"}, "Name &#39;acme-smtp&#39; is already used by another mail server"),
        ({"host": ""}, "Host is required"),
        ({"host": "smtp example.com"}, "Host must be a host name or IP address"),
        ({"port": "70000"}, "Port must be a whole number from 1 to 65,535"),
        ({"port": "abc"}, "Port must be a whole number from 1 to 65,535"),
        ({"security": "tls13"}, "Security must be one of plain, starttls, ssl"),
        ({"from_address": "nope"}, "From address is not a valid email address"),
        ({"from_address": "", "username": ""}, "From address or a username is required"),
        ({"reply_to": "a@b@c"}, "Reply-To is not a valid email address"),
        ({"daily_send_limit": "-1"}, "Daily send limit must be a whole number from 0"),
        ({"rate_limit_per_minute": "9" * 30}, "Per-minute send limit must be a whole number"),
        ({"uncertain_policy": "maybe"}, "When a send&#39;s outcome is uncertain must be one of"),
        ({"from_name": "x" * 201}, "From name must be at most 200 characters"),
    ],
)
def test_an_invalid_mail_server_is_422_with_the_field_named(
    app: Flask, world: dict[str, Any], admin: Portal, changes: dict[str, str], message: str
) -> None:
    for url in ("/mail-servers/", f"/mail-servers/{world['acme']['server']}"):
        if url != "/mail-servers/" and changes.get("name") == "acme-smtp":
            continue  # its own name is no clash
        response = admin.post(url, server_form(password="typed-secret-1", **changes))
        assert response.status_code == 422, url
        assert message in response.text, url
        assert "typed-secret-1" not in response.text  # not even what was just typed
    assert count(MailSendServerConfig) == 3


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"provider": "carrier-pigeon"}, "Provider must be one of twilio, vonage, http_json, test"),
        ({"base_url": "ftp://x"}, "Base URL must start with http:// or https://"),
        ({"provider": "http_json", "base_url": ""}, "Base URL is required for a generic HTTP JSON"),
        ({"retry_window_s": "59"}, "Retry window (seconds) must be a whole number from 60"),
        ({"sender_id": "s" * 65}, "Sender must be at most 64 characters"),
        ({"name": "acme-sms"}, "Name &#39;acme-sms&#39; is already used by another SMS provider"),
    ],
)
def test_an_invalid_sms_provider_is_422_with_the_field_named(
    app: Flask, world: dict[str, Any], admin: Portal, changes: dict[str, str], message: str
) -> None:
    response = admin.post("/sms-providers/", provider_form(**changes))
    assert response.status_code == 422
    assert message in response.text
    assert count(SmsProviderConfig) == 3


def test_secrets_are_write_only_and_never_in_any_response(
    app: Flask, world: dict[str, Any], admin: Portal
) -> None:
    server = db.session.get(MailSendServerConfig, world["acme"]["server"])
    provider = db.session.get(SmsProviderConfig, world["acme"]["provider"])
    assert server is not None
    assert provider is not None
    forbidden = [
        SMTP_PASSWORD,
        SMS_SECRET,
        WEBHOOK_SECRET,
        server.password_encrypted,
        provider.secret_encrypted,
        provider.webhook_secret_encrypted,
    ]
    sid, pid = server.id, provider.id
    responses = [
        admin.get("/mail-servers/"),
        admin.get(f"/mail-servers/{sid}/edit"),
        admin.post(f"/mail-servers/{sid}", server_form(name="acme-smtp", port="0")),
        admin.post(f"/mail-servers/{sid}/test", htmx=True),
        admin.post(f"/mail-servers/{sid}/test"),
        admin.get("/sms-providers/"),
        admin.get(f"/sms-providers/{pid}/edit"),
        admin.post(f"/sms-providers/{pid}", provider_form(name="acme-sms", retry_window_s="1")),
        admin.post(f"/sms-providers/{pid}/test", htmx=True),
        admin.post(f"/sms-providers/{pid}/routes", {"country": "nope"}),
    ]
    for response in responses:
        body = response.get_data(as_text=True)
        for secret in forbidden:
            assert secret
            assert secret not in body, response.request.path
    edit = responses[1].text
    assert 'type="password" value=""' in edit
    assert "A value is stored. Leave this blank to keep it." in edit
    assert "Remove the stored password" in edit


def test_a_blank_secret_keeps_the_stored_one_and_the_box_removes_it(
    app: Flask, world: dict[str, Any], admin: Portal
) -> None:
    sid, pid = world["acme"]["server"], world["acme"]["provider"]
    form = server_form(name="acme-smtp", username="user@acme.example.com", password="")
    assert admin.post(f"/mail-servers/{sid}", form).status_code == 303
    server = db.session.get(MailSendServerConfig, sid)
    assert server is not None
    assert server.password == SMTP_PASSWORD
    assert admin.post(f"/mail-servers/{sid}", form | {"password": "new-one"}).status_code == 303
    db.session.expire_all()
    assert server.password == "new-one"
    assert admin.post(f"/mail-servers/{sid}", form | {"remove_password": "on"}).status_code == 303
    db.session.expire_all()
    assert server.password_encrypted is None
    pform = provider_form(name="acme-sms", provider="test")
    assert admin.post(f"/sms-providers/{pid}", pform).status_code == 303
    provider = db.session.get(SmsProviderConfig, pid)
    assert provider is not None
    assert (provider.secret, provider.webhook_secret) == (SMS_SECRET, WEBHOOK_SECRET)
    removed = pform | {"remove_webhook_secret": "on", "secret": "rotated"}
    assert admin.post(f"/sms-providers/{pid}", removed).status_code == 303
    db.session.expire_all()
    assert (provider.secret, provider.webhook_secret_encrypted) == ("rotated", None)


def test_create_a_server_and_the_default_moves_to_it(
    app: Flask, world: dict[str, Any], admin: Portal
) -> None:
    first = admin.post("/mail-servers/", server_form(name="one", is_default="on"))
    assert first.status_code == 303
    second = admin.post(
        "/mail-servers/", server_form(name="two", is_default="on", from_address="A@Example.COM")
    )
    assert second.status_code == 303
    rows = {
        s.name: s
        for s in db.session.scalars(
            select(MailSendServerConfig).where(MailSendServerConfig.tenant_id == world["acme_id"])
        )
    }
    assert (rows["one"].is_default, rows["two"].is_default) == (False, True)
    assert rows["two"].from_address == "a@example.com"
    assert (rows["two"].port, rows["two"].security, rows["two"].verify_tls) == (
        587,
        "starttls",
        True,
    )
    page = admin.get(f"/mail-servers/{rows['two'].id}/edit").text
    assert "Mail server &#39;two&#39; added." in page


def test_test_connection_says_hello_logs_in_and_reports_latency_or_the_error(
    app: Flask, world: dict[str, Any], admin: Portal
) -> None:
    server = db.session.get(MailSendServerConfig, world["acme"]["server"])
    assert server is not None
    url = f"/mail-servers/{server.id}/test"
    with ScriptedSmtpServer(
        auth_users={"user@acme.example.com": SMTP_PASSWORD}, auth_require_tls=False
    ) as smtp:
        server.host, server.port = smtp.host, smtp.port
        db.session.commit()
        ok = admin.post(url, htmx=True)
        assert ok.status_code == 200
        assert ok.text.startswith(f'<div id="connection-{server.id}"')
        assert "Connected and logged in.</strong> Took" in ok.text
        assert "HX-Request" in ok.headers["Vary"]
        assert smtp.logins == ["user@acme.example.com"]
        server.password = "wrong"
        db.session.commit()
        refused = admin.post(url, htmx=True)
        assert "Failed" in refused.text
        assert "535" in refused.text
        assert "refused the username or password" in refused.text  # in plain words too
        page = admin.post(url)  # without JavaScript: a page
        assert "<h1>Connection test: acme-smtp</h1>" in page.text
    server.port = 1
    db.session.commit()
    unreachable = admin.post(url, htmx=True)
    assert unreachable.status_code == 200
    assert "Failed" in unreachable.text
    assert "Nothing accepts connections on" in unreachable.text


class _ProviderApi:
    """Twilio's account resource and Vonage's balance, answering by credentials (GET only)."""

    def __init__(self) -> None:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                owner.paths.append(self.path)
                parts = urlsplit(self.path)
                good = False
                if parts.path.startswith("/2010-04-01/Accounts/"):
                    auth = self.headers.get("Authorization", "")
                    good = auth == "Basic " + base64.b64encode(b"AC123:right").decode()
                elif parts.path == "/account/get-balance":
                    query = parse_qs(parts.query)
                    good = query.get("api_key") == ["AC123"] and query.get("api_secret") == [
                        "right"
                    ]
                body = json.dumps({"value": 1.5} if good else {"code": 20003}).encode()
                self.send_response(200 if good else 401)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.paths: list[str] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def provider_api() -> Iterator[_ProviderApi]:
    api = _ProviderApi()
    yield api
    api.close()


@pytest.mark.parametrize("kind", ["twilio", "vonage"])
def test_a_provider_credential_check_reads_the_account_and_sends_nothing(
    app: Flask, world: dict[str, Any], admin: Portal, provider_api: _ProviderApi, kind: str
) -> None:
    provider = db.session.get(SmsProviderConfig, world["acme"]["provider"])
    assert provider is not None
    provider.provider, provider.base_url, provider.account_id = kind, provider_api.url, "AC123"
    provider.secret = "right"
    db.session.commit()
    url = f"/sms-providers/{provider.id}/test"
    ok = admin.post(url, htmx=True)
    assert ok.status_code == 200
    assert "Credentials accepted" in ok.text
    provider.secret = "wrong"
    db.session.commit()
    refused = admin.post(url, htmx=True)
    assert "The provider refused the credentials (HTTP 401)" in refused.text
    assert "wrong" not in refused.text
    assert len(provider_api.paths) == 2
    assert count(SmsSendRecord) == 0


def test_the_test_provider_answers_ok_and_others_say_no_check_is_available(
    app: Flask, world: dict[str, Any], admin: Portal
) -> None:
    provider = db.session.get(SmsProviderConfig, world["acme"]["provider"])
    assert provider is not None
    url = f"/sms-providers/{provider.id}/test"
    assert "The test provider accepts every message" in admin.post(url, htmx=True).text
    provider.provider, provider.base_url = "http_json", "http://127.0.0.1:1/gateway"
    db.session.commit()
    assert "not available for this provider" in admin.post(url, htmx=True).text


def test_routes_by_country_are_validated_added_and_removed(
    app: Flask, world: dict[str, Any], admin: Portal
) -> None:
    pid = world["acme"]["provider"]
    url = f"/sms-providers/{pid}/routes"
    for data, message in (
        ({"country": ""}, "Country is required"),
        ({"country": "GBR"}, "Country must be at most 2 characters"),
        ({"country": "1A"}, "Country must be an ISO 3166 two-letter code"),
        ({"country": "XX"}, "XX is not a country code we know"),
        ({"country": "GB"}, "GB already has a route through this provider"),
        ({"country": "FR", "priority": "-5"}, "Priority must be a whole number from 0"),
    ):
        response = admin.post(url, data)
        assert response.status_code == 422, data
        assert message in response.text, data
    assert admin.post(url, {"country": "fr", "priority": "5"}).status_code == 303
    route = db.session.scalar(
        select(SmsProviderRegion).where(SmsProviderRegion.country_code == "FR")
    )
    assert route is not None
    assert (route.tenant_id, route.provider_id, route.priority) == (world["acme_id"], pid, 5)
    assert admin.post(f"{url}/{route.id}/delete", {"confirm": "yes"}).status_code == 303
    assert count(SmsProviderRegion) == 3
    index = admin.get("/sms-providers/").text
    assert "GB" in index


def test_a_config_that_records_use_is_disabled_not_deleted(
    app: Flask, world: dict[str, Any], admin: Portal
) -> None:
    sid, pid = world["acme"]["server"], world["acme"]["provider"]
    db.session.add(
        MailSendRecord(tenant_id=world["acme_id"], to_addrs=["a@example.com"], server_config_id=sid)
    )
    db.session.add(
        SmsSendRecord(
            tenant_id=world["acme_id"], phone_number="+447911123456", provider_config_id=pid
        )
    )
    db.session.commit()
    refused = admin.post(f"/mail-servers/{sid}/delete", {"confirm": "yes"})
    assert refused.status_code == 303
    assert "cannot be deleted" in admin.get(refused.headers["Location"]).text
    assert admin.post(f"/sms-providers/{pid}/delete", {"confirm": "yes"}).status_code == 303
    assert count(MailSendServerConfig) == 3
    assert count(SmsProviderConfig) == 3
    disabled = admin.post(f"/mail-servers/{sid}", server_form(name="acme-smtp", enabled=None))
    assert disabled.status_code == 303
    server = db.session.get(MailSendServerConfig, sid)
    assert server is not None
    assert server.enabled is False
    # One that nothing uses goes for good.
    assert admin.post("/mail-servers/", server_form(name="spare")).status_code == 303
    spare = db.session.scalar(
        select(MailSendServerConfig).where(MailSendServerConfig.name == "spare")
    )
    assert spare is not None
    assert admin.post(f"/mail-servers/{spare.id}/delete", {"confirm": "yes"}).status_code == 303
    assert count(MailSendServerConfig) == 3


# --- the mail server's webhook -------------------------------------------------------


def test_the_edit_page_shows_the_mail_webhook_url_and_its_derived_secret(
    app: Flask, world: dict[str, Any], admin: Portal
) -> None:
    from portal.web.machine.webhooks import body_signature, mail_webhook_secret

    sid = world["acme"]["server"]
    secret = mail_webhook_secret(app.config["SETTINGS"], sid)
    page = admin.get(f"/mail-servers/{sid}/edit").text
    url = f"http://localhost/webhooks/mail/generic/{sid}"
    assert f'id="webhook-url" type="text" value="{url}" readonly' in page
    assert f'id="webhook-secret" type="text" value="{secret}" readonly' in page
    assert 'data-copy="webhook-secret"' in page
    assert "X-Postroom-Signature" in page
    # Each server has its own; a new (unsaved) server has none yet.
    other = mail_webhook_secret(app.config["SETTINGS"], world["globex"]["server"])
    assert other != secret
    assert other not in page
    assert "webhook-secret" not in admin.get("/mail-servers/new").text
    assert "webhook-secret" not in admin.post("/mail-servers/", server_form(port="x")).text
    # ... and the secret shown is the one the webhook checks.
    body = json.dumps({"eventId": "e1", "messageId": "m1", "event": "delivered"}).encode()
    signed = admin.client.post(
        url,
        data=body,
        headers={
            "Content-Type": "application/json",
            "X-Postroom-Signature": body_signature(secret, body),
        },
    )
    assert signed.status_code == 200, signed.get_data(as_text=True)


@pytest.mark.parametrize("role", ["support", "anonymous"])
def test_only_those_who_may_edit_servers_see_the_webhook_secret(
    app: Flask, world: dict[str, Any], role: str
) -> None:
    from portal.web.machine.webhooks import mail_webhook_secret

    sid = world["acme"]["server"]
    secret = mail_webhook_secret(app.config["SETTINGS"], sid)
    portal = Portal(app, ROLES[role])
    for url in ("/mail-servers/", f"/mail-servers/{sid}/edit", "/", "/mail-records/"):
        response = portal.get(url)
        assert secret not in response.get_data(as_text=True), url
    assert portal.get(f"/mail-servers/{sid}/edit").status_code in (302, 403)
    # Another tenant's admin cannot reach it either.
    assert Portal(app, "admin@globex.test").get(f"/mail-servers/{sid}/edit").status_code == 404
