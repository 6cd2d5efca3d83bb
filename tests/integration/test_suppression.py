"""The suppression list: a suppressed recipient ends Suppressed without a provider call; mail
with some recipients suppressed goes to the rest; and the portal page (add, search, remove
with a reason), per tenant and channel."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from flask import Flask
from sqlalchemy import select

from portal.extensions import db
from portal.messaging.after_send import suppression
from portal.models import Channel, Suppression, TenantMessageUsage
from tests.conftest import make_tenant
from tests.integration.test_portal_templates import Portal, user
from tests.support.delivery import accept_mail, drain, mail_server, record
from tests.support.sms import UK, accept_sms, drain_sms, provider, sms_record
from tests.support.sms_provider import FakeSmsProvider
from tests.support.smtp_server import ScriptedSmtpServer


@pytest.fixture
def sms_server() -> Iterator[FakeSmsProvider]:
    with FakeSmsProvider(hang_s=2.0) as running:
        yield running


def test_a_suppressed_number_ends_suppressed_without_a_provider_call(
    app: Flask, sms_server: FakeSmsProvider
) -> None:
    acme = make_tenant("acme").id
    provider(acme, "http_json", sms_server)
    suppression.suppress(db.session, acme, Channel.SMS, UK, "complaint", by="ops@acme.test")
    db.session.commit()
    rid = accept_sms(app, acme)
    drain_sms(app)
    row = sms_record(rid)
    assert (row.status, row.error_code) == ("Suppressed", "SUPPRESSED")
    assert "complaint" in (row.error_message or "")
    assert "ops@acme.test" in (row.error_message or "")
    assert sms_server.requests == []
    assert db.session.scalar(select(TenantMessageUsage.sms_count)) in (None, 0)  # no charge


def test_mail_goes_to_the_unsuppressed_recipients_only(
    app: Flask, smtp: ScriptedSmtpServer
) -> None:
    acme = make_tenant("acme").id
    other = make_tenant("other").id
    mail_server(acme, smtp)
    suppression.suppress(db.session, acme, Channel.MAIL, "Bob@Example.com", "hard_bounce")
    suppression.suppress(db.session, other, Channel.MAIL, "ann@example.com", "manual")
    db.session.commit()
    all_blocked = accept_mail(app, acme, to=["bob@example.com"])
    some = accept_mail(app, acme, to=["ann@example.com"], cc=["bob@example.com"])
    drain(app)
    blocked = record(all_blocked)
    assert (blocked.status, blocked.error_code) == ("Suppressed", "SUPPRESSED")
    sent = record(some)
    assert sent.status == "Sent"
    assert sent.refused_recipients is not None
    assert sent.refused_recipients["bob@example.com"][0] == "SUPPRESSED"
    (message,) = smtp.messages
    assert message.rcpt_tos == ["ann@example.com"]  # another tenant's list does not apply


def test_after_removal_the_recipient_is_sent_to_again(app: Flask, smtp: ScriptedSmtpServer) -> None:
    acme = make_tenant("acme").id
    mail_server(acme, smtp)
    suppression.suppress(db.session, acme, Channel.MAIL, "ann@example.com", "manual")
    assert suppression.unsuppress(
        db.session, acme, Channel.MAIL, "ann@example.com", by="me", reason="asked us to"
    )
    db.session.commit()
    rid = accept_mail(app, acme)
    drain(app)
    assert record(rid).status == "Sent"


# --- the portal page --------------------------------------------------------------------


@pytest.fixture
def world(app: Flask) -> dict[str, Any]:
    acme, globex = make_tenant("acme"), make_tenant("globex")
    user("admin@acme.test", "tenant_admin", acme.id)
    user("support@acme.test", "support", acme.id)
    user("admin@globex.test", "tenant_admin", globex.id)
    db.session.commit()
    return {"acme": acme.id, "globex": globex.id}


def _active(tenant_id: int) -> list[Suppression]:
    db.session.expire_all()
    return list(
        db.session.scalars(
            select(Suppression).where(
                Suppression.tenant_id == tenant_id, Suppression.removed_at.is_(None)
            )
        )
    )


def test_the_page_adds_searches_and_removes_with_a_reason(
    app: Flask, world: dict[str, Any]
) -> None:
    admin = Portal(app, "admin@acme.test")
    assert admin.get("/suppressions/").status_code == 200
    bad = admin.post("/suppressions/", {"channel": "sms", "address": "not a number"})
    assert bad.status_code == 422
    assert "Address or number must be a phone number" in bad.text
    assert admin.post("/suppressions/", {"channel": "mail", "address": "a@"}).status_code == 422
    ok = admin.post(
        "/suppressions/", {"channel": "sms", "address": "+44 7400 123456", "detail": "STOP"}
    )
    assert ok.status_code == 303
    admin.post("/suppressions/", {"channel": "mail", "address": "Carl@Example.com"})
    rows = {r.address: r for r in _active(world["acme"])}
    assert set(rows) == {"+447400123456", "carl@example.com"}
    assert rows["+447400123456"].reason == "manual"
    assert rows["+447400123456"].created_by == "admin@acme.test"

    admin.get("/suppressions/")  # shows (and so clears) the flash messages
    page = admin.get("/suppressions/?q=carl")
    assert "carl@example.com" in page.text
    assert "+447400123456" not in page.text
    fragment = admin.client.get("/suppressions/?q=7400&channel=sms", headers={"HX-Request": "true"})
    assert fragment.text.lstrip().startswith('<div id="suppression-list">')
    assert "+447400123456" in fragment.text
    assert "Manual" not in fragment.text

    target = rows["carl@example.com"].id
    missing = admin.post(f"/suppressions/{target}/delete", {"reason": "  "})
    assert missing.status_code == 422
    assert "Reason is required" in missing.text
    assert (
        admin.post(f"/suppressions/{target}/delete", {"reason": "resubscribed"}).status_code == 303
    )
    assert {r.address for r in _active(world["acme"])} == {"+447400123456"}
    removed = db.session.get(Suppression, target)
    assert removed is not None
    assert (removed.removed_by, removed.removal_reason) == ("admin@acme.test", "resubscribed")


def test_the_page_is_tenant_scoped_and_needs_the_permission(
    app: Flask, world: dict[str, Any]
) -> None:
    row = suppression.suppress(db.session, world["acme"], Channel.MAIL, "x@example.com", "manual")
    db.session.commit()
    globex = Portal(app, "admin@globex.test")
    assert "x@example.com" not in globex.get("/suppressions/").text
    assert globex.post(f"/suppressions/{row.id}/delete", {"reason": "r"}).status_code == 404
    assert Portal(app, "support@acme.test").get("/suppressions/").status_code == 403
    assert Portal(app, None).get("/suppressions/").status_code in (302, 401)
    admin = Portal(app, "admin@acme.test")
    no_csrf = admin.post("/suppressions/", {"address": "y@example.com"}, csrf=False)
    assert no_csrf.status_code == 400
