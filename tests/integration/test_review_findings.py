"""The smaller findings of an outside security review, each with the behaviour that closes it:
platform-tier names by the config's tier, /metrics behind a token, invitations' links and rate,
a per-client sign-in cap, a cap on status callback endpoints, and requests refused at the door
that could never be sent. Against real PostgreSQL and Redis, a real SMTP server and a local
HTTP server playing the SMS provider."""

from __future__ import annotations

import shutil
import subprocess
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from flask import Flask
from sqlalchemy import func, select

from portal.extensions import db
from portal.messaging.sending.backoff import BackoffPolicy
from portal.models import AppUser, MailSendRecord
from portal.tenancy import PLATFORM_TENANT_ID
from tests.conftest import make_api_key
from tests.integration.test_portal_templates import Portal, user
from tests.support.delivery import accept_mail, drain, mail_server, tenant
from tests.support.sms import accept_sms, drain_sms, provider
from tests.support.sms_provider import FakeSmsProvider
from tests.support.smtp_server import ScriptedSmtpServer

FAST = BackoffPolicy(max_retries=5, base_s=0.02, quota_floor_s=0.05, retry_after_cap_s=1.0)
ROOT = Path(__file__).resolve().parents[2]
SECRET = "PLATFORM-SECRET-5d2b"  # in the platform tier's server and provider names


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


# --- platform-tier servers and providers are named by their tier, not the record's scope --------


def test_a_tenants_mail_through_the_platform_server_never_names_it_to_the_tenant(
    app: Flask, smtp: ScriptedSmtpServer
) -> None:
    """acme has no server of its own: its TENANT-scope mail falls back to the platform's,
    whose name and id it saw in the API, the timeline and the attempt's headers page."""
    acme = tenant("acme").id
    server = mail_server(
        PLATFORM_TENANT_ID, smtp, name=f"{SECRET}-relay", from_address="mail@platform.test"
    )
    server_id = server.id
    user("admin@acme.test", "tenant_admin", acme)
    user("ops@postroom.test", "platform_operator", PLATFORM_TENANT_ID)
    tenant_key, operator_key = make_api_key(acme), make_api_key(PLATFORM_TENANT_ID, "ops")
    db.session.commit()
    rid = accept_mail(app, acme)
    drain(app, policy=FAST)
    assert len(smtp.messages) == 1
    # Saved after the attempt: the headers page warns, naming the server to operators only.
    server.from_name, server.updated_time = "Changed", datetime.now(UTC)
    db.session.commit()

    client = app.test_client()
    body = client.get(f"/api/v1/mail/{rid}", headers=bearer(tenant_key)).get_json()
    assert body["serverId"] is None
    assert body["attempts"][0]["server"] == "platform mail service"
    assert SECRET not in str(body)
    listed = client.get("/api/v1/mail", headers=bearer(tenant_key)).get_json()
    assert listed["items"][0]["serverId"] is None
    portal = Portal(app, "admin@acme.test")
    for url in (f"/mail-records/{rid}", f"/mail-records/{rid}/attempts/1"):
        page = portal.get(url)
        assert page.status_code == 200
        assert SECRET not in page.text, url
        assert "platform mail service" in page.text or "platform mail server" in page.text

    seen = client.get(
        f"/api/v1/mail/{rid}", query_string={"tenantId": acme}, headers=bearer(operator_key)
    ).get_json()
    assert seen["serverId"] == server_id
    assert seen["attempts"][0]["server"] == f"{SECRET}-relay"
    operator = Portal(app, "ops@postroom.test")
    assert SECRET in operator.get(f"/mail-records/{rid}").text
    assert SECRET in operator.get(f"/mail-records/{rid}/attempts/1").text


def test_a_tenants_sms_through_the_platform_provider_never_names_it_to_the_tenant(
    app: Flask,
) -> None:
    acme = tenant("acme").id
    tenant_key = make_api_key(acme)
    user("admin@acme.test", "tenant_admin", acme)
    with FakeSmsProvider() as fake:
        provider(PLATFORM_TENANT_ID, "twilio", fake, name=f"{SECRET}-sms")
        db.session.commit()
        rid = accept_sms(app, acme)
        drain_sms(app, policy=FAST)
    body = app.test_client().get(f"/api/v1/sms/{rid}", headers=bearer(tenant_key)).get_json()
    assert body["providerId"] is None
    assert body["attempts"][0]["provider"] == "platform SMS service"
    assert SECRET not in str(body)
    page = Portal(app, "admin@acme.test").get(f"/sms-records/{rid}")
    assert SECRET not in page.text
    assert "platform SMS service" in page.text


