"""LISTEN/NOTIFY on PostgreSQL: acceptance NOTIFYs at commit, and idle workers wake at once.

Polling stays the fallback: when the listening connection drops, the pools still poll every
``POLL_INTERVAL_S`` while this thread reconnects.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping

import psycopg
from sqlalchemy import Engine, make_url

from portal.messaging.records.acceptance import NOTIFY_CHANNEL

log = logging.getLogger("portal.delivery")


def _conninfo(engine: Engine) -> str:
    url = engine.url.set(drivername="postgresql")
    return url.render_as_string(hide_password=False)


class Listener:
    """A thread holding one LISTEN connection that sets the channel's wake event."""

    def __init__(
        self, engine: Engine, wake: Mapping[str, threading.Event], direct_url: str | None = None
    ):
        # LISTEN needs a session of its own: behind a transaction-mode pooler it goes to
        # DATABASE_DIRECT_URL, the database itself.
        self.conninfo = (
            _conninfo(engine)
            if direct_url is None
            else make_url(direct_url).set(drivername="postgresql").render_as_string(False)
        )
        self.wake = {NOTIFY_CHANNEL[name]: event for name, event in wake.items()}
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="listen-notify", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()

    def _run(self) -> None:
        backoff = 0.5
        while not self.stopping.is_set():
            try:
                with psycopg.connect(self.conninfo, autocommit=True, connect_timeout=5) as conn:
                    for channel in self.wake:
                        conn.execute(f"LISTEN {channel}")
                    backoff = 0.5
                    # Everything that became due while we were away is found by the poll.
                    for event in self.wake.values():
                        event.set()
                    while not self.stopping.is_set():
                        for note in conn.notifies(timeout=1.0):
                            woken = self.wake.get(note.channel)
                            if woken is not None:
                                woken.set()
            except psycopg.Error as exc:
                log.warning("LISTEN connection lost (%s); polling meanwhile", exc)
                self.stopping.wait(backoff)
                backoff = min(backoff * 2, 10.0)
