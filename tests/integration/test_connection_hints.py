"""A failed connection test says in plain words what to change, against a
real SMTP server in the test process (the raw errors name no setting)."""

from __future__ import annotations

import socket

import pytest

from portal.messaging.sending.transports.smtp import (
    Security,
    SmtpServer,
    connection_hint,
    test_connection,
)
from tests.support.smtp_server import ScriptedSmtpServer


def server_at(host: str, port: int, security: Security, **more: object) -> SmtpServer:
    values: dict[str, object] = {
        "key": f"hint-{port}@v1",
        "host": host,
        "port": port,
        "security": security,
        "username": None,
        "password": None,
        "connect_timeout_s": 1.0,
        "read_timeout_s": 1.0,
        "verify_tls": False,
        "local_hostname": "worker.test",
    } | more
    return SmtpServer(**values)  # type: ignore[arg-type]


def hint_for(server: SmtpServer) -> tuple[str, str]:
    _latency, error = test_connection(server)
    assert error is not None
    hint = connection_hint(server, error)
    assert hint is not None, error
    return error, hint


def test_ssl_on_a_plain_smtp_port_says_to_choose_starttls() -> None:
    with ScriptedSmtpServer() as plain:
        error, hint = hint_for(server_at(plain.host, plain.port, Security.SSL))
    assert "WRONG_VERSION_NUMBER" in error or "record" in error.lower()
    assert "Choose STARTTLS" in hint


def test_a_login_the_server_does_not_offer_says_what_to_change() -> None:
    with ScriptedSmtpServer() as plain:
        over_plain = server_at(plain.host, plain.port, Security.PLAIN, username="u", password="p")
        _error, hint = hint_for(over_plain)
    assert "only over an encrypted connection" in hint


def test_starttls_where_none_is_offered() -> None:
    with ScriptedSmtpServer() as plain:
        _error, hint = hint_for(server_at(plain.host, plain.port, Security.STARTTLS))
    assert "does not offer STARTTLS" in hint


def test_nothing_listening_and_an_unknown_host() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    _error, hint = hint_for(server_at("127.0.0.1", port, Security.PLAIN))
    assert f"Nothing accepts connections on 127.0.0.1:{port}" in hint
    _error, hint = hint_for(server_at("no-such-host.invalid", 25, Security.PLAIN))
    assert "does not resolve" in hint


@pytest.mark.parametrize(
    ("security", "port", "error", "expected"),
    [
        (Security.STARTTLS, 465, "connect: timed out", "Port 465 expects TLS from the first byte"),
        (Security.PLAIN, 587, "535 5.7.8 Authentication credentials invalid", "refused the"),
        (
            Security.SSL,
            465,
            "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed",
            "not valid for",
        ),
        (Security.PLAIN, 25, "something we have never seen", None),
    ],
)
def test_hints_for_errors_the_local_server_cannot_produce(
    security: Security, port: int, error: str, expected: str | None
) -> None:
    hint = connection_hint(server_at("mail.example.com", port, security), error)
    if expected is None:
        assert hint is None
    else:
        assert hint is not None
        assert expected in hint
