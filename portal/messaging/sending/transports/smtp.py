"""SMTP transport: build a MIME message and send it over a connection kept open per server config.

Pure library (no Flask, no database). A delivery worker thread owns one ``SmtpConnectionPool``;
every failure comes back as ``SmtpSendError`` carrying the server's real reply code
(``"550 5.1.1"``) or ``"NETWORK_ERROR"`` / ``"TIMEOUT"`` / ``"CONFIG_ERROR"``, so the classifier
can tell temporary failures from permanent ones.
"""

from __future__ import annotations

import functools
import logging
import re
import smtplib
import socket
import time
from dataclasses import dataclass, field
from enum import StrEnum
from types import TracebackType

from portal.messaging.sending import outbound
from portal.messaging.sending.classify import Reach, unavailable
from portal.messaging.sending.transports.mail_message import (
    OutgoingMail,
    check_address,
    dot_stuffed,
    envelope_recipients,
    message_bytes,
    needs_smtputf8,
    on_the_wire,
    utf8_message_bytes,
)

__all__ = [
    "Security",
    "SendResult",
    "SmtpConnectionPool",
    "SmtpSendError",
    "SmtpServer",
    "connection_hint",
    "test_connection",
]

log = logging.getLogger(__name__)

NETWORK_ERROR = "NETWORK_ERROR"
TIMEOUT = "TIMEOUT"
# The server cannot be used as configured (STARTTLS or AUTH not offered, no usable AUTH
# mechanism): retrying will not help until someone edits the server config.
CONFIG_ERROR = "CONFIG_ERROR"
# The mail cannot be written as given: an address with a non-ASCII local part to a server that
# does not offer SMTPUTF8, or an address whose domain has no ASCII form. Every attempt would
# fail the same way.
INVALID_INPUT = "INVALID_INPUT"

# QUIT on a connection we are dropping anyway must not stall the worker for a full read timeout.
_QUIT_TIMEOUT_S = 1.0

_ENHANCED_STATUS = re.compile(r"^[245]\.\d{1,3}\.\d{1,3}")


class Security(StrEnum):
    """How the connection to the SMTP server is secured."""

    PLAIN = "plain"
    STARTTLS = "starttls"
    SSL = "ssl"


@dataclass(frozen=True)
class SmtpServer:
    """Connection settings of one SMTP server config at one version."""

    key: str  # config id + version: a saved change gets a new key, hence a new connection
    host: str
    port: int
    security: Security
    username: str | None
    password: str | None = field(repr=False)  # never in logs
    connect_timeout_s: float
    read_timeout_s: float
    verify_tls: bool = True
    local_hostname: str | None = None
    # Whether the host may resolve to private and reserved addresses: the caller decides by the
    # config's tier (portal.messaging.sending.outbound.allows_private); every connection checks it.
    allow_private: bool = True


@dataclass
class SendResult:
    """What the server accepted; partially refused recipients are listed in ``refused``."""

    accepted: list[str]
    refused: dict[str, tuple[int, str]]
    elapsed_s: float
    reply: str = ""  # the server's final reply text, often with its queue id


class SmtpSendError(Exception):
    """A send that failed, with the server's reply code or a connection-problem code."""

    def __init__(
        self,
        code: str,
        message: str,
        *,
        refused: dict[str, tuple[int, str]] | None = None,
        after_data: bool = False,
        connection: bool = False,
    ) -> None:
        super().__init__(f"{code} {message}")
        self.code = code
        self.message = message
        self.refused: dict[str, tuple[int, str]] = dict(refused or {})
        # True when the whole payload was written but no final reply was read: the server may
        # have accepted the mail, so resending risks a duplicate.
        self.after_data = after_data
        # True when the server failed before it could take any mail (no connection, TLS, a
        # refusing greeting, EHLO/STARTTLS): its circuit breaker counts these, and only these.
        self.connection = connection


# --- errors --------------------------------------------------------------------------------


def _decode(reply: bytes | str) -> str:
    return reply.decode("utf-8", "replace") if isinstance(reply, bytes) else reply