def test_a_tenants_own_server_keeps_its_name_and_id(app: Flask, smtp: ScriptedSmtpServer) -> None:
    acme = tenant("acme").id
    own = mail_server(acme, smtp, name="acme-relay").id
    tenant_key = make_api_key(acme)
    db.session.commit()
    rid = accept_mail(app, acme)
    drain(app, policy=FAST)
    body = app.test_client().get(f"/api/v1/mail/{rid}", headers=bearer(tenant_key)).get_json()
    assert body["serverId"] == own
    assert body["attempts"][0]["server"] == "acme-relay"


# --- /metrics is closed to the outside ----------------------------------------------------------


def with_settings(app: Flask, monkeypatch: pytest.MonkeyPatch, **changes: Any) -> None:
    monkeypatch.setitem(app.config, "SETTINGS", app.config["SETTINGS"].replace(**changes))


def test_metrics_without_a_token_answer_only_to_this_machine_unforwarded(app: Flask) -> None:
    client = app.test_client()
    assert client.get("/metrics").status_code == 200  # the test client is 127.0.0.1
    assert client.get("/metrics", environ_base={"REMOTE_ADDR": "::1"}).status_code == 200
    outside = client.get("/metrics", environ_base={"REMOTE_ADDR": "203.0.113.9"})
    assert outside.status_code == 403
    assert "METRICS_TOKEN" in outside.text
    assert "server_up" not in outside.text
    # Through a reverse proxy on this host the peer is loopback: a forwarded request is refused.
    proxied = client.get("/metrics", headers={"X-Forwarded-For": "203.0.113.9"})
    assert proxied.status_code == 403


def test_metrics_with_a_token_answer_only_to_it(
    app: Flask, monkeypatch: pytest.MonkeyPatch
) -> None:
    with_settings(app, monkeypatch, metrics_token="s3cret-metrics-token")
    client = app.test_client()
    remote = {"REMOTE_ADDR": "203.0.113.9"}
    refused = client.get("/metrics")  # loopback is not enough once a token is set
    assert refused.status_code == 401
    assert refused.headers["WWW-Authenticate"].startswith("Bearer")
    wrong = client.get("/metrics", headers=bearer("nope"), environ_base=remote)
    assert wrong.status_code == 401
    # A token with characters outside ASCII is a wrong token, not a 500.
    odd = client.get("/metrics", headers=bearer("s3cret-métrics-token"), environ_base=remote)
    assert odd.status_code == 401
    right = client.get("/metrics", headers=bearer("s3cret-metrics-token"), environ_base=remote)
    assert right.status_code == 200
    assert "# TYPE" in right.text


