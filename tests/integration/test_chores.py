"""Chores on rq-scheduler against real Redis: the sweep's schedule is declared under a fixed id,
so any number of registrations (threads, processes, restarts) leave exactly one; and the real
``rqscheduler`` + ``rq worker`` children, supervised, run the sweep on time."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import redis
from flask import Flask
from rq import Queue
from rq_scheduler import Scheduler
from sqlalchemy import select

from portal.config import Settings
from portal.delivery.children import Supervisor, chore_children
from portal.delivery.chores import PREFIX, QUEUE, ChoreWorker, ensure_schedules, schedules
from portal.extensions import db
from portal.models import MailSendRecord
from tests.conftest import TEST_DATABASE_URL, TEST_REDIS_URL, settings_for_tests
from tests.support.delivery import tenant
from tests.support.workers import ROOT, accept_abandoned, alive, wait_for, worker_env

SWEEP_ID = f"{PREFIX}sweep-stuck-sends"
SWEEP_FUNC = "portal.delivery.chores.sweep_job"
FOREIGN_ID = "reports-nightly"  # someone else's job on the same Redis
RETIRED_ID = f"{PREFIX}retired-chore"  # ours once, no longer declared


def short_settings(**changes: float) -> Settings:
    return settings_for_tests(TEST_DATABASE_URL, **({"sweep_interval_s": 1.0} | changes))


def ours(**changes: float) -> dict[str, int]:
    """Every chore the product declares (the sweep among them) -> its interval."""
    return {s.id: s.interval_s for s in schedules(short_settings(**changes))}


def scheduler(client: redis.Redis) -> Scheduler:
    return Scheduler(queue_name=QUEUE, connection=client)


def scheduled(client: redis.Redis) -> dict[str, int | None]:
    """Every scheduled job id -> its interval; also checks each id has its job hash."""
    ids = [m.decode() for m in client.zrange(Scheduler.scheduled_jobs_key, 0, -1)]
    jobs = {job.id: job.meta.get("interval") for job in scheduler(client).get_jobs()}
    assert sorted(jobs) == sorted(ids), f"scheduled ids without a job: {set(ids) - set(jobs)}"
    return jobs


def foreign_job(client: redis.Redis) -> None:
    scheduler(client).schedule(
        scheduled_time=datetime.now(UTC) + timedelta(hours=1),
        func="os.getcwd",
        interval=86400,
        id=FOREIGN_ID,
        queue_name="reports",
    )


# --- registration ----------------------------------------------------------------------------


def test_the_sweep_is_scheduled_under_its_fixed_id(redis_client: redis.Redis) -> None:
    done = ensure_schedules(redis_client, short_settings())
    assert done == dict.fromkeys(ours(), "added")
    assert SWEEP_ID in done
    (job,) = [j for j in scheduler(redis_client).get_jobs() if j.id == SWEEP_ID]
    assert (job.id, job.func_name, job.origin) == (SWEEP_ID, SWEEP_FUNC, QUEUE)
    assert job.meta["interval"] == 1
    when = redis_client.zscore(Scheduler.scheduled_jobs_key, SWEEP_ID)
    assert when is not None
    assert when <= time.time() + 1  # due at once: the first sweep runs on the next tick

    assert ensure_schedules(redis_client, short_settings()) == {}
    assert ensure_schedules(redis_client, short_settings()) == {}
    assert scheduled(redis_client) == ours()
    assert scheduled(redis_client)[SWEEP_ID] == 1


def register_at_once(n: int, interval: float) -> tuple[list[dict[str, str]], list[BaseException]]:
    """``ensure_schedules`` from ``n`` threads released together, one connection each."""
    barrier = threading.Barrier(n)
    results: list[dict[str, str]] = []
    errors: list[BaseException] = []

    def register() -> None:
        try:
            client = redis.Redis.from_url(TEST_REDIS_URL)
            barrier.wait(5)
            results.append(ensure_schedules(client, short_settings(sweep_interval_s=interval)))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=register) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert len(results) + len(errors) == n
    return results, errors


def test_registration_from_four_threads_at_once_leaves_one(redis_client: redis.Redis) -> None:
    fresh, errors = register_at_once(4, 1.0)
    assert not errors, errors
    assert any(r.get(SWEEP_ID) == "added" for r in fresh), fresh
    assert scheduled(redis_client) == ours()

    again, errors = register_at_once(4, 1.0)
    assert not errors, errors
    assert again == [{}] * 4  # there already: nothing to do
    assert scheduled(redis_client) == ours()

    # A new interval, four workers starting together: whatever the interleaving, one schedule
    # with the new interval; none of the racing registrations raises.
    stale, errors = register_at_once(4, 2.0)
    assert errors == []
    assert any(r.get(SWEEP_ID) == "replaced" for r in stale), stale
    assert scheduled(redis_client) == ours(sweep_interval_s=2.0)
    assert scheduled(redis_client)[SWEEP_ID] == 2


def test_registration_that_lost_the_race_to_remove_a_stale_schedule_still_succeeds(
    redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race made deterministic: worker B reads the stale schedule, worker A removes it,
    then B carries on with what it read."""
    ensure_schedules(redis_client, short_settings(sweep_interval_s=60.0))
    read_by_b = list(scheduler(redis_client).get_jobs())
    (stale,) = [j for j in read_by_b if j.id == SWEEP_ID]
    scheduler(redis_client).cancel(stale)  # A: remove the stale one (A's add comes later)
    stale.delete()
    monkeypatch.setattr(Scheduler, "get_jobs", lambda self, *a, **k: iter(read_by_b))
    done = ensure_schedules(redis_client, short_settings())
    monkeypatch.undo()
    assert done.get(SWEEP_ID) in ("added", "replaced")
    assert scheduled(redis_client)[SWEEP_ID] == 1


