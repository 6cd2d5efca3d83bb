"""The status-callback pool: CALLBACK_CONCURRENCY threads that claim due
``callback_delivery`` rows and post them.

Each thread claims one delivery (``callbacks.claim``: at most two in flight per endpoint,
endpoints in turn after this pool's last one), posts it with its own HTTP client and writes
the outcome. With nothing due, one idle thread polls every ``POLL_INTERVAL_S`` and the others
wait until it finds work (a pool with no callbacks to post asks the database twice a second,
not twice per thread: idle worker processes cost CPU on both sides of the connection). Stopping
claims nothing more; a post in flight finishes (10 s at most).
"""

from __future__ import annotations

import logging
import threading
import time

from sqlalchemy import Engine

from portal.config import Settings
from portal.messaging.after_send import callbacks

log = logging.getLogger("portal.callbacks")

# An idle thread that is not the one polling asks again after this many poll intervals even
# if no thread found work (the polling one may be busy posting meanwhile).
IDLE_WAIT_POLLS = 10


class CallbackPool:
    def __init__(self, engine: Engine, settings: Settings):
        self.engine = engine
        self.settings = settings
        self.stopping = threading.Event()
        self._cursor = 0
        self._lock = threading.Lock()
        # The idle threads: one polls (``_polling``), the others wait on ``_found`` until it
        # finds work (or IDLE_WAIT_POLLS poll intervals, should that thread be posting).
        self._found = threading.Condition(self._lock)
        self._polling = False
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
        with self._found:
            self._found.notify_all()

    def join(self, deadline: float) -> bool:
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)

    def _next_cursor(self, endpoint_id: int | None = None) -> int:
        with self._lock:
            if endpoint_id is not None:
                self._cursor = endpoint_id
            return self._cursor

    def _idle(self, polling: bool) -> bool:
        """Nothing was due. The thread that is ``polling`` (or the first idle one, which then
        is) waits a poll interval and asks again; the others wait until a thread finds work.
        Returns whether this thread is the one polling."""
        with self._found:
            if self.stopping.is_set():  # stop's notify may have come before this wait
                return polling
            if not polling and self._polling:
                self._found.wait(self.settings.poll_interval_s * IDLE_WAIT_POLLS)
                return False
            self._polling = True
        self.stopping.wait(self.settings.poll_interval_s)
        return True

    def _work(self) -> None:
        client = callbacks.new_client()
        wait = 0.0
        polling = False  # this thread is the idle one that polls
        try:
            while not self.stopping.wait(wait):
                wait = 0.0
                try:
                    claimed = callbacks.claim(self.engine, self._next_cursor())
                except Exception as exc:  # the database is away: try again later
                    log.warning("cannot claim callbacks: %s", exc)
                    wait = max(1.0, self.settings.poll_interval_s)
                    continue
                if claimed is None:
                    polling = self._idle(polling)
                    continue
                with self._found:
                    if polling:
                        self._polling = polling = False
                    self._found.notify_all()  # there may be more: every idle thread asks
                self._next_cursor(claimed.endpoint_id)
                try:
                    callbacks.attempt(
                        self.engine, self.settings, client, claimed, resolver=self.resolver
                    )
                except Exception:  # the lease runs out and the delivery is due again
                    log.exception("callback attempt failed", extra={"delivery_id": claimed.id})
        finally:
            client.close()