def _reply_error(
    code: int, reply: bytes | str, *, refused: dict[str, tuple[int, str]] | None = None
) -> SmtpSendError:
    """Turn an SMTP reply into an error coded "550 5.1.1" (or "550" without enhanced status)."""
    text = _decode(reply).strip()
    if code < 0:  # smtplib's marker for a reply line it could not parse
        return SmtpSendError(NETWORK_ERROR, f"unparseable reply: {text}", refused=refused)
    match = _ENHANCED_STATUS.match(text)
    if match is None:
        return SmtpSendError(str(code), text, refused=refused)
    enhanced = match.group(0)
    # Every line of a multi-line reply repeats the status; keep it once, in the code.
    lines = [line.removeprefix(enhanced).strip() for line in text.split("\n")]
    return SmtpSendError(f"{code} {enhanced}", "\n".join(lines), refused=refused)


def refusals(refused: dict[str, tuple[int, str]]) -> dict[str, tuple[str, str]]:
    """Each refused recipient's reply as ``(code, text)``, coded as a send's error is
    ("550 5.1.1"), so the suppression list can read which of them are gone for good."""
    coded = {}
    for address, (code, reply) in refused.items():
        error = _reply_error(code, reply)
        coded[address] = (error.code, error.message)
    return coded


def _caused_by_timeout(exc: BaseException) -> bool:
    # smtplib re-raises socket timeouts as SMTPServerDisconnected; the timeout is in the chain.
    seen: BaseException | None = exc
    for _ in range(10):
        if seen is None:
            return False
        if isinstance(seen, TimeoutError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _exception_error(exc: BaseException, stage: str, *, after_data: bool = False) -> SmtpSendError:
    """Map an smtplib / socket exception raised during ``stage`` to an SmtpSendError."""
    if isinstance(exc, smtplib.SMTPResponseException):
        # Includes SMTPAuthenticationError (535/530) and SMTPConnectError (bad greeting).
        return _reply_error(exc.smtp_code, exc.smtp_error)
    detail = str(exc) or type(exc).__name__
    if _caused_by_timeout(exc):
        return SmtpSendError(TIMEOUT, f"{stage}: timed out", after_data=after_data)
    if isinstance(exc, smtplib.SMTPServerDisconnected):
        return SmtpSendError(NETWORK_ERROR, f"{stage}: {detail}", after_data=after_data)
    if isinstance(exc, smtplib.SMTPException):
        return SmtpSendError(CONFIG_ERROR, f"{stage}: {detail}")
    return SmtpSendError(NETWORK_ERROR, f"{stage}: {detail}", after_data=after_data)


# --- connections ---------------------------------------------------------------------------


@functools.cache
def _default_local_hostname() -> str:
    # getfqdn() can block on a slow resolver; resolve once per process, not once per connection.
    return socket.getfqdn()


class _Checked(smtplib.SMTP):
    """SMTP connecting to the address the outbound policy checked (no second lookup); the
    host name stays the TLS server name, for SSL and STARTTLS alike."""

    allow_private = True

    def _get_socket(self, host: str, port: int, timeout: float) -> socket.socket:
        return outbound.connect(host, port, timeout, allow_private=self.allow_private)


class _CheckedSSL(smtplib.SMTP_SSL, _Checked):
    """SMTP_SSL wraps what ``_Checked._get_socket`` connected."""


# How far a session being opened had got, for ``classify.unavailable`` (the breaker's input):
# up to STARTTLS it is still being set up (the connection, TLS, the greeting, EHLO), the server's
# own state whoever's mail it is; by the login the server has answered, and a refused login is
# our credentials (AUTH), never the server being down.
_SESSION_REACH = {
    "connect": Reach.CONNECT,
    "ehlo": Reach.CONNECT,
    "starttls": Reach.CONNECT,
    "auth": Reach.ANSWERED,
}


def _open(server: SmtpServer) -> smtplib.SMTP:
    """Connect, EHLO, STARTTLS and log in; raise SmtpSendError on any failure."""
    local_hostname = server.local_hostname or _default_local_hostname()
    smtp: smtplib.SMTP | None = None
    stage = "connect"
    try:
        # The connect timeout covers TCP, the TLS handshake (SSL) and the greeting. The host goes
        # to connect() because STARTTLS checks the certificate against it.
        if server.security == Security.SSL:
            smtp = _CheckedSSL(
                local_hostname=local_hostname,
                timeout=server.connect_timeout_s,
                context=outbound.tls_context(server.verify_tls),
            )
        else:
            smtp = _Checked(local_hostname=local_hostname, timeout=server.connect_timeout_s)
        smtp.allow_private = server.allow_private
        smtp._host = server.host  # type: ignore[attr-defined]  # TLS name; set by __init__ only
        smtp.connect(server.host, server.port)
        if smtp.sock is None:
            raise smtplib.SMTPServerDisconnected("no socket after connect")
        smtp.sock.settimeout(server.read_timeout_s)
        stage = "ehlo"
        smtp.ehlo_or_helo_if_needed()
        if server.security == Security.STARTTLS:
            stage = "starttls"
            # Raises SMTPNotSupportedError when STARTTLS is not offered: never fall back to
            # plain text when the config asks for TLS.
            code, reply = smtp.starttls(context=outbound.tls_context(server.verify_tls))
            if code != 220:
                raise smtplib.SMTPResponseException(code, reply)
            stage = "ehlo"
            smtp.ehlo_or_helo_if_needed()
        if server.username:
            stage = "auth"
            smtp.login(server.username, server.password or "")
    except OSError as exc:  # smtplib.SMTPException is an OSError too
        if smtp is not None:
            smtp.close()
        error = _exception_error(exc, stage)
        error.connection = unavailable(_SESSION_REACH[stage])
        raise error from exc
    except outbound.Refused as exc:
        if smtp is not None:
            smtp.close()
        raise SmtpSendError(CONFIG_ERROR, f"the server is refused: {exc}") from exc
    except UnicodeError as exc:
        # smtplib encodes AUTH credentials as ASCII.
        if smtp is not None:
            smtp.close()
        raise SmtpSendError(CONFIG_ERROR, f"{stage}: {exc}") from exc
    except BaseException:
        if smtp is not None:
            smtp.close()
        raise
    return smtp


def _quit_quietly(smtp: smtplib.SMTP) -> None:
    try:
        if smtp.sock is not None:
            smtp.sock.settimeout(_QUIT_TIMEOUT_S)
            smtp.quit()
    except OSError:
        pass  # the server may have gone already; we are closing anyway
    finally:
        smtp.close()


@dataclass
class _Connection:
    smtp: smtplib.SMTP
    last_used: float


class _StaleConnection(Exception):
    """A reused connection turned out dead before anything of the mail was committed."""

    def __init__(self, error: SmtpSendError) -> None:
        super().__init__(str(error))
        self.error = error


class SmtpConnectionPool:
    """One open SMTP connection per server key, reused across sends.

    Not thread-safe by design: each delivery worker thread owns its own pool, so a connection is
    never used by two sends at once and no lock sits on the send path.

    ``pipelining``: where the server's EHLO offers PIPELINING (RFC 2920), MAIL FROM, the
    RCPT TOs and DATA go out together and their replies are read afterwards, one round trip
    instead of two or more; every reply is still read and handled as when each command waits
    for its own (``_transact``). The class default is what the delivery workers use.
    """

    pipelining: bool = True

    def __init__(self, idle_timeout_s: float = 60.0, *, pipelining: bool | None = None) -> None:
        self.idle_timeout_s = idle_timeout_s
        if pipelining is not None:
            self.pipelining = pipelining
        self._connections: dict[str, _Connection] = {}

    def __enter__(self) -> SmtpConnectionPool:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close_all()

    @property
    def open_keys(self) -> list[str]:
        """Server keys that currently have an open connection."""
        return list(self._connections)

    def send(self, server: SmtpServer, mail: OutgoingMail) -> SendResult:
        """Send one mail; raise SmtpSendError (server refused / connection failed) or ValueError."""
        started = time.monotonic()
        try:
            # Internationalised domains go out as A-labels; a non-ASCII local part needs
            # SMTPUTF8, which only the server's EHLO can tell.
            wired, given = on_the_wire(mail)
            utf8 = needs_smtputf8(wired)
            payload = dot_stuffed(utf8_message_bytes(wired) if utf8 else message_bytes(wired))
            sender = check_address("From", wired.from_addr, utf8=utf8)
        except ValueError as exc:
            # Nothing was sent and no attempt would do better: the record fails at once.
            raise SmtpSendError(INVALID_INPUT, f"the mail cannot be written: {exc}") from exc
        recipients = envelope_recipients(wired)
        self.close_idle(now=started)
        try:
            return self._send_on(server, sender, recipients, payload, started, utf8=utf8)
        except SmtpSendError as error:
            error.refused = {given.get(a, a): reply for a, reply in error.refused.items()}
            raise

    def _send_on(
        self,
        server: SmtpServer,
        sender: str,
        recipients: list[str],
        payload: bytes,
        started: float,
        *,
        utf8: bool,
    ) -> SendResult:
        connection = self._connections.get(server.key)
        if connection is not None:
            try:
                return self._transact(
                    server, connection, sender, recipients, payload, started, utf8=utf8
                )
            except _StaleConnection as stale:
                # Servers close idle connections; nothing was committed, so one fresh try is safe.
                log.info("smtp connection to %s was stale (%s); reconnecting", server.host, stale)

        connection = self._connect(server)
        try:
            return self._transact(
                server, connection, sender, recipients, payload, started, utf8=utf8
            )
        except _StaleConnection as stale:
            raise stale.error from stale.__cause__

    def close_idle(self, now: float | None = None) -> None:
        """Close connections not used for ``idle_timeout_s`` (also old keys of edited configs)."""
        now = time.monotonic() if now is None else now
        for key, connection in list(self._connections.items()):
            if now - connection.last_used > self.idle_timeout_s:
                self._discard(key, polite=True)

    def close_all(self) -> None:
        """QUIT and close every open connection."""
        for key in list(self._connections):
            self._discard(key, polite=True)

    def _connect(self, server: SmtpServer) -> _Connection:
        connection = _Connection(_open(server), time.monotonic())
        self._connections[server.key] = connection
        return connection

    def _discard(self, key: str, *, polite: bool = False) -> None:
        connection = self._connections.pop(key, None)
        if connection is None:
            return
        if polite:
            _quit_quietly(connection.smtp)
        else:
            connection.smtp.close()

    def _after_reply_error(self, key: str, code: int) -> None:
        """Make the session ready for the next mail: RSET, or drop it if the server is leaving."""
        connection = self._connections.get(key)
        if connection is None:
            return
        if code == 421:  # the server is closing the channel
            self._discard(key)
            return
        try:
            rset_code, _ = connection.smtp.rset()
        except OSError:
            self._discard(key)
            return
        if rset_code != 250:
            self._discard(key)
        else:
            connection.last_used = time.monotonic()

    def _transact(
        self,
        server: SmtpServer,
        connection: _Connection,
        sender: str,
        recipients: list[str],
        payload: bytes,
        started: float,
        *,
        utf8: bool = False,
    ) -> SendResult:
        """Run MAIL / RCPT / DATA on an open connection (with SMTPUTF8 when ``utf8``).

        The commands go out one at a time, each after the previous reply, or, where the server
        offers PIPELINING, together (``_Envelope``); the replies are handled the same way in
        both: in order, each under its own stage (its timeout, its error), and a transaction
        given up early (sender refused, every recipient refused) drains the replies still
        owed before its RSET.
        """
        # Lower-level calls instead of sendmail(): only they tell "failed before the payload was
        # written" (safe to resend) from "failed waiting for the final reply" (ambiguous).
        smtp = connection.smtp
        if utf8 and not smtp.has_extn("smtputf8"):
            # Nothing sent yet: the session stays clean for the next mail.
            connection.last_used = time.monotonic()
            raise SmtpSendError(
                INVALID_INPUT,
                "an address has non-ASCII letters before the @, and this mail server does not "
                "accept such addresses (it does not offer SMTPUTF8): the mail cannot be sent "
                "to it as written",
            )
        options = [f"SIZE={len(payload)}"] if smtp.has_extn("size") else []
        if utf8:
            options.append("SMTPUTF8")
            if smtp.has_extn("8bitmime"):
                options.append("BODY=8BITMIME")
        envelope = _Envelope(
            smtp,
            sender,
            options,
            recipients,
            utf8=utf8,
            pipelined=self.pipelining and smtp.has_extn("pipelining"),
        )
        refused = envelope.refused
        try:
            code, reply = envelope.reply()  # MAIL FROM
            if code != 250:
                error = _reply_error(code, reply)
                if code == 421:
                    # On a reused connection this is typically the idle timeout announced late.
                    self._discard(server.key)
                    raise _StaleConnection(error)
                self._given_up(server.key, envelope, code)
                raise error

            accepted: list[str] = []
            for recipient in recipients:
                code, reply = envelope.reply()  # RCPT TO
                if code in (250, 251):
                    accepted.append(recipient)
                    continue
                refused[recipient] = (code, _decode(reply).strip())
                if code == 421:
                    self._discard(server.key)
                    raise _reply_error(code, reply, refused=refused)
            if not accepted:
                first_code, first_reply = next(iter(refused.values()))
                self._given_up(server.key, envelope, first_code)
                raise _reply_error(first_code, first_reply, refused=refused)

            code, reply = envelope.reply()  # DATA
            if code != 354:
                self._after_reply_error(server.key, code)
                raise _reply_error(code, reply, refused=refused)

            envelope.stage = "payload"
            smtp.send(payload)
            envelope.stage = "final reply"
            code, reply = smtp.getreply()
        except smtplib.SMTPResponseException as exc:
            self._discard(server.key)
            raise _reply_error(exc.smtp_code, exc.smtp_error, refused=refused) from exc
        except OSError as exc:
            self._discard(server.key)
            stage = envelope.stage
            error = _exception_error(exc, stage, after_data=stage == "final reply")
            error.refused = refused
            if stage in ("mail", "rcpt", "data") and error.code != TIMEOUT:
                # Dropped before any of the payload went out: resending on a new connection
                # cannot duplicate the mail.
                raise _StaleConnection(error) from exc
            raise error from exc
        except (SmtpSendError, _StaleConnection):
            raise
        except BaseException:
            # Unknown state mid-transaction: never reuse this session.
            self._discard(server.key)
            raise

        connection.last_used = time.monotonic()
        if code != 250:
            # The transaction is over either way; the session stays usable unless it was a 421.
            if code == 421:
                self._discard(server.key)
            raise _reply_error(code, reply, refused=refused)
        return SendResult(
            accepted=accepted,
            refused=refused,
            elapsed_s=time.monotonic() - started,
            reply=_decode(reply).strip(),
        )

    def _given_up(self, key: str, envelope: _Envelope, code: int) -> None:
        """The transaction ends before DATA (sender or every recipient refused): read the
        replies still owed to pipelined commands, then RSET as ``_after_reply_error`` does. A
        session that fails while draining is dropped; the refusal is still what is raised."""
        try:
            envelope.drain()
        except OSError:
            self._discard(key)
            return
        self._after_reply_error(key, code)


# At most this many commands go out before their replies are read: RFC 2920 asks a client not
# to write so much that the server's replies fill its receive buffer while it is still writing
# (each side then waits for the other). A hundred RCPTs' replies are about 3 KB.
_PIPELINE_GROUP = 100


class _Envelope:
    """MAIL FROM, one RCPT TO per recipient and DATA, written when their replies are wanted:
    one at a time, or (``pipelined``) in groups of up to ``_PIPELINE_GROUP`` ending with DATA
    at the latest. ``stage`` names the command whose reply is being waited for (the stage of a
    timeout or a dropped connection); ``refused`` collects the recipients' refusals."""

    def __init__(
        self,
        smtp: smtplib.SMTP,
        sender: str,
        options: list[str],
        recipients: list[str],
        *,
        utf8: bool,
        pipelined: bool,
    ) -> None:
        self.smtp = smtp
        self.pipelined = pipelined
        self.stage = "mail"
        self.refused: dict[str, tuple[int, str]] = {}
        # The commands as smtplib's mail(), rcpt() and putcmd("data") write them.
        optionlist = " " + " ".join(options) if options and smtp.does_esmtp else ""
        encoding = "utf-8" if utf8 else "ascii"
        self._stages = ["mail", *(["rcpt"] * len(recipients)), "data"]
        self._lines = [
            _command(f"mail FROM:{smtplib.quoteaddr(sender)}{optionlist}", encoding),
            *(_command(f"rcpt TO:{smtplib.quoteaddr(r)}", encoding) for r in recipients),
            b"data\r\n",
        ]
        self._written = 0  # commands written
        self._read = 0  # replies read
        self._data_code = 0  # DATA's reply code, once read

    def reply(self) -> tuple[int, bytes]:
        """The next command's reply, writing it (and, pipelined, the commands after it in its
        group) first if it has not gone out yet."""
        index = self._read
        self.stage = self._stages[index]
        if self._written <= index:
            size = _PIPELINE_GROUP if self.pipelined else 1
            group = self._lines[index : index + size]
            self.smtp.send(b"".join(group))
            self._written = index + len(group)
        code, reply = self.smtp.getreply()
        self._read += 1
        if self._stages[index] == "data":
            self._data_code = code
        return code, reply

    def drain(self) -> None:
        """Read the replies of commands written but not yet answered; had DATA been accepted
        (a server that answers 354 although no recipient was), end the empty message with a
        lone dot (RFC 2920 3.1) and read its reply, so the session can be RSET."""
        while self._read < self._written:
            self.reply()
        if self._data_code == 354:
            self.stage = "payload"
            self.smtp.send(b".\r\n")
            self.stage = "final reply"
            self.smtp.getreply()


def _command(line: str, encoding: str) -> bytes:
    """One command line, refused as smtplib's putcmd refuses it (a CR or LF inside)."""
    if "\r" in line or "\n" in line:
        raise ValueError(f"command and arguments contain prohibited newline characters: {line!r}")
    return line.encode(encoding) + b"\r\n"


def test_connection(server: SmtpServer) -> tuple[float, str | None]:
    """Connect, EHLO, STARTTLS, log in and QUIT; return (latency in seconds, error or None)."""
    started = time.monotonic()
    try:
        smtp = _open(server)
    except SmtpSendError as exc:
        return time.monotonic() - started, str(exc)
    latency = time.monotonic() - started
    _quit_quietly(smtp)
    return latency, None


# pytest would otherwise try to collect the function above when a test imports it by name.
test_connection.__test__ = False  # type: ignore[attr-defined]


def shown_error(error: str) -> str:
    """A failed connection test as a person configuring the server is shown it: the reply code
    or what failed, never the server's own words (a tenant must not read what some service on
    the far side of a host and port says; ``connection_hint`` explains the raw error)."""
    code, _, rest = error.partition(" ")
    if code == CONFIG_ERROR and rest.startswith("the server is refused"):
        return rest[:1].upper() + rest[1:]
    if code == TIMEOUT:
        return "No answer in time."
    if code == NETWORK_ERROR:
        return "The connection failed."
    if code == CONFIG_ERROR:
        return "The settings cannot be used for a connection."
    if code[:3].isdigit():
        return f"The server answered with reply code {code[:3]}."
    return "The connection failed."


def connection_hint(server: SmtpServer, error: str) -> str | None:
    """What a failed connection test most likely means, in plain words, and what to change
    (the raw error, e.g. ``[SSL: WRONG_VERSION_NUMBER]``, names no setting); None when the
    error says nothing we recognise."""
    text = error.lower()
    where = f"{server.host}:{server.port}"
    if any(k in text for k in ("wrong_version_number", "unknown protocol", "record layer")):
        return (
            f"Port {server.port} does not start with TLS: it speaks plain SMTP first and "
            "then switches with STARTTLS. Choose STARTTLS (usually port 587 or 25), or SSL "
            "on port 465."
        )
    implicit_tls_port = server.port == 465 and server.security is not Security.SSL
    if implicit_tls_port and any(k in text for k in ("timed out", "unexpectedly closed")):
        return "Port 465 expects TLS from the first byte: choose SSL, or port 587 with STARTTLS."
    if "auth extension not supported" in text:
        if server.security is Security.PLAIN:
            return (
                "The server offers login only over an encrypted connection: choose STARTTLS "
                "(or SSL on port 465)."
            )
        return (
            "The server offers no login on this port: clear Username and Password if it "
            "needs none, or use its submission port (587) with STARTTLS."
        )
    if "starttls extension not supported" in text:
        return (
            f"The server does not offer STARTTLS on port {server.port}: choose SSL if it is "
            "port 465, Plain only on a trusted network, or use its submission port (587)."
        )
    if "certificate verify failed" in text or "certificate_verify_failed" in text:
        return (
            f"The server's certificate is not valid for {server.host}: use the host name on "
            "its certificate, or, for a server of your own with a self-signed certificate, "
            "turn off certificate checking for it."
        )
    if "connection refused" in text:
        return f"Nothing accepts connections on {where}: check the host and the port."
    if any(k in text for k in ("name or service not known", "name resolution", "nodename")):
        return f"The host name {server.host} does not resolve: check its spelling."
    if text.startswith(("535", "534", "530")) or "authentication" in text:
        return "The server refused the username or password: check both (and the account)."
    if "timed out" in text:
        return (
            f"No answer from {where} in time: check the host and the port; a firewall may "
            "be dropping the connection."
        )
    return None
