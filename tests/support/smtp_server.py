"""A real SMTP server inside the test process (aiosmtpd), with replies that tests can script.

How the server answers is decided, in this order, by:

1. ``fail_next(n, reply, stage)``: the next n commands of that stage get ``reply``;
2. ``script(address, reply, stage)``: an exact address (case-insensitive) gets ``reply``;
3. the address's local part: ``m<code>`` (sender, at MAIL), ``r<code>`` (at RCPT),
   ``d<code>`` (at the end of DATA), e.g. ``r421@x.test`` -> ``421 4.3.0 try later``;
   ``hang@...`` and ``drop@...`` act at the end of DATA.

A reply is ``"550 5.1.1 no such user"``, a bare code (``"552"``: canned text below), ``"hang"``
(sleep ``hang_s`` then accept; the message is recorded before the sleep, as a server that
received it but answers late) or ``"drop"`` (close the connection without answering). Any 2xx
reply means "accept". A 421 reply closes the connection after it is sent, as real servers do.

Run ``python -m tests.support.smtp_server --port 1025`` for a sink printing one line a message.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import ipaddress
import re
import socket
import ssl
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from email import message_from_bytes, policy
from email.message import EmailMessage
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

from aiosmtpd.controller import Controller
from aiosmtpd.smtp import SMTP, AuthResult, Envelope, LoginPassword, Session
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

Stage = Literal["mail", "rcpt", "data", "auth"]
HANG = "hang"
DROP = "drop"

CANNED_REPLIES: dict[int, str] = {
    250: "250 2.0.0 OK",
    421: "421 4.3.0 try later",
    450: "450 4.2.1 mailbox busy",
    451: "451 4.3.0 local error in processing",
    452: "452 4.5.3 too many recipients",
    530: "530 5.7.0 authentication required",
    535: "535 5.7.8 authentication credentials invalid",
    550: "550 5.1.1 no such user",
    552: "552 5.3.4 message too big for system",
    553: "553 5.1.3 mailbox name not allowed",
    554: "554 5.7.1 message rejected",
}

_REPLY = re.compile(r"^(?P<code>[2-5]\d\d)(?:[ -](?P<text>.*))?$", re.DOTALL)
_LOCAL_PART = re.compile(r"^(?P<stage>[mrd])(?P<code>[2-5]\d\d)(?:$|[^0-9])", re.IGNORECASE)
_LOCAL_STAGE: dict[str, Stage] = {"m": "mail", "r": "rcpt", "d": "data"}


def normalise_reply(reply: str) -> str:
    """Expand a bare code to its canned reply; validate everything else."""
    reply = reply.strip()
    if reply in (HANG, DROP):
        return reply
    match = _REPLY.match(reply)
    if match is None:
        raise ValueError(f"not an SMTP reply, 'hang' or 'drop': {reply!r}")
    if match.group("text"):
        return reply
    code = int(match.group("code"))
    return CANNED_REPLIES.get(code, f"{code} scripted reply")


@dataclass(frozen=True)
class ReceivedMessage:
    """A message the server accepted (or received before hanging)."""

    mail_from: str
    rcpt_tos: list[str]
    raw: bytes
    message: EmailMessage
    connection: int  # 1-based number of the SMTP connection that delivered it

    @property
    def message_id(self) -> str | None:
        """The Message-ID header, as written by the client."""
        value = self.message["Message-ID"]
        return None if value is None else str(value)


def self_signed_certificate(hostname: str = "localhost") -> tuple[bytes, bytes]:
    """Return (certificate PEM, private key PEM) valid for ``hostname`` and 127.0.0.1."""
    key = ec.generate_private_key(ec.SECP256R1())  # EC: generated in about a millisecond
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hostname)])
    now = datetime.now(UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=5))
        .not_valid_after(now + timedelta(days=7))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName(hostname), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return certificate.public_bytes(serialization.Encoding.PEM), key_pem


def _server_tls_context(cert_pem: bytes, key_pem: bytes) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    # load_cert_chain only reads files; keep them just long enough to be read.
    with tempfile.TemporaryDirectory() as tmp:
        cert_path, key_path = Path(tmp, "cert.pem"), Path(tmp, "key.pem")
        cert_path.write_bytes(cert_pem)
        key_path.write_bytes(key_pem)
        context.load_cert_chain(cert_path, key_path)
    return context


class _BoundController(Controller):
    """A Controller serving on a socket bound beforehand, so port 0 gives a free port race-free."""

    def __init__(
        self, handler: Any, sock: socket.socket, *, auth_over_implicit_tls: bool, **kwargs: Any
    ) -> None:
        host, port = sock.getsockname()[:2]
        super().__init__(handler, hostname=host, port=port, **kwargs)
        self._sock = sock
        self._auth_over_implicit_tls = auth_over_implicit_tls

    def factory(self) -> SMTP:
        smtp = SMTP(self.handler, **self.SMTP_kwargs)  # what Controller.factory() does
        if self._auth_over_implicit_tls:
            # The whole connection is TLS but aiosmtpd only recognises STARTTLS; allowing AUTH
            # here is safe, and avoids passing auth_require_tls=False (which warns).
            smtp._auth_require_tls = False
        return smtp

    def _create_server(self) -> Any:
        return self.loop.create_server(self._factory_invoker, sock=self._sock, ssl=self.ssl_context)


class _Handler:
    """aiosmtpd hooks; all state lives on the ScriptedSmtpServer."""

    def __init__(self, owner: ScriptedSmtpServer) -> None:
        self.owner = owner

    async def handle_EHLO(
        self,
        server: SMTP,
        session: Session,
        envelope: Envelope,
        hostname: str,
        responses: list[str],
    ) -> list[str]:
        session.host_name = hostname  # the hook owns this (aiosmtpd contract)
        self.owner._register_connection(server)
        if self.owner.pipelining:
            # aiosmtpd reads each command line as it comes, pipelined or not; it only does
            # not say so.
            responses.insert(-1, "250-PIPELINING")
        return responses

    async def handle_HELO(
        self, server: SMTP, session: Session, envelope: Envelope, hostname: str
    ) -> str:
        session.host_name = hostname
        self.owner._register_connection(server)
        return f"250 {server.hostname}"

    async def handle_MAIL(
        self,
        server: SMTP,
        session: Session,
        envelope: Envelope,
        address: str,
        mail_options: list[str],
    ) -> str:
        status = await self._answer(server, self.owner._scripted("mail", [address]))
        if status is None:
            envelope.mail_from = address
            envelope.mail_options.extend(mail_options)
            return "250 OK"
        return status

    async def handle_RCPT(
        self,
        server: SMTP,
        session: Session,
        envelope: Envelope,
        address: str,
        rcpt_options: list[str],
    ) -> str:
        status = await self._answer(server, self.owner._scripted("rcpt", [address]))
        if status is None:
            envelope.rcpt_tos.append(address)
            envelope.rcpt_options.extend(rcpt_options)
            return "250 OK"
        return status

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        reply = self.owner._scripted("data", list(envelope.rcpt_tos))
        if reply is None or reply == HANG or reply.startswith("2"):
            number = self.owner._record(server, envelope)
            status = await self._answer(server, reply)
            return status or f"250 2.0.0 OK queued as {number}"
        status = await self._answer(server, reply)
        return status or "250 2.0.0 OK"

    async def _answer(self, server: SMTP, reply: str | None) -> str | None:
        """Carry out a scripted reply; None means "accept"."""
        if reply is None or reply.startswith("2"):
            return None
        if reply == HANG:
            # Cancelled (so interrupted) when the client disconnects or the server stops.
            await asyncio.sleep(self.owner.hang_s)
            return None
        if reply == DROP:
            if isinstance(server.transport, asyncio.Transport):
                server.transport.abort()
            # connection_lost() cancels this handler; never answer.
            await asyncio.get_running_loop().create_future()
        if reply.startswith("421"):
            # Close after the reply is written (close() flushes what is buffered).
            server.loop.call_soon(_close_transport, server)
        return reply


def _close_transport(server: SMTP) -> None:
    if server.transport is not None:
        server.transport.close()


class ScriptedSmtpServer:
    """A real SMTP server on 127.0.0.1 recording messages and answering as scripted.

    Thread-safe: aiosmtpd runs on its own thread; tests read state from theirs.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        tls: bool = False,
        implicit_tls: bool = False,
        auth_users: dict[str, str] | None = None,
        auth_require_tls: bool = True,
        hang_s: float = 5.0,
        idle_timeout_s: float = 300.0,
        data_size_limit: int = 32 * 1024 * 1024,
        on_message: Callable[[ReceivedMessage], None] | None = None,
        pipelining: bool = False,
    ) -> None:
        self.host = host
        self.port = port
        self.tls = tls  # STARTTLS offered
        self.implicit_tls = implicit_tls  # TLS from the first byte (SMTPS)
        self.auth_users = dict(auth_users or {})
        self.auth_require_tls = auth_require_tls  # False: allow AUTH over plain text
        self.hang_s = hang_s
        self.idle_timeout_s = idle_timeout_s
        self.data_size_limit = data_size_limit
        self.on_message = on_message
        self.pipelining = pipelining  # PIPELINING offered in the EHLO reply (RFC 2920)
        self.cert_pem: bytes | None = None

        self._lock = threading.Condition()
        self._messages: list[ReceivedMessage] = []
        self._scripts: dict[tuple[str, Stage], str] = {}
        self._fail_next: dict[Stage, collections.deque[str]] = collections.defaultdict(
            collections.deque
        )
        self._connection_numbers: weakref.WeakKeyDictionary[SMTP, int] = weakref.WeakKeyDictionary()
        self._connection_count = 0
        self._logins: list[str] = []
        self._controller: _BoundController | None = None

    # --- lifecycle -----------------------------------------------------------------------

    def __enter__(self) -> ScriptedSmtpServer:
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
        """Bind, generate the certificate if TLS is on, and serve on a background thread."""
        if self._controller is not None:
            raise RuntimeError("server already started")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]

        kwargs: dict[str, Any] = {
            "server_hostname": "smtp.test",  # skips aiosmtpd's getfqdn(), slow on some hosts
            "data_size_limit": self.data_size_limit,
            "timeout": self.idle_timeout_s,
        }
        if self.tls or self.implicit_tls:
            self.cert_pem, key_pem = self_signed_certificate()
            context = _server_tls_context(self.cert_pem, key_pem)
            if self.implicit_tls:
                kwargs["ssl_context"] = context
            else:
                kwargs["tls_context"] = context
        if self.auth_users:
            kwargs["authenticator"] = self._authenticate
            kwargs["auth_required"] = True
            kwargs["auth_require_tls"] = self.auth_require_tls
        controller = _BoundController(
            _Handler(self),
            sock,
            auth_over_implicit_tls=self.implicit_tls and bool(self.auth_users),
            **kwargs,
        )
        try:
            controller.start()
        except BaseException:
            sock.close()
            raise
        self._controller = controller

    def stop(self) -> None:
        """Drop client connections (interrupting any hang) and stop serving."""
        controller = self._controller
        if controller is None:
            return
        self.drop_connections()
        controller.stop()
        self._controller = None

    def drop_connections(self) -> None:
        """Close every open client connection, as a server restarting or timing out would."""
        controller = self._controller
        if controller is None:
            return
        future = asyncio.run_coroutine_threadsafe(self._drop_all(), controller.loop)
        future.result(timeout=5)

    async def _drop_all(self) -> None:
        with self._lock:
            protocols = list(self._connection_numbers)
        for protocol in protocols:
            if isinstance(protocol.transport, asyncio.Transport):
                protocol.transport.abort()
        deadline = time.monotonic() + 1.0
        # Wait for connection_lost so the client sees the close before this returns.
        while any(p.transport is not None for p in protocols) and time.monotonic() < deadline:
            await asyncio.sleep(0.002)

    # --- scripting -------------------------------------------------------------------------

    def script(self, address: str, reply: str, stage: Stage = "rcpt") -> None:
        """Answer ``reply`` whenever ``address`` shows up at ``stage``."""
        with self._lock:
            self._scripts[(address.lower(), stage)] = normalise_reply(reply)

    def fail_next(self, n: int, reply: str, stage: Stage = "data") -> None:
        """Answer ``reply`` to the next ``n`` commands of ``stage``, whoever the address."""
        reply = normalise_reply(reply)
        with self._lock:
            self._fail_next[stage].extend([reply] * n)

    def clear(self) -> None:
        """Forget messages, scripts, counters and logins."""
        with self._lock:
            self._messages.clear()
            self._scripts.clear()
            self._fail_next.clear()
            self._connection_count = 0
            self._logins.clear()

    def _scripted(self, stage: Stage, addresses: Iterable[str]) -> str | None:
        addresses = list(addresses)
        with self._lock:
            queue = self._fail_next.get(stage)
            if queue:
                return queue.popleft()
            for address in addresses:
                reply = self._scripts.get((address.lower(), stage))
                if reply is not None:
                    return reply
        for address in addresses:
            local = address.rpartition("@")[0].lower()
            match = _LOCAL_PART.match(local)
            if match and _LOCAL_STAGE[match.group("stage").lower()] == stage:
                return normalise_reply(match.group("code"))
            if stage == "data":
                for special in (HANG, DROP):
                    if local == special or local.startswith(f"{special}-"):
                        return special
        return None

    # --- recording -------------------------------------------------------------------------

    def _register_connection(self, server: SMTP) -> None:
        # Counted at the first EHLO/HELO: the controller's own start-up probe never says hello,
        # and a second EHLO after STARTTLS is the same connection.
        with self._lock:
            if server not in self._connection_numbers:
                self._connection_count += 1
                self._connection_numbers[server] = self._connection_count

    def _record(self, server: SMTP, envelope: Envelope) -> int:
        raw = envelope.original_content or b""
        if isinstance(envelope.content, bytes) and not raw:
            raw = envelope.content
        parsed = message_from_bytes(raw, policy=policy.default)
        with self._lock:
            received = ReceivedMessage(
                mail_from=envelope.mail_from or "",
                rcpt_tos=list(envelope.rcpt_tos),
                raw=raw,
                message=parsed,
                connection=self._connection_numbers.get(server, 0),
            )
            self._messages.append(received)
            number = len(self._messages)
            self._lock.notify_all()
        if self.on_message is not None:
            self.on_message(received)
        return number

    def _authenticate(
        self, server: SMTP, session: Session, envelope: Envelope, mechanism: str, auth_data: Any
    ) -> AuthResult:
        reply = self._scripted("auth", [])
        if reply is not None and not reply.startswith("2"):
            return AuthResult(success=False, handled=False, message=reply)
        if isinstance(auth_data, LoginPassword):
            login = auth_data.login.decode("utf-8", "replace")
            password = auth_data.password.decode("utf-8", "replace")
            if login in self.auth_users and self.auth_users[login] == password:
                with self._lock:
                    self._logins.append(login)
                return AuthResult(success=True)
        return AuthResult(success=False, handled=False)

    @property
    def messages(self) -> list[ReceivedMessage]:
        """Every message received so far, oldest first (a copy)."""
        with self._lock:
            return list(self._messages)

    @property
    def connection_count(self) -> int:
        """How many SMTP connections said EHLO/HELO since start (or clear())."""
        with self._lock:
            return self._connection_count

    @property
    def logins(self) -> list[str]:
        """User names that authenticated successfully, one entry per AUTH."""
        with self._lock:
            return list(self._logins)

    def count_by_message_id(self) -> dict[str, int]:
        """How many times each Message-ID was received (duplicates show as counts above 1)."""
        counts: collections.Counter[str] = collections.Counter(
            m.message_id or "" for m in self.messages
        )
        return dict(counts)

    def wait_for_messages(self, n: int, timeout_s: float = 2.0) -> list[ReceivedMessage]:
        """Wait until at least ``n`` messages arrived; raise TimeoutError otherwise."""
        with self._lock:
            if not self._lock.wait_for(lambda: len(self._messages) >= n, timeout_s):
                raise TimeoutError(f"{len(self._messages)} of {n} messages after {timeout_s} s")
            return list(self._messages)


def _print_message(message: ReceivedMessage) -> None:
    subject = message.message["Subject"] or ""
    print(
        f"{datetime.now(UTC):%H:%M:%S} {message.message_id} from={message.mail_from} "
        f"to={','.join(message.rcpt_tos)} subject={str(subject)!r} bytes={len(message.raw)}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    """Run a sink that accepts every message and prints one line per message."""
    parser = argparse.ArgumentParser(description="SMTP sink for development and tests")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=1025)
    parser.add_argument("--tls", action="store_true", help="offer STARTTLS (self-signed)")
    parser.add_argument(
        "--user", action="append", default=[], metavar="NAME:PASSWORD", help="require AUTH"
    )
    args = parser.parse_args(argv)
    users = dict(entry.split(":", 1) for entry in args.user)
    server = ScriptedSmtpServer(
        host=args.host,
        port=args.port,
        tls=args.tls,
        auth_users=users,
        auth_require_tls=args.tls,
        on_message=_print_message,
    )
    with server:
        try:
            print(f"SMTP sink listening on {server.host}:{server.port}", flush=True)
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
