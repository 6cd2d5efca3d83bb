"""A TCP proxy on 127.0.0.1 that a test can cut and restore, standing in for a database restart
or a network partition without touching the real server behind it.

``cut()`` closes every live connection (both sides, at once: the client sees the connection
reset mid-session, as when PostgreSQL restarts) and refuses new ones until ``restore()``: they
are accepted and closed at once, before a byte is read, like a server that is not ready yet.
The listening socket stays bound throughout, so the port never changes hands.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import struct
import threading
from collections.abc import Callable
from types import TracebackType


class TcpProxy:
    """Forward 127.0.0.1:``port`` to ``upstream``; thread-safe ``cut()`` / ``restore()``."""

    def __init__(self, upstream_host: str, upstream_port: int, *, host: str = "127.0.0.1"):
        self.upstream = (upstream_host, upstream_port)
        self.host = host
        self.port = 0
        self._listener: socket.socket | None = None
        self._lock = threading.Lock()
        self._live: set[socket.socket] = set()
        self._cut = threading.Event()
        self._closing = threading.Event()
        self._threads: list[threading.Thread] = []
        self.accepted = 0  # connections forwarded
        self.refused = 0  # connections closed at once while cut
        self.severed = 0  # live connections closed by cut()

    # --- life cycle ----------------------------------------------------------------------

    def __enter__(self) -> TcpProxy:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.host, 0))
        listener.listen(128)
        listener.settimeout(0.2)
        self.port = listener.getsockname()[1]
        self._listener = listener
        self._spawn(self._accept_loop, "proxy-accept")

    def stop(self) -> None:
        self._closing.set()
        self._sever_all()
        if self._listener is not None:
            self._listener.close()
        for thread in self._threads:
            thread.join(2.0)

    # --- faults --------------------------------------------------------------------------

    def cut(self) -> int:
        """Close every live connection and refuse new ones; returns how many were closed."""
        self._cut.set()
        return self._sever_all()

    def restore(self) -> None:
        """Forward new connections again."""
        self._cut.clear()

    # --- forwarding ----------------------------------------------------------------------

    def _spawn(self, target: Callable[..., None], name: str, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        thread.start()
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._closing.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed by stop()
            if self._cut.is_set():
                _reset(client)
                self.refused += 1
                continue
            try:
                upstream = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                _reset(client)
                continue
            client.settimeout(None)
            upstream.settimeout(None)
            with self._lock:
                if self._cut.is_set():  # cut() ran while we connected
                    _reset(client)
                    _reset(upstream)
                    self.refused += 1
                    continue
                self._live |= {client, upstream}
                self.accepted += 1
            self._spawn(self._pump, "proxy-pump", client, upstream)

    def _pump(self, client: socket.socket, upstream: socket.socket) -> None:
        """Copy bytes both ways until either side closes (or cut() closes both)."""
        peer = {client: upstream, upstream: client}
        with selectors.DefaultSelector() as selector:
            selector.register(client, selectors.EVENT_READ)
            selector.register(upstream, selectors.EVENT_READ)
            try:
                while True:
                    for key, _ in selector.select(timeout=0.5):
                        source: socket.socket = key.fileobj  # type: ignore[assignment]
                        data = source.recv(65536)
                        if not data:
                            return
                        peer[source].sendall(data)
                    if self._closing.is_set():
                        return
            except (OSError, ValueError):
                return  # closed under us by cut() or stop()
            finally:
                with self._lock:
                    self._live -= {client, upstream}
                for sock in (client, upstream):
                    with contextlib.suppress(OSError):
                        sock.close()

    def _sever_all(self) -> int:
        with self._lock:
            live = list(self._live)
            self._live.clear()
        for sock in live:
            _reset(sock)
        self.severed += len(live) // 2
        return len(live) // 2


def _reset(sock: socket.socket) -> None:
    """Close with an RST (SO_LINGER 0): the peer sees the connection reset at once."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()
