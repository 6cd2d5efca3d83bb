"""SMTP PIPELINING (RFC 2920): where the server's EHLO offers it, MAIL FROM, the RCPT TOs and
DATA go out together; everything the transport promises without it holds with it.

The transport's tests (``test_smtp_transport.py``) run against a server offering PIPELINING
and one that does not; here, servers written line by line check what reaches the wire: the
group before any reply, one command at a time when PIPELINING is not offered, and the lone dot
after a DATA a server accepted with no recipient.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from portal.messaging.sending.transports import smtp as transport
from portal.messaging.sending.transports.smtp import SmtpConnectionPool, SmtpSendError
from tests.integration.test_smtp_transport import config, outgoing
from tests.support.smtp_server import ScriptedSmtpServer

pytestmark = pytest.mark.timeout(15)


@pytest.fixture
def smtp_server() -> Iterator[ScriptedSmtpServer]:
    """aiosmtpd offering PIPELINING."""
    with ScriptedSmtpServer(pipelining=True) as server:
        yield server


@pytest.fixture
def pool() -> Iterator[SmtpConnectionPool]:
    with SmtpConnectionPool(pipelining=True) as connection_pool:
        yield connection_pool


@pytest.fixture
def writes(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Every write of the transport's SMTP sessions, in order."""
    seen: list[bytes] = []
    original = transport.smtplib.SMTP.send

    def send(self: Any, s: Any) -> None:
        seen.append(s if isinstance(s, bytes) else s.encode())
        original(self, s)

    monkeypatch.setattr(transport.smtplib.SMTP, "send", send)
    return seen


def _commands(writes: list[bytes], since: int) -> list[list[bytes]]:
    """The writes after the first ``since``, each as its command lines (the payload's lines
    left out: from the write after DATA on)."""
    return [w.split(b"\r\n")[:-1] for w in writes[since:]]


def test_the_envelope_goes_out_in_one_write_when_offered(
    smtp_server: ScriptedSmtpServer, pool: SmtpConnectionPool, writes: list[bytes]
) -> None:
    server = config(smtp_server)
    pool.send(server, outgoing(message_id="<rec-1.mail@postroom>"))  # the session opens
    before = len(writes)

    result = pool.send(server, outgoing(to=["alice@example.test", "bob@example.test"]))

    group, payload = writes[before:]
    assert group.split(b"\r\n")[:-1] == [
        f"mail FROM:<sender@postroom.test> SIZE={len(payload)}".encode(),
        b"rcpt TO:<alice@example.test>",
        b"rcpt TO:<bob@example.test>",
        b"data",
    ]
    assert payload.endswith(b"\r\n.\r\n")
    assert result.accepted == ["alice@example.test", "bob@example.test"]
    assert len(smtp_server.messages) == 2


@pytest.mark.parametrize(
    ("offered", "wanted"), [(False, True), (True, False)], ids=["not-offered", "turned-off"]
)
def test_one_command_a_write_unless_offered_and_wanted(
    offered: bool, wanted: bool, writes: list[bytes]
) -> None:
    with (
        ScriptedSmtpServer(pipelining=offered) as server,
        SmtpConnectionPool(pipelining=wanted) as pool,
    ):
        pool.send(config(server), outgoing(message_id="<rec-1.mail@postroom>"))
        before = len(writes)

        pool.send(config(server), outgoing(to=["alice@example.test", "bob@example.test"]))

        assert [len(lines) for lines in _commands(writes, before)[:4]] == [1, 1, 1, 1]
        assert len(writes) - before == 5  # MAIL, RCPT, RCPT, DATA, the payload
        assert len(server.messages) == 2


def test_a_sender_refused_in_a_group_drains_the_replies_and_the_session_stays_usable(
    smtp_server: ScriptedSmtpServer, pool: SmtpConnectionPool
) -> None:
    server = config(smtp_server)

    with pytest.raises(SmtpSendError) as caught:
        pool.send(server, outgoing(from_addr="m553@postroom.test", to=["r550@example.test"]))

    # MAIL's refusal, not the RCPT's or DATA's "503 need MAIL" that followed it in the group.
    assert caught.value.code == "553 5.1.3"
    assert caught.value.refused == {}
    pool.send(server, outgoing())
    assert smtp_server.connection_count == 1
    assert len(smtp_server.messages) == 1


