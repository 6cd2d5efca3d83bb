"""A real HTTP server inside the test process that answers as the SMS providers do.

One threaded server plays all three HTTP providers, by path:

- Twilio: ``POST /2010-04-01/Accounts/{sid}/Messages.json`` (form, basic auth);
- Vonage: ``POST /sms/json`` (form with ``api_key``/``api_secret``; HTTP 200 with per-message
  statuses);
- the JSON gateway: ``POST /gateway`` (JSON, ``Idempotency-Key``, ``X-Postroom-Signature``
  checked against the gateway secret). The gateway really deduplicates: a key it accepted
  before gets 409 with the earlier id, as the protocol says.

Credentials are checked as the provider would (Twilio 401 code 20003, Vonage status "4", the
gateway 401). How the server answers a number is scripted with ``script(number, *answers)``:
each attempt to that number takes the next answer; when none is left, it is "ok". Answers:

``ok``; ``auth`` (credentials refused); ``invalid_number``; ``refused`` (unsubscribed or
barred); ``code:<c>`` (the provider's error code or Vonage status ``c``); ``unreadable`` (400
with a body that is not JSON); ``throttled`` / ``throttled:<retry-after>`` (429);
``server_error`` (500); ``hang`` (take the request, answer only after ``hang_s``: the client
times out after writing it); ``drop`` (take the request, close without answering);
``duplicate`` / ``duplicate_no_id`` (gateway: 409 with and without the earlier id).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import itertools
import json
import threading
from collections import defaultdict, deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any
from urllib.parse import parse_qs

TWILIO_SID, TWILIO_TOKEN = "AC00000000000000000000000000000001", "twilio-auth-token"
VONAGE_KEY, VONAGE_SECRET = "vonage-key", "vonage-secret"
GATEWAY_SECRET = "gateway-signing-secret"


@dataclass
class Request:
    """One request as the server received it, and how it answered."""

    kind: str  # "twilio", "vonage" or "http_json"
    path: str
    headers: dict[str, str]
    body: bytes
    fields: dict[str, Any]
    to: str  # E.164, with the "+"
    key: str | None  # the idempotency key or client reference it carried
    answer: str = ""
    status: int = 0


@dataclass
class _Reply:
    status: int
    body: Any = None  # dict -> JSON; bytes -> as is
    headers: dict[str, str] = field(default_factory=dict)


class FakeSmsProvider:
    """The server; use as a context manager."""

    def __init__(self, *, hang_s: float = 5.0, delay_s: float = 0.0):
        self.hang_s = hang_s
        self.delay_s = delay_s  # every answer takes this long (a provider's own latency)
        self.requests: list[Request] = []
        self._scripts: dict[str, deque[str]] = defaultdict(deque)
        self._accepted_keys: dict[str, str] = {}  # gateway: key -> id it answered
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._release = threading.Event()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        # A short poll: shutdown() waits for it, once per test.
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )

    # --- life cycle ----------------------------------------------------------------------

    def __enter__(self) -> FakeSmsProvider:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self._release.set()  # hanging answers end now
        self._server.shutdown()
        self._server.server_close()

    @property
    def base_url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    @property
    def gateway_url(self) -> str:
        return f"{self.base_url}/gateway"

    # --- scripting and reading -----------------------------------------------------------

    def script(self, number: str, *answers: str) -> None:
        """The next attempts to ``number`` get ``answers`` in order (then "ok")."""
        with self._lock:
            self._scripts[number].extend(answers)

    def to(self, number: str) -> list[Request]:
        with self._lock:
            return [r for r in self.requests if r.to == number]

    def accepted(self) -> list[Request]:
        """Requests answered as accepted (what a provider would deliver)."""
        with self._lock:
            return [r for r in self.requests if r.answer in ("ok", "hang")]

    def _next_answer(self, number: str) -> str:
        with self._lock:
            queue = self._scripts.get(number)
            return queue.popleft() if queue else "ok"

    def _new_id(self) -> int:
        with self._lock:
            return next(self._ids)

    # --- answering -----------------------------------------------------------------------

    def _handle(self, handler: BaseHTTPRequestHandler) -> None:
        length = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(length)
        headers = {k.lower(): v for k, v in handler.headers.items()}
        path = handler.path.split("?", 1)[0]
        if path.startswith("/2010-04-01/Accounts/") and path.endswith("/Messages.json"):
            request = self._twilio_request(path, headers, body)
        elif path == "/sms/json":
            request = self._vonage_request(path, headers, body)
        elif path == "/gateway":
            request = self._gateway_request(path, headers, body)
        else:
            self._write(handler, _Reply(404, {"message": f"no such endpoint {path}"}))
            return
        with self._lock:
            self.requests.append(request)
        if self.delay_s:
            self._release.wait(self.delay_s)
        reply = self._reply(request, headers, body)
        request.status = reply.status if reply is not None else 0
        if request.answer == "hang":
            # The request is taken (and, at the gateway, its key recorded as accepted); the
            # answer comes too late for the client.
            self._release.wait(self.hang_s)
        if reply is None:  # "drop": close without a word
            handler.close_connection = True
            return
        self._write(handler, reply)

    def _twilio_request(self, path: str, headers: dict[str, str], body: bytes) -> Request:
        form = {k: v[0] for k, v in parse_qs(body.decode()).items()}
        return Request("twilio", path, headers, body, form, form.get("To", ""), None)

    def _vonage_request(self, path: str, headers: dict[str, str], body: bytes) -> Request:
        form = {k: v[0] for k, v in parse_qs(body.decode()).items()}
        to = form.get("to", "")
        return Request("vonage", path, headers, body, form, f"+{to}", form.get("client-ref"))

    def _gateway_request(self, path: str, headers: dict[str, str], body: bytes) -> Request:
        try:
            data = json.loads(body)
        except ValueError:
            data = {}
        key = headers.get("idempotency-key")
        return Request("http_json", path, headers, body, data, str(data.get("to", "")), key)

    def _reply(self, request: Request, headers: dict[str, str], body: bytes) -> _Reply | None:
        refusal = self._check_credentials(request, headers, body)
        if refusal is not None:
            request.answer = "bad_credentials"
            return refusal
        if request.kind == "http_json" and request.key in self._accepted_keys:
            request.answer = "duplicate"
            return _Reply(409, {"id": self._accepted_keys[request.key], "code": "DUPLICATE_KEY"})
        answer = self._next_answer(request.to)
        request.answer = answer
        name, _, arg = answer.partition(":")
        if name in ("ok", "hang"):
            return self._accept(request)
        if name == "drop":
            return None
        if name == "server_error":
            return {
                "twilio": _Reply(500, {"code": 20500, "message": "Internal Server Error"}),
                "vonage": _Reply(500, b"<html>Internal Server Error</html>"),
                "http_json": _Reply(500, b"gateway exploded"),
            }[request.kind]
        if name == "throttled":
            retry = {"Retry-After": arg} if arg else {}
            return {
                "twilio": _Reply(
                    429, {"code": 20429, "message": "Too Many Requests", "status": 429}, retry
                ),
                "vonage": _Reply(429, {"title": "Too Many Requests"}, retry),
                "http_json": _Reply(429, {"code": "THROTTLED", "message": "slow down"}, retry),
            }[request.kind]
        if name == "unreadable":
            return _Reply(400, b"<html>Bad Request</html>")
        if name in ("duplicate", "duplicate_no_id"):
            earlier = {"id": f"gw-earlier-{request.key}"} if name == "duplicate" else {}
            return _Reply(409, earlier | {"code": "DUPLICATE_KEY"})
        code = {
            "auth": {"twilio": "20003", "vonage": "4", "http_json": "AUTH_FAILED"},
            "invalid_number": {"twilio": "21211", "vonage": "6", "http_json": "INVALID_RECIPIENT"},
            "refused": {"twilio": "21610", "vonage": "7", "http_json": "RECIPIENT_REFUSED"},
        }.get(name, {}).get(request.kind) or arg
        return self._refuse(request, name, code)

    def _check_credentials(
        self, request: Request, headers: dict[str, str], body: bytes
    ) -> _Reply | None:
        if request.kind == "twilio":
            expected = base64.b64encode(f"{TWILIO_SID}:{TWILIO_TOKEN}".encode()).decode()
            if headers.get("authorization") != f"Basic {expected}" or TWILIO_SID not in (
                request.path
            ):
                return _twilio_error(401, 20003, "Authenticate")
        elif request.kind == "vonage":
            fields = request.fields
            if (fields.get("api_key"), fields.get("api_secret")) != (VONAGE_KEY, VONAGE_SECRET):
                return _vonage_status(request, "4", "Bad Credentials")
        else:
            good = hmac.new(GATEWAY_SECRET.encode(), body, hashlib.sha256).hexdigest()
            if not hmac.compare_digest(headers.get("x-postroom-signature", ""), good):
                return _Reply(401, {"code": "AUTH_FAILED", "message": "bad signature"})
        return None

    def _accept(self, request: Request) -> _Reply:
        n = self._new_id()
        if request.kind == "twilio":
            sid = f"SM{n:032x}"
            return _Reply(201, {"sid": sid, "status": "queued", "to": request.to})
        if request.kind == "vonage":
            return _Reply(
                200,
                {
                    "message-count": "1",
                    "messages": [
                        {
                            "to": request.to.lstrip("+"),
                            "message-id": f"0C{n:014X}",
                            "status": "0",
                            "remaining-balance": "15.53590000",
                            "message-price": "0.03330000",
                            "network": "23410",
                            "client-ref": request.key,
                        }
                    ],
                },
            )
        gateway_id = f"gw-{n}"
        if request.key:
            with self._lock:
                self._accepted_keys[request.key] = gateway_id
        return _Reply(200, {"id": gateway_id})

    def _refuse(self, request: Request, name: str, code: str) -> _Reply:
        if request.kind == "twilio":
            return _twilio_error(401 if name == "auth" else 400, int(code), f"refused ({name})")
        if request.kind == "vonage":
            return _vonage_status(request, code, f"refused ({name})")
        return _Reply(
            401 if name == "auth" else 400, {"code": code, "message": f"refused ({name})"}
        )

    @staticmethod
    def _write(handler: BaseHTTPRequestHandler, reply: _Reply) -> None:
        if isinstance(reply.body, bytes):
            payload, content_type = reply.body, "text/html"
        else:
            payload, content_type = json.dumps(reply.body).encode(), "application/json"
        try:
            handler.send_response(reply.status)
            handler.send_header("Content-Type", content_type)
            handler.send_header("Content-Length", str(len(payload)))
            for name, value in reply.headers.items():
                handler.send_header(name, value)
            handler.end_headers()
            handler.wfile.write(payload)
        except OSError:
            handler.close_connection = True  # the client gave up (a hang): nothing to tell

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        provider = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as the real providers
            # The headers and the body go out in two writes; without TCP_NODELAY the second
            # waits for the client's delayed ACK: 40 ms per request on a kept-alive connection.
            disable_nagle_algorithm = True

            def do_POST(self) -> None:
                provider._handle(self)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        return Handler


def _twilio_error(status: int, code: int, message: str) -> _Reply:
    return _Reply(
        status,
        {
            "code": code,
            "message": message,
            "more_info": f"https://www.twilio.com/docs/errors/{code}",
            "status": status,
        },
    )


def _vonage_status(request: Request, status: str, text: str) -> _Reply:
    return _Reply(
        200,
        {
            "message-count": "1",
            "messages": [{"to": request.to.lstrip("+"), "status": status, "error-text": text}],
        },
    )
