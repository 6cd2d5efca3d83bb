"""SMTP transport against a real SMTP server (aiosmtpd) in the test process; no mocks."""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Iterator
from email import message_from_bytes, policy
from email.message import EmailMessage
from typing import Any

import pytest

from portal.messaging.sending.transports.mail_message import Attachment, OutgoingMail, build_message
from portal.messaging.sending.transports.smtp import (
    Security,
    SmtpConnectionPool,
    SmtpSendError,
    SmtpServer,
)
from portal.messaging.sending.transports.smtp import test_connection as check_connection
from tests.support.smtp_server import ScriptedSmtpServer

pytestmark = pytest.mark.timeout(10)

USERS = {"user": "secret"}


@pytest.fixture(params=[False, True], ids=["one-at-a-time", "pipelining"])
def offers_pipelining(request: pytest.FixtureRequest) -> bool:
    """Every test that talks to a server runs twice: against a server that takes one command
    at a time, and against one offering PIPELINING (RFC 2920), which the pool then uses."""
    return bool(request.param)


@pytest.fixture
def smtp_server(offers_pipelining: bool) -> Iterator[ScriptedSmtpServer]:
    with ScriptedSmtpServer(pipelining=offers_pipelining) as server:
        yield server


@pytest.fixture
def tls_server(offers_pipelining: bool) -> Iterator[ScriptedSmtpServer]:
    with ScriptedSmtpServer(tls=True, auth_users=USERS, pipelining=offers_pipelining) as server:
        yield server


@pytest.fixture
def pool() -> Iterator[SmtpConnectionPool]:
    with SmtpConnectionPool() as connection_pool:
        yield connection_pool


def config(
    server: ScriptedSmtpServer,
    *,
    key: str = "server-1@v1",
    security: Security = Security.PLAIN,
    username: str | None = None,
    password: str | None = None,
    read_timeout_s: float = 2.0,
    verify_tls: bool = False,
) -> SmtpServer:
    return SmtpServer(
        key=key,
        host=server.host,
        port=server.port,
        security=security,
        username=username,
        password=password,
        connect_timeout_s=2.0,
        read_timeout_s=read_timeout_s,
        verify_tls=verify_tls,
        local_hostname="worker.test",
    )


def outgoing(**changes: Any) -> OutgoingMail:
    values: dict[str, Any] = {
        "message_id": "<rec-123.mail@postroom>",
        "from_addr": "sender@postroom.test",
        "to": ["alice@example.test"],
        "subject": "Hello",
        "text": "Hello Alice",
    }
    values.update(changes)
    return OutgoingMail(**values)


def parse(raw: bytes) -> EmailMessage:
    return message_from_bytes(raw, policy=policy.default)


# --- building ------------------------------------------------------------------------------


def test_text_and_html_make_multipart_alternative() -> None:
    msg = parse(build_message(outgoing(text="plain body", html="<p>html body</p>")).as_bytes())

    assert msg.get_content_type() == "multipart/alternative"
    parts = [part.get_content_type() for part in msg.iter_parts()]
    assert parts == ["text/plain", "text/html"]
    html = msg.get_body(("html",))
    assert html is not None
    assert "<p>html body</p>" in html.get_content()


@pytest.mark.parametrize(
    ("text", "html", "content_type"),
    [("only text", None, "text/plain"), (None, "<b>only html</b>", "text/html")],
)
def test_one_body_makes_a_single_part(
    text: str | None, html: str | None, content_type: str
) -> None:
    msg = parse(build_message(outgoing(text=text, html=html)).as_bytes())

    assert msg.get_content_type() == content_type
    assert not msg.is_multipart()


def test_attachments_make_multipart_mixed() -> None:
    pdf = Attachment("rapport-été.pdf", "application/pdf", b"%PDF-1.4 \x00\xff binary")
    mail = outgoing(text="see attached", html="<p>see attached</p>", attachments=[pdf])

    msg = parse(build_message(mail).as_bytes())

    assert msg.get_content_type() == "multipart/mixed"
    first, attachment = list(msg.iter_parts())
    assert first.get_content_type() == "multipart/alternative"
    assert attachment.get_content_type() == "application/pdf"
    assert attachment.get_filename() == "rapport-été.pdf"
    assert attachment.get_payload(decode=True) == pdf.data


