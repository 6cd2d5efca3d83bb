"""Uncertain outcomes (seed 002): the sweep and an ambiguous timeout follow the config's
uncertain policy (retry marks the attempt ambiguous; hold makes it Uncertain, never resent);
operators resolve Uncertain records without resending; the ambiguity is never erased."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from flask import Flask
from sqlalchemy import select, text, update

from portal.extensions import db
from portal.messaging.records.uncertain import ResolveError, resolve_uncertain
from portal.messaging.sending.claim import claim
from portal.messaging.sending.sweeper import sweep_stuck_sends
from portal.models import Channel, SmsSendRecord
from portal.tenancy import PLATFORM_TENANT_ID
from tests.conftest import make_api_key, make_tenant
from tests.support.after_send import post_generic, sms_config, sms_row
from tests.support.sms import UK, accept_sms, drain_sms, provider, sms_record
from tests.support.sms_provider import FakeSmsProvider


@pytest.fixture
def sms_server() -> Iterator[FakeSmsProvider]:
    with FakeSmsProvider(hang_s=2.0) as running:
        yield running


def _stuck(rid: int, *, prepared: bool) -> None:
    """Claimed long ago by a worker that never came back."""
    (row,) = claim(db.session, SmsSendRecord, [rid], 1)
    db.session.execute(
        update(SmsSendRecord)
        .where(SmsSendRecord.id == rid)
        .values(
            updated_time=text("statement_timestamp() - interval '10 minutes'"),
            prepared_at=text("statement_timestamp()") if prepared else None,
            provider_config_id=row.provider_config_id,
        )
    )
    db.session.commit()


@pytest.mark.parametrize(
    ("policy", "prepared", "status", "ambiguous"),
    [
        ("retry", True, "Retry", True),
        ("retry", False, "Retry", False),
        ("hold", True, "Uncertain", True),
        ("hold", False, "Retry", False),  # nothing was sent before preparation
    ],
)
def test_the_sweep_follows_the_uncertain_policy(
    app: Flask, policy: str, prepared: bool, status: str, ambiguous: bool
) -> None:
    acme = make_tenant("acme").id
    config = sms_config(acme, "http_json", uncertain_policy=policy)
    db.session.commit()
    rid = accept_sms(app, acme)
    db.session.execute(
        update(SmsSendRecord).where(SmsSendRecord.id == rid).values(provider_config_id=config.id)
    )
    db.session.commit()
    _stuck(rid, prepared=prepared)
    report = sweep_stuck_sends(db.engine, app.config["SETTINGS"])
    assert report.total == 1
    row = sms_record(rid)
    assert (row.status, row.ambiguous_attempt) == (status, ambiguous)
    if status == "Uncertain":
        assert report.held == {"sms": 1}
        assert claim(db.session, SmsSendRecord, [rid], 1) == []  # never due again
        db.session.rollback()


def test_a_timeout_under_hold_is_uncertain_and_never_resent(
    app: Flask, sms_server: FakeSmsProvider
) -> None:
    acme = make_tenant("acme").id
    provider(acme, "http_json", sms_server, uncertain_policy="hold")
    db.session.commit()
    sms_server.script(UK, "hang")
    rid = accept_sms(app, acme)
    drain_sms(app, read_timeout_s=0.3)
    row = sms_record(rid)
    assert (row.status, row.error_code, row.ambiguous_attempt) == ("Uncertain", "TIMEOUT", True)
    assert len(sms_server.requests) == 1


@pytest.fixture
def uncertain(app: Flask) -> dict[str, Any]:
    acme = make_tenant("acme").id
    config = sms_config(acme)
    taken = sms_row(acme, config, provider_message_id="gw-taken")
    row = sms_row(
        acme, config, status="Uncertain", ambiguous_attempt=True, ambiguous_reason="timeout"
    )
    keys = {"acme": make_api_key(acme), "platform": make_api_key(PLATFORM_TENANT_ID)}
    db.session.commit()
    return {"acme": acme, "config": config.id, "id": row.id, "taken": taken.id, "keys": keys}


def test_resolve_accepted_needs_an_unused_provider_id_and_applies_kept_events(
    app: Flask, uncertain: dict[str, Any]
) -> None:
    rid = uncertain["id"]
    event = {"eventId": "e", "messageId": "gw-real", "event": "delivered"}
    post_generic(app.test_client(), "sms", "http_json", uncertain["config"], event)
    with pytest.raises(ResolveError) as taken:
        resolve_uncertain(
            db.session, Channel.SMS, rid, accepted=True, provider_message_id="gw-taken", by="op"
        )
    assert taken.value.status == 409
    with pytest.raises(ResolveError) as missing:
        resolve_uncertain(db.session, Channel.SMS, rid, accepted=True, by="op")
    assert missing.value.status == 422
    resolved = resolve_uncertain(
        db.session, Channel.SMS, rid, accepted=True, provider_message_id="gw-real", by="op"
    )
    db.session.commit()
    assert resolved.status == "Sent"
    row = sms_record(rid)
    assert (row.status, row.provider_message_id, row.resolution, row.resolved_by) == (
        "Sent",
        "gw-real",
        "accepted",
        "op",
    )
    assert row.ambiguous_attempt is True  # the ambiguity stays on record
    assert row.delivery_outcome == "delivered"  # the event that came first
    with pytest.raises(ResolveError) as again:
        resolve_uncertain(db.session, Channel.SMS, rid, accepted=False, reason="x", by="op")
    assert again.value.status == 409


def test_resolve_failed_needs_a_reason_and_never_resends(
    app: Flask, uncertain: dict[str, Any]
) -> None:
    rid = uncertain["id"]
    with pytest.raises(ResolveError) as missing:
        resolve_uncertain(db.session, "sms", rid, accepted=False, reason=" ", by="op")
    assert missing.value.status == 422
    resolve_uncertain(db.session, "sms", rid, accepted=False, reason="not in the log", by="op")
    db.session.commit()
    row = sms_record(rid)
    assert (row.status, row.error_code, row.error_message) == (
        "Failed",
        "RESOLVED_FAILED",
        "not in the log",
    )
    assert row.ambiguous_attempt is True
    assert claim(db.session, SmsSendRecord, [rid], 1) == []


def test_the_resolve_endpoint_is_for_the_records_tenant(
    app: Flask, uncertain: dict[str, Any]
) -> None:
    # The tenant's own key resolves (seed 002: "from trusted server
    # code"); a platform key reaches the record only with ?tenantId= (it was 403 / 200).
    client = app.test_client()
    url = f"/api/v1/sms/{uncertain['id']}/resolve"
    body = {"outcome": "accepted", "providerMessageId": "gw-new"}
    platform = {"Authorization": f"Bearer {uncertain['keys']['platform']}"}
    assert client.post(url, json=body, headers=platform).status_code == 404
    tenant = {"Authorization": f"Bearer {uncertain['keys']['acme']}"}
    assert client.post(url, json={"outcome": "maybe"}, headers=tenant).status_code == 422
    response = client.post(url, json=body, headers=tenant)
    assert response.status_code == 200, response.text
    assert response.json == {"id": uncertain["id"], "status": "Sent", "providerMessageId": "gw-new"}
    assert client.post(url, json=body, headers=tenant).status_code == 409
    chosen = f"{url}?tenantId={uncertain['acme']}"
    assert client.post(chosen, json=body, headers=platform).status_code == 409  # reached
    missing = client.post("/api/v1/sms/999999999/resolve", json=body, headers=tenant)
    assert missing.status_code == 404


def test_the_portal_resolves_and_shows_the_timeline(app: Flask, uncertain: dict[str, Any]) -> None:
    from flask import render_template
    from flask_login import login_user

    from portal.messaging.after_send.events import events_for
    from portal.models import AppUser
    from tests.integration.test_portal_templates import Portal, user

    user("operator@postroom.test", "platform_operator", PLATFORM_TENANT_ID)
    user("admin@acme.test", "tenant_admin", uncertain["acme"])
    db.session.commit()
    rid = uncertain["id"]
    post_generic(
        app.test_client(),
        "sms",
        "http_json",
        uncertain["config"],
        {"eventId": "x", "messageId": "gw-9", "event": "delivered", "timestamp": 1767225600},
    )
    record = sms_record(rid)
    operator = db.session.scalar(select(AppUser).where(AppUser.role == "platform_operator"))
    with app.test_request_context():
        login_user(operator)
        html = render_template(
            "shared/_events.html",
            events=events_for(db.session, "sms", rid),
            record=record,
            channel="sms",
        )
    assert "Outcome uncertain" in html
    assert f'hx-post="/api/v1/sms/{rid}/resolve"' in html
    assert "No provider events yet." in html

    # An operator acts on the tenant it views: the platform tier's view
    # does not reach acme's record; acme's admins may resolve it (they were refused before).
    portal = Portal(app, "operator@postroom.test")
    portal.view(PLATFORM_TENANT_ID)  # an operator starts on all tenants
    elsewhere = portal.post(f"/api/v1/sms/{rid}/resolve", {"outcome": "failed", "reason": "r"})
    assert elsewhere.status_code == 404
    admin = Portal(app, "admin@acme.test")
    bad = admin.post(f"/api/v1/sms/{rid}/resolve", {"outcome": "maybe"})
    assert bad.status_code == 422  # allowed in, and nothing done
    portal.view(uncertain["acme"])
    empty = portal.client.post(
        f"/api/v1/sms/{rid}/resolve",
        data={"outcome": "failed", "csrf_token": portal.token},
        headers={"HX-Request": "true"},
    )
    assert empty.status_code == 200
    assert "needs a reason" in empty.text
    done = portal.client.post(
        f"/api/v1/sms/{rid}/resolve",
        data={"outcome": "accepted", "providerMessageId": "gw-9", "csrf_token": portal.token},
        headers={"HX-Request": "true"},
    )
    assert done.status_code == 204
    assert done.headers["HX-Refresh"] == "true"
    record = sms_record(rid)
    assert (record.status, record.resolved_by) == ("Sent", "operator@postroom.test")
    with app.test_request_context():
        login_user(operator)
        html = render_template(
            "shared/_events.html",
            events=events_for(db.session, "sms", rid),
            record=record,
            channel="sms",
        )
    assert "Resolved as <strong>accepted</strong> by operator@postroom.test" in html
    assert "Delivered" in html
    assert "2026-01-01 00:00:00" in html
