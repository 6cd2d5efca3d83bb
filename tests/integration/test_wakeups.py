"""The delivery service in-process: NOTIFY wakes idle workers at once; polling is the fallback;
stop claims nothing more and lets the send in hand finish."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from flask import Flask

from portal.delivery.service import DeliveryService
from portal.extensions import db
from portal.models import Channel
from tests.support.delivery import accept_mail, mail_server, record, tenant, waiting_on_a_lock
from tests.support.smtp_server import ScriptedSmtpServer


@pytest.fixture
def smtp() -> Iterator[ScriptedSmtpServer]:
    with ScriptedSmtpServer(hang_s=1.0) as server:
        yield server


def wait_until(predicate: object, timeout_s: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if predicate():  # type: ignore[operator]
            return time.monotonic() - started
        time.sleep(0.01)
    raise AssertionError(f"not within {timeout_s}s")


def test_notify_wakes_idle_workers_long_before_the_poll(
    app: Flask, smtp: ScriptedSmtpServer
) -> None:
    acme = tenant("acme").id
    mail_server(acme, smtp)
    db.session.commit()
    settings = app.config["SETTINGS"].replace(poll_interval_s=30.0, mail_send_concurrency=2)
    service = DeliveryService(db.engine, settings)
    service.start()
    try:
        time.sleep(0.5)  # the listener is connected and the first poll has passed
        rid = accept_mail(app, acme)
        took = wait_until(lambda: record(rid).status == "Sent", 5.0)
    finally:
        service.stop()
        assert service.wait(5.0)
    print(f"accepted-to-sent with NOTIFY and a 30 s poll: {took * 1000:.0f} ms")
    assert took < 5.0  # far below the 30 s poll: the NOTIFY woke the worker


def test_polling_finds_due_work_without_notify(app: Flask, smtp: ScriptedSmtpServer) -> None:
    acme = tenant("acme").id
    mail_server(acme, smtp)
    db.session.commit()
    settings = app.config["SETTINGS"].replace(poll_interval_s=0.1, mail_send_concurrency=2)
    service = DeliveryService(db.engine, settings)
    service.listener = None  # polling only
    service.start()
    try:
        ids = [accept_mail(app, acme, to=[f"u{i}@example.com"]) for i in range(10)]
        wait_until(lambda: all(record(i).status == "Sent" for i in ids), 10.0)
    finally:
        service.stop()
        assert service.wait(5.0)
    assert len(smtp.messages) == 10


def test_stop_finishes_the_send_in_hand_and_claims_nothing_more(
    app: Flask, smtp: ScriptedSmtpServer
) -> None:
    acme = tenant("acme").id
    mail_server(acme, smtp)
    db.session.commit()
    settings = app.config["SETTINGS"].replace(
        poll_interval_s=0.05, mail_send_concurrency=1, smtp_read_timeout_s=5.0
    )
    service = DeliveryService(db.engine, settings)
    service.start()
    try:
        slow = accept_mail(app, acme, to=["hang@example.com"])  # the server answers after 1 s
        wait_until(lambda: record(slow).status == "Sending", 5.0)
        service.stop()
        later = accept_mail(app, acme, to=["later@example.com"])
        assert service.wait(5.0)
    finally:
        service.stop()
    assert record(slow).status == "Sent"
    assert record(later).status == "Pending"


def test_stop_returns_only_once_a_claim_under_way_is_over(app: Flask) -> None:
    """A claim statement that began before the stop may still take a record; stop returns
    only after it (the worker says "claiming nothing more" then), and no claim begins after:
    a record accepted once stop has returned is never claimed."""
    from sqlalchemy import text

    from portal.delivery.pool import ChannelPool, ChannelSpec
    from portal.models import MailSendRecord

    acme = tenant("acme").id
    early = accept_mail(app, acme, to=["early@example.com"])
    spec = ChannelSpec(Channel.MAIL, MailSendRecord, 2, object, lambda _c, _r: None)
    pool = ChannelPool(db.engine, spec, poll_interval_s=30.0)
    claimed: list[int] = []
    stopped_at: list[float] = []
    with db.engine.connect() as blocker:
        # The claim's UPDATE waits for this lock, as a claim slowed by a loaded server would.
        blocker.execute(text("LOCK TABLE mail_send_record IN EXCLUSIVE MODE"))
        claiming = threading.Thread(target=lambda: claimed.extend(r.id for r in pool._claim(1)))
        claiming.start()
        wait_until(lambda: len(waiting_on_a_lock("%mail_send_record%")) == 1, 5.0)
        stopping = threading.Thread(
            target=lambda: (pool.stop(), stopped_at.append(time.monotonic()))
        )
        stopping.start()
        time.sleep(0.3)
        assert not stopped_at, "stop returned while a claim was under way"
        assert pool._claim(1) == []  # none begins once stopping
        # Read before the release: once the lock goes, the claim and the stop may finish
        # before this thread runs again.
        released_at = time.monotonic()
        blocker.rollback()
    claiming.join(5.0)
    stopping.join(5.0)
    assert claimed == [early]  # the claim under way took its record
    assert stopped_at
    assert stopped_at[0] >= released_at
    later = accept_mail(app, acme, to=["later@example.com"])
    assert pool._claim(1) == []
    assert record(later).status == "Pending"


def test_a_busy_worker_claims_its_next_record_in_each_sent_write(
    app: Flask, smtp: ScriptedSmtpServer
) -> None:
    """With a backlog, a worker's claims after the first ride on its Sent writes (one
    statement and one commit fewer per mail); every mail goes out once."""
    acme = tenant("acme").id
    mail_server(acme, smtp)
    db.session.commit()
    ids = [accept_mail(app, acme, to=[f"b{i}@example.com"]) for i in range(10)]
    settings = app.config["SETTINGS"].replace(poll_interval_s=30.0, mail_send_concurrency=1)
    service = DeliveryService(db.engine, settings)
    service.start()
    try:
        wait_until(lambda: all(record(i).status == "Sent" for i in ids), 10.0)
    finally:
        service.stop()
        assert service.wait(5.0)
    pool = service.pools[Channel.MAIL]
    assert pool.claimed_total == 10
    assert pool.claimed_with_sent >= 8  # all but the first (and one the poller may take)
    assert sorted(m.rcpt_tos[0] for m in smtp.messages) == sorted(
        f"b{i}@example.com" for i in range(10)
    )
