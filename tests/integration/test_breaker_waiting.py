"""Records waiting for an open breaker wait on the breaker, not on a time.

While a server's breaker is open its records are written once (Retry, ``SERVER_UNAVAILABLE``,
no retry used) and then left alone: a probe costs a few writes, not two per waiting record
(counted by the records' ``version``, which every write bumps). When the probe succeeds the
waiting records are due at once, not at the next probe time. The server is a port with nothing
listening (connections refused), then a real SMTP server on that port.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis
from flask import Flask
from sqlalchemy import func, select

from portal.config import Settings
from portal.delivery.pool import ChannelPool, ChannelSpec
from portal.extensions import db
from portal.messaging.sending import breaker, pipeline
from portal.messaging.sending.backoff import BackoffPolicy
from portal.messaging.sending.breaker import Breaker, ServerDown, Verdict
from portal.messaging.sending.claim import claim_due
from portal.messaging.sending.outcomes import Claimed
from portal.messaging.sending.pipeline import MailContext, process_mail
from portal.models import Channel, MailSendRecord, SendStatus
from tests.support.delivery import accept_mail, mail_server, tenant, unfinished
from tests.support.smtp_server import ScriptedSmtpServer
from tests.support.workers import free_port

WAITING = 60

pytestmark = pytest.mark.timeout(90)


def _settings(app: Flask, **more: Any) -> Settings:
    base: Settings = app.config["SETTINGS"]
    values: dict[str, Any] = {
        "max_retries": 10,  # a failed probe uses one; none may run out here
        "backoff_base_s": 0.05,
        "breaker_failures": 3,
    }
    return base.replace(**(values | more))


def _one_round(ctx: MailContext) -> bool:
    """What a pool worker does once: claim one due record and attempt it (False: none due)."""
    claimed = claim_due(db.engine, MailSendRecord, 1)
    if claimed:
        process_mail(ctx, claimed[0])
    return bool(claimed)


def _versions() -> dict[int, int]:
    """Each record's version: every write of a record bumps it."""
    with db.engine.connect() as connection:
        rows = connection.execute(select(MailSendRecord.id, MailSendRecord.version)).all()
    return {rid: version for rid, version in rows}


def _attempts() -> int:
    """The attempts that reached SMTP so far."""
    with db.engine.connect() as connection:
        return int(connection.scalar(select(func.sum(MailSendRecord.attempt_count))) or 0)


def _all_waiting() -> bool:
    """Every record waits for the breaker (or has ended): none due, none in flight."""
    with db.engine.connect() as connection:
        busy = connection.scalar(
            select(func.count()).where(
                MailSendRecord.status != SendStatus.FAILED.value,
                (MailSendRecord.status != SendStatus.RETRY.value)
                | (MailSendRecord.error_code != breaker.SERVER_UNAVAILABLE),
            )
        )
    return busy == 0


