"""Circuit breaker per server and provider: an outage costs records no
retries beyond the first few, a record's own refusals never open it, and it works without Redis.

Records are claimed and processed in the test thread (the code the pool workers run); the
outage is a port with nothing listening (mail) or a gateway answering 503 (SMS).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import redis
from flask import Flask
from sqlalchemy import func, select

from portal.config import Settings
from portal.extensions import db
from portal.messaging.sending import breaker
from portal.messaging.sending.backoff import BackoffPolicy
from portal.messaging.sending.breaker import Breaker, Verdict
from portal.messaging.sending.claim import claim_due
from portal.messaging.sending.pipeline import MailContext, SmsContext, process_mail, process_sms
from portal.models import (
    BreakerState,
    Channel,
    MailSendRecord,
    SendStatus,
    SmsSendRecord,
    TenantMessageUsage,
)
from portal.tenancy import PLATFORM_TENANT_ID
from tests.support import sms as sms_support
from tests.support.delivery import accept_mail, mail_server, tenant
from tests.support.smtp_server import ScriptedSmtpServer
from tests.support.workers import free_port

N = 150
OUTAGE_S = 2.7  # 3x the whole retry schedule at MAX_RETRIES=2, BACKOFF_BASE_S=0.2 (<= 0.9 s)


def _settings(app: Flask, **more: Any) -> Settings:
    base: Settings = app.config["SETTINGS"]
    values: dict[str, Any] = {
        "max_retries": 2,
        "backoff_base_s": 0.2,
        "breaker_failures": 5,
        "breaker_probe_min_s": OUTAGE_S + 0.8,  # the first probe comes after the outage
        "breaker_probe_max_s": 30.0,
    }
    return base.replace(**(values | more))


def _breaker(settings: Settings, *, with_redis: bool = True) -> Breaker:
    connect = breaker._connector(settings) if with_redis else None
    return Breaker(db.engine, settings, connect)


def _drain(
    model: type[MailSendRecord] | type[SmsSendRecord],
    process: Callable[[Any], None],
    done: Callable[[], bool],
    timeout_s: float = 30.0,
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        claimed = claim_due(db.engine, model, 1)
        if claimed:
            process(claimed[0])
            continue
        if done():
            return
        time.sleep(0.02)
    raise AssertionError("the records did not all go out in time")


def _summary(model: type[MailSendRecord] | type[SmsSendRecord]) -> dict[str, Any]:
    db.session.expire_all()
    rows = db.session.execute(select(model.status, model.retry_count)).all()
    return {
        "statuses": {s for s, _ in rows},
        "max_retries_used": max(r for _, r in rows),
        "count": len(rows),
    }


def _all_sent(model: type[MailSendRecord] | type[SmsSendRecord]) -> Callable[[], bool]:
    def done() -> bool:
        with db.engine.connect() as conn:
            left = conn.scalar(select(func.count()).where(model.status != SendStatus.SENT.value))
        return left == 0

    return done


@pytest.fixture
def clean_redis(redis_client: redis.Redis) -> redis.Redis:
    return redis_client


@pytest.mark.long
def test_smtp_outage_costs_no_record_more_than_one_retry(
    app: Flask, clean_redis: redis.Redis
) -> None:
    port = free_port()
    smtp = ScriptedSmtpServer(port=port)
    settings = _settings(app)
    t = tenant("acme")
    mail_server(t.id, smtp)  # host/port of a server not started yet: connections refused
    db.session.commit()
    ids = [accept_mail(app, t.id, to=[f"u{i}@example.com"]) for i in range(N)]
    ctx = MailContext(
        engine=db.engine,
        settings=settings,
        policy=BackoffPolicy.from_settings(settings),
        breaker=_breaker(settings),
    )
    timer = threading.Timer(OUTAGE_S, smtp.start)
    timer.start()
    try:
        _drain(MailSendRecord, lambda r: process_mail(ctx, r), _all_sent(MailSendRecord))
    finally:
        timer.cancel()
        ctx.close()
        smtp.stop()
    summary = _summary(MailSendRecord)
    assert summary == {"statuses": {"Sent"}, "max_retries_used": 1, "count": N}
    assert len({m.message_id for m in smtp.messages}) == N
    assert len(ids) == N
    # Deferred records were never charged twice nor before they could go out.
    assert db.session.scalar(select(func.sum(TenantMessageUsage.mail_count))) == N


class _Gateway:
    """An in-house SMS gateway (http_json) that answers 503 with no code while ``down``."""

    def __init__(self) -> None:
        self.down = True
        self.accepted = 0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if owner.down:
                    status, body = 503, b"<html>Service Unavailable</html>"
                else:
                    owner.accepted += 1
                    status, body = 200, json.dumps({"id": f"gw-{owner.accepted}"}).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host!s}:{port}/gateway"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def gateway() -> Iterator[_Gateway]:
    server = _Gateway()
    yield server
    server.close()


@pytest.mark.long
def test_sms_provider_answering_503_costs_no_record_more_than_one_retry(
    app: Flask, clean_redis: redis.Redis, gateway: _Gateway
) -> None:
    settings = _settings(app)
    t = tenant("acme")
    sms_support.provider(t.id, "http_json", None, base_url=gateway.url, secret="s3cret")
    db.session.commit()
    for i in range(N):
        sms_support.accept_sms(app, t.id, phoneNumber=f"+4474001{i:05d}")
    ctx = SmsContext(
        engine=db.engine,
        settings=settings,
        policy=BackoffPolicy.from_settings(settings),
        breaker=_breaker(settings),
    )
    timer = threading.Timer(OUTAGE_S, lambda: setattr(gateway, "down", False))
    timer.start()
    try:
        _drain(SmsSendRecord, lambda r: process_sms(ctx, r), _all_sent(SmsSendRecord))
    finally:
        timer.cancel()
        ctx.close()
    summary = _summary(SmsSendRecord)
    assert summary == {"statuses": {"Sent"}, "max_retries_used": 1, "count": N}
    assert gateway.accepted == N


def test_a_tenants_refused_recipients_never_open_a_shared_platform_server(
    app: Flask, clean_redis: redis.Redis
) -> None:
    settings = _settings(app, breaker_failures=3)
    with ScriptedSmtpServer() as smtp:
        server = mail_server(PLATFORM_TENANT_ID, smtp, name="platform")
        a, b = tenant("a"), tenant("b")
        db.session.commit()
        for i in range(10):
            address = f"gone{i}@example.com"
            smtp.script(address, "550 5.1.1 no such user")
            accept_mail(app, a.id, to=[address])
        ctx = MailContext(
            engine=db.engine,
            settings=settings,
            policy=BackoffPolicy.from_settings(settings),
            breaker=_breaker(settings),
        )
        try:
            _drain(MailSendRecord, lambda r: process_mail(ctx, r), lambda: True, timeout_s=10)
            b_id = accept_mail(app, b.id, to=["bea@example.com"])
            _drain(MailSendRecord, lambda r: process_mail(ctx, r), lambda: True, timeout_s=10)
        finally:
            ctx.close()
        assert ctx.breaker is not None
        assert ctx.breaker.check(Channel.MAIL, server.id, 0).verdict is Verdict.SEND
    db.session.expire_all()
    statuses = dict(db.session.execute(select(MailSendRecord.id, MailSendRecord.status)).all())
    assert statuses.pop(b_id) == "Sent"
    assert set(statuses.values()) == {"Failed"}
    assert db.session.scalar(select(func.count()).select_from(BreakerState)) == 0


def test_open_breaker_defers_without_a_retry_and_probes_one_record_at_a_time(
    app: Flask, clean_redis: redis.Redis
) -> None:
    """Deferred: Retry, retry_count unchanged, SERVER_UNAVAILABLE with the last real error;
    a failed probe doubles the interval and the next probe takes another record."""
    settings = _settings(app, breaker_probe_min_s=0.3, breaker_probe_max_s=0.5)
    t = tenant("acme")
    server = mail_server(t.id, ScriptedSmtpServer(port=free_port()))
    db.session.commit()
    ids = [accept_mail(app, t.id, to=[f"u{i}@example.com"]) for i in range(8)]
    ctx = MailContext(
        engine=db.engine,
        settings=settings,
        policy=BackoffPolicy.from_settings(settings),
        breaker=_breaker(settings),
    )
    try:
        for _ in range(8):
            (record,) = claim_due(db.engine, MailSendRecord, 1)
            process_mail(ctx, record)
    finally:
        ctx.close()
    db.session.expire_all()
    rows = {r.id: r for r in db.session.scalars(select(MailSendRecord))}
    failed = [i for i in ids if rows[i].retry_count == 1]
    deferred = [i for i in ids if rows[i].error_code == breaker.SERVER_UNAVAILABLE]
    assert len(failed) == 5
    assert len(deferred) == 3
    for i in deferred:
        assert rows[i].status == "Retry"
        assert rows[i].retry_count == 0
        assert rows[i].prepared_at is None  # nothing charged, nothing frozen
        assert "Connection refused" in (rows[i].error_message or "")
    state = db.session.get(BreakerState, ("mail", server.id))
    assert state is not None
    assert state.down_since is not None
    # The probe: one record after probe_min; a second asking at once is deferred.
    assert ctx.breaker is not None
    time.sleep(0.35)
    assert ctx.breaker.check(Channel.MAIL, server.id, deferred[0]).verdict is Verdict.PROBE
    assert ctx.breaker.check(Channel.MAIL, server.id, deferred[1]).verdict is Verdict.DEFER
    ctx.breaker.failed(Channel.MAIL, server.id, deferred[0], "111 Connection refused")
    time.sleep(0.55)  # the interval doubled, capped at probe_max
    # The record that just probed does not probe again: another one takes it.
    assert ctx.breaker.check(Channel.MAIL, server.id, deferred[0]).verdict is Verdict.DEFER
    assert ctx.breaker.check(Channel.MAIL, server.id, deferred[1]).verdict is Verdict.PROBE
    assert ctx.breaker.answered(Channel.MAIL, server.id) is True
    breaker.release(db.engine, Channel.MAIL, server.id, batch=2)
    db.session.rollback()  # a new transaction: now() is now
    due = db.session.scalar(
        select(func.count()).where(
            MailSendRecord.id.in_(deferred), MailSendRecord.next_retry_at <= func.now()
        )
    )
    assert due == 3
    assert db.session.get(BreakerState, ("mail", server.id)) is None


def test_without_redis_the_database_keeps_the_state(app: Flask) -> None:
    settings = _settings(app, breaker_probe_min_s=0.2)
    gate = _breaker(settings, with_redis=False)
    for record_id in range(1, 5):
        gate.failed(Channel.SMS, 77, record_id, "HTTP_503 down")
    gate.failed(Channel.SMS, 77, 4, "HTTP_503 down")  # the same record counts once
    assert gate.check(Channel.SMS, 77, 9).verdict is Verdict.SEND
    gate.failed(Channel.SMS, 77, 5, "HTTP_503 down")
    check = gate.check(Channel.SMS, 77, 9)
    assert check.verdict is Verdict.DEFER
    assert check.last_error == "HTTP_503 down"
    assert 0 < check.wait_s <= 0.2
    time.sleep(0.25)
    assert gate.check(Channel.SMS, 77, 9).verdict is Verdict.PROBE
    assert gate.check(Channel.SMS, 77, 10).verdict is Verdict.DEFER
    assert gate.answered(Channel.SMS, 77) is True
    assert gate.check(Channel.SMS, 77, 10).verdict is Verdict.SEND
