"""Status callbacks on real PostgreSQL (and the SQLite triggers), a real
SMTP server and a local HTTP receiver that verifies signatures with ``standardwebhooks``."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from flask import Flask
from sqlalchemy import func, select, text, update
from standardwebhooks import Webhook

from portal.config import Settings
from portal.delivery.callback_pool import CallbackPool
from portal.extensions import db
from portal.messaging.after_send import callbacks
from portal.models import CallbackDelivery, CallbackEndpoint, MailSendRecord
from tests.conftest import make_api_key
from tests.support.callback_receiver import CallbackReceiver
from tests.support.delivery import accept_mail, drain, mail_server, tenant
from tests.support.smtp_server import ScriptedSmtpServer


@pytest.fixture
def receiver() -> Iterator[CallbackReceiver]:
    with CallbackReceiver() as server:
        yield server


def endpoint(
    tenant_id: int, name: str, url: str, events: list[str], **fields: Any
) -> tuple[int, str]:
    secret = callbacks.new_secret()
    row = CallbackEndpoint(tenant_id=tenant_id, name=name, url=url, **fields)
    row.event_list = events
    row.secret = secret
    db.session.add(row)
    db.session.commit()
    return row.id, secret


def deliver_all(app: Flask, settings: Settings | None = None, timeout_s: float = 10.0) -> int:
    """Claim and post due callbacks in this thread until none is due or waiting."""
    settings = settings or app.config["SETTINGS"]
    done = 0
    deadline = time.monotonic() + timeout_s
    with callbacks.new_client() as client:
        while time.monotonic() < deadline:
            claimed = callbacks.claim(db.engine, 0)
            if claimed is not None:
                callbacks.attempt(db.engine, settings, client, claimed)
                done += 1
                continue
            waiting = db.session.scalar(
                select(func.count())
                .select_from(CallbackDelivery)
                .where(CallbackDelivery.status.in_(["pending", "sending"]))
            )
            db.session.rollback()
            if not waiting:
                return done
            time.sleep(0.01)
    raise AssertionError("callbacks still due after the timeout")


def deliveries(**where: Any) -> list[CallbackDelivery]:
    db.session.expire_all()
    return list(
        db.session.scalars(
            select(CallbackDelivery).filter_by(**where).order_by(CallbackDelivery.id)
        )
    )


def test_each_subscribed_event_once_per_endpoint_signed(
    app: Flask, smtp: ScriptedSmtpServer, receiver: CallbackReceiver
) -> None:
    acme, globex = tenant("acme"), tenant("globex")
    mail_server(acme.id, smtp, name="acme-smtp")
    mail_server(globex.id, smtp, name="globex-smtp")
    db.session.commit()
    _, secret_a = endpoint(acme.id, "all", receiver.url("/a"), ["mail.queued", "mail.sent"])
    _, secret_b = endpoint(acme.id, "sent", receiver.url("/b"), ["mail.sent"])
    endpoint(acme.id, "off", receiver.url("/c"), list(callbacks.EVENT_TYPES), enabled=False)
    rid = accept_mail(app, acme.id, businessKey="order-1", metadata={"order": 1})
    other = accept_mail(app, globex.id)
    drain(app)
    assert deliver_all(app) == 3
    a = receiver.verified(secret_a, "/a")
    assert [(m["type"], m["data"]["sequence"]) for m in a] == [("mail.queued", 1), ("mail.sent", 2)]
    sent = a[1]["data"]
    assert sent["id"] == rid
    assert sent["status"] == "Sent"
    assert sent["channel"] == "mail"
    assert sent["businessKey"] == "order-1"
    assert sent["metadata"] == {"order": 1}
    assert sent["providerMessageId"]
    assert [m["type"] for m in receiver.verified(secret_b, "/b")] == ["mail.sent"]
    assert not [r for r in receiver.received if r.path == "/c"]
    # A tenant without endpoints: no row at all.
    assert not deliveries(record_id=other)
    with pytest.raises(Exception, match="signature"):
        Webhook(secret_b).verify(receiver.received[0].body, receiver.received[0].headers)


def test_a_bounce_that_fails_a_sent_mail_is_bounced_only(
    app: Flask, receiver: CallbackReceiver
) -> None:
    acme = tenant("acme")
    db.session.commit()
    endpoint(acme.id, "all", receiver.url(), list(callbacks.EVENT_TYPES))
    rid = accept_mail(app, acme.id)
    db.session.execute(update(MailSendRecord).where(MailSendRecord.id == rid).values(status="Sent"))
    db.session.execute(
        update(MailSendRecord)
        .where(MailSendRecord.id == rid)
        .values(status="Failed", delivery_outcome="bounced", error_code="5.1.1")
    )
    db.session.execute(
        update(MailSendRecord).where(MailSendRecord.id == rid).values(read_at=datetime.now(UTC))
    )
    db.session.commit()
    rows = deliveries(record_id=rid)
    assert [(d.event_type, d.sequence) for d in rows] == [
        ("mail.queued", 1),
        ("mail.sent", 2),
        ("mail.bounced", 3),
        ("mail.read", 4),
    ]
    assert rows[2].payload["status"] == "Failed"
    assert rows[2].payload["errorCode"] == "5.1.1"


def test_retries_survive_500s_and_downtime_with_the_same_webhook_id(
    app: Flask, receiver: CallbackReceiver
) -> None:
    acme = tenant("acme")
    db.session.commit()
    # An endpoint on a port nothing listens on yet.
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    eid, secret = endpoint(acme.id, "later", f"http://127.0.0.1:{port}/x", ["mail.queued"])
    endpoint(acme.id, "flaky", receiver.url("/flaky"), ["mail.queued"])
    receiver.fail_next(2)
    accept_mail(app, acme.id)
    settings: Settings = app.config["SETTINGS"]
    with callbacks.new_client() as client:
        for _ in range(2):  # the down endpoint fails twice
            claimed = callbacks.claim(db.engine, 0)
            while claimed is not None and claimed.endpoint_id != eid:
                callbacks.attempt(db.engine, settings, client, claimed)
                claimed = callbacks.claim(db.engine, 0)
            if claimed is None:
                time.sleep(0.2)
                claimed = callbacks.claim(db.engine, eid - 1)
            assert claimed is not None
            assert claimed.endpoint_id == eid
            callbacks.attempt(db.engine, settings, client, claimed)
    (down,) = deliveries(endpoint_id=eid)
    assert down.status == "pending"
    assert down.attempts == 2
    assert "Connect" in (down.last_error or "")
    with CallbackReceiver(port) as late:
        deliver_all(app)
        assert [m["type"] for m in late.verified(secret)] == ["mail.queued"]
    flaky = [r for r in receiver.received if r.path == "/flaky"]
    assert [r.status for r in flaky] == [500, 500, 204]
    assert len({r.webhook_id for r in flaky}) == 1
    (row,) = deliveries(endpoint_id=eid)
    assert row.status == "delivered"
    assert row.attempts == 3


def test_dead_after_the_window_and_paused_after_twenty_failures(app: Flask) -> None:
    acme = tenant("acme")
    db.session.commit()
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    eid, _ = endpoint(acme.id, "gone", f"http://127.0.0.1:{port}/", ["mail.queued"])
    db.session.execute(
        update(CallbackEndpoint).where(CallbackEndpoint.id == eid).values(consecutive_failures=19)
    )
    db.session.commit()
    accept_mail(app, acme.id)
    settings = app.config["SETTINGS"].replace(callback_give_up_s=0.0)
    with callbacks.new_client() as client:
        claimed = callbacks.claim(db.engine, 0)
        assert claimed is not None
        settled = callbacks.attempt(db.engine, settings, client, claimed)
    assert settled == callbacks.Settled("dead", True)
    (row,) = deliveries()
    assert row.status == "dead"
    db.session.expire_all()
    ep = db.session.get(CallbackEndpoint, eid)
    assert ep is not None
    assert ep.consecutive_failures == 20
    assert ep.paused_until is not None
    # Paused: a new event waits.
    accept_mail(app, acme.id)
    assert callbacks.claim(db.engine, 0) is None
    # Resend moves a dead delivery back, same id, fresh window.
    assert callbacks.resend(db.session, acme.id, [row.id], 60.0) == 1
    db.session.commit()
    assert deliveries(id=row.id)[0].status == "pending"


def test_a_rotated_secret_signs_with_both_for_a_day(app: Flask, receiver: CallbackReceiver) -> None:
    acme = tenant("acme")
    db.session.commit()
    eid, old = endpoint(acme.id, "a", receiver.url(), ["mail.queued"])
    ep = db.session.get(CallbackEndpoint, eid)
    assert ep is not None
    new = callbacks.rotate_secret(ep, datetime.now(UTC))
    db.session.commit()
    accept_mail(app, acme.id)
    deliver_all(app)
    assert receiver.verified(old) == receiver.verified(new)
    assert len(receiver.verified(new)) == 1
    assert callbacks.signing_secrets(ep, datetime.now(UTC) + timedelta(days=1, seconds=1)) == [new]


PRIVATE = [
    "0.1.2.3",
    "10.0.0.1",
    "100.64.0.1",
    "127.0.0.1",
    "169.254.169.254",
    "172.16.0.1",
    "192.168.1.1",
    "224.0.0.1",
    "240.0.0.1",
    "255.255.255.255",
    "::",
    "::1",
    "fc00::1",
    "fd12::1",
    "fe80::1",
    "::ffff:10.0.0.1",
    "::ffff:127.0.0.1",
    "64:ff9b::a9fe:a9fe",
    "64:ff9b::7f00:1",
]


def test_private_addresses_are_refused_without_opening_a_socket(
    app: Flask, monkeypatch: pytest.MonkeyPatch
) -> None:
    opened: list[Any] = []

    def no_socket(*args: Any, **kwargs: Any) -> Any:
        opened.append(args)
        raise AssertionError("a socket was opened")

    monkeypatch.setattr(socket, "socket", no_socket)
    monkeypatch.setattr(socket, "create_connection", no_socket)
    settings = app.config["SETTINGS"].replace(callback_allow_private=False)
    lookups: list[str] = []

    def stub(host: str, port: int) -> list[str]:
        lookups.append(host)
        return {
            "inside.example": ["93.184.216.34", "10.1.2.3"],
            "mapped.example": ["::ffff:192.168.0.1"],
        }[host]

    client = httpx.Client(trust_env=False)
    for address in PRIVATE:
        literal = f"[{address}]" if ":" in address else address
        url = f"https://{literal}/hook"
        assert callbacks.forbidden(address), address
        assert callbacks.check_at_save(url, settings, resolver=stub), address
        result = callbacks.post(client, url, "{}", {}, allow_private=False, resolver=stub)
        assert not result.ok, address
        assert (result.error or "").startswith("refused"), address
    for host in ("inside.example", "mapped.example"):
        result = callbacks.post(
            client, f"https://{host}/", "{}", {}, allow_private=False, resolver=stub
        )
        assert not result.ok
        assert "private" in (result.error or "")
        assert callbacks.check_at_save(f"https://{host}/", settings, resolver=stub)
    assert lookups
    assert not opened
    assert not callbacks.forbidden("93.184.216.34")
    assert not callbacks.forbidden("2606:2800::1")
    assert callbacks.url_problem("ftp://x.example/")
    assert callbacks.url_problem("http://u:p@x.example/")


def test_metadata_is_checked_kept_and_returned(app: Flask) -> None:
    acme = tenant("acme")
    token = make_api_key(acme.id)
    db.session.commit()
    client = app.test_client()
    auth = {"Authorization": f"Bearer {token}"}
    base = {"to": ["ann@example.com"], "subject": "Hi", "text": "Hi"}
    for bad in ([1], {f"k{i}": i for i in range(21)}, {"k": "x" * 2100}):
        answer = client.post("/api/v1/mail", json=base | {"metadata": bad}, headers=auth)
        assert answer.status_code == 422, answer.json
        assert "metadata" in str(answer.json)
    answer = client.post("/api/v1/mail", json=base | {"metadata": {"order": "A-1"}}, headers=auth)
    assert answer.status_code in (200, 201, 202), answer.json
    rid = answer.json["id"]
    got = client.get(f"/api/v1/mail/{rid}", headers=auth)
    assert got.json["metadata"] == {"order": "A-1"}


def test_sqlite_triggers_write_the_same_rows(sqlite_app: Flask) -> None:
    from tests.conftest import _clean

    _clean(sqlite_app)
    with sqlite_app.app_context():
        acme = tenant("acme")
        db.session.commit()
        endpoint(acme.id, "all", "http://127.0.0.1:9/", list(callbacks.EVENT_TYPES))
        endpoint(acme.id, "sent", "http://127.0.0.1:9/", ["mail.sent"])
        rid = accept_mail(sqlite_app, acme.id, metadata={"a": 1})
        for values in (
            {"status": "Sending"},
            {"status": "Sent"},
            {"delivery_outcome": "delivered"},
        ):
            db.session.execute(
                update(MailSendRecord).where(MailSendRecord.id == rid).values(**values)
            )
        db.session.commit()
        rows = deliveries(record_id=rid)
        assert [(d.event_type, d.sequence) for d in rows] == [
            ("mail.queued", 1),
            ("mail.sent", 2),
            ("mail.sent", 2),
            ("mail.delivered", 3),
        ]
        assert rows[1].payload["metadata"] == {"a": 1}
        db.session.rollback()  # SQLite: a reader's open transaction would block the claim
        assert callbacks.claim(db.engine, 0) is not None
        db.session.execute(text("DELETE FROM callback_delivery"))
        db.session.commit()
        db.session.remove()


def test_the_worker_pool_delivers(app: Flask, receiver: CallbackReceiver) -> None:
    acme = tenant("acme")
    db.session.commit()
    _, secret = endpoint(acme.id, "a", receiver.url(), ["mail.queued"])
    for _ in range(3):
        accept_mail(app, acme.id)
    pool = CallbackPool(db.engine, app.config["SETTINGS"])
    pool.start()
    try:
        deadline = time.monotonic() + 10
        while len(receiver.verified(secret)) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        pool.stop()
        assert pool.join(time.monotonic() + 5)
    assert len(receiver.verified(secret)) == 3
    assert len({r.webhook_id for r in receiver.received}) == 3


def test_an_idle_pool_asks_the_database_from_one_thread(
    app: Flask, receiver: CallbackReceiver
) -> None:
    """With nothing due, one of the pool's threads polls and the others wait for it to find
    work: idle worker processes cost CPU on both sides of the connection. Work found wakes
    them all."""
    from sqlalchemy import event

    settings = app.config["SETTINGS"].replace(callback_concurrency=4, poll_interval_s=0.05)
    asked: list[float] = []

    def count(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if "callback_delivery" in statement:
            asked.append(time.monotonic())

    event.listen(db.engine, "before_cursor_execute", count)
    pool = CallbackPool(db.engine, settings)
    pool.start()
    try:
        time.sleep(0.3)  # every thread has asked once and found nothing
        since = time.monotonic()
        time.sleep(1.0)
        polls = len([t for t in asked if t >= since])
        # One thread every 50 ms: at most 20 a second (fewer on a loaded machine); four
        # threads each polling would ask about 80 times.
        assert 1 <= polls <= 30
        acme = tenant("acme")
        db.session.commit()
        _, secret = endpoint(acme.id, "a", receiver.url(), ["mail.queued"])
        for _ in range(3):
            accept_mail(app, acme.id)
        deadline = time.monotonic() + 10
        while len(receiver.verified(secret)) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(receiver.verified(secret)) == 3
    finally:
        event.remove(db.engine, "before_cursor_execute", count)
        pool.stop()
        assert pool.join(time.monotonic() + 5)


def test_sms_status_changes_are_events_too(app: Flask) -> None:
    from portal.messaging.records import acceptance
    from portal.models import SmsSendRecord
    from portal.tenancy import tenant_context

    acme = tenant("acme")
    db.session.commit()
    endpoint(acme.id, "sms", "http://127.0.0.1:9/", ["sms.queued", "sms.sent", "sms.delivered"])
    with tenant_context(acme.id):
        accepted = acceptance.send_sms(
            db.session,
            {"phoneNumber": "+447400123456", "content": "hi", "metadata": {"k": 1}},
            settings=app.config["SETTINGS"],
        )
    db.session.commit()
    for values in ({"status": "Sending"}, {"status": "Sent"}, {"delivery_outcome": "delivered"}):
        db.session.execute(
            update(SmsSendRecord).where(SmsSendRecord.id == accepted.id).values(**values)
        )
    db.session.commit()
    rows = deliveries(channel="sms", record_id=accepted.id)
    assert [(d.event_type, d.sequence) for d in rows] == [
        ("sms.queued", 1),
        ("sms.sent", 2),
        ("sms.delivered", 3),
    ]
    assert rows[0].payload["metadata"] == {"k": 1}
    assert rows[0].payload["channel"] == "sms"
