"""The configs a delivery worker reads at every send, cached in the process by the
configuration epoch (migration 0016).

A worker's attempt reads the epoch in a statement it runs anyway (the claim of its record,
migration 0028, or else the suppression lookup; ``preparation.suppressed_recipients``) and
tells the cache (``seen``). While the epoch stays
the same, the mail server and SMS provider rows, the secrets decrypted from them and the SMS
routing derived from them come from memory: no round trip and no decryption per send. Any
change to those tables (whoever makes it) changes the epoch in the same transaction, so an
attempt that reads the new epoch drops everything cached and reads afresh; an attempt that
read the old one uses what was true when it read it, as if it had read the rows then.

Why that is safe with many threads: a value is stored only into the dict that was current
before it was loaded, and a dict is replaced whenever an attempt reports another epoch. A
change committed after a dict was made is seen by the next attempt that reads the epoch,
which replaces the dict; so no value older than the epoch an attempt read is ever handed to
it. Without an epoch (SQLite, or the row missing) nothing is cached.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

T = TypeVar("T")
_MISSING = object()


class ConfigCache:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._epoch: int | None = None
        self._items: dict[Hashable, Any] = {}
        self._local = threading.local()

    @contextmanager
    def attempt(self) -> Iterator[None]:
        """A delivery attempt: within it, once ``seen`` has been told the epoch, config reads
        may come from the cache. Outside one (the portal, tests calling preparation
        directly), every read goes to the database."""
        self._local.attempt = True
        self._local.epoch = None
        try:
            yield
        finally:
            self._local.attempt = False
            self._local.epoch = None

    def seen(self, epoch: int | None) -> None:
        """The epoch this thread's attempt read (None: cache nothing in this attempt)."""
        if not getattr(self._local, "attempt", False):
            return
        self._local.epoch = epoch
        if epoch is None:
            return
        with self._lock:
            if epoch != self._epoch:
                self._epoch = epoch
                self._items = {}

    def get(self, key: Hashable, load: Callable[[], T]) -> T:
        """The value for ``key`` under the epoch this thread's attempt read, or ``load()``."""
        if getattr(self._local, "epoch", None) is None:
            return load()
        items = self._items
        found = items.get(key, _MISSING)
        if found is _MISSING:
            found = load()
            with self._lock:
                if self._items is items:
                    items[key] = found
        return found  # type: ignore[no-any-return]

    def clear(self) -> None:
        with self._lock:
            self._epoch = None
            self._items = {}


CONFIGS = ConfigCache()
