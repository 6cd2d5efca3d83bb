"""A server's health is what its sends say: a server refusing every connection is
"Failing since ... (N records, last: connection refused)" on its page, its list and the
dashboard's banner before its breaker opens, with one inbox notice per incident; a recipient's
own refusal is an answer (Up); a send that goes through ends the incident and a later failure
opens a new one; an open breaker is "Paused by the breaker"; operators see the platform's
failing servers, and no tenant sees another's.

Records are claimed and sent in the test thread (the code the pool workers run) to real
aiosmtpd servers, or to a port with nothing listening.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from flask import Flask
from sqlalchemy import select

from portal.config import Settings
from portal.extensions import db
from portal.messaging.after_send import inbox
from portal.messaging.sending import breaker, health
from portal.messaging.sending.backoff import BackoffPolicy
from portal.messaging.sending.breaker import Breaker
from portal.messaging.sending.claim import claim_due
from portal.messaging.sending.pipeline import MailContext, process_mail
from portal.models import Channel, MailSendRecord, MailSendServerConfig, Notification
from portal.tenancy import PLATFORM_TENANT_ID
from tests.integration.test_portal_templates import Portal, user
from tests.support.delivery import accept_mail, mail_server, tenant
from tests.support.smtp_server import ScriptedSmtpServer
from tests.support.workers import free_port


@pytest.fixture
def ctx(app: Flask, redis_client: redis.Redis) -> Iterator[MailContext]:
    settings: Settings = app.config["SETTINGS"].replace(
        max_retries=10, backoff_base_s=0.01, breaker_failures=10, breaker_probe_min_s=60.0
    )
    context = MailContext(
        engine=db.engine,
        settings=settings,
        policy=BackoffPolicy.from_settings(settings),
        breaker=Breaker(db.engine, settings, breaker._connector(settings)),
    )
    yield context
    context.close()


def send_all(ctx: MailContext) -> None:
    """Claim and send every due record once."""
    while claimed := claim_due(db.engine, MailSendRecord, 1):
        process_mail(ctx, claimed[0])


def send(app: Flask, ctx: MailContext, tenant_id: int, n: int, **body: Any) -> None:
    for i in range(n):
        accept_mail(app, tenant_id, to=[f"u{i}-{time.monotonic_ns()}@example.com"], **body)
    send_all(ctx)


def state(server: MailSendServerConfig) -> health.State:
    db.session.expire_all()
    return health.states(db.session, Channel.MAIL, [server.id])[server.id]


def incident_notices(tenant_id: int) -> list[Notification]:
    db.session.expire_all()
    return list(
        db.session.scalars(
            select(Notification)
            .where(Notification.tenant_id == tenant_id, Notification.kind == "server_down")
            .order_by(Notification.id)
        )
    )


@pytest.fixture
def world(app: Flask) -> dict[str, Any]:
    acme, globex = tenant("acme"), tenant("globex")
    user("admin@acme.test", "tenant_admin", acme.id)
    user("admin@globex.test", "tenant_admin", globex.id)
    user("operator@postroom.test", "platform_operator", PLATFORM_TENANT_ID)
    db.session.commit()
    return {"acme": acme.id, "globex": globex.id}


def test_a_refusing_server_is_failing_everywhere_before_its_breaker_opens_with_one_notice(
    app: Flask, ctx: MailContext, world: dict[str, Any]
) -> None:
    acme = world["acme"]
    dead = ScriptedSmtpServer(port=free_port())  # never started: connections refused
    server = mail_server(acme, dead, name="acme-smtp")
    db.session.commit()
    send(app, ctx, acme, 4)
    send_all(ctx)  # their retries fail the same way
    assert ctx.breaker is not None
    assert not ctx.breaker.is_open(Channel.MAIL, server.id)  # 4 records < BREAKER_FAILURES

    found = state(server)
    assert found.health is health.Health.FAILING
    assert found.records == 4
    assert found.text.startswith("Failing since ")
    assert found.text.endswith("(4 records, last: connection refused)")

    admin = Portal(app, "admin@acme.test")
    for page in ("/mail-servers/", f"/mail-servers/{server.id}/edit", "/"):
        text = admin.get(page).text
        assert "Failing" in text, page
        assert "4 records, last: connection refused" in text, page
        assert ">Up<" not in text, page
    assert "Mail server acme-smtp: Failing" in admin.get("/").text

    inbox.scan(db.engine)
    send(app, ctx, acme, 3)  # more records fail in the same incident
    inbox.scan(db.engine)
    inbox.scan(db.engine)
    assert state(server).records == 7
    assert [n.title for n in incident_notices(acme)] == ["Mail server acme-smtp is failing"]

    # Another tenant hears nothing of it.
    other = Portal(app, "admin@globex.test")
    assert "acme-smtp" not in other.get("/").text
    assert "Failing" not in other.get("/").text
    assert other.get(f"/mail-servers/{server.id}/edit").status_code == 404
    assert incident_notices(world["globex"]) == []


def test_a_recipients_own_refusal_is_an_answer_not_a_failing_server(
    app: Flask, ctx: MailContext, world: dict[str, Any], smtp: ScriptedSmtpServer
) -> None:
    acme = world["acme"]
    server = mail_server(acme, smtp, name="acme-smtp")
    db.session.commit()
    for i in range(6):
        smtp.script(f"gone{i}@example.com", "550 5.1.1 no such user")
        accept_mail(app, acme, to=[f"gone{i}@example.com"])
    send_all(ctx)
    assert state(server).health is health.Health.UP
    text = Portal(app, "admin@acme.test").get("/mail-servers/").text
    assert ">Up<" in text
    assert "Failing" not in text
    inbox.scan(db.engine)
    assert incident_notices(acme) == []


def test_a_send_that_goes_through_ends_the_incident_and_a_later_failure_opens_a_new_one(
    app: Flask, ctx: MailContext, world: dict[str, Any]
) -> None:
    acme = world["acme"]
    port = free_port()
    smtp = ScriptedSmtpServer(port=port)
    server = mail_server(acme, smtp, name="acme-smtp")
    db.session.commit()
    assert state(server).text == "No recent sends"

    send(app, ctx, acme, 2)
    first = state(server)
    assert first.health is health.Health.FAILING
    inbox.scan(db.engine)

    smtp.start()
    try:
        send_all(ctx)  # the two records' retries go through
        time.sleep(1.1)  # the next incident starts in a later second
        assert state(server).health is health.Health.UP
        assert ">Up<" in Portal(app, "admin@acme.test").get("/mail-servers/").text
        inbox.scan(db.engine)
        db.session.expire_all()
        ups = db.session.scalars(
            select(Notification.title).where(Notification.kind == "server_up")
        ).all()
        assert ups == ["Mail server acme-smtp is back up"]
    finally:
        smtp.stop()
    send(app, ctx, acme, 1)
    second = state(server)
    assert second.health is health.Health.FAILING
    assert second.records == 1
    assert first.since is not None
    assert second.since is not None
    assert second.since > first.since
    inbox.scan(db.engine)
    assert len(incident_notices(acme)) == 2


def test_an_open_breaker_is_paused_by_the_breaker(
    app: Flask, ctx: MailContext, world: dict[str, Any]
) -> None:
    acme = world["acme"]
    server = mail_server(acme, ScriptedSmtpServer(port=free_port()), name="acme-smtp")
    db.session.commit()
    ctx.settings = ctx.settings.replace(breaker_failures=2)
    ctx.breaker = Breaker(db.engine, ctx.settings, breaker._connector(ctx.settings))
    send(app, ctx, acme, 3)
    assert ctx.breaker.is_open(Channel.MAIL, server.id)
    found = state(server)
    assert found.health is health.Health.PAUSED
    assert found.text.startswith("Paused by the breaker failing since ")
    admin = Portal(app, "admin@acme.test")
    assert "Paused by the breaker" in admin.get("/mail-servers/").text
    assert "Mail server acme-smtp: Paused by the breaker" in admin.get("/").text
    inbox.scan(db.engine)
    assert len(incident_notices(acme)) == 1  # the breaker opening is the same incident


def test_operators_see_failing_platform_servers_and_tenants_only_that_the_service_is_degraded(
    app: Flask, ctx: MailContext, world: dict[str, Any]
) -> None:
    relay = mail_server(PLATFORM_TENANT_ID, ScriptedSmtpServer(port=free_port()), name="relay-7")
    db.session.commit()
    send(app, ctx, world["acme"], 2)  # acme has no server: its mail goes through the platform's
    assert state(relay).health is health.Health.FAILING

    operator = Portal(app, "operator@postroom.test")
    dashboard = operator.get("/").text
    assert "Mail server relay-7: Failing" in dashboard
    assert "2 records, last: connection refused" in dashboard
    assert "Failing" in operator.get("/mail-servers/").text

    tenant_view = Portal(app, "admin@acme.test").get("/").text
    assert "Platform mail service degraded" in tenant_view
    assert "relay-7" not in tenant_view
    assert "connection refused" not in tenant_view

    inbox.scan(db.engine)
    assert [n.title for n in incident_notices(PLATFORM_TENANT_ID)] == [
        "Mail server relay-7 is failing"
    ]
    assert [n.title for n in incident_notices(world["acme"])] == [
        "The platform's mail service is degraded"
    ]