def test_every_recipient_refused_in_a_group_keeps_each_reply(
    smtp_server: ScriptedSmtpServer, pool: SmtpConnectionPool
) -> None:
    server = config(smtp_server)

    with pytest.raises(SmtpSendError) as caught:
        pool.send(server, outgoing(to=["r550@example.test"], cc=["r452@example.test"]))

    assert caught.value.code == "550 5.1.1"
    assert caught.value.refused == {
        "r550@example.test": (550, "5.1.1 no such user"),
        "r452@example.test": (452, "4.5.3 too many recipients"),
    }
    assert transport.refusals(caught.value.refused) == {
        "r550@example.test": ("550 5.1.1", "no such user"),
        "r452@example.test": ("452 4.5.3", "too many recipients"),
    }
    pool.send(server, outgoing())
    assert smtp_server.connection_count == 1


@pytest.mark.parametrize("pipelining", [True, False], ids=["pipelined", "in-turn"])
@pytest.mark.parametrize("stage", ["mail", "rcpt"])
def test_a_server_silent_at_a_stage_times_out_at_that_stage(pipelining: bool, stage: str) -> None:
    with (
        ScriptedSmtpServer(pipelining=True, hang_s=3.0) as server,
        SmtpConnectionPool(pipelining=pipelining) as pool,
    ):
        server.fail_next(1, "hang", stage=stage)  # type: ignore[arg-type]
        started = time.monotonic()

        with pytest.raises(SmtpSendError) as caught:
            pool.send(config(server, read_timeout_s=0.5), outgoing())

        assert (caught.value.code, caught.value.message) == ("TIMEOUT", f"{stage}: timed out")
        assert caught.value.after_data is False
        assert time.monotonic() - started < 2.0  # one timeout, no second try
        assert pool.open_keys == []
        assert server.connection_count == 1