def test_the_prometheus_example_scrapes_with_the_token_and_is_valid() -> None:
    config = ROOT / "deploy" / "prometheus" / "prometheus.yml"
    text = config.read_text()
    assert "type: Bearer" in text
    assert "credentials_file:" in text
    promtool = shutil.which("promtool")
    if promtool is None:
        raise pytest.UsageError("promtool is missing: apt-get install prometheus (scripts/test.sh)")
    done = subprocess.run(
        [promtool, "check", "config", "--syntax-only", config.name],
        cwd=config.parent,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_workers_metrics_port_listens_on_loopback_only() -> None:
    source = (ROOT / "portal" / "metrics.py").read_text()
    assert 'start_http_server(port, addr="127.0.0.1"' in source


# --- invitations: the configured address only, and a rate per tier -----------------------------


def invite(portal: Portal, email: str) -> Any:
    return portal.post("/users/", {"email": email, "role": "support", "name": ""})


def exists(email: str) -> bool:
    return db.session.scalar(select(AppUser.id).where(AppUser.email == email)) is not None


def test_without_public_base_url_no_invitation_is_sent(app: Flask) -> None:
    """The link took the request's Host, which the client chooses."""
    acme = tenant("acme").id
    user("admin@acme.example.com", "tenant_admin", acme)
    db.session.commit()
    assert app.config["SETTINGS"].public_base_url is None
    answer = Portal(app, "admin@acme.example.com").client.post(
        "/users/",
        data={"email": "new@acme.example.com", "role": "support"},
        base_url="http://evil.example",
    )
    refused = invite(Portal(app, "admin@acme.example.com"), "new@acme.example.com")
    assert refused.status_code == 503
    assert "PUBLIC_BASE_URL" in refused.text
    assert answer.status_code in (400, 503)  # no CSRF token on the first: refused either way
    assert "evil.example" not in answer.text
    assert (
        db.session.scalar(select(AppUser.id).where(AppUser.email == "new@acme.example.com")) is None
    )
    assert db.session.scalar(select(func.count()).select_from(MailSendRecord)) == 0


def test_invitations_are_limited_per_tier_per_hour(
    app: Flask, monkeypatch: pytest.MonkeyPatch
) -> None:
    with_settings(
        app, monkeypatch, public_base_url="https://portal.example.com", invitations_per_hour=3
    )
    acme, globex = tenant("acme").id, tenant("globex").id
    user("admin@acme.example.com", "tenant_admin", acme)
    user("admin@globex.example.com", "tenant_admin", globex)
    db.session.commit()
    admin = Portal(app, "admin@acme.example.com")
    for n in range(3):
        answer = invite(admin, f"person{n}@acme.example.com")
        assert answer.status_code == 200, answer.text
        assert "https://portal.example.com/users/accept/" in answer.text
    over = invite(admin, "person3@acme.example.com")
    assert over.status_code == 429
    assert "invitations in the last hour" in over.text
    assert (
        db.session.scalar(select(AppUser.id).where(AppUser.email == "person3@acme.example.com"))
        is None
    )
    # Another tenant has its own allowance.
    assert (
        invite(Portal(app, "admin@globex.example.com"), "person@globex.example.com").status_code
        == 200
    )


# --- sign-in: a cap per client, whatever addresses it tries -------------------------------------


@pytest.mark.parametrize("store", ["redis", "database"])
def test_one_client_spreading_guesses_over_many_addresses_is_locked_out(
    app: Flask, monkeypatch: pytest.MonkeyPatch, redis_client: Any, store: str
) -> None:
    """One client tried 200 passwords on 200 addresses: each pair and each address stayed
    under its own limit."""
    from portal.web.auth import LOCKED_OUT
    from tests.integration.test_login_throttle import (
        EMAIL,
        PASSWORD,
        _redis_unreachable,
        attempt,
        make_user,
    )

    with_settings(app, monkeypatch, login_client_max_failures=6)
    if store == "database":
        _redis_unreachable(app, monkeypatch)
    make_user()
    for n in range(6):
        assert attempt(app, f"guess{n}@acme.example.com", "wrong", "198.51.100.7")[0] == 422
    status, body = attempt(app, EMAIL, PASSWORD, "198.51.100.7")
    assert status == 429
    assert LOCKED_OUT in body
    # Another client is not held back, and its right password gives its attempt back.
    assert attempt(app, EMAIL, PASSWORD, "198.51.100.8")[0] == 302


# --- status callback endpoints per tier are capped ----------------------------------------------


def test_callback_endpoints_are_capped_per_tier_in_the_portal_and_the_import(
    app: Flask, monkeypatch: pytest.MonkeyPatch
) -> None:
    from portal.importer import ConfigImportError, import_config
    from portal.models import CallbackEndpoint

    with_settings(app, monkeypatch, callback_endpoints_max=2, callback_allow_private=True)
    acme = tenant("acme").id
    user("admin@acme.example.com", "tenant_admin", acme)
    db.session.commit()
    admin = Portal(app, "admin@acme.example.com")
    events = ["mail.sent"]
    for name in ("one", "two"):
        url = f"https://hooks.example.com/{name}"
        page = admin.post("/callbacks/", {"name": name, "url": url, "events": events})
        assert page.status_code == 200, page.text
    over = admin.post(
        "/callbacks/", {"name": "three", "url": "https://hooks.example.com/3", "events": events}
    )
    assert over.status_code == 422
    assert "CALLBACK_ENDPOINTS_MAX" in over.text
    assert 'id="f-name-error"' in over.text
    count = select(func.count()).select_from(CallbackEndpoint)
    assert db.session.scalar(count) == 2
    # import-config: an existing endpoint may be updated, a new one is refused naming the field.
    existing = {"tenant": "acme", "name": "one", "url": "https://hooks.example.com/1"}
    import_config(db.session(), {"callbacks": [existing | {"events": events}]})
    new = {"tenant": "acme", "name": "four", "url": "https://hooks.example.com/4"}
    with pytest.raises(ConfigImportError, match=r"callbacks\[0\]: name: .*CALLBACK_ENDPOINTS_MAX"):
        import_config(db.session(), {"callbacks": [new | {"events": events}]})
    db.session.rollback()
    assert db.session.scalar(count) == 2
