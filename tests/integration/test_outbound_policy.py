"""The outbound policy where a tenant meets it (real PostgreSQL, real local servers on
127.0.0.1, tenants' private targets turned off as in production): an http_json gateway on
loopback is refused at save and at send with fixed words (no echo of what answered), the SMTP,
IMAP and Twilio Test buttons refuse loopback without connecting, and the platform tier reaches
its private servers while OUTBOUND_PLATFORM_ALLOW_PRIVATE says so."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from flask import Flask
from sqlalchemy import func, select

from portal.extensions import db
from portal.messaging.sending.transports import sms
from portal.models import MailReceiveConfig, MailSendServerConfig, SmsProviderConfig
from portal.tenancy import PLATFORM_TENANT_ID
from tests.conftest import make_tenant
from tests.integration.test_portal_templates import Portal, user

SECRET_WORDS = "INTERNAL-ADMIN-PANEL-7731"  # what an internal service says: never shown


class Listener:
    """A TCP service on 127.0.0.1 that greets every connection with ``SECRET_WORDS``."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            with conn:
                try:
                    conn.sendall(f"220 {SECRET_WORDS} ESMTP\r\n".encode())
                    conn.recv(100)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


class InternalHttp:
    """An internal HTTP service answering every request 500 with ``SECRET_WORDS``."""

    def __init__(self) -> None:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                owner.requests += 1
                body = f"<h1>{SECRET_WORDS}</h1>".encode()
                self.send_response(500)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.requests = 0
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def listener() -> Iterator[Listener]:
    service = Listener()
    yield service
    service.close()


@pytest.fixture
def internal() -> Iterator[InternalHttp]:
    service = InternalHttp()
    yield service
    service.close()


@pytest.fixture
def strict(app: Flask) -> Iterator[None]:
    """Production's policy: tenants' configs may not reach private addresses."""
    before = app.config["SETTINGS"]
    app.config["SETTINGS"] = before.replace(outbound_tenant_allow_private=False)
    yield
    app.config["SETTINGS"] = before


@pytest.fixture
def world(app: Flask) -> dict[str, int]:
    acme = make_tenant("acme")
    user("admin@acme.test", "tenant_admin", acme.id)
    user("operator@postroom.test", "platform_operator", PLATFORM_TENANT_ID)
    return {"acme": acme.id}


def smtp_server(tier: int, port: int) -> int:
    server = MailSendServerConfig(
        tenant_id=tier, name=f"smtp-{tier}", host="127.0.0.1", port=port, security="plain",
        from_address="no-reply@acme.example.com",
    )  # fmt: skip
    db.session.add(server)
    db.session.commit()
    return server.id


def test_an_http_json_gateway_on_loopback_is_refused_at_save(
    app: Flask, world: dict[str, int], strict: None, internal: InternalHttp
) -> None:
    admin = Portal(app, "admin@acme.test")
    form = {
        "name": "gateway", "provider": "http_json", "base_url": f"{internal.url}/internal/admin",
        "account_id": "", "secret": "s3cret", "webhook_secret": "", "sender_id": "Acme",
        "enabled": "on", "daily_send_limit": "", "rate_limit_per_minute": "",
        "retry_window_s": "", "uncertain_policy": "retry",
    }  # fmt: skip
    refused = admin.post("/sms-providers/", form, htmx=True)
    assert refused.status_code == 422
    assert "private or reserved address" in refused.text
    assert db.session.scalar(select(func.count()).select_from(SmsProviderConfig)) == 0
    ok = admin.post("/sms-providers/", form | {"base_url": "https://gateway.invalid/send"})
    assert ok.status_code in (200, 302, 303)  # a name that does not resolve yet is accepted
    assert internal.requests == 0


def test_a_send_to_a_loopback_gateway_is_refused_and_no_answer_is_echoed(
    internal: InternalHttp,
) -> None:
    out = sms.OutgoingSms(record_id=1, to="+447400123456", content="Hi", idempotency_key="k-1")
    tenant_account = sms.ProviderAccount(
        "http_json", "gw", f"{internal.url}/internal/admin", None, "s3cret", "Acme",
        allow_private=False,
    )  # fmt: skip
    with sms.new_client(2.0, 2.0) as client:
        refused = sms.send(client, tenant_account, out)
        assert (refused.accepted, refused.code) == (False, "CONFIG_ERROR")
        assert "private or reserved address" in (refused.message or "")
        assert internal.requests == 0
        # Where private targets are allowed, what the service said is still never shown.
        allowed = sms.send(
            client, sms.ProviderAccount(**{**tenant_account.__dict__, "allow_private": True}), out
        )
    assert (allowed.accepted, allowed.code) == (False, "HTTP_500")
    assert SECRET_WORDS not in (allowed.message or "")
    assert internal.requests == 1


