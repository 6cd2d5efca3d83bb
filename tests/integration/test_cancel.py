"""Cancellation: Pending or Retry without an ambiguous earlier attempt -> Cancelled; a worker
that claimed the record first wins and the cancel says so; bulk with a reason per id."""

from __future__ import annotations

from typing import Any

import pytest
from flask import Flask
from sqlalchemy import update

from portal.extensions import db
from portal.messaging.records.retry import retry_records
from portal.messaging.sending.claim import claim
from portal.models import MailSendRecord
from tests.conftest import make_api_key, make_tenant
from tests.support.delivery import accept_mail, drain, mail_server, record
from tests.support.smtp_server import ScriptedSmtpServer


@pytest.fixture
def world(app: Flask, smtp: ScriptedSmtpServer) -> dict[str, Any]:
    acme, globex = make_tenant("acme"), make_tenant("globex")
    mail_server(acme.id, smtp)
    keys = {"acme": make_api_key(acme.id), "globex": make_api_key(globex.id)}
    db.session.commit()
    return {"acme": acme.id, "globex": globex.id, "keys": keys}


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_a_pending_mail_is_cancelled_and_never_sent(
    app: Flask, world: dict[str, Any], smtp: ScriptedSmtpServer
) -> None:
    rid = accept_mail(app, world["acme"])
    client = app.test_client()
    other = client.post(f"/api/v1/mail/{rid}/cancel", headers=_auth(world["keys"]["globex"]))
    assert other.status_code == 404
    response = client.post(f"/api/v1/mail/{rid}/cancel", headers=_auth(world["keys"]["acme"]))
    assert response.status_code == 200
    assert response.json == {"id": rid, "status": "Cancelled"}
    drain(app)
    row = record(rid)
    assert row.status == "Cancelled"
    assert row.cancelled_at is not None
    assert smtp.messages == []
    again = client.post(f"/api/v1/mail/{rid}/cancel", headers=_auth(world["keys"]["acme"]))
    assert again.status_code == 409
    assert "already cancelled" in again.json["error"]["message"]
    # A cancelled record is not retried by hand either.
    assert retry_records(db.session, MailSendRecord, [rid], None).skipped == {rid: "cancelled"}


def test_a_worker_that_claimed_it_first_wins(app: Flask, world: dict[str, Any]) -> None:
    rid = accept_mail(app, world["acme"])
    (claimed,) = claim(db.session, MailSendRecord, [rid], 1)
    db.session.commit()
    assert claimed.status == "Sending"
    response = app.test_client().post(
        f"/api/v1/mail/{rid}/cancel", headers=_auth(world["keys"]["acme"])
    )
    assert response.status_code == 409
    assert "being sent" in response.json["error"]["message"]
    assert record(rid).status == "Sending"


def test_bulk_cancel_gives_a_reason_for_each_skipped_id(app: Flask, world: dict[str, Any]) -> None:
    pending = accept_mail(app, world["acme"])
    retrying = accept_mail(app, world["acme"])
    ambiguous = accept_mail(app, world["acme"])
    sent = accept_mail(app, world["acme"])
    foreign = accept_mail(app, world["globex"])
    db.session.execute(
        update(MailSendRecord).where(MailSendRecord.id == retrying).values(status="Retry")
    )
    db.session.execute(
        update(MailSendRecord)
        .where(MailSendRecord.id == ambiguous)
        .values(status="Retry", ambiguous_attempt=True)
    )
    db.session.execute(
        update(MailSendRecord).where(MailSendRecord.id == sent).values(status="Sent")
    )
    db.session.commit()
    client = app.test_client()
    ids = [pending, retrying, ambiguous, sent, foreign, pending]
    response = client.post(
        "/api/v1/mail/cancel", json={"ids": ids}, headers=_auth(world["keys"]["acme"])
    )
    assert response.status_code == 200
    body = response.json
    assert body["cancelled"] == 2
    assert body["cancelledIds"] == [pending, retrying]
    reasons = {s["id"]: s["reason"] for s in body["skipped"]}
    assert reasons[sent].startswith("already sent")
    assert reasons[foreign] == "no such record"
    assert "may have been accepted" in reasons[ambiguous]
    row = record(ambiguous)
    assert (row.status, row.ambiguous_attempt) == ("Retry", True)  # never erased
    bad = client.post(
        "/api/v1/mail/cancel", json={"ids": ["x"]}, headers=_auth(world["keys"]["acme"])
    )
    assert bad.status_code == 422
    assert client.post("/api/v1/sms/cancel", json={"ids": [pending]}).status_code == 401


def test_the_portal_cancels_with_its_session(app: Flask, world: dict[str, Any]) -> None:
    from tests.integration.test_portal_templates import Portal, user

    user("support@acme.test", "support", world["acme"])
    db.session.commit()
    rid = accept_mail(app, world["acme"])
    portal = Portal(app, "support@acme.test")
    no_token = portal.client.post(f"/api/v1/mail/{rid}/cancel", headers={"HX-Request": "true"})
    assert no_token.status_code == 400  # a session needs the CSRF token
    done = portal.client.post(
        f"/api/v1/mail/{rid}/cancel", headers={"HX-Request": "true", "X-CSRFToken": portal.token}
    )
    assert done.status_code == 204
    assert done.headers["HX-Refresh"] == "true"
    assert record(rid).status == "Cancelled"
    again = portal.client.post(
        f"/api/v1/mail/{rid}/cancel", headers={"HX-Request": "true", "X-CSRFToken": portal.token}
    )
    assert again.status_code == 200
    assert "already cancelled" in again.text


def test_the_records_list_cancels_many_with_its_session(app: Flask, world: dict[str, Any]) -> None:
    from tests.integration.test_portal_templates import Portal, user

    user("admin@acme.test", "tenant_admin", world["acme"])
    db.session.commit()
    ids = [accept_mail(app, world["acme"]) for _ in range(2)]
    portal = Portal(app, "admin@acme.test")
    done = portal.client.post(
        "/api/v1/mail/cancel",
        data={"ids": [str(i) for i in ids], "csrf_token": portal.token},
        headers={"HX-Request": "true"},
    )
    assert done.status_code == 204
    assert {record(i).status for i in ids} == {"Cancelled"}