def _run_until(ctx: MailContext, done: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _one_round(ctx):
            time.sleep(0.01)
        if done():
            return
    raise AssertionError("the records did not reach the expected state in time")


def _run_for(ctx: MailContext, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _one_round(ctx):
            time.sleep(0.01)


def test_probes_of_an_open_breaker_do_not_rewrite_the_waiting_records(
    any_app: Flask, redis_client: redis.Redis
) -> None:
    """Several probe cycles of an outage with 60 records waiting: a few writes per probe,
    none per waiting record; the waiting records use no retry; one that expires meanwhile
    ends EXPIRED at its expiry, the breaker still open."""
    app = any_app
    settings = _settings(app, breaker_probe_min_s=0.3, breaker_probe_max_s=0.3)
    t = tenant("acme")
    server = mail_server(t.id, ScriptedSmtpServer(port=free_port()))  # nothing listening
    db.session.commit()
    for i in range(WAITING - 1):
        accept_mail(app, t.id, to=[f"u{i}@example.com"])
    expires_at = datetime.now(UTC) + timedelta(seconds=1.5)
    expiring = accept_mail(app, t.id, to=["soon@example.com"], expiresAt=expires_at.isoformat())
    db.session.rollback()  # SQLite: no read left open beside the workers' writes
    gate = Breaker(db.engine, settings, breaker._connector(settings))
    ctx = MailContext(db.engine, settings, BackoffPolicy.from_settings(settings), breaker=gate)
    try:
        # The breaker opens after 3 refused connections; every record then waits for it.
        _run_until(ctx, _all_waiting, 20)
        before, attempts_before = _versions(), _attempts()
        _run_for(ctx, 2.5)  # about 5 probes (0.3 s apart, seen at the view's 0.5 s refresh)
        after, attempts_after = _versions(), _attempts()
    finally:
        ctx.close()
    probes = attempts_after - attempts_before
    touched = [rid for rid, version in after.items() if version != before[rid]]
    writes = sum(after.values()) - sum(before.values())
    assert probes >= 2, "the breaker stopped probing"
    # A probe writes its record (released, claimed, failed, and back from its backoff
    # claimed and waiting again) and maybe one more released for it that another record's
    # probe beat; the expiring record ends. Before, every waiting record was claimed and
    # deferred again at every probe: 2 x 60 writes a probe.
    assert len(touched) <= 2 * probes + 1, (len(touched), probes)
    assert writes <= 8 * probes + 2, (writes, probes)
    with db.engine.connect() as connection:
        rows = connection.execute(
            select(
                MailSendRecord.id,
                MailSendRecord.status,
                MailSendRecord.error_code,
                MailSendRecord.retry_count,
                MailSendRecord.attempt_count,
            )
        ).all()
    never_tried = [r for r in rows if r.attempt_count == 0 and r.id != expiring]
    assert never_tried, "every record probed"
    assert {r.retry_count for r in never_tried} == {0}, "waiting used retries"
    assert {(r.status, r.error_code) for r in rows if r.id == expiring} == {("Failed", "EXPIRED")}
    assert gate.is_open(Channel.MAIL, server.id)


def test_a_probe_that_succeeds_releases_the_waiting_records_at_once(
    app: Flask, redis_client: redis.Redis
) -> None:
    """Probe interval 60 s: the waiting records go out within 2 s of the probe that finds
    the server back, with a pool of worker threads as in the worker, and use no retry. (The
    breaker's clock is moved on by the interval rather than the test waiting for it.)"""
    settings = _settings(app, breaker_probe_min_s=60.0, breaker_probe_max_s=60.0)
    port = free_port()
    t = tenant("acme")
    mail_server(t.id, ScriptedSmtpServer(port=port))  # nothing listening yet
    db.session.commit()
    ids = [accept_mail(app, t.id, to=[f"u{i}@example.com"]) for i in range(WAITING)]
    ahead = {"s": 0.0}
    gate = Breaker(
        db.engine, settings, breaker._connector(settings), clock=lambda: time.time() + ahead["s"]
    )
    policy = BackoffPolicy.from_settings(settings)
    ctx = MailContext(db.engine, settings, policy, breaker=gate)
    try:
        _run_until(ctx, _all_waiting, 20)
    finally:
        ctx.close()
    engine = db.engine
    spec = ChannelSpec(
        channel=Channel.MAIL,
        model=MailSendRecord,
        concurrency=4,
        make_context=lambda: MailContext(engine, settings, policy, breaker=gate),
        process=process_mail,
    )
    pool = ChannelPool(engine, spec, poll_interval_s=0.5)
    with ScriptedSmtpServer(port=port) as smtp:  # the server is back
        pool.start()
        try:
            ahead["s"] = 60.0  # the probe interval has passed
            deadline = time.monotonic() + 15
            while len(smtp.messages) < WAITING and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.2)  # the last Sent writes
        finally:
            pool.stop()
            assert not (left := unfinished(pool, 10)), left
    with db.engine.connect() as connection:
        rows = connection.execute(
            select(MailSendRecord.sent_at, MailSendRecord.retry_count).where(
                MailSendRecord.id.in_(ids)
            )
        ).all()
    sent = sorted(r.sent_at for r in rows if r.sent_at is not None)
    assert len(sent) == WAITING, f"{len(sent)} of {WAITING} sent within 15 s"
    after_probe = (sent[-1] - sent[0]).total_seconds()
    assert after_probe <= 2.0, f"the last waiting record went {after_probe:.1f} s after the probe"
    assert max(r.retry_count for r in rows) <= 1  # the 3 that opened it used one each


def test_a_record_gated_just_before_the_breaker_closed_does_not_wait(
    app: Flask, redis_client: redis.Redis
) -> None:
    """The gate said "wait", then a probe closed the breaker and released the waiting records,
    then this record's wait was written: it is due at once all the same."""
    settings = _settings(app, breaker_probe_min_s=60.0, breaker_probe_max_s=60.0)
    t = tenant("acme")
    server = mail_server(t.id, ScriptedSmtpServer(port=free_port()))
    db.session.commit()
    rid = accept_mail(app, t.id)
    gate = Breaker(db.engine, settings, breaker._connector(settings))
    for n in range(3):
        gate.failed(Channel.MAIL, server.id, 10_000 + n, "111 Connection refused")
    (record,) = claim_due(db.engine, MailSendRecord, 1)
    check = gate.check(Channel.MAIL, server.id, rid)
    assert check.verdict is Verdict.DEFER
    assert gate.answered(Channel.MAIL, server.id)  # a probe elsewhere: closed and released
    breaker.release(db.engine, Channel.MAIL, server.id)
    ctx = MailContext(db.engine, settings, BackoffPolicy.from_settings(settings), breaker=gate)
    claimed = Claimed(Channel.MAIL, record.id, record.version, record.tenant_id, 0)
    pipeline._defer(ctx, claimed, record, ServerDown(check, server.id, server.name))
    with db.engine.connect() as connection:
        status, code, due = connection.execute(
            select(
                MailSendRecord.status,
                MailSendRecord.error_code,
                MailSendRecord.next_retry_at <= func.now(),
            ).where(MailSendRecord.id == rid)
        ).one()
    assert (status, code, due) == ("Retry", breaker.SERVER_UNAVAILABLE, True)


def test_records_left_waiting_for_a_closed_breaker_are_released(
    app: Flask, redis_client: redis.Redis
) -> None:
    """The breaker closed but its records were not released (the release failed, or Redis lost
    the close): a worker's next check of the waiting records releases them, where nothing else
    would make them due before their deadline."""
    settings = _settings(app, breaker_probe_min_s=60.0, breaker_probe_max_s=60.0)
    t = tenant("acme")
    server = mail_server(t.id, ScriptedSmtpServer(port=free_port()))
    db.session.commit()
    ids = [accept_mail(app, t.id, to=[f"u{i}@example.com"]) for i in range(10)]
    gate = Breaker(db.engine, settings, breaker._connector(settings))
    ctx = MailContext(db.engine, settings, BackoffPolicy.from_settings(settings), breaker=gate)
    try:
        _run_until(ctx, _all_waiting, 20)
    finally:
        ctx.close()
    assert gate.answered(Channel.MAIL, server.id)  # closed; no release follows
    Breaker(db.engine, settings, breaker._connector(settings)).watch()  # a worker starting
    with db.engine.connect() as connection:
        due = connection.scalar(
            select(func.count()).where(
                MailSendRecord.id.in_(ids), MailSendRecord.next_retry_at <= func.now()
            )
        )
    assert due == len(ids)
