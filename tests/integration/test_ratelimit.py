"""Rate limits (seed 000 "Rate limits") on real Redis: the windows and their keys, the one Lua
script, deferrals that use no retry, a platform server's budget shared by its tenants, Redis
down, and exact counts across two real ``worker.py`` processes."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
from flask import Flask
from sqlalchemy import func, select, update

from portal.delivery.children import die_with_parent
from portal.extensions import db
from portal.messaging.records import acceptance
from portal.messaging.sending.backoff import BackoffPolicy
from portal.messaging.sending.ratelimit import (
    ADMIT_LUA,
    Admission,
    RateLimiter,
    RateLimitUnavailable,
    key,
)
from portal.models import Channel, DeadLetterMessage, MailSendRecord, SmsSendRecord
from portal.tenancy import PLATFORM_TENANT_ID, tenant_context
from tests.conftest import TEST_REDIS_URL
from tests.support.delivery import accept_mail, mail_server, tenant
from tests.support.delivery import record as mail_record
from tests.support.sms import (
    UK,
    accept_sms,
    drain_with,
    mail_context,
    provider,
    sms_context,
    sms_record,
)
from tests.support.sms_provider import FakeSmsProvider
from tests.support.smtp_server import ScriptedSmtpServer
from tests.support.workers import worker_env

FAST = BackoffPolicy(max_retries=5, base_s=0.02, quota_floor_s=0.05, retry_after_cap_s=1.0)
# Hour-long "minutes" for in-process pipeline tests, so that no test straddles a window edge;
# the real 60 s and 86 400 s windows are tested on the limiter itself.
STEADY = {"minute_s": 3600.0}
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Config:
    """A stand-in for a server or provider config (the limiter reads four attributes)."""

    id: int
    tenant_id: int
    daily_send_limit: int | None = None
    rate_limit_per_minute: int | None = None


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def limiter(**windows: float) -> RateLimiter:
    return RateLimiter.for_url(TEST_REDIS_URL, 0.5, **windows)


def down() -> RateLimiter:
    """A limiter whose Redis is a closed port."""
    return RateLimiter.for_url(f"redis://127.0.0.1:{closed_port()}/0", 0.2)


def window_numbers(client: redis.Redis, length_s: float) -> int:
    seconds, micros = client.time()
    return int((seconds * 1000 + micros // 1000) // int(length_s * 1000))


def counters(client: redis.Redis) -> dict[str, int]:
    return {k.decode(): int(client.get(k) or 0) for k in client.scan_iter("rl:*")}


@pytest.fixture
def sms_server() -> Iterator[FakeSmsProvider]:
    with FakeSmsProvider() as server:
        yield server


# --- the limiter on its own -----------------------------------------------------------------


def test_daily_window_counts_to_its_limit_in_its_key_and_expires_at_utc_midnight(
    redis_client: redis.Redis,
) -> None:
    config = Config(id=12, tenant_id=7, daily_send_limit=3)
    rl = limiter()
    day = window_numbers(redis_client, 86_400)
    assert [rl.admit(Channel.SMS, config).allowed for _ in range(4)] == [True, True, True, False]
    refusal = rl.admit(Channel.SMS, config)
    seconds, _ = redis_client.time()
    until_midnight = 86_400 - seconds % 86_400
    assert refusal.window == "daily"
    assert until_midnight - 1 <= refusal.wait_s <= until_midnight
    if window_numbers(redis_client, 86_400) != day:
        pytest.fail("the test ran across UTC midnight; run it again")
    daily_key = key(Channel.SMS, "daily", 7, 12, day)
    assert daily_key == f"rl:sms:daily:7:12:{day}"
    assert counters(redis_client) == {daily_key: 3}  # refusals counted nothing
    ttl_ms = redis_client.pttl(daily_key)
    assert until_midnight * 1000 - 1500 <= ttl_ms <= until_midnight * 1000


def test_a_minute_refusal_uses_no_daily_budget(redis_client: redis.Redis) -> None:
    """Real 60 s windows; the test repeats itself if it straddled a minute's edge."""
    config = Config(id=5, tenant_id=-1, daily_send_limit=10, rate_limit_per_minute=2)
    rl = limiter()
    for _ in range(3):
        redis_client.flushdb()
        minute, day = window_numbers(redis_client, 60), window_numbers(redis_client, 86_400)
        results = [rl.admit(Channel.MAIL, config) for _ in range(5)]
        if (window_numbers(redis_client, 60), window_numbers(redis_client, 86_400)) != (
            minute,
            day,
        ):
            continue
        assert [r.allowed for r in results] == [True, True, False, False, False]
        assert {r.window for r in results[2:]} == {"min"}
        assert all(0 < r.wait_s <= 60 for r in results[2:])
        min_key = f"rl:mail:min:-1:5:{minute}"
        daily_key = f"rl:mail:daily:-1:5:{day}"
        assert counters(redis_client) == {min_key: 2, daily_key: 2}
        assert 0 < redis_client.pttl(min_key) <= 60_000
        return
    pytest.fail("three runs in a row straddled a minute's edge")


