"""A tenant's application in the test process: a local HTTP server that takes status
callbacks, verifies their signatures with the ``standardwebhooks`` library, and answers as
scripted (``fail_next(n)``: the next n posts get 500)."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

from standardwebhooks import Webhook


@dataclass(frozen=True)
class Received:
    path: str
    headers: dict[str, str]
    body: str
    status: int  # what we answered

    @property
    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def webhook_id(self) -> str:
        return self.headers["webhook-id"]


class CallbackReceiver:
    def __init__(self, port: int = 0):
        self.received: list[Received] = []
        self._failures = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length).decode()
                with receiver._lock:
                    status = 500 if receiver._failures > 0 else 204
                    receiver._failures = max(0, receiver._failures - 1)
                    receiver.received.append(
                        Received(
                            self.path, {k.lower(): v for k, v in self.headers.items()}, body, status
                        )
                    )
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def url(self, path: str = "/hook") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def fail_next(self, n: int) -> None:
        with self._lock:
            self._failures = n

    def verified(self, secret: str, path: str | None = None) -> list[dict[str, Any]]:
        """The bodies of the 2xx-answered posts (to ``path``), each checked with ``secret``."""
        hook = Webhook(secret)
        out = []
        for item in list(self.received):
            if item.status >= 300 or (path is not None and item.path != path):
                continue
            out.append(hook.verify(item.body, item.headers))
        return out

    def __enter__(self) -> CallbackReceiver:
        self.thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.server.shutdown()
        self.server.server_close()