@pytest.mark.process
def test_registration_from_two_processes_at_once_leaves_one(
    redis_client: redis.Redis, tmp_path: Path
) -> None:
    foreign_job(redis_client)
    go = tmp_path / "go"
    # Both import first and say so; then both register the moment the go file appears.
    program = (
        "import json, os, sys, time\n"
        "import redis\n"
        "from portal.delivery.chores import ensure_schedules\n"
        "from tests.conftest import TEST_DATABASE_URL, settings_for_tests\n"
        "settings = settings_for_tests(TEST_DATABASE_URL, sweep_interval_s=1.0)\n"
        "client = redis.Redis.from_url(sys.argv[1])\n"
        "client.ping()\n"
        "print('ready', flush=True)\n"
        "deadline = time.monotonic() + 30\n"
        "while not os.path.exists(sys.argv[2]) and time.monotonic() < deadline:\n"
        "    time.sleep(0.002)\n"
        "print(json.dumps(ensure_schedules(client, settings)), flush=True)\n"
    )
    env = worker_env(tmp_path, "unused")
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", program, TEST_REDIS_URL, str(go)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        for process in processes:
            assert process.stdout is not None
            assert process.stdout.readline().strip() == "ready", process.stderr
        go.touch()
        outputs = []
        for process in processes:
            out, err = process.communicate(timeout=30)
            assert process.returncode == 0, err
            outputs.append(json.loads(out))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait(5)
    assert any(o.get(SWEEP_ID) == "added" for o in outputs), outputs
    assert scheduled(redis_client) == ours() | {FOREIGN_ID: 86400}


