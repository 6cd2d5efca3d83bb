"""Delivery in several processes (``DELIVERY_PROCESSES``): the GIL holds one process's send
workers to about one core, so ``worker.py`` can run its workers in N processes, itself one of
them. This module is how it starts the others: ``python -m portal.delivery.process --mail M
--sms S``, a child the worker's supervisor watches (restarted if it dies; SIGTERM at the
worker's shutdown, or when the worker itself dies). One SIGTERM finishes the sends in flight
and logs "delivery process stopped"; a second exits at once.

A child runs only send workers: the chores (rq-scheduler, the rq worker), the status-callback
pool and the metrics endpoint stay with the worker, which serves every process's metrics from
the shared ``PROMETHEUS_MULTIPROC_DIR``. Claims, quotas, rate limits, breakers and the fair
order are in PostgreSQL and Redis, shared by processes exactly as by two ``worker.py``; the
cap of pool size - 1 workers in flight to one server or provider is per process.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from types import FrameType

log = logging.getLogger("portal.worker")


def shares(total: int, processes: int) -> list[int]:
    """``total`` workers shared out among ``processes`` (the first ones take the remainder)."""
    return [total // processes + (1 if i < total % processes else 0) for i in range(processes)]


def split(mail: int, sms: int, processes: int) -> list[tuple[int, int]]:
    """Each process's (mail, SMS) workers; a process that would get none of either is left
    out, so there are never more processes than workers."""
    return [
        (m, s)
        for m, s in zip(shares(mail, processes), shares(sms, processes), strict=True)
        if m or s
    ]


def main(argv: list[str] | None = None) -> int:
    # The handlers first: a SIGTERM while the app is built (a restarted child may get the
    # worker's stop then) ends in the orderly stop below, having claimed nothing.
    stopping = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        if stopping.is_set():
            os._exit(1)  # a second signal: at once (what is in flight stays Sending)
        stopping.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    from portal import create_app
    from portal.config import Settings
    from portal.delivery.service import DeliveryService
    from portal.extensions import db
    from portal.logs import configure_logging

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mail", type=int, required=True, help="mail send workers")
    parser.add_argument("--sms", type=int, required=True, help="SMS send workers")
    args = parser.parse_args(argv)
    configure_logging(os.environ.get("LOG_LEVEL", "INFO"))
    settings = Settings.from_env().replace(
        mail_send_concurrency=args.mail,
        sms_send_concurrency=args.sms,
        delivery_processes=1,
        callback_concurrency=0,
        worker_metrics_port=0,
    )
    app = create_app(settings, web=False)
    with app.app_context():
        engine = db.engine
    service = DeliveryService(engine, settings)
    if not stopping.is_set():
        service.start()
        log.info(
            "delivery process started",
            extra={"pid": os.getpid(), "mail_workers": args.mail, "sms_workers": args.sms},
        )
        stopping.wait()
        service.stop()
        service.wait(settings.shutdown_grace_s)
    engine.dispose()
    log.info("delivery process stopped", extra={"pid": os.getpid()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