def test_priority_read_receipt_and_extra_headers() -> None:
    mail = outgoing(
        priority=1,
        read_receipt_to="receipts@postroom.test",
        reply_to="help@postroom.test",
        extra_headers={"X-Postroom-Record": "123"},
    )

    msg = parse(build_message(mail).as_bytes())

    assert msg["X-Priority"] == "1 (Highest)"
    assert msg["Importance"] == "high"
    assert msg["Disposition-Notification-To"] == "receipts@postroom.test"
    assert msg["Reply-To"] == "help@postroom.test"
    assert msg["X-Postroom-Record"] == "123"


def test_message_id_is_kept_as_given_on_every_build() -> None:
    mail = outgoing(message_id="<rec-42.mail@postroom>")

    first, second = build_message(mail), build_message(mail)

    assert first["Message-ID"] == second["Message-ID"] == "<rec-42.mail@postroom>"
    assert first["Date"]


def test_serialised_with_crlf_and_without_bcc() -> None:
    mail = outgoing(cc=["carol@example.test"], bcc=["hidden@example.test"], text="a\nb\nc")

    raw = build_message(mail).as_bytes()

    assert re.search(rb"(?<!\r)\n", raw) is None
    assert b"hidden@example.test" not in raw
    assert b"\r\nBcc:" not in raw
    assert parse(raw)["Cc"] == "carol@example.test"


def test_non_ascii_display_name_and_subject_are_encoded() -> None:
    mail = outgoing(from_name="Zoë Müller, Ltd", subject="Grüße")

    raw = build_message(mail).as_bytes()

    assert raw.isascii()
    msg = parse(raw)
    sender = msg["From"].addresses[0]
    assert (sender.display_name, sender.addr_spec) == ("Zoë Müller, Ltd", "sender@postroom.test")
    assert msg["Subject"] == "Grüße"


@pytest.mark.parametrize(
    "changes",
    [
        {"subject": "Hi\r\nBcc: victim@example.test"},
        {"subject": "Hi\nX-Evil: 1"},
        {"from_name": "Eve\r\nBcc: victim@example.test"},
        {"to": ["alice@example.test\r\nBcc: victim@example.test"]},
        {"bcc": ["victim@example.test>\r\nRCPT TO:<x@y.test"]},
        {"reply_to": "a@b.test\nX-Evil: 1"},
        {"extra_headers": {"X-Record": "1\r\nBcc: victim@example.test"}},
        {"extra_headers": {"X-Bad: name": "1"}},
        {"extra_headers": {"From": "boss@example.test"}},
        {"attachments": [Attachment("a\r\n.pdf", "application/pdf", b"x")]},
        {"message_id": "<rec-1@postroom>\r\nBcc: victim@example.test"},
        {"message_id": "rec-1"},
        {"priority": 9},
        {"to": [], "cc": [], "bcc": []},
    ],
)
def test_unsafe_or_malformed_input_is_refused(changes: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"."):
        build_message(outgoing(**changes))


# --- sending -------------------------------------------------------------------------------


def test_send_over_plain_delivers_to_every_recipient_bcc_only_in_the_envelope(
    smtp_server: ScriptedSmtpServer, pool: SmtpConnectionPool
) -> None:
    mail = outgoing(cc=["carol@example.test"], bcc=["hidden@example.test"])

    result = pool.send(config(smtp_server), mail)

    assert result.accepted == ["alice@example.test", "carol@example.test", "hidden@example.test"]
    assert result.refused == {}
    assert result.elapsed_s > 0
    [received] = smtp_server.messages
    assert received.mail_from == "sender@postroom.test"
    assert received.rcpt_tos == result.accepted
    assert received.message_id == "<rec-123.mail@postroom>"
    assert "Bcc" not in received.message
    assert b"hidden@example.test" not in received.raw
    assert re.search(rb"(?<!\r)\n", received.raw) is None