def test_when_both_windows_are_full_the_later_reset_is_reported(
    redis_client: redis.Redis,
) -> None:
    rl = limiter(day_s=30.0, minute_s=2.0)
    for config_id in range(3):  # a new config (fresh keys) if both windows rolled over between
        config = Config(id=config_id, tenant_id=1, daily_send_limit=1, rate_limit_per_minute=1)
        assert rl.admit(Channel.SMS, config).allowed
        seconds, micros = redis_client.time()
        now_ms = seconds * 1000 + micros // 1000
        resets = {
            "daily": (30_000 - now_ms % 30_000) / 1000,
            "min": (2_000 - now_ms % 2_000) / 1000,
        }
        refusal = rl.admit(Channel.SMS, config)
        if not refusal.allowed:
            break
    later = max(resets, key=lambda name: resets[name])
    if abs(resets["daily"] - resets["min"]) > 0.1:  # too close to call: both are right
        assert refusal.window == later
    assert resets[later] - 0.1 <= refusal.wait_s <= resets[later]


def test_a_short_window_opens_again_when_it_resets(redis_client: redis.Redis) -> None:
    rl = limiter(day_s=0.3)
    for config_id in range(5):  # a new config (fresh keys) if the window rolled over between
        config = Config(id=config_id, tenant_id=2, daily_send_limit=1)
        assert rl.admit(Channel.SMS, config).allowed
        refusal = rl.admit(Channel.SMS, config)
        if not refusal.allowed:
            break
    assert (refusal.allowed, refusal.window) == (False, "daily")
    assert 0 < refusal.wait_s <= 0.3
    time.sleep(refusal.wait_s + 0.01)
    assert rl.admit(Channel.SMS, config).allowed


def test_the_script_is_registered_once_and_run_by_evalsha(redis_client: redis.Redis) -> None:
    redis_client.script_flush()
    config = Config(id=4, tenant_id=4, daily_send_limit=100)
    rl = limiter()
    for _ in range(3):
        assert rl.admit(Channel.SMS, config).allowed
    sha = redis_client.script_load(ADMIT_LUA)
    assert rl._admit_script().sha == sha
    stats = {
        name: int(info["calls"])
        for name, info in redis_client.info("commandstats").items()
        if name in ("cmdstat_evalsha", "cmdstat_eval")
    }
    assert stats.get("cmdstat_evalsha", 0) >= 3


def test_configs_without_limits_never_touch_redis() -> None:
    rl = down()
    for daily, per_minute in [(None, None), (0, 0), (None, 0)]:
        config = Config(id=1, tenant_id=1, daily_send_limit=daily, rate_limit_per_minute=per_minute)
        assert rl.admit(Channel.MAIL, config) == Admission(allowed=True)


def test_redis_unreachable_is_reported_quickly() -> None:
    started = time.monotonic()
    with pytest.raises(RateLimitUnavailable):
        down().admit(Channel.SMS, Config(id=1, tenant_id=1, daily_send_limit=5))
    assert time.monotonic() - started < 2.0


# --- in the delivery pipeline ---------------------------------------------------------------


def test_a_full_window_defers_sms_without_using_a_retry(
    app: Flask, sms_server: FakeSmsProvider, redis_client: redis.Redis
) -> None:
    acme = tenant("acme").id
    config = provider(acme, "http_json", sms_server, name="gw", daily_send_limit=2)
    db.session.commit()
    ids = [accept_sms(app, acme, content=f"message {i}") for i in range(5)]
    ctx = sms_context(app, policy=FAST, limiter=limiter(**STEADY))
    try:
        drain_with(ctx, until=lambda: all(sms_record(i).status != "Pending" for i in ids))
    finally:
        ctx.close()
    rows = [sms_record(i) for i in ids]
    assert Counter(r.status for r in rows) == Counter({"Sent": 2, "Retry": 3})
    seconds, _ = redis_client.time()
    until_midnight = 86_400 - seconds % 86_400
    for row in rows:
        if row.status == "Retry":
            assert (row.error_code, row.retry_count) == ("QUOTA_EXCEEDED", 0)
            assert row.prepared_at is not None  # prepared: sent at once when tried again
            assert "daily window of 'gw' is full" in (row.error_message or "")
            # No sooner than the window resets (and the quota floor), the cap notwithstanding.
            wait = (row.next_retry_at - row.updated_time) / timedelta(seconds=1)  # type: ignore[operator]
            assert until_midnight - 5 <= wait <= until_midnight + 1
    assert len(sms_server.requests) == 2
    day = window_numbers(redis_client, 86_400)
    assert counters(redis_client) == {f"rl:sms:daily:{acme}:{config.id}:{day}": 2}


