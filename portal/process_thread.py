"""A thread of a process's own that requests hand work to: acceptance's wake-up NOTIFYs and the
API keys' "last used" writes, each folded so that a burst of requests costs one run.

The thread is started by the first wake-up in each process, not at import: gunicorn forks its
workers after importing the app, and a thread does not survive a fork.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable


class ProcessThread:
    """Runs ``work`` in a daemon thread named ``name`` after each ``wake``; wake-ups that come
    while it runs are folded into one more run."""

    def __init__(self, name: str, work: Callable[[], None]):
        self.name = name
        self.work = work
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = 0

    def wake(self) -> None:
        """Have ``work`` run soon. Callers hold a lock of their own around it (the one that
        guards what ``work`` takes), so two never start the thread at once."""
        if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
            # First use in this process (gunicorn forks after import): start the thread.
            self._pid = os.getpid()
            self._wake = threading.Event()
            self._thread = threading.Thread(
                target=self._run, args=(self._wake,), name=self.name, daemon=True
            )
            self._thread.start()
        self._wake.set()

    def _run(self, wake: threading.Event) -> None:
        while True:
            wake.wait()
            wake.clear()
            self.work()