def test_leading_dots_survive_the_trip(
    smtp_server: ScriptedSmtpServer, pool: SmtpConnectionPool
) -> None:
    pool.send(config(smtp_server), outgoing(text="line one\n.\n.. two dots\n"))

    # aiosmtpd undoes the dot-stuffing; the body must come out exactly as written.
    assert smtp_server.messages[0].raw.endswith(b"\r\n\r\nline one\r\n.\r\n.. two dots\r\n")


def test_send_over_starttls_with_auth(
    tls_server: ScriptedSmtpServer, pool: SmtpConnectionPool
) -> None:
    server = config(tls_server, security=Security.STARTTLS, username="user", password="secret")

    result = pool.send(server, outgoing())

    assert result.accepted == ["alice@example.test"]
    assert tls_server.logins == ["user"]
    assert len(tls_server.messages) == 1


def test_send_over_implicit_tls(pool: SmtpConnectionPool) -> None:
    with ScriptedSmtpServer(implicit_tls=True, auth_users=USERS) as server:
        result = pool.send(
            config(server, security=Security.SSL, username="user", password="secret"),
            outgoing(),
        )

        assert result.accepted == ["alice@example.test"]
        assert server.logins == ["user"]


def test_self_signed_certificate_is_refused_when_verifying(
    tls_server: ScriptedSmtpServer, pool: SmtpConnectionPool
) -> None:
    server = config(tls_server, security=Security.STARTTLS, verify_tls=True)

    with pytest.raises(SmtpSendError) as caught:
        pool.send(server, outgoing())

    assert caught.value.code == "NETWORK_ERROR"
    assert "certificate" in caught.value.message.lower()
    assert tls_server.messages == []


def test_starttls_required_but_not_offered_is_a_config_error(
    smtp_server: ScriptedSmtpServer, pool: SmtpConnectionPool
) -> None:
    with pytest.raises(SmtpSendError) as caught:
        pool.send(config(smtp_server, security=Security.STARTTLS), outgoing())

    assert caught.value.code == "CONFIG_ERROR"
    assert smtp_server.messages == []


def test_connection_is_reused_across_sends(
    smtp_server: ScriptedSmtpServer, pool: SmtpConnectionPool
) -> None:
    server = config(smtp_server)

    for n in range(5):
        pool.send(server, outgoing(message_id=f"<rec-{n}.mail@postroom>"))

    assert smtp_server.connection_count == 1
    assert [m.connection for m in smtp_server.messages] == [1] * 5
    assert pool.open_keys == [server.key]


def test_a_new_config_version_opens_a_new_connection_and_idle_ones_close(
    smtp_server: ScriptedSmtpServer, pool: SmtpConnectionPool
) -> None:
    pool.send(config(smtp_server, key="server-1@v1"), outgoing())
    pool.send(config(smtp_server, key="server-1@v2"), outgoing())

    assert smtp_server.connection_count == 2
    assert sorted(pool.open_keys) == ["server-1@v1", "server-1@v2"]
    pool.close_idle(now=time.monotonic() + pool.idle_timeout_s + 1)
    assert pool.open_keys == []


def test_reconnects_once_when_the_server_dropped_an_idle_connection(
    smtp_server: ScriptedSmtpServer, pool: SmtpConnectionPool
) -> None:
    server = config(smtp_server)
    pool.send(server, outgoing(message_id="<rec-1.mail@postroom>"))
    smtp_server.drop_connections()

    result = pool.send(server, outgoing(message_id="<rec-2.mail@postroom>"))

    assert result.accepted == ["alice@example.test"]
    assert smtp_server.connection_count == 2
    assert smtp_server.count_by_message_id() == {
        "<rec-1.mail@postroom>": 1,
        "<rec-2.mail@postroom>": 1,
    }


def test_reconnects_when_a_reused_connection_answers_421_to_mail_from(
    smtp_server: ScriptedSmtpServer, pool: SmtpConnectionPool
) -> None:
    server = config(smtp_server)
    pool.send(server, outgoing(message_id="<rec-1.mail@postroom>"))
    smtp_server.fail_next(1, "421 4.4.2 idle timeout exceeded", stage="mail")

    pool.send(server, outgoing(message_id="<rec-2.mail@postroom>"))

    assert smtp_server.connection_count == 2
    assert len(smtp_server.messages) == 2