def test_a_group_larger_than_one_write_allows_is_sent_in_parts(
    smtp_server: ScriptedSmtpServer,
    pool: SmtpConnectionPool,
    writes: list[bytes],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(transport, "_PIPELINE_GROUP", 2)
    to = [f"user{n}@example.test" for n in range(4)]
    server = config(smtp_server)
    pool.send(server, outgoing(message_id="<rec-1.mail@postroom>"))
    before = len(writes)

    result = pool.send(server, outgoing(to=to[:2], cc=["r550@example.test"], bcc=to[2:]))

    # MAIL + RCPT, RCPT + RCPT, RCPT + RCPT, DATA, then the payload.
    assert [len(lines) for lines in _commands(writes, before)[:4]] == [2, 2, 2, 1]
    assert result.accepted == to
    assert set(result.refused) == {"r550@example.test"}


# --- servers written line by line ----------------------------------------------------------


class LineServer:
    """One SMTP connection on 127.0.0.1 served by ``script(conversation)`` on a thread."""

    def __init__(self, script: Callable[[Conversation], None]) -> None:
        self.script = script
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.host = "127.0.0.1"
        self.failure: BaseException | None = None
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> LineServer:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.listener.close()
        self.thread.join(5)
        if self.failure is not None:
            raise self.failure

    def _serve(self) -> None:
        try:
            sock, _ = self.listener.accept()
            with sock:
                sock.settimeout(5)
                self.script(Conversation(sock))
        except BaseException as exc:
            self.failure = exc


class Conversation:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""
        self.lines: list[bytes] = []  # every line received, in order

    def say(self, *replies: str) -> None:
        self.sock.sendall(b"".join(r.encode() + b"\r\n" for r in replies))

    def line(self) -> bytes:
        while b"\r\n" not in self.buffer:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("the client closed the connection")
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\r\n")
        self.lines.append(line)
        return line

    def waiting(self, within_s: float = 0.2) -> bool:
        """Whether more has arrived (or arrives within ``within_s``) beyond the lines read."""
        if self.buffer:
            return True
        self.sock.settimeout(within_s)
        try:
            chunk = self.sock.recv(65536)
        except TimeoutError:
            return False
        finally:
            self.sock.settimeout(5)
        self.buffer += chunk
        return bool(chunk)

    def greet(self, *extensions: str) -> None:
        self.say("220 line.test ESMTP")
        assert self.line().lower().startswith(b"ehlo ")
        self.say("250-line.test", *(f"250-{e}" for e in extensions), "250 8BITMIME")

    def message(self) -> bytes:
        body = []
        while (line := self.line()) != b".":
            body.append(line)
        return b"\r\n".join(body)


def _server_config(server: LineServer) -> Any:
    return transport.SmtpServer(
        key="line@v1",
        host=server.host,
        port=server.port,
        security=transport.Security.PLAIN,
        username=None,
        password=None,
        connect_timeout_s=2.0,
        read_timeout_s=2.0,
        local_hostname="worker.test",
    )


def test_the_whole_group_arrives_before_the_server_answers_any_of_it() -> None:
    def script(talk: Conversation) -> None:
        talk.greet("PIPELINING")
        # Not a single reply until DATA is in: a client waiting for MAIL's reply would hang.
        commands = [talk.line() for _ in range(4)]
        assert [c.split(b":")[0] for c in commands] == [
            b"mail FROM",
            b"rcpt TO",
            b"rcpt TO",
            b"data",
        ]
        talk.say("250 2.1.0 ok", "250 2.1.5 ok", "550 5.1.1 no such user", "354 go ahead")
        assert b"Subject: Hello" in talk.message()
        talk.say("250 2.0.0 queued as X1")
        assert talk.line().lower() == b"quit"
        talk.say("221 bye")

    with LineServer(script) as server, SmtpConnectionPool(pipelining=True) as pool:
        result = pool.send(
            _server_config(server), outgoing(to=["alice@example.test", "gone@example.test"])
        )

        assert result.accepted == ["alice@example.test"]
        assert result.refused == {"gone@example.test": (550, "5.1.1 no such user")}
        assert result.reply == "2.0.0 queued as X1"


def test_without_pipelining_offered_each_command_waits_for_its_reply() -> None:
    def script(talk: Conversation) -> None:
        talk.greet("SIZE 1000000")
        for reply in ("250 ok", "250 ok", "250 ok", "354 go ahead"):
            command = talk.line()
            assert not talk.waiting(), f"{command!r} came with more behind it"
            talk.say(reply)
        talk.message()
        talk.say("250 queued")
        assert talk.line().lower() == b"quit"
        talk.say("221 bye")

    with LineServer(script) as server, SmtpConnectionPool(pipelining=True) as pool:
        result = pool.send(
            _server_config(server), outgoing(to=["alice@example.test", "bob@example.test"])
        )

        assert result.accepted == ["alice@example.test", "bob@example.test"]


def test_data_accepted_with_no_recipient_is_ended_by_a_lone_dot_and_reset() -> None:
    def script(talk: Conversation) -> None:
        talk.greet("PIPELINING")
        for _ in range(3):
            talk.line()
        # A server that answers DATA with 354 although it refused the only recipient.
        talk.say("250 ok", "550 5.1.1 no such user", "354 go ahead")
        assert talk.line() == b"."  # the lone dot: no message
        talk.say("554 5.5.1 no valid recipients")
        assert talk.line().lower() == b"rset"
        talk.say("250 reset")
        # The session goes on: the next mail on the same connection.
        for _ in range(3):
            talk.line()
        talk.say("250 ok", "250 ok", "354 go ahead")
        talk.message()
        talk.say("250 queued")
        assert talk.line().lower() == b"quit"
        talk.say("221 bye")

    with LineServer(script) as server, SmtpConnectionPool(pipelining=True) as pool:
        with pytest.raises(SmtpSendError) as caught:
            pool.send(_server_config(server), outgoing(to=["gone@example.test"]))

        assert caught.value.code == "550 5.1.1"
        assert caught.value.refused == {"gone@example.test": (550, "5.1.1 no such user")}
        assert caught.value.after_data is False
        pool.send(_server_config(server), outgoing())