def test_stale_schedules_of_ours_are_replaced_and_others_left_alone(
    redis_client: redis.Redis,
) -> None:
    sched = scheduler(redis_client)
    foreign_job(redis_client)
    # Ours, from an older release: the sweep with another interval, and a chore since dropped.
    ensure_schedules(redis_client, short_settings(sweep_interval_s=60.0))
    sched.schedule(
        scheduled_time=datetime.now(UTC),
        func="portal.delivery.chores.sweep_job",
        interval=300,
        id=RETIRED_ID,
        queue_name=QUEUE,
        meta={"interval": 300},
    )
    assert scheduled(redis_client) == ours(sweep_interval_s=60.0) | {
        RETIRED_ID: 300,
        FOREIGN_ID: 86400,
    }

    done = ensure_schedules(redis_client, short_settings())
    assert done == {SWEEP_ID: "replaced", RETIRED_ID: "removed"}
    assert scheduled(redis_client) == ours() | {FOREIGN_ID: 86400}
    assert not redis_client.exists(f"rq:job:{RETIRED_ID}")
    assert redis_client.exists(f"rq:job:{FOREIGN_ID}")

    # Same id and interval but another function (a renamed job): replaced too.
    sched.cancel(SWEEP_ID)
    sched.schedule(
        scheduled_time=datetime.now(UTC),
        func="os.getcwd",
        interval=1,
        id=SWEEP_ID,
        queue_name=QUEUE,
        meta={"interval": 1},
    )
    assert ensure_schedules(redis_client, short_settings()) == {SWEEP_ID: "replaced"}
    (job,) = [j for j in sched.get_jobs() if j.id == SWEEP_ID]
    assert job.func_name == SWEEP_FUNC
    assert scheduled(redis_client) == ours() | {FOREIGN_ID: 86400}


# --- the real children -----------------------------------------------------------------------


def chores_env(tmp_path: Path, secret_key: str) -> dict[str, str]:
    instance = tmp_path / "instance"
    instance.mkdir(exist_ok=True)
    return worker_env(
        instance,
        secret_key,
        SWEEP_INTERVAL_S="1",
        STUCK_SEND_THRESHOLD_S="1",
        LOG_LEVEL="INFO",
    )


@pytest.fixture
def supervisor(app: Flask, redis_client: redis.Redis, tmp_path: Path) -> Iterator[Supervisor]:
    env = chores_env(tmp_path, app.config["SETTINGS"].secret_key)
    sup = Supervisor(chore_children(TEST_REDIS_URL, 1.0), env, ROOT)
    sup.start()
    try:
        yield sup
    finally:
        running = [c.process.pid for c in sup.children if c.process is not None]
        sup.stop()
        for pid in running:  # never leak one, whatever stop() did
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def status(record_id: int) -> tuple[str, str | None, int]:
    row = db.session.execute(
        select(MailSendRecord.status, MailSendRecord.error_code, MailSendRecord.retry_count).where(
            MailSendRecord.id == record_id
        )
    ).one()
    db.session.rollback()
    return row[0], row[1], row[2]


def wait_swept(record_id: int, timeout_s: float) -> float:
    started = time.monotonic()
    try:
        wait_for(
            lambda: status(record_id) == ("Retry", "ZOMBIE_RECOVERED", 1),
            timeout_s,
            f"record {record_id} swept",
            poll_s=0.1,
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}; {chores_seen()}") from exc
    return time.monotonic() - started


def chores_seen() -> str:
    """What Redis holds for the chores, for a failure's message: each schedule's next run
    (seconds from now: a periodic job missing here was lost, e.g. by a scheduler killed
    between taking it off the schedule and putting it back), the scheduler's lock and the
    jobs waiting in the chore queue."""
    client = redis.Redis.from_url(TEST_REDIS_URL)
    try:
        now = time.time()
        runs = client.zrange(Scheduler.scheduled_jobs_key, 0, -1, withscores=True)
        nexts = {job.decode(): round(at - now, 1) for job, at in runs}
        lock = client.ttl(Scheduler.scheduler_lock_key)
        return f"next runs (s): {nexts}; scheduler lock ttl: {lock} s; queued: " + str(
            Queue(QUEUE, connection=client).count
        )
    finally:
        client.close()


