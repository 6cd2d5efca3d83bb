"""The status-callback pool: CALLBACK_CONCURRENCY threads that claim due
``callback_delivery`` rows and post them.

Each thread claims one delivery (``callbacks.claim``: at most two in flight per endpoint,
endpoints in turn after this pool's last one), posts it with its own HTTP client and writes
the outcome; with nothing due it waits ``POLL_INTERVAL_S`` or the stop event. Stopping claims
nothing more; a post in flight finishes (10 s at most).
"""

from __future__ import annotations

import logging
import threading
import time

from sqlalchemy import Engine

from portal.config import Settings
from portal.messaging.after_send import callbacks

log = logging.getLogger("portal.callbacks")


class CallbackPool:
    def __init__(self, engine: Engine, settings: Settings):
        self.engine = engine
        self.settings = settings
        self.stopping = threading.Event()
        self._cursor = 0
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self.resolver: callbacks.Resolver = callbacks.system_resolver

    @property
    def concurrency(self) -> int:
        return self.settings.callback_concurrency

    def start(self) -> None:
        for i in range(self.concurrency):
            thread = threading.Thread(target=self._work, name=f"callback-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self.stopping.set()

    def join(self, deadline: float) -> bool:
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)

    def _next_cursor(self, endpoint_id: int | None = None) -> int:
        with self._lock:
            if endpoint_id is not None:
                self._cursor = endpoint_id
            return self._cursor

    def _work(self) -> None:
        client = callbacks.new_client()
        wait = 0.0
        try:
            while not self.stopping.wait(wait):
                try:
                    claimed = callbacks.claim(self.engine, self._next_cursor())
                except Exception as exc:  # the database is away: try again later
                    log.warning("cannot claim callbacks: %s", exc)
                    wait = max(1.0, self.settings.poll_interval_s)
                    continue
                if claimed is None:
                    wait = self.settings.poll_interval_s
                    continue
                self._next_cursor(claimed.endpoint_id)
                wait = 0.0
                try:
                    callbacks.attempt(
                        self.engine, self.settings, client, claimed, resolver=self.resolver
                    )
                except Exception:  # the lease runs out and the delivery is due again
                    log.exception("callback attempt failed", extra={"delivery_id": claimed.id})
        finally:
            client.close()