def test_retries_a_dropped_connection_only_once(
    smtp_server: ScriptedSmtpServer, pool: SmtpConnectionPool
) -> None:
    server = config(smtp_server)
    pool.send(server, outgoing(message_id="<rec-1.mail@postroom>"))
    smtp_server.fail_next(2, "drop", stage="mail")

    with pytest.raises(SmtpSendError) as caught:
        pool.send(server, outgoing(message_id="<rec-2.mail@postroom>"))

    assert caught.value.code == "NETWORK_ERROR"
    assert caught.value.after_data is False
    assert smtp_server.connection_count == 2


def test_a_fresh_connection_that_drops_is_not_retried(
    smtp_server: ScriptedSmtpServer, pool: SmtpConnectionPool
) -> None:
    smtp_server.fail_next(1, "drop", stage="rcpt")

    with pytest.raises(SmtpSendError) as caught:
        pool.send(config(smtp_server), outgoing())

    assert caught.value.code == "NETWORK_ERROR"
    assert smtp_server.connection_count == 1


def test_drop_after_data_is_ambiguous_and_never_resent(
    smtp_server: ScriptedSmtpServer, pool: SmtpConnectionPool
) -> None:
    with pytest.raises(SmtpSendError) as caught:
        pool.send(config(smtp_server), outgoing(to=["drop@example.test"]))

    assert caught.value.code == "NETWORK_ERROR"
    assert caught.value.after_data is True
    assert smtp_server.connection_count == 1
    assert pool.open_keys == []


@pytest.mark.parametrize(
    ("to", "code", "message"),
    [
        ("r550@example.test", "550 5.1.1", "no such user"),
        ("r421@example.test", "421 4.3.0", "try later"),
        ("r451@example.test", "451 4.3.0", "local error in processing"),
        ("r452@example.test", "452 4.5.3", "too many recipients"),
        ("d552@example.test", "552 5.3.4", "message too big for system"),
        ("d554@example.test", "554 5.7.1", "message rejected"),
        ("d451@example.test", "451 4.3.0", "local error in processing"),
        ("d421@example.test", "421 4.3.0", "try later"),
    ],
)
def test_reply_codes_map_to_the_error_code(
    smtp_server: ScriptedSmtpServer, pool: SmtpConnectionPool, to: str, code: str, message: str
) -> None:
    with pytest.raises(SmtpSendError) as caught:
        pool.send(config(smtp_server), outgoing(to=[to]))

    assert caught.value.code == code
    assert caught.value.message == message
    assert caught.value.after_data is False
    assert smtp_server.messages == []


def test_sender_refused_at_mail_from(
    smtp_server: ScriptedSmtpServer, pool: SmtpConnectionPool
) -> None:
    with pytest.raises(SmtpSendError) as caught:
        pool.send(config(smtp_server), outgoing(from_addr="m553@postroom.test"))

    assert caught.value.code == "553 5.1.3"


def test_reply_without_enhanced_status_keeps_the_bare_code(
    smtp_server: ScriptedSmtpServer, pool: SmtpConnectionPool
) -> None:
    smtp_server.script("bob@example.test", "550 mailbox unavailable")

    with pytest.raises(SmtpSendError) as caught:
        pool.send(config(smtp_server), outgoing(to=["bob@example.test"]))

    assert (caught.value.code, caught.value.message) == ("550", "mailbox unavailable")


def test_session_stays_usable_after_a_refusal_but_not_after_421(
    smtp_server: ScriptedSmtpServer, pool: SmtpConnectionPool
) -> None:
    server = config(smtp_server)

    with pytest.raises(SmtpSendError):
        pool.send(server, outgoing(to=["r550@example.test"]))
    pool.send(server, outgoing())
    assert smtp_server.connection_count == 1

    with pytest.raises(SmtpSendError):
        pool.send(server, outgoing(to=["d421@example.test"]))
    pool.send(server, outgoing())
    assert smtp_server.connection_count == 2
    assert len(smtp_server.messages) == 2


