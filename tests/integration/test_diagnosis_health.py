"""A record's diagnosis reads its server's health where the server's page reads it: a server
that refuses every connection is down for the record panel, bulk retry's plan and the API in
the words of its page, before its breaker opens, and no longer once a send gets through."""

from __future__ import annotations

from typing import Any

from flask import Flask
from sqlalchemy import select

from portal.extensions import db
from portal.messaging.sending import health
from portal.models import BreakerState, Channel, MailSendRecord, MailSendServerConfig
from tests.conftest import make_api_key
from tests.integration.test_diagnosis_issue_cases import (
    ADMIN,
    NO_RETRIES,
    Scene,
    plan,
    scene,
    status,
)
from tests.integration.test_portal_records import cheap_passwords, signed_in
from tests.support.delivery import accept_mail, drain, mail_server
from tests.support.smtp_server import ScriptedSmtpServer
from tests.support.workers import free_port

__all__ = ["cheap_passwords", "scene"]


def api_verdict(app: Flask, key: str, record_id: int) -> dict[str, Any]:
    answer = app.test_client().get(
        f"/api/v1/mail/{record_id}", headers={"Authorization": f"Bearer {key}"}
    )
    assert answer.status_code == 200, answer.json
    return dict(answer.json["diagnosis"]["wouldFailAgain"])


def test_a_server_failing_before_its_breaker_opens_is_down_in_its_pages_words_until_it_answers(
    scene: Scene, smtp: ScriptedSmtpServer
) -> None:
    server = mail_server(scene.acme, smtp, name="main", port=free_port())  # refuses all
    key = make_api_key(scene.acme)
    db.session.commit()
    ids = [accept_mail(scene.app, scene.acme, to=[f"user{i}@example.com"]) for i in range(3)]
    drain(scene.app, policy=NO_RETRIES)
    assert [status(MailSendRecord, i) for i in ids] == ["DeadLetter"] * 3
    settings = scene.app.config["SETTINGS"]
    assert len(ids) < settings.breaker_failures  # its breaker is still closed
    breaker_row = db.session.scalar(select(BreakerState).where(BreakerState.config_id == server.id))
    assert breaker_row is None or breaker_row.down_since is None

    state = health.states(db.session, Channel.MAIL, [server.id])[server.id]
    assert state.health is health.Health.FAILING
    line = state.text  # "Failing since 10:42 UTC (3 records, last: connection refused)"
    assert line.endswith("(3 records, last: connection refused)")
    client, token = signed_in(scene.app, ADMIN)
    own_page = client.get(f"/mail-servers/{server.id}/edit").text
    assert f'>{state.label}</span> <small class="breaker">{state.detail}</small>' in own_page

    panel = client.get(f"/mail-records/{ids[0]}").text
    assert '<span class="mono">SERVER_DOWN</span>' in panel
    assert line in panel
    bulk = plan(client, token, "/mail-records/retry", ids)
    assert "<strong>3 SERVER_DOWN</strong>" in bulk
    assert line in bulk
    verdict = api_verdict(scene.app, key, ids[0])
    assert (verdict["value"], verdict["reason"]) == (True, "SERVER_DOWN")
    assert line in verdict["why"]

    # It answers again: a send gets through, and none of them says it is down any more.
    db.session.expire_all()
    row = db.session.get(MailSendServerConfig, server.id)
    assert row is not None
    row.port = smtp.port
    db.session.commit()
    sent = accept_mail(scene.app, scene.acme, to=["fine@example.com"])
    drain(scene.app, policy=NO_RETRIES)
    assert status(MailSendRecord, sent) == "Sent"
    assert ">Up</span>" in client.get(f"/mail-servers/{server.id}/edit").text
    panel = client.get(f"/mail-records/{ids[0]}").text
    assert "SERVER_DOWN" not in panel
    assert "Failing since" not in panel
    bulk = plan(client, token, "/mail-records/retry", ids)
    assert "SERVER_DOWN" not in bulk
    assert "<strong>3</strong> will be requeued" in bulk
    assert api_verdict(scene.app, key, ids[0])["value"] is False
