"""A record's timeline tells its whole story: every event, with its time and who, written when
it happened (never read from logs), through the real pipeline (aiosmtpd, the fake SMS
provider, a port with nothing listening), the portal's own buttons and the callback pool."""

from __future__ import annotations

import time
from typing import Any

import redis
from flask import Flask

from portal import simulator
from portal.extensions import db
from portal.messaging.after_send import callbacks, events
from portal.messaging.records import uncertain
from portal.messaging.sending import breaker
from portal.messaging.sending.backoff import BackoffPolicy
from portal.messaging.sending.breaker import Breaker
from portal.messaging.sending.claim import claim_due
from portal.messaging.sending.pipeline import MailContext, process_mail
from portal.models import (
    Channel,
    MailSendRecord,
    RecordEvent,
    RecordEventKind,
    SmsSendRecord,
)
from portal.tenancy import PLATFORM_TENANT_ID
from portal.web.records.timeline import Entry, timeline
from tests.integration.test_callbacks import endpoint
from tests.integration.test_portal_records import HX, cheap_passwords, signed_in, user
from tests.support.callback_receiver import CallbackReceiver
from tests.support.delivery import accept_mail, drain, mail_server, tenant
from tests.support.sms import FR, accept_sms, binding, drain_sms, provider, sms_template
from tests.support.sms_provider import FakeSmsProvider
from tests.support.smtp_server import ScriptedSmtpServer
from tests.support.workers import free_port

__all__ = ["cheap_passwords"]

ADMIN = "admin@acme.example.com"
SUPPORT = "support@acme.example.com"
OPERATOR = "operator@postroom.example.com"
NO_RETRIES = BackoffPolicy(max_retries=0, base_s=0.01)


def story(channel: Channel, record_id: int) -> list[Entry]:
    db.session.expire_all()
    model: Any = MailSendRecord if channel is Channel.MAIL else SmsSendRecord
    record = db.session.get(model, record_id)
    assert record is not None
    return timeline(db.session(), channel, record, operator=False)


def titles(entries: list[Entry]) -> list[str]:
    return [e.title for e in entries]


def test_an_sms_failing_preparation_bulk_retried_by_an_operator_and_failing_again(
    any_app: Flask, cheap_passwords: None
) -> None:
    """The issue's case: the timeline showed only "Accepted"."""
    app = any_app
    acme = tenant("acme").id
    db.session.commit()
    user(OPERATOR, "platform_operator", PLATFORM_TENANT_ID)
    with FakeSmsProvider() as server:
        twilio = provider(acme, "twilio", server)
        binding(sms_template(acme, "otp"), twilio, country="GB")  # none for FR
        db.session.commit()
        record = accept_sms(app, acme, phoneNumber=FR, templateCode="otp", variables={"code": "7"})
        drain_sms(app, policy=NO_RETRIES)
        client, token = signed_in(app, OPERATOR, view_tenant=acme)
        done = client.post(
            "/sms-records/retry",
            data={"confirm": "yes", "confirmed": str(record), "include_blocked": "yes"},
            headers=HX | {"X-CSRFToken": token},
        )
        assert done.status_code == 200, done.text
        drain_sms(app, policy=NO_RETRIES)
        assert server.requests == []
    entries = story(Channel.SMS, record)
    assert titles(entries) == [
        "Accepted",
        "Failed before any attempt",
        "Retry pressed",
        "Failed before any attempt",
    ]
    first, retried, again = entries[1:]
    assert "no provider binding for country FR" in first.detail, first.detail
    assert first.code == again.code
    assert retried.who == OPERATOR
    assert retried.detail.startswith("retried anyway: would fail again (NO_BINDING): ")
    assert [e.at for e in entries] == sorted(e.at for e in entries)
    page = client.get(f"/sms-records/{record}").text.split('id="record-timeline"', 1)[1]
    assert page.count('data-kind="step"') == 2
    assert "retried anyway: would fail again (NO_BINDING)" in page
    assert "no provider binding for country FR" in page


