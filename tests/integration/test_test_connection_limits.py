"""Test buttons cannot stall the portal: a real WSGI server with four request threads (as one
gunicorn process of the run command), 24 concurrent "Test connection" posts against a port
that accepts and never answers, and meanwhile another tenant's API call and a fresh sign-in
page answer in under half a second; the posts over the caps get 429 with Retry-After at once."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from flask import Flask
from werkzeug.serving import BaseWSGIServer

from portal.extensions import db
from portal.models import MailSendServerConfig
from tests.conftest import make_api_key, make_tenant
from tests.integration.test_portal_templates import Portal, user


class PooledServer(BaseWSGIServer):
    """werkzeug's server with a fixed pool of request threads (gunicorn's gthread worker)."""

    def __init__(self, app: Flask, threads: int) -> None:
        super().__init__("127.0.0.1", 0, app)
        self.pool = ThreadPoolExecutor(threads)

    def process_request(self, request: Any, client_address: Any) -> None:
        self.pool.submit(self._handle, request, client_address)

    def _handle(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)


@pytest.fixture
def blackhole() -> Iterator[int]:
    """A port that accepts connections and never says a word."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(sock.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    yield sock.getsockname()[1]
    sock.close()
    for conn in held:
        conn.close()


@pytest.fixture
def served(app: Flask) -> Iterator[str]:
    before = app.config["SETTINGS"]
    app.config["SETTINGS"] = before.replace(outbound_test_timeout_s=5.0)
    server = PooledServer(app, threads=4)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.pool.shutdown(wait=True)
    server.server_close()
    app.config["SETTINGS"] = before


def attacker(app: Flask, base: str, port: int) -> tuple[httpx.Client, str, int]:
    acme = make_tenant("acme")
    user("admin@acme.test", "tenant_admin", acme.id)
    server = MailSendServerConfig(
        tenant_id=acme.id, name="slow", host="127.0.0.1", port=port, security="plain",
        from_address="no-reply@acme.example.com",
    )  # fmt: skip
    db.session.add(server)
    db.session.commit()
    portal = Portal(app, "admin@acme.test")
    # Session protection compares the browser's address and User-Agent: the test client's.
    agent = str(portal.client.environ_base["HTTP_USER_AGENT"])
    client = httpx.Client(base_url=base, timeout=30, headers={"User-Agent": agent})
    for cookie in portal.client._cookies.values():
        client.cookies.set(cookie.key, cookie.value)
    return client, portal.token, server.id


def test_connection_tests_are_capped_and_other_tenants_stay_fast(
    app: Flask, served: str, blackhole: int
) -> None:
    client, token, server_id = attacker(app, served, blackhole)
    globex = make_tenant("globex")
    key = make_api_key(globex.id)
    db.session.commit()
    victim = httpx.Client(base_url=served, timeout=10)
    assert victim.get("/auth/login").status_code == 200  # warm

    def press() -> httpx.Response:
        return client.post(
            f"/mail-servers/{server_id}/test",
            data={"csrf_token": token},
            headers={"HX-Request": "true", "HX-Target": f"connection-{server_id}"},
        )

    with ThreadPoolExecutor(24) as attack:
        pressed = [attack.submit(press) for _ in range(24)]
        # The attack holds what it can: the tier's two tests hang (5 s), the rest are refused.
        # Measured once the refusals are back, so the figures are about held threads, not
        # about the queue of 22 quick refusals on a loaded machine.
        deadline = time.monotonic() + 4.0
        while sum(f.done() for f in pressed) < 22 and time.monotonic() < deadline:
            time.sleep(0.02)
        timings = []
        for _ in range(3):
            started = time.monotonic()
            api = victim.get("/api/v1/mail", headers={"Authorization": f"Bearer {key}"})
            middle = time.monotonic()
            page = victim.get("/auth/login")
            timings += [middle - started, time.monotonic() - middle]
            assert api.status_code == 200, api.text
            assert page.status_code == 200
        answers = [f.result() for f in pressed]

    assert max(timings) < 0.5, timings
    busy = [a for a in answers if a.status_code == 429]
    ran = [a for a in answers if a.status_code == 200]
    assert busy, [a.status_code for a in answers]
    assert len(ran) <= 2 * 3  # at most the tier's cap at a time, each ending in 5 s
    assert all(int(a.headers["Retry-After"]) >= 1 for a in busy)
    assert "connection tests" in busy[0].text
    # The button's status box comes back saying why (the page swaps a 429 in; before, the
    # answer was plain text that the page dropped).
    assert all(a.text.startswith(f'<div id="connection-{server_id}"') for a in busy)
    assert all("No answer in time" in a.text for a in ran)


def test_the_per_tier_cap_answers_429_with_retry_after(app: Flask, blackhole: int) -> None:
    from portal.messaging.sending import outbound

    settings = app.config["SETTINGS"].replace(outbound_test_per_process=10)
    with outbound.test_slot(settings, 5), outbound.test_slot(settings, 5):
        with pytest.raises(outbound.Busy) as busy, outbound.test_slot(settings, 5):
            pass
        assert busy.value.retry_after_s >= 1
        with outbound.test_slot(settings, 6):  # another tier still may
            pass
    with outbound.test_slot(settings, 5):  # slots are given back
        pass
