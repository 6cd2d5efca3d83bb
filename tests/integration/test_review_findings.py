"""The smaller findings of an outside security review, each with the behaviour that closes it:
platform-tier names by the config's tier, /metrics behind a token, invitations' links and rate,
a per-client sign-in cap, a cap on status callback endpoints, and requests refused at the door
that could never be sent. Against real PostgreSQL and Redis, a real SMTP server and a local
HTTP server playing the SMS provider."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
from flask import Flask

from portal.extensions import db
from portal.messaging.backoff import BackoffPolicy
from portal.tenancy import PLATFORM_TENANT_ID
from tests.conftest import make_api_key
from tests.integration.test_portal_templates import Portal, user
from tests.support.delivery import accept_mail, drain, mail_server, tenant
from tests.support.sms import accept_sms, drain_sms, provider
from tests.support.sms_provider import FakeSmsProvider
from tests.support.smtp_server import ScriptedSmtpServer

FAST = BackoffPolicy(max_retries=5, base_s=0.02, quota_floor_s=0.05, retry_after_cap_s=1.0)
SECRET = "PLATFORM-SECRET-5d2b"  # in the platform tier's server and provider names


@pytest.fixture
def smtp() -> Iterator[ScriptedSmtpServer]:
    with ScriptedSmtpServer() as server:
        yield server


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