def test_a_deferral_never_uses_up_retries_and_the_next_window_delivers(
    app: Flask, sms_server: FakeSmsProvider, redis_client: redis.Redis
) -> None:
    """The seed's fix: a tenant over its daily limit is delivered when the day rolls over
    (here a 0.4 s "day"), not dead-lettered; even with no retries at all allowed."""
    acme = tenant("acme").id
    provider(acme, "vonage", sms_server, daily_send_limit=1)
    db.session.commit()
    ids = [accept_sms(app, acme, content=f"message {i}") for i in range(3)]
    used_up = ids[0]
    db.session.execute(
        update(SmsSendRecord).where(SmsSendRecord.id == used_up).values(retry_count=5)
    )
    db.session.commit()
    no_retries = BackoffPolicy(max_retries=0, base_s=0.01, quota_floor_s=0.01)
    ctx = sms_context(app, policy=no_retries, limiter=limiter(day_s=0.4, **STEADY))
    try:
        drain_with(ctx, timeout_s=10)
    finally:
        ctx.close()
    rows = [sms_record(i) for i in ids]
    assert [r.status for r in rows] == ["Sent"] * 3
    assert [r.retry_count for r in rows] == [5, 0, 0]
    assert db.session.scalar(select(func.count()).select_from(DeadLetterMessage)) == 0
    assert len(sms_server.requests) == 3


def test_mail_is_rate_limited_too_per_minute(
    app: Flask, smtp: ScriptedSmtpServer, redis_client: redis.Redis
) -> None:
    acme = tenant("acme").id
    server = mail_server(acme, smtp, name="acme-smtp", rate_limit_per_minute=2)
    db.session.commit()
    ids = [accept_mail(app, acme, to=[f"u{i}@example.com"]) for i in range(4)]
    ctx = mail_context(app, policy=FAST, limiter=limiter(**STEADY))
    try:
        drain_with(ctx, until=lambda: all(mail_record(i).status != "Pending" for i in ids))
    finally:
        ctx.pool.close_all()
    rows = [mail_record(i) for i in ids]
    assert Counter((r.status, r.error_code, r.retry_count) for r in rows) == Counter(
        {("Sent", None, 0): 2, ("Retry", "QUOTA_EXCEEDED", 0): 2}
    )
    assert len(smtp.messages) == 2
    (only,) = counters(redis_client)
    assert only.startswith(f"rl:mail:min:{acme}:{server.id}:")


@pytest.mark.parametrize("channel", ["mail", "sms"])
def test_a_platform_configs_budget_is_shared_by_every_tenant(
    app: Flask,
    smtp: ScriptedSmtpServer,
    sms_server: FakeSmsProvider,
    redis_client: redis.Redis,
    channel: str,
) -> None:
    a, b = tenant("acme").id, tenant("globex").id
    if channel == "mail":
        config_id = mail_server(PLATFORM_TENANT_ID, smtp, name="shared", daily_send_limit=3).id
    else:
        config_id = provider(
            PLATFORM_TENANT_ID, "http_json", sms_server, name="shared", daily_send_limit=3
        ).id
    db.session.commit()
    ids = []
    for owner in (a, b, a, b, a, b):
        if channel == "mail":
            ids.append(accept_mail(app, owner))
        else:
            ids.append(accept_sms(app, owner))
    ctx = (mail_context if channel == "mail" else sms_context)(
        app, policy=FAST, limiter=limiter(**STEADY)
    )
    model = MailSendRecord if channel == "mail" else SmsSendRecord
    try:
        drain_with(
            ctx,
            until=lambda: (
                db.session.scalar(
                    select(func.count()).select_from(model).where(model.status == "Pending")
                )
                == 0
            ),
        )
    finally:
        ctx.close()
    db.session.expire_all()
    statuses = Counter(
        db.session.execute(select(model.tenant_id, model.status).where(model.id.in_(ids))).all()
    )
    assert sum(n for (_, s), n in statuses.items() if s == "Sent") == 3
    assert sum(n for (_, s), n in statuses.items() if s == "Retry") == 3
    # One budget, kept under the config's owner (the platform), not under each tenant.
    day = window_numbers(redis_client, 86_400)
    assert counters(redis_client) == {f"rl:{channel}:daily:-1:{config_id}:{day}": 3}