def test_a_mail_refused_at_rcpt_retried_anyway_and_refused_for_good(
    app: Flask, smtp: ScriptedSmtpServer, cheap_passwords: None
) -> None:
    acme = tenant("acme").id
    mail_server(acme, smtp)
    db.session.commit()
    user(ADMIN, "tenant_admin", acme)
    refused = simulator.MAIL["refused"].address
    smtp.script(refused, simulator.REFUSED_REPLY, stage="rcpt")
    record = accept_mail(app, acme, to=[refused])
    drain(app, policy=NO_RETRIES)
    client, token = signed_in(app, ADMIN)
    form = {"csrf_token": token, "confirm": "yes", "anyway": "SUPPRESSED"}
    assert client.post(f"/mail-records/{record}/retry", data=form).status_code == 302
    drain(app, policy=NO_RETRIES)
    entries = story(Channel.MAIL, record)
    assert titles(entries) == [
        "Accepted",
        "Attempt 1: Refused; not retried",
        "Recipient suppressed",
        "Retry pressed",
        "Not sent: the recipient is suppressed",
    ]
    attempt, suppressed, retried, ended = entries[1:]
    assert attempt.code == "550 5.1.1"
    assert "no such mailbox" in attempt.detail
    assert refused in suppressed.detail
    assert retried.who == ADMIN
    assert retried.detail.startswith("retried anyway: would fail again (SUPPRESSED): ")
    assert ended.code == "SUPPRESSED"


def test_a_breaker_outage_with_many_probes_is_one_line_per_stretch(
    any_app: Flask, redis_client: redis.Redis
) -> None:
    app = any_app
    settings = app.config["SETTINGS"].replace(
        max_retries=10,
        backoff_base_s=0.05,
        breaker_failures=3,
        breaker_probe_min_s=0.2,
        breaker_probe_max_s=0.2,
    )
    acme = tenant("acme").id
    mail_server(acme, ScriptedSmtpServer(port=free_port()))  # nothing listening
    db.session.commit()
    ids = [accept_mail(app, acme, to=[f"u{i}@example.com"]) for i in range(8)]
    db.session.rollback()
    gate = Breaker(db.engine, settings, breaker._connector(settings))
    ctx = MailContext(db.engine, settings, BackoffPolicy.from_settings(settings), breaker=gate)
    try:
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            claimed = claim_due(db.engine, MailSendRecord, 1)
            if claimed:
                process_mail(ctx, claimed[0])
            else:
                time.sleep(0.01)
    finally:
        ctx.close()
    deferred_total = lines_total = 0
    for rid in ids:
        entries = story(Channel.MAIL, rid)
        row = db.session.get(MailSendRecord, rid)
        assert row is not None
        waits = [e for e in entries if e.title == "Waiting; no retry used"]
        attempts = [e for e in entries if e.kind == "attempt"]
        # A new stretch only after something else happened to the record.
        assert len(waits) <= len(attempts) + 1, titles(entries)
        for i, entry in enumerate(entries[:-1]):
            if entry in waits:
                assert entries[i + 1] not in waits, titles(entries)
        if row.deferral_count:
            assert waits, titles(entries)
            assert waits[0].code == breaker.SERVER_UNAVAILABLE
        deferred_total += row.deferral_count
        lines_total += len(waits)
    assert lines_total >= 1
    assert lines_total <= deferred_total


def test_a_cancel_by_support_names_who(
    app: Flask, smtp: ScriptedSmtpServer, cheap_passwords: None
) -> None:
    acme = tenant("acme").id
    mail_server(acme, smtp)
    db.session.commit()
    user(SUPPORT, "support", acme)
    record = accept_mail(app, acme)
    client, token = signed_in(app, SUPPORT)
    row = db.session.get(MailSendRecord, record)
    assert row is not None
    done = client.post(
        "/mail-records/cancel",
        data={"confirm": "yes", "confirmed": f"{record}:{row.version}"},
        headers=HX | {"X-CSRFToken": token},
    )
    assert done.status_code == 200, done.text
    entries = story(Channel.MAIL, record)
    assert [(e.title, e.who) for e in entries] == [("Accepted", None), ("Cancelled", SUPPORT)]


