"""The worker's log configuration: one JSON line per event of ours; the HTTP client's own line
per request (httpx logs each at INFO) is left out, its warnings are not, and at DEBUG all is."""

from __future__ import annotations

import io
import json
import logging
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer

import httpx
import pytest

from portal.logs import CHATTY, JsonFormatter, configure_logging


class _Ok(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def url() -> Iterator[str]:
    server = HTTPServer(("127.0.0.1", 0), _Ok)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/sms"
    server.shutdown()
    server.server_close()


@pytest.fixture
def configured() -> Iterator[io.StringIO]:
    """configure_logging into a buffer, as the worker does; the root logger as it was after."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    levels = {name: logging.getLogger(name).level for name in CHATTY}
    for handler in handlers:
        if isinstance(handler.formatter, JsonFormatter):
            root.removeHandler(handler)
    stream = io.StringIO()
    try:
        yield stream
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        for name, was in levels.items():
            logging.getLogger(name).setLevel(was)


def _loggers(stream: io.StringIO) -> list[str]:
    return [json.loads(line)["logger"] for line in stream.getvalue().splitlines()]


def test_a_request_logs_our_line_only(url: str, configured: io.StringIO) -> None:
    stream = configured
    configure_logging("INFO", stream)
    with httpx.Client() as client:
        assert client.post(url, content=b"x").status_code == 200
    logging.getLogger("portal.delivery").info("sent", extra={"record_id": 7})
    logging.getLogger("httpx").warning("the provider's certificate expires soon")
    assert _loggers(stream) == ["portal.delivery", "httpx"]


def test_at_debug_the_http_client_logs_too(url: str, configured: io.StringIO) -> None:
    stream = configured
    configure_logging("DEBUG", stream)
    with httpx.Client() as client:
        client.post(url, content=b"x")
    assert "httpx" in _loggers(stream)