@pytest.mark.process
def test_redis_down_defers_limited_sends_and_unlimited_mail_still_goes(
    app: Flask, smtp: ScriptedSmtpServer, sms_server: FakeSmsProvider, redis_client: redis.Redis
) -> None:
    acme = tenant("acme").id
    mail_server(acme, smtp, name="unlimited")
    limited_mail = mail_server(acme, smtp, name="limited", is_default=False, daily_send_limit=50)
    provider(acme, "http_json", sms_server, rate_limit_per_minute=100)
    db.session.commit()
    free = accept_mail(app, acme)
    held = accept_mail(app, acme, serverId=limited_mail.id)
    texts = [accept_sms(app, acme, content=f"t{i}") for i in range(3)]
    outage = down()
    started = time.monotonic()
    mail_ctx = mail_context(app, policy=FAST, limiter=outage)
    sms_ctx = sms_context(app, policy=FAST, limiter=outage)
    try:
        drain_with(
            mail_ctx,
            until=lambda: (mail_record(held).status, mail_record(free).status) == ("Retry", "Sent"),
        )
        drain_with(sms_ctx, until=lambda: all(sms_record(i).status == "Retry" for i in texts))
    finally:
        mail_ctx.close()
        sms_ctx.close()
    assert time.monotonic() - started < 10
    assert mail_record(free).status == "Sent"
    assert len(smtp.messages) == 1
    deferred: list[MailSendRecord | SmsSendRecord] = [mail_record(held)]
    deferred += [sms_record(i) for i in texts]
    for row in deferred:
        assert (row.status, row.error_code, row.retry_count) == (
            "Retry",
            "RATE_LIMIT_UNAVAILABLE",
            0,
        )
        assert row.next_retry_at is not None
    assert sms_server.requests == []  # never sent unchecked
    # Not lost: Redis is back, the same records go out, once each.
    for model, rids in ((MailSendRecord, [held]), (SmsSendRecord, texts)):
        db.session.execute(update(model).where(model.id.in_(rids)).values(next_retry_at=func.now()))
    db.session.commit()
    back = limiter(**STEADY)
    mail_ctx = mail_context(app, policy=FAST, limiter=back)
    sms_ctx = sms_context(app, policy=FAST, limiter=back)
    try:
        drain_with(mail_ctx)
        drain_with(sms_ctx)
    finally:
        mail_ctx.close()
        sms_ctx.close()
    assert mail_record(held).status == "Sent"
    assert [sms_record(i).status for i in texts] == ["Sent"] * 3
    assert len(smtp.messages) == 2
    assert len(sms_server.requests) == 3


# --- two worker processes -------------------------------------------------------------------


@dataclass
class Worker:
    name: str
    process: subprocess.Popen[bytes]
    stdout: Path
    stderr: Path

    def log_lines(self) -> list[dict[str, Any]]:
        lines = []
        for raw in self.stderr.read_text(errors="replace").splitlines():
            try:
                entry = json.loads(raw)
            except ValueError:
                continue
            if isinstance(entry, dict):
                lines.append(entry)
        return lines

    def ready(self) -> bool:
        return "worker: delivering" in self.stdout.read_text(errors="replace")


def start_workers(tmp_path: Path, secret_key: str, n: int = 2) -> list[Worker]:
    (tmp_path / "instance").mkdir(exist_ok=True)
    # ROUTE_WAIT_S: a worker waits its turn on the one test server rather than defer its
    # record as SERVER_BUSY, which a loaded run once did after 1 s: every record here ends Sent
    # or over its quota, nothing else (tests/process/test_concurrency.py's burst does the same).
    env = worker_env(
        tmp_path / "instance",
        secret_key,
        MAIL_SEND_CONCURRENCY="4",
        SMS_SEND_CONCURRENCY="10",
        ROUTE_WAIT_S="30",
    )
    workers = []
    for i in range(n):
        out, err = tmp_path / f"worker-{i}.stdout", tmp_path / f"worker-{i}.stderr"
        with out.open("w") as out_file, err.open("w") as err_file:
            process = subprocess.Popen(
                [sys.executable, "worker.py"],
                cwd=ROOT,
                env=env,
                stdout=out_file,
                stderr=err_file,
                stdin=subprocess.DEVNULL,
                preexec_fn=die_with_parent,
            )
        workers.append(Worker(f"worker-{i}", process, out, err))
    return workers


