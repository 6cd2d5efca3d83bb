"""SMTP transport: build a MIME message and send it over a connection kept open per server config.

Pure library (no Flask, no database). A delivery worker thread owns one ``SmtpConnectionPool``;
every failure comes back as ``SmtpSendError`` carrying the server's real reply code
(``"550 5.1.1"``) or ``"NETWORK_ERROR"`` / ``"TIMEOUT"`` / ``"CONFIG_ERROR"``, so the classifier
can tell temporary failures from permanent ones.
"""

from __future__ import annotations

import binascii
import functools
import logging
import re
import secrets
import smtplib
import socket
import ssl
import time
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from email import policy, quoprimime
from email.headerregistry import Address
from email.message import EmailMessage
from email.utils import format_datetime, formataddr
from enum import StrEnum
from types import TracebackType

from email_validator import EmailNotValidError, validate_email

from portal.messaging.sending import outbound
from portal.messaging.sending.classify import Reach, unavailable

__all__ = [
    "Attachment",
    "OutgoingMail",
    "Security",
    "SendResult",
    "SmtpConnectionPool",
    "SmtpSendError",
    "SmtpServer",
    "build_message",
    "connection_hint",
    "message_bytes",
    "test_connection",
    "wire_address",
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
_UNSAFE_HEADER_CHARS = re.compile(r"[\r\n\x00]")
# RFC 5322 field-name: printable ASCII except the colon.
_HEADER_NAME = re.compile(r"^[!-9;-~]+$")
# A bare addr-spec without quoting or comments: the caller validated the address already, this
# only keeps anything that could break the SMTP command line or the header out.
_ADDR_SPEC = re.compile(r"^[^\s<>()\[\],;:\"\\@]+@[^\s<>()\[\],;:\"\\@]+$")
_MESSAGE_ID = re.compile(r"^<[^\s<>@]+@[^\s<>@]+>$")
_CONTENT_TYPE = re.compile(r"^[A-Za-z0-9!#$&^_.+-]+/[A-Za-z0-9!#$&^_.+-]+$")
_LEADING_DOTS = re.compile(rb"(?m)^\.")

# Headers that build_message owns; extra_headers may not override them.
_RESERVED_HEADERS = frozenset(
    {
        "bcc",
        "cc",
        "content-disposition",
        "content-transfer-encoding",
        "content-type",
        "date",
        "disposition-notification-to",
        "from",
        "importance",
        "message-id",
        "mime-version",
        "reply-to",
        "return-path",
        "sender",
        "subject",
        "to",
        "x-priority",
    }
)

_PRIORITY_HEADERS: dict[int, tuple[str, str]] = {
    1: ("1 (Highest)", "high"),
    2: ("2 (High)", "high"),
    3: ("3 (Normal)", "normal"),
    4: ("4 (Low)", "low"),
    5: ("5 (Lowest)", "low"),
}


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


@dataclass(frozen=True)
class Attachment:
    """One file attached to a mail."""

    filename: str
    content_type: str
    data: bytes = field(repr=False)


@dataclass(frozen=True, kw_only=True)
class OutgoingMail:
    """A fully rendered mail, ready to be built and sent."""

    message_id: str  # "<rec-123.mail@postroom>", derived from the record id: same on every attempt
    from_addr: str
    from_name: str | None = None
    to: list[str] = field(default_factory=list)
    cc: list[str] = field(default_factory=list)
    bcc: list[str] = field(default_factory=list)
    reply_to: str | None = None
    subject: str = ""
    html: str | None = None
    text: str | None = None
    attachments: list[Attachment] = field(default_factory=list)
    priority: int | None = None  # 1 = highest .. 5 = lowest
    read_receipt_to: str | None = None
    extra_headers: dict[str, str] = field(default_factory=dict)
    date: datetime | None = None  # the Date header; None: now (an attempt's, for its .eml)


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


# --- building ------------------------------------------------------------------------------


def _check_text(name: str, value: str) -> str:
    if _UNSAFE_HEADER_CHARS.search(value):
        raise ValueError(f"{name} must not contain CR, LF or NUL characters")
    return value


def _check_address(name: str, value: str, *, utf8: bool = False) -> str:
    """``value`` when it can be written as it is: ASCII, or (``utf8``, for a server offering
    SMTPUTF8) a UTF-8 local part at an ASCII domain; ValueError otherwise."""
    _check_text(name, value)
    ascii_form = value.isascii() or (utf8 and value.rpartition("@")[2].isascii())
    if not ascii_form or not _ADDR_SPEC.match(value):
        raise ValueError(f"{name} is not a plain ASCII address: {value!r}")
    return value


@functools.lru_cache(maxsize=4096)
def _a_labels(domain: str) -> str:
    """The domain's ASCII form (IDNA A-labels), by the same rules as acceptance's check
    (email_validator's); ValueError when it has none."""
    try:
        ascii_domain = validate_email("a@" + domain, check_deliverability=False).ascii_domain
    except EmailNotValidError as exc:
        raise ValueError(f"the domain {domain!r} has no ASCII form: {exc}") from None
    if not ascii_domain:
        raise ValueError(f"the domain {domain!r} has no ASCII form")
    return ascii_domain


def wire_address(address: str) -> str:
    """The address as it goes into the envelope and the headers: an internationalised domain
    as its A-labels (``ann@exämple.com`` -> ``ann@xn--exmple-cua.com``), the local part as
    given. A non-ASCII local part stays: only SMTPUTF8 carries it (see ``needs_smtputf8``)."""
    local, at, domain = address.rpartition("@")
    if not at or domain.isascii():
        return address
    return f"{local}@{_a_labels(domain)}"


def needs_smtputf8(mail: OutgoingMail) -> bool:
    """Whether an address of the mail (on the wire) has a non-ASCII local part."""
    return not all(a.isascii() for a in _all_addresses(mail))


def _all_addresses(mail: OutgoingMail) -> list[str]:
    optional = [a for a in (mail.reply_to, mail.read_receipt_to) if a]
    return [mail.from_addr, *mail.to, *mail.cc, *mail.bcc, *optional]


def _on_the_wire(mail: OutgoingMail) -> tuple[OutgoingMail, dict[str, str]]:
    """The mail with every address in its wire form, and wire form -> address as given."""
    given: dict[str, str] = {}

    def wire(address: str) -> str:
        converted = wire_address(address)
        given.setdefault(converted, address)
        return converted

    def each(addresses: list[str]) -> list[str]:
        return [wire(a) for a in addresses]

    return (
        replace(
            mail,
            from_addr=wire(mail.from_addr),
            to=each(mail.to),
            cc=each(mail.cc),
            bcc=each(mail.bcc),
            reply_to=wire(mail.reply_to) if mail.reply_to else mail.reply_to,
            read_receipt_to=(
                wire(mail.read_receipt_to) if mail.read_receipt_to else mail.read_receipt_to
            ),
        ),
        given,
    )


def utf8_message_bytes(mail: OutgoingMail) -> bytes:
    """The message for an SMTPUTF8 transaction: as ``message_bytes``, with addresses whose
    local part is not ASCII written in UTF-8 in the headers (RFC 6532).

    The email package refuses such an address in a header, so the message is built with an
    ASCII stand-in for each one, which is then replaced in the header block only.
    """
    stand_ins: dict[str, str] = {}

    def ascii_only(address: str) -> str:
        if address.isascii():
            return address
        if address not in stand_ins:
            stand_ins[address] = (
                f"postroom-utf8-{secrets.token_hex(8)}@{address.rpartition('@')[2]}"
            )
        return stand_ins[address]

    for address in _all_addresses(mail):
        _check_address("address", address, utf8=True)
    ascii_mail = replace(
        mail,
        from_addr=ascii_only(mail.from_addr),
        to=[ascii_only(a) for a in mail.to],
        cc=[ascii_only(a) for a in mail.cc],
        bcc=[ascii_only(a) for a in mail.bcc],
        reply_to=ascii_only(mail.reply_to) if mail.reply_to else mail.reply_to,
        read_receipt_to=(
            ascii_only(mail.read_receipt_to) if mail.read_receipt_to else mail.read_receipt_to
        ),
    )
    data = message_bytes(ascii_mail)
    head, blank, body = data.partition(b"\r\n\r\n")
    for address, stand_in in stand_ins.items():
        head = head.replace(stand_in.encode("ascii"), address.encode("utf-8"))
    return head + blank + body


@dataclass(frozen=True, slots=True)
class _Mailbox:
    """A checked address and its display name (email.headerregistry.Address parses both
    again at every construction: build_message makes one only when it needs it)."""

    display_name: str
    addr_spec: str

    def header(self) -> Address:
        return Address(display_name=self.display_name, addr_spec=self.addr_spec)


def _address(name: str, value: str, display_name: str = "") -> _Mailbox:
    return _Mailbox(display_name, _check_address(name, value))


HeaderValue = str | _Mailbox | tuple[_Mailbox, ...]


def _header_fields(mail: OutgoingMail) -> list[tuple[str, HeaderValue]]:
    """The message's own headers, in order, checked; ValueError on unsafe or malformed input."""
    if not (mail.to or mail.cc or mail.bcc):
        raise ValueError("mail has no recipients")
    if not _MESSAGE_ID.match(mail.message_id):
        raise ValueError(f"Message-ID must look like <id@host>: {mail.message_id!r}")
    fields: list[tuple[str, HeaderValue]] = [
        ("Message-ID", mail.message_id),
        ("Date", format_datetime(mail.date or datetime.now(UTC))),
        ("From", _address("From", mail.from_addr, _check_text("From name", mail.from_name or ""))),
    ]
    if mail.to:
        fields.append(("To", tuple(_address("To", addr) for addr in mail.to)))
    if mail.cc:
        fields.append(("Cc", tuple(_address("Cc", addr) for addr in mail.cc)))
    for addr in mail.bcc:  # checked, never written: Bcc lives in the envelope only
        _check_address("Bcc", addr)
    if mail.reply_to:
        fields.append(("Reply-To", _address("Reply-To", mail.reply_to)))
    fields.append(("Subject", _check_text("Subject", mail.subject)))
    if mail.priority is not None:
        if mail.priority not in _PRIORITY_HEADERS:
            raise ValueError(f"priority must be 1..5, got {mail.priority!r}")
        x_priority, importance = _PRIORITY_HEADERS[mail.priority]
        fields += [("X-Priority", x_priority), ("Importance", importance)]
    if mail.read_receipt_to:
        # Not an address header in the stdlib registry (unstructured): write it as text.
        receipt = _address("Disposition-Notification-To", mail.read_receipt_to)
        fields.append(("Disposition-Notification-To", str(receipt.header())))
    for name, value in mail.extra_headers.items():
        if not _HEADER_NAME.match(name):
            raise ValueError(f"invalid header name: {name!r}")
        if name.lower() in _RESERVED_HEADERS:
            raise ValueError(f"header {name} is set from the mail itself, not extra_headers")
        fields.append((name, _check_text(name, value)))
    return fields


def build_message(mail: OutgoingMail) -> EmailMessage:
    """Build the MIME message (SMTP policy: CRLF); raise ValueError on unsafe or malformed input."""
    msg = EmailMessage(policy=policy.SMTP)
    for name, value in _header_fields(mail):
        if isinstance(value, _Mailbox):
            msg[name] = value.header()
        elif isinstance(value, tuple):
            msg[name] = tuple(mailbox.header() for mailbox in value)
        else:
            msg[name] = value

    if mail.text is not None and mail.html is not None:
        msg.set_content(mail.text)
        msg.add_alternative(mail.html, subtype="html")
    elif mail.html is not None:
        msg.set_content(mail.html, subtype="html")
    else:
        msg.set_content(mail.text or "")

    for attachment in mail.attachments:
        filename = _check_text("attachment filename", attachment.filename)
        content_type = attachment.content_type.strip().lower() or "application/octet-stream"
        if not _CONTENT_TYPE.match(content_type):
            raise ValueError(f"invalid attachment content type: {attachment.content_type!r}")
        maintype, subtype = content_type.split("/", 1)
        # add_attachment turns the body into multipart/mixed with the body as its first part.
        msg.add_attachment(attachment.data, maintype=maintype, subtype=subtype, filename=filename)
    return msg


# The wire form of the common mail (ASCII headers, one or two text bodies, no attachments),
# written directly. build_message's EmailMessage parses every header it is given into a
# syntax tree and folds that tree again on output: about 2 ms of CPU for a short mail here
# (0.07 ms written directly), a third of a worker's CPU per mail on a machine the database
# and the workers share.
# The bytes mean the same (tests compare both parsed, over generated mails): same headers,
# the same body encodings chosen by the same rules (email.contentmanager's for UTF-8 text
# under the SMTP policy). Anything else goes through build_message.

_MAX_LINE = 78  # policy.SMTP.max_line_length


def message_bytes(mail: OutgoingMail) -> bytes:
    """The message as sent (CRLF line ends, not dot-stuffed); raise ValueError as build_message."""
    fields = _header_fields(mail)
    lines = None if mail.attachments else _ascii_header_lines(fields)
    if lines is None:
        return build_message(mail).as_bytes()
    if mail.text is not None and mail.html is not None:
        parts = [_text_part(mail.text, "plain"), _text_part(mail.html, "html")]
        boundary = _boundary(parts)
        lines += [
            "Content-Type: multipart/alternative;",
            f' boundary="{boundary}"',
            "MIME-Version: 1.0",
        ]
        # The line break before a delimiter belongs to the delimiter (RFC 2046 5.1.1): each
        # part ends with one of its own and then the delimiter's, as the generator writes it.
        delimiter = b"--" + boundary.encode()
        body = b"\r\n" + b"".join(delimiter + b"\r\n" + part + b"\r\n" for part in parts)
        body += delimiter + b"--\r\n"
    elif mail.html is not None:
        body = _text_part(mail.html, "html", mime_version=True)
    else:
        body = _text_part(mail.text or "", "plain", mime_version=True)
    return "\r\n".join(lines).encode("ascii") + b"\r\n" + body


def _ascii_header_lines(fields: list[tuple[str, HeaderValue]]) -> list[str] | None:
    """The header lines, folded at spaces (addresses: after commas) to 78 characters; None
    when a value is not ASCII or will not fold so (RFC 2047 words: build_message's job)."""
    lines: list[str] = []
    for name, value in fields:
        if isinstance(value, str):
            words = value.split(" ")
            glue = " "
        else:
            addresses = (value,) if isinstance(value, _Mailbox) else value
            words = [formataddr((a.display_name, a.addr_spec)) for a in addresses]
            glue = ", "
        if not all(word.isascii() for word in words):
            return None
        folded = _fold(f"{name}:", words, glue)
        if folded is None:
            return None
        lines += folded
    return lines


def _fold(label: str, words: list[str], glue: str) -> list[str] | None:
    """``label`` and ``words`` joined by ``glue`` in lines of at most 78 characters, broken
    only before the space of a glue (unfolding gives the value back exactly); None when that
    cannot be done."""
    line = f"{label} {words[0]}"
    out: list[str] = []
    for word in words[1:]:
        if not word or len(line) + len(glue) + len(word) <= _MAX_LINE:
            line += glue + word
        else:
            out.append(line + glue[:-1])
            line = " " + word
    out.append(line)
    if any(len(one) > _MAX_LINE for one in out) or any(not one.strip() for one in out[1:]):
        return None
    return out


def _text_part(text: str, subtype: str, *, mime_version: bool = False) -> bytes:
    """A text part's headers and body in UTF-8, its transfer encoding chosen as set_content
    chooses it under the SMTP policy (7bit, 8bit, quoted-printable or base64)."""
    lines = text.encode("utf-8").splitlines()
    if max((len(line) for line in lines), default=0) <= _MAX_LINE:
        data = b"\r\n".join(lines) + b"\r\n"
        cte = "7bit" if data.isascii() else "8bit"
    else:
        sniff = b"\r\n".join(lines[:10]) + b"\r\n"
        sniff_qp = quoprimime.body_encode(sniff.decode("latin-1"), _MAX_LINE)
        if len(sniff_qp) > len(binascii.b2a_base64(sniff)):
            cte = "base64"
            whole = b"\r\n".join(lines) + b"\r\n"
            step = _MAX_LINE // 4 * 3
            data = b"".join(
                binascii.b2a_base64(whole[i : i + step]) for i in range(0, len(whole), step)
            )
        else:
            cte = "quoted-printable"
            source = sniff if len(lines) <= 10 else b"\n".join(lines) + b"\n"
            data = quoprimime.body_encode(source.decode("latin-1"), _MAX_LINE).encode("ascii")
        data = b"\r\n".join(data.splitlines()) + b"\r\n"
    head = f'Content-Type: text/{subtype}; charset="utf-8"\r\nContent-Transfer-Encoding: {cte}\r\n'
    if mime_version:
        head += "MIME-Version: 1.0\r\n"
    return head.encode("ascii") + b"\r\n" + data


def _boundary(parts: list[bytes]) -> str:
    while True:
        boundary = "=" * 15 + secrets.token_hex(12) + "=="
        if not any(boundary.encode() in part for part in parts):
            return boundary


def _envelope_recipients(mail: OutgoingMail) -> list[str]:
    seen: set[str] = set()
    recipients: list[str] = []
    for addr in [*mail.to, *mail.cc, *mail.bcc]:
        if addr.lower() not in seen:
            seen.add(addr.lower())
            recipients.append(addr)
    return recipients


def _dot_stuffed(payload: bytes) -> bytes:
    """Quote leading dots and add the terminating ``.`` line (RFC 5321 4.5.2)."""
    data = _LEADING_DOTS.sub(b"..", payload)
    if not data.endswith(b"\r\n"):
        data += b"\r\n"
    return data + b".\r\n"


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


@functools.cache
def _tls_context(verify: bool) -> ssl.SSLContext:
    context = ssl.create_default_context()
    if not verify:
        # Only for servers the operator explicitly marked as self-signed.
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


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
                context=_tls_context(server.verify_tls),
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
            code, reply = smtp.starttls(context=_tls_context(server.verify_tls))
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
            wired, given = _on_the_wire(mail)
            utf8 = needs_smtputf8(wired)
            payload = _dot_stuffed(utf8_message_bytes(wired) if utf8 else message_bytes(wired))
            sender = _check_address("From", wired.from_addr, utf8=utf8)
        except ValueError as exc:
            # Nothing was sent and no attempt would do better: the record fails at once.
            raise SmtpSendError(INVALID_INPUT, f"the mail cannot be written: {exc}") from exc
        recipients = _envelope_recipients(wired)
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