def test_smtp_and_imap_tests_refuse_loopback_for_a_tenant_without_connecting(
    app: Flask, world: dict[str, int], strict: None, listener: Listener
) -> None:
    admin = Portal(app, "admin@acme.test")
    server_id = smtp_server(world["acme"], listener.port)
    box = MailReceiveConfig(
        tenant_id=world["acme"], name="bounces", host="127.0.0.1", port=listener.port,
        security="plain", verify_tls=False, username="b@acme.test", folder="INBOX", enabled=True,
    )  # fmt: skip
    box.secret = "pw"
    db.session.add(box)
    db.session.commit()
    smtp = admin.post(f"/mail-servers/{server_id}/test", htmx=True)
    imap = admin.post(f"/mail-receivers/{box.id}/test", htmx=True)
    for answer in (smtp, imap):
        assert answer.status_code == 200
        assert "private or reserved address" in answer.text
        assert SECRET_WORDS not in answer.text
    assert listener.accepted == 0


def test_an_imap_test_never_shows_what_a_non_imap_service_said(
    app: Flask, world: dict[str, int], listener: Listener
) -> None:
    """Allowed to connect (tests' default), the mailbox test shows plain words, no banner."""
    admin = Portal(app, "admin@acme.test")
    box = MailReceiveConfig(
        tenant_id=world["acme"], name="bounces", host="127.0.0.1", port=listener.port,
        security="plain", verify_tls=False, username="b@acme.test", folder="INBOX", enabled=True,
    )  # fmt: skip
    box.secret = "pw"
    db.session.add(box)
    db.session.commit()
    answer = admin.post(f"/mail-receivers/{box.id}/test", htmx=True)
    assert listener.accepted == 1
    assert SECRET_WORDS not in answer.text


def test_the_twilio_test_to_a_private_url_is_refused(
    app: Flask, world: dict[str, int], strict: None, internal: InternalHttp
) -> None:
    admin = Portal(app, "admin@acme.test")
    provider = SmsProviderConfig(
        tenant_id=world["acme"], name="tw", provider="twilio", base_url=internal.url,
        account_id="AC123", sender_id="+15550001111",
    )  # fmt: skip
    provider.secret = "token"
    db.session.add(provider)
    db.session.commit()
    answer = admin.post(f"/sms-providers/{provider.id}/test", htmx=True)
    assert answer.status_code == 200
    assert "private or reserved address" in answer.text
    assert "token" not in answer.text
    assert internal.requests == 0


def test_the_platform_tier_reaches_private_servers_while_the_setting_says_so(
    app: Flask, world: dict[str, int], strict: None, listener: Listener
) -> None:
    operator = Portal(app, "operator@postroom.test")
    server_id = smtp_server(PLATFORM_TENANT_ID, listener.port)
    allowed = operator.post(f"/mail-servers/{server_id}/test", htmx=True)
    assert allowed.status_code == 200
    assert "private or reserved address" not in allowed.text
    assert listener.accepted == 1
    assert SECRET_WORDS not in allowed.text  # the banner is never shown, even to operators
    settings = app.config["SETTINGS"]
    app.config["SETTINGS"] = settings.replace(outbound_platform_allow_private=False)
    try:
        refused = operator.post(f"/mail-servers/{server_id}/test", htmx=True)
    finally:
        app.config["SETTINGS"] = settings
    assert "private or reserved address" in refused.text
    assert listener.accepted == 1


def test_the_callbacks_policy_is_the_same_function() -> None:
    from portal.messaging.after_send import callbacks
    from portal.messaging.sending import outbound

    assert callbacks.forbidden is outbound.forbidden
    assert callbacks.Refused is outbound.Refused
    assert httpx  # the module the pinned requests are built with