def stop_workers(workers: list[Worker]) -> dict[str, int | None]:
    for w in workers:
        if w.process.poll() is None:
            w.process.send_signal(signal.SIGTERM)
    codes: dict[str, int | None] = {}
    for w in workers:
        try:
            codes[w.name] = w.process.wait(30)
        except subprocess.TimeoutExpired:
            w.process.kill()
            codes[w.name] = None
    return codes


def wait_for(predicate: Any, timeout_s: float, what: str, workers: list[Worker]) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        dead = {w.name: w.process.returncode for w in workers if w.process.poll() is not None}
        assert not dead, f"worker(s) exited early: {dead}"
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout_s}s: {what}")


@pytest.mark.process
@pytest.mark.slow
def test_two_worker_processes_share_one_budget_exactly(
    app: Flask,
    smtp: ScriptedSmtpServer,
    redis_client: redis.Redis,
    tmp_path: Path,
) -> None:
    texts_total, texts_limit, mails_total, mails_limit = 300, 37, 120, 23
    acme = tenant("acme").id
    with FakeSmsProvider(delay_s=0.005) as sms_server:
        sms_config = provider(acme, "http_json", sms_server, daily_send_limit=texts_limit)
        mail_config = mail_server(acme, smtp, name="acme-smtp", daily_send_limit=mails_limit)
        db.session.commit()
        workers = start_workers(tmp_path, app.config["SETTINGS"].secret_key)
        try:
            wait_for(lambda: all(w.ready() for w in workers), 30, "workers ready", workers)
            settings = app.config["SETTINGS"]
            # Accepted once both are listening: one NOTIFY per batch wakes both at once.
            with tenant_context(acme):
                acceptance.send_sms_batch(
                    db.session,
                    [{"phoneNumber": UK, "content": f"t{i}"} for i in range(texts_total)],
                    settings=settings,
                )
                acceptance.send_mail_batch(
                    db.session,
                    [
                        {"to": [f"u{i}@example.com"], "subject": "s", "text": "t"}
                        for i in range(mails_total)
                    ],
                    settings=settings,
                )
            db.session.commit()

            def settled() -> bool:
                waiting = 0
                for model in (SmsSendRecord, MailSendRecord):
                    waiting += (
                        db.session.scalar(
                            select(func.count())
                            .select_from(model)
                            .where(model.status.in_(["Pending", "Sending"]))
                        )
                        or 0
                    )
                db.session.rollback()
                return waiting == 0

            wait_for(settled, 60, "every record sent or deferred", workers)
        finally:
            codes = stop_workers(workers)
        assert codes == {w.name: 0 for w in workers}, codes

        for model, total, limit in (
            (SmsSendRecord, texts_total, texts_limit),
            (MailSendRecord, mails_total, mails_limit),
        ):
            rows = db.session.execute(
                select(model.status, model.error_code, model.retry_count)
            ).all()
            assert Counter(tuple(r) for r in rows) == Counter(
                {("Sent", None, 0): limit, ("Retry", "QUOTA_EXCEEDED", 0): total - limit}
            )
        assert len(sms_server.requests) == texts_limit
        assert len(smtp.messages) == mails_limit
        day = window_numbers(redis_client, 86_400)
        assert counters(redis_client) == {
            f"rl:sms:daily:{acme}:{sms_config.id}:{day}": texts_limit,
            f"rl:mail:daily:{acme}:{mail_config.id}:{day}": mails_limit,
        }
        handled = {
            w.name: {e["record_id"] for e in w.log_lines() if "record_id" in e} for w in workers
        }
        sizes = {name: len(ids) for name, ids in handled.items()}
        assert all(sizes.values()), f"both processes must take part: {sizes}"
        errors = [e for w in workers for e in w.log_lines() if e.get("level") == "ERROR"]
        assert not errors, errors[:5]
        print(
            f"\n[rate limits, two workers] SMS {texts_limit}/{texts_total} sent, mail "
            f"{mails_limit}/{mails_total} sent, the rest deferred with retry_count 0; "
            f"records handled per process: {sizes}"
        )