def child(sup: Supervisor, name: str) -> subprocess.Popen[bytes]:
    (found,) = [c for c in sup.children if c.name == name]
    assert found.process is not None, f"{name} is not running"
    return found.process


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.timeout(90)
def test_scheduled_sweep_runs_in_the_supervised_children(
    app: Flask, redis_client: redis.Redis, supervisor: Supervisor
) -> None:
    acme = tenant("acme").id
    db.session.commit()
    ensure_schedules(redis_client, short_settings())
    stuck = accept_abandoned(app, acme)
    took = wait_swept(stuck, 20.0)
    print(f"\nabandoned claim swept {took:.1f} s after it was made (threshold 1 s, interval 1 s)")

    # The scheduler keeps the one schedule each: no duplicate after it ran a few times.
    assert scheduled(redis_client) == ours()

    # A child that dies is started again, and the chores go on.
    old = child(supervisor, "rq-scheduler")
    old.send_signal(signal.SIGKILL)
    assert old.wait(5) == -signal.SIGKILL
    wait_for(
        lambda: child_alive(supervisor, "rq-scheduler", other_than=old.pid),
        10.0,
        "rq-scheduler restarted",
    )
    again = accept_abandoned(app, acme, to=["again@example.com"])
    # The new scheduler first waits out the killed one's lock (rq-scheduler sets it for the
    # interval + 10 s and cannot tell whose it is), then the sweep's next run: up to ~13 s.
    wait_swept(again, 40.0)

    processes = {c.name: c.process for c in supervisor.children if c.process is not None}
    supervisor.stop()
    for name, process in processes.items():
        assert process.poll() is not None, f"{name} still running after stop()"
        assert not alive(process.pid)


def child_alive(sup: Supervisor, name: str, other_than: int) -> bool:
    (found,) = [c for c in sup.children if c.name == name]
    process = found.process
    return process is not None and process.pid != other_than and process.poll() is None


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_killed_rq_worker_is_restarted_and_the_sweep_goes_on(
    app: Flask, redis_client: redis.Redis, supervisor: Supervisor
) -> None:
    acme = tenant("acme").id
    db.session.commit()
    ensure_schedules(redis_client, short_settings())
    # The supervisor's rq worker and scheduler start (each imports the app) before the first
    # sweep: a few seconds alone, over 20 s beside the whole suite on 2 cores.
    wait_swept(accept_abandoned(app, acme), 60.0)

    old = child(supervisor, "rq-worker")
    old.send_signal(signal.SIGKILL)
    assert old.wait(5) == -signal.SIGKILL
    stuck = accept_abandoned(app, acme, to=["after-kill@example.com"])
    # Restarted after a 1 s pause, then the sweep's next run: a few seconds alone, but a busy
    # machine (the whole suite in parallel) has taken over 10 s; this waits for the event.
    wait_swept(stuck, 60.0)
    assert child_alive(supervisor, "rq-worker", other_than=old.pid)


def test_a_chore_worker_stops_its_command_thread_within_seconds(redis_client: redis.Redis) -> None:
    """rq unsubscribes, then waits for its command channel's thread. The thread may read the
    unsubscribe reply first and then wait its whole sleep for a subscription that never
    comes (redis-py 8): with rq's own minute, a stopped or orphaned chore child lingered up
    to 60 s. Here the thread has already read the reply when the stop begins."""
    worker = ChoreWorker([Queue(QUEUE, connection=redis_client)], connection=redis_client)
    worker.subscribe()
    wait_for(lambda: worker.pubsub.subscribed, 5.0, "subscribed")
    worker.pubsub.unsubscribe()
    wait_for(lambda: not worker.pubsub.subscribed, 5.0, "the thread read the unsubscribe reply")
    started = time.monotonic()
    worker.unsubscribe()
    assert time.monotonic() - started < 3.0
    assert not worker.pubsub_thread.is_alive()
