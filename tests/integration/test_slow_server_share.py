"""A server whose sends time out holds at most its slow share of a pool's workers.

A timeout after DATA never counts for the breaker (the mail may have been taken), so before
the slow share a server that hung after DATA kept all of a pool's workers but one: another
tenant's mail waited behind it. Here a real pool of 8 worker threads runs the real attempt
(``process_mail``) against two real SMTP servers in the test process: tenant A's hangs after
DATA, past the read timeout; tenant B's answers at once. Once A's first sends have timed out,
A's sends in flight stay at ``slow_cap(8, SLOW_SERVER_MAX_SHARE)`` and B's mail goes out
promptly; when A's server answers again, it gets its full share back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from flask import Flask
from sqlalchemy import func, select

from portal.config import Settings
from portal.delivery.pool import ChannelPool, ChannelSpec
from portal.extensions import db
from portal.messaging.sending import breaker
from portal.messaging.sending.backoff import BackoffPolicy
from portal.messaging.sending.breaker import Breaker
from portal.messaging.sending.claim import RouteGate, slow_cap
from portal.messaging.sending.pipeline import MailContext, process_mail
from portal.models import BreakerState, Channel, MailSendRecord, SendStatus
from tests.support.delivery import accept_mail, mail_server, tenant, unfinished
from tests.support.smtp_server import ScriptedSmtpServer

WORKERS = 8
A_MAILS = 12
B_MAILS = 20
READ_TIMEOUT_S = 2.0

pytestmark = pytest.mark.timeout(90)


def _settings(app: Flask) -> Settings:
    base: Settings = app.config["SETTINGS"]
    return base.replace(
        smtp_read_timeout_s=READ_TIMEOUT_S,
        smtp_connect_timeout_s=2.0,
        max_retries=30,  # A's records keep coming back while the test runs
        backoff_base_s=0.2,
        route_wait_s=1.0,
        slow_server_max_share=0.25,
    )


@pytest.fixture
def servers() -> Iterator[tuple[ScriptedSmtpServer, ScriptedSmtpServer]]:
    with ScriptedSmtpServer(hang_s=30.0) as hanging, ScriptedSmtpServer() as healthy:
        yield hanging, healthy


def _count(*where: Any) -> int:
    with db.engine.connect() as connection:
        return int(connection.scalar(select(func.count()).where(*where)) or 0)


def _wait(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.mark.long
def test_a_server_hanging_after_data_holds_only_its_slow_share_of_the_workers(
    app: Flask,
    redis_client: redis.Redis,
    servers: tuple[ScriptedSmtpServer, ScriptedSmtpServer],
) -> None:
    hanging, healthy = servers
    settings = _settings(app)
    a, b = tenant("hang-co"), tenant("quick-co")
    server_a = mail_server(a.id, hanging, name="hanging", uncertain_policy="retry")
    mail_server(b.id, healthy, name="healthy")
    db.session.commit()
    engine = db.engine
    gate = Breaker(engine, settings, breaker._connector(settings))
    policy = BackoffPolicy.from_settings(settings)
    spec = ChannelSpec(
        channel=Channel.MAIL,
        model=MailSendRecord,
        concurrency=WORKERS,
        make_context=lambda: MailContext(engine, settings, policy, breaker=gate),
        process=process_mail,
    )
    pool = ChannelPool(engine, spec, poll_interval_s=0.1)
    route = ("mail", server_a.id)
    cap = slow_cap(WORKERS, settings.slow_server_max_share)
    samples: list[tuple[float, int]] = []
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.is_set():
            samples.append((time.monotonic(), pool.routes.held(route)))
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    a_ids = [accept_mail(app, a.id, to=[f"hang-{n}@a.example.com"]) for n in range(A_MAILS)]
    pool.start()
    sampler.start()
    try:
        # A's first sends, one per worker but one, all time out (after DATA).
        _wait(
            lambda: (
                _count(MailSendRecord.tenant_id == a.id, MailSendRecord.retry_count >= 1)
                >= WORKERS - 1
            ),
            20,
            "A's first sends to time out",
        )
        first_wave_done = time.monotonic()
        time.sleep(0.5)  # A's retries (due after 0.1 to 0.3 s) are in flight again
        b_ids = [accept_mail(app, b.id, to=[f"bo{n}@b.example.com"]) for n in range(B_MAILS)]
        _wait(
            lambda: (
                _count(
                    MailSendRecord.tenant_id == b.id,
                    MailSendRecord.status == SendStatus.SENT.value,
                )
                == B_MAILS
            ),
            20,
            "B's mail to be sent",
        )
        b_done = time.monotonic()
        held_meanwhile = max(n for at, n in samples if first_wave_done <= at <= b_done)

        # A's server answers again: its next send that completes lifts the slow share.
        hanging.hang_s = 0.0
        ok = accept_mail(app, a.id, to=["ok@a.example.com"])
        _wait(
            lambda: _count(MailSendRecord.id == ok, MailSendRecord.status == "Sent") == 1,
            30,
            "A's mail to go out once its server answers",
        )
        _wait(lambda: not pool.routes.slow(route), 5, "A's full share back")
    finally:
        sampling.set()
        pool.stop()
        assert not (left := unfinished(pool, 10)), left
        sampler.join(2)

    assert held_meanwhile <= cap, (held_meanwhile, cap)
    with db.engine.connect() as connection:
        rows = connection.execute(
            select(MailSendRecord.created_time, MailSendRecord.sent_at).where(
                MailSendRecord.id.in_(b_ids)
            )
        ).all()
        # The breaker never counted A's timeouts after DATA: nothing waited for it.
        waited = connection.scalar(
            select(func.count()).where(MailSendRecord.error_code == breaker.SERVER_UNAVAILABLE)
        )
        states = connection.scalar(select(func.count()).select_from(BreakerState))
    latency = max((sent - created).total_seconds() for created, sent in rows)
    # Before the slow share, A held 7 of the 8 workers and B waited for its sends to time
    # out (1.6 s here); with it, B goes out at once (0.2 s).
    assert latency < 1.0, f"B's mail waited {latency:.2f} s behind A's hanging server"
    assert (waited, states) == (0, 0)
    assert len(a_ids) == A_MAILS


def test_the_route_gate_holds_a_timing_out_route_to_its_slow_share() -> None:
    gate = RouteGate(WORKERS - 1)
    cap = slow_cap(WORKERS, 0.25)
    assert (cap, slow_cap(4, 0.25), slow_cap(10, 0.25), slow_cap(2, 1.0)) == (2, 1, 2, 1)
    assert all(gate.try_enter("x", 0.0, 0.25) for _ in range(WORKERS - 1))
    assert not gate.try_enter("x", 0.0, 0.25)  # all but one: the usual cap
    gate.settled("x", timed_out=True)
    for _ in range(WORKERS - 1):
        gate.leave("x")
    assert [gate.try_enter("x", 5.0, 0.25) for _ in range(cap + 1)] == [True] * cap + [False]
    started = time.monotonic()
    assert not gate.try_enter("x", 5.0, 0.25)
    assert time.monotonic() - started < 0.5  # a slow route's places free at its timeouts
    assert gate.try_enter("y", 0.0, 0.25)  # other routes keep their full share
    gate.settled("x", timed_out=False)  # an answer: the full share again
    assert all(gate.try_enter("x", 0.0, 0.25) for _ in range(WORKERS - 1 - cap))
    assert not gate.try_enter("x", 0.0, 0.25)
