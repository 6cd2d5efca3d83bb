"""An open circuit breaker is seen: the servers page says "Paused by the breaker" with its
error and next check, the dashboard shows a banner (a tenant sees only "platform mail service
degraded" for a platform-tier server, without its name or error), and ``server_up`` is 0."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from flask import Flask

from portal.extensions import db
from portal.models import BreakerState, MailSendServerConfig
from portal.tenancy import PLATFORM_TENANT_ID
from tests.conftest import make_tenant
from tests.integration.test_metrics import parse, value
from tests.integration.test_portal_templates import Portal, user

SECRET_ERROR = "421 relay-7.internal greeting refused"


def test_an_open_breaker_is_seen_by_operators_in_full_and_by_tenants_without_names(
    app: Flask,
) -> None:
    acme = make_tenant("acme").id
    relay = MailSendServerConfig(
        tenant_id=PLATFORM_TENANT_ID, name="relay-7", host="127.0.0.1", port=1, is_default=True
    )
    own = MailSendServerConfig(tenant_id=acme, name="acme-smtp", host="127.0.0.1", port=2)
    db.session.add_all([relay, own])
    db.session.flush()
    now = datetime.now(UTC)
    db.session.add(
        BreakerState(
            channel="mail",
            config_id=relay.id,
            down_since=now - timedelta(minutes=3),
            last_error=SECRET_ERROR,
            next_probe_at=now + timedelta(seconds=40),
            interval_s=40.0,
            streak=[],
        )
    )
    db.session.commit()
    user("admin@acme.test", "tenant_admin", acme)
    user("operator@postroom.test", "platform_operator", PLATFORM_TENANT_ID)

    tenant_view = Portal(app, "admin@acme.test").get("/").text
    assert "Platform mail service degraded" in tenant_view
    assert "relay-7" not in tenant_view
    assert SECRET_ERROR not in tenant_view

    operator = Portal(app, "operator@postroom.test")
    dashboard = operator.get("/").text
    assert "Mail server relay-7: Paused by the breaker" in dashboard
    assert SECRET_ERROR in dashboard
    servers = operator.get("/mail-servers/").text
    assert "Paused by the breaker" in servers
    assert SECRET_ERROR in servers

    _names, samples = parse(app.test_client().get("/metrics").text)
    assert value(samples, "server_up", channel="mail", config="relay-7") == 0
    assert value(samples, "server_up", channel="mail", config="acme-smtp") == 1

    # Closed again: no banner, up again.
    db.session.query(BreakerState).delete()
    db.session.commit()
    assert "degraded" not in Portal(app, "admin@acme.test").get("/").text
    _names, samples = parse(app.test_client().get("/metrics").text)
    assert value(samples, "server_up", channel="mail", config="relay-7") == 1
