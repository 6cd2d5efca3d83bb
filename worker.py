"""The delivery process: ``python worker.py``.

Builds the app, starts a delivery pool per channel, and shuts down in two stages: the first
SIGTERM/SIGINT claims nothing more and waits up to SHUTDOWN_GRACE_S for sends in flight
(what is left stays Sending for the stuck-send sweep); a second signal exits at once.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from types import FrameType

from portal import create_app
from portal.config import Settings
from portal.delivery.service import DeliveryService
from portal.extensions import db
from portal.logs import configure_logging

log = logging.getLogger("portal.worker")


def main() -> int:
    configure_logging(os.environ.get("LOG_LEVEL", "INFO"))
    app = create_app()
    settings: Settings = app.config["SETTINGS"]
    with app.app_context():
        engine = db.engine
    service = DeliveryService(engine, settings)
    stopping = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        if stopping.is_set():
            log.warning("second signal: exiting at once")
            os._exit(1)
        log.info("signal %s: claiming nothing more, finishing sends in flight", signum)
        stopping.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if settings.worker_metrics_port:
        from prometheus_client import start_http_server

        start_http_server(settings.worker_metrics_port, addr="127.0.0.1")
    service.start()
    print(f"worker: delivering (pid {os.getpid()})", flush=True)
    stopping.wait()
    service.stop()
    service.wait(settings.shutdown_grace_s)
    engine.dispose()
    log.info("worker stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
