"""The delivery process: ``python worker.py``.

Builds the app, starts a delivery pool per channel, registers the periodic chores with
rq-scheduler and supervises, as child processes, the rq-scheduler daemon and an rq worker that
runs them. With ``DELIVERY_PROCESSES`` N > 1 (PostgreSQL), the send workers are shared out
among this process and N - 1 delivery children (``portal.delivery.process``), supervised the
same way. Shutdown has two stages: the first SIGTERM/SIGINT claims nothing more and waits up
to SHUTDOWN_GRACE_S for sends in flight (what is left stays Sending for the stuck-send sweep),
then stops the children and exits 0; a second signal exits at once.
"""

from __future__ import annotations

import os
import tempfile

# Prometheus multiprocess mode, set before any metric exists: the chore children (the sweep)
# count into the same folder and this process's /metrics adds every process up.
_OWN_METRICS_DIR = "PROMETHEUS_MULTIPROC_DIR" not in os.environ
os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", tempfile.mkdtemp(prefix="postroom-metrics-"))

import logging
import shutil
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from portal import create_app
from portal.config import Settings
from portal.delivery.children import Child, Supervisor, chore_children
from portal.delivery.chores import ensure_schedules
from portal.delivery.process import split
from portal.delivery.service import DeliveryService
from portal.extensions import db
from portal.logs import configure_logging
from portal.redis_store import connect

log = logging.getLogger("portal.worker")


def keep_schedules(settings: Settings, stopping: threading.Event) -> None:
    """Register the chores now and re-check them every SCHEDULE_CHECK_S: Redis may have
    come back empty."""
    wait = 0.0
    while not stopping.wait(wait):
        try:
            done = ensure_schedules(connect(settings.redis_url), settings)
            if done:
                log.info("chore schedules updated", extra={"schedules": done})
            wait = settings.schedule_check_s
        except Exception as exc:  # Redis away: delivery goes on; try again soon
            log.warning("cannot register the chore schedules (%s); retrying", exc)
            wait = min(settings.schedule_check_s, max(1.0, wait * 2))


def delivery_shares(settings: Settings, dialect: str) -> tuple[Settings, list[Child]]:
    """This process's settings (its share of the send workers) and the delivery children
    that run the rest (``DELIVERY_PROCESSES``)."""
    processes = settings.delivery_processes
    if processes > 1 and dialect != "postgresql":
        log.warning("DELIVERY_PROCESSES=%d needs PostgreSQL; delivering in one process", processes)
        processes = 1
    parts = split(settings.mail_send_concurrency, settings.sms_send_concurrency, processes)
    if len(parts) <= 1:
        return settings, []
    (mail, sms), rest = parts[0], parts[1:]
    children = [
        Child(
            f"delivery-{i}",
            [sys.executable, "-m", "portal.delivery.process", "--mail", str(m), "--sms", str(s)],
            stop_timeout_s=settings.shutdown_grace_s + 5.0,
        )
        for i, (m, s) in enumerate(rest, start=1)
    ]
    log.info("delivering in %d processes", len(parts), extra={"shares": [list(p) for p in parts]})
    return settings.replace(mail_send_concurrency=mail, sms_send_concurrency=sms), children


def _say_unlocked(level: int, message: str) -> None:
    """Write one log line straight to stderr from a signal handler: a handler may interrupt
    the main thread inside logging or a stream write, and taking their locks again there can
    block or raise, so the exit that follows would never come."""
    record = log.makeRecord(log.name, level, __file__, 0, message, (), None)
    handlers = logging.getLogger().handlers
    line = handlers[0].format(record) if handlers else message
    os.write(2, (line + "\n").encode("utf-8", "replace"))


def main() -> int:
    configure_logging(os.environ.get("LOG_LEVEL", "INFO"))
    # The handlers come first: a signal during start-up (building the app can take a second)
    # must still end in the orderly stop below, not in the default action's abrupt death.
    stopping = threading.Event()
    # Each pool's "claim nothing more", set by the handler itself before it says so: waking the
    # main thread to stop the service takes a moment on a loaded machine, and a record accepted
    # after the line below must not be claimed in it. It returns once the claims under way are
    # over (a poll's claim that began just before the signal would otherwise take such a record).
    claim_stops: list[Callable[[], None]] = []

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        if stopping.is_set():
            _say_unlocked(logging.WARNING, "second signal: exiting at once")
            os._exit(1)
        for stop_claiming in claim_stops:
            stop_claiming()
        log.info("signal %s: claiming nothing more, finishing sends in flight", signum)
        stopping.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    app = create_app(web=False)
    settings: Settings = app.config["SETTINGS"]
    with app.app_context():
        engine = db.engine
    redis_url = settings.redis_url
    if redis_url is None:  # embedded Redis: the children need its socket
        redis_url = f"unix://{connect(None).socket_file}"  # type: ignore[attr-defined]
    env = dict(os.environ, REDIS_URL=redis_url)
    mine, others = delivery_shares(settings, engine.dialect.name)
    supervisor = Supervisor(
        chore_children(redis_url, settings.sweep_interval_s) + others,
        env,
        Path(__file__).parent,
    )
    service = DeliveryService(engine, mine)
    claim_stops.extend(pool.stop for pool in service.pools.values())
    if settings.worker_metrics_port:
        from portal.metrics import start_worker_metrics

        start_worker_metrics(settings.worker_metrics_port, engine)
    service.start()
    supervisor.start()
    threading.Thread(
        target=keep_schedules, args=(settings, stopping), name="schedules", daemon=True
    ).start()
    print(f"worker: delivering (pid {os.getpid()})", flush=True)
    stopping.wait()
    service.stop()
    if others:  # the delivery children finish their sends in flight while this process does
        supervisor.stop()
        service.wait(settings.shutdown_grace_s)
    else:
        service.wait(settings.shutdown_grace_s)
        supervisor.stop()
    engine.dispose()
    if _OWN_METRICS_DIR:
        shutil.rmtree(os.environ["PROMETHEUS_MULTIPROC_DIR"], ignore_errors=True)
    log.info("worker stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