def test_a_resolution_of_an_uncertain_record_says_who_and_how(app: Flask) -> None:
    acme = tenant("acme").id
    db.session.commit()
    record = accept_mail(app, acme)
    db.session.execute(
        MailSendRecord.__table__.update()
        .where(MailSendRecord.id == record)
        .values(status="Uncertain", ambiguous_attempt=True, error_code="ZOMBIE_RECOVERED")
    )
    uncertain.resolve_uncertain(
        db.session(), Channel.MAIL, record, accepted=False, reason="not in the logs", by=ADMIN
    )
    db.session.commit()
    [_, resolved] = story(Channel.MAIL, record)
    assert (resolved.title, resolved.who) == ("Resolved: not sent", ADMIN)
    assert resolved.detail == "not sent: not in the logs"


def test_delivery_events_and_status_callbacks_with_each_endpoints_answer(
    app: Flask, smtp: ScriptedSmtpServer
) -> None:
    acme = tenant("acme").id
    server = mail_server(acme, smtp)
    db.session.commit()
    with CallbackReceiver() as receiver:
        endpoint(acme, "orders", receiver.url("/a"), ["mail.sent"])
        endpoint(acme, "down", f"http://127.0.0.1:{free_port()}/", ["mail.sent"])
        record = accept_mail(app, acme)
        drain(app)
        _deliver_once(app)
    row = db.session.get(MailSendRecord, record)
    assert row is not None
    assert row.provider_message_id
    events.store(
        db.session(),
        Channel.MAIL,
        tenant_id=acme,
        config_id=server.id,
        provider="smtp",
        event=events.ProviderEvent(
            "d1", events.EventType.BOUNCED, row.provider_message_id, code="5.1.1"
        ),
    )
    db.session.commit()
    entries = story(Channel.MAIL, record)
    calls = [e for e in entries if e.kind == "callback"]
    assert len(calls) == 2, titles(entries)
    good = next(e for e in calls if "'orders'" in e.title)
    bad = next(e for e in calls if "'down'" in e.title)
    assert good.title == "Status callback mail.sent to 'orders': delivered"
    assert good.detail.startswith("answered HTTP 2")
    assert bad.detail.startswith("no answer"), bad.detail
    [bounced] = [e for e in entries if e.kind == "event"]
    assert (bounced.title, bounced.code) == ("Bounced", "5.1.1")


def _deliver_once(app: Flask) -> None:
    """One try of every due callback (a dead endpoint stays pending with its error)."""
    settings = app.config["SETTINGS"]
    with callbacks.new_client() as client:
        while (claimed := callbacks.claim(db.engine, 0)) is not None:
            callbacks.attempt(db.engine, settings, client, claimed)


def test_no_other_tenants_events(app: Flask, smtp: ScriptedSmtpServer) -> None:
    acme, globex = tenant("acme").id, tenant("globex").id
    db.session.commit()
    ours = accept_mail(app, acme)
    db.session.add_all(
        [  # rows naming our record's id but another tenant, or the other channel
            RecordEvent(
                tenant_id=globex,
                channel="mail",
                record_id=ours,
                kind=RecordEventKind.CANCELLED.value,
                actor="someone@globex.example.com",
            ),
            RecordEvent(
                tenant_id=acme,
                channel="sms",
                record_id=ours,
                kind=RecordEventKind.CANCELLED.value,
            ),
            RecordEvent(
                tenant_id=acme,
                channel="mail",
                record_id=ours,
                kind=RecordEventKind.RETRIED.value,
                message="requeued by hand",
                actor=ADMIN,
            ),
        ]
    )
    db.session.commit()
    assert [(e.title, e.who) for e in story(Channel.MAIL, ours)] == [
        ("Accepted", None),
        ("Retry pressed", ADMIN),
    ]