def test_partial_refusal_is_recorded(
    smtp_server: ScriptedSmtpServer, pool: SmtpConnectionPool
) -> None:
    mail = outgoing(to=["alice@example.test", "r550@example.test"], cc=["r452@example.test"])

    result = pool.send(config(smtp_server), mail)

    assert result.accepted == ["alice@example.test"]
    assert result.refused == {
        "r550@example.test": (550, "5.1.1 no such user"),
        "r452@example.test": (452, "4.5.3 too many recipients"),
    }
    assert smtp_server.messages[0].rcpt_tos == ["alice@example.test"]


def test_all_refused_raises_the_first_refusal(
    smtp_server: ScriptedSmtpServer, pool: SmtpConnectionPool
) -> None:
    with pytest.raises(SmtpSendError) as caught:
        pool.send(config(smtp_server), outgoing(to=["r550@example.test", "r452@example.test"]))

    assert caught.value.code == "550 5.1.1"
    assert set(caught.value.refused) == {"r550@example.test", "r452@example.test"}


def test_bad_password_keeps_the_535_code(
    tls_server: ScriptedSmtpServer, pool: SmtpConnectionPool
) -> None:
    server = config(tls_server, security=Security.STARTTLS, username="user", password="wrong")

    with pytest.raises(SmtpSendError) as caught:
        pool.send(server, outgoing())

    assert caught.value.code == "535 5.7.8"
    assert tls_server.messages == []


def test_missing_credentials_get_530(
    tls_server: ScriptedSmtpServer, pool: SmtpConnectionPool
) -> None:
    with pytest.raises(SmtpSendError) as caught:
        pool.send(config(tls_server, security=Security.STARTTLS), outgoing())

    assert caught.value.code == "530 5.7.0"


def test_hang_after_data_times_out_as_ambiguous(
    smtp_server: ScriptedSmtpServer, pool: SmtpConnectionPool
) -> None:
    started = time.monotonic()

    with pytest.raises(SmtpSendError) as caught:
        pool.send(config(smtp_server, read_timeout_s=0.5), outgoing(to=["hang@example.test"]))

    assert caught.value.code == "TIMEOUT"
    assert caught.value.after_data is True
    assert time.monotonic() - started < 1.5
    assert pool.open_keys == []
    # The server did get it: this is why a TIMEOUT after DATA must not be blindly resent.
    assert smtp_server.count_by_message_id() == {"<rec-123.mail@postroom>": 1}


def test_message_id_is_the_same_on_every_attempt(
    smtp_server: ScriptedSmtpServer, pool: SmtpConnectionPool
) -> None:
    server = config(smtp_server, read_timeout_s=0.5)
    mail = outgoing(message_id="<rec-7.mail@postroom>")
    smtp_server.fail_next(1, "hang", stage="data")

    with pytest.raises(SmtpSendError):
        pool.send(server, mail)
    pool.send(server, mail)

    assert smtp_server.count_by_message_id() == {"<rec-7.mail@postroom>": 2}


def test_closed_port_is_a_network_error(pool: SmtpConnectionPool) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = SmtpServer("gone@v1", "127.0.0.1", port, Security.PLAIN, None, None, 1.0, 1.0)

    with pytest.raises(SmtpSendError) as caught:
        pool.send(server, outgoing())

    assert caught.value.code == "NETWORK_ERROR"
    assert caught.value.after_data is False
    assert pool.open_keys == []


def test_test_connection_ok(tls_server: ScriptedSmtpServer) -> None:
    server = config(tls_server, security=Security.STARTTLS, username="user", password="secret")

    latency, error = check_connection(server)

    assert error is None
    assert 0 < latency < 2
    assert tls_server.logins == ["user"]
    assert tls_server.messages == []


def test_test_connection_bad_password(tls_server: ScriptedSmtpServer) -> None:
    server = config(tls_server, security=Security.STARTTLS, username="user", password="wrong")

    latency, error = check_connection(server)

    assert error is not None
    assert error.startswith("535 5.7.8")
    assert latency >= 0


def test_password_never_appears_in_the_config_repr(tls_server: ScriptedSmtpServer) -> None:
    server = config(tls_server, username="user", password="hunter2")

    assert "hunter2" not in repr(server)
