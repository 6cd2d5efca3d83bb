"""A mail as it goes on the wire: the rendered mail (OutgoingMail, its attachments), the checks
that keep its addresses and headers from breaking the SMTP session, and its bytes (MIME, header
folding, dot-stuffing). Pure functions; the SMTP transport (``smtp``) sends what this builds.
"""

from __future__ import annotations

import binascii
import functools
import re
import secrets
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from email import policy, quoprimime
from email.headerregistry import Address
from email.message import EmailMessage
from email.utils import format_datetime, formataddr

from email_validator import EmailNotValidError, validate_email

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


# --- building ------------------------------------------------------------------------------


def _check_text(name: str, value: str) -> str:
    if _UNSAFE_HEADER_CHARS.search(value):
        raise ValueError(f"{name} must not contain CR, LF or NUL characters")
    return value


def check_address(name: str, value: str, *, utf8: bool = False) -> str:
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


def on_the_wire(mail: OutgoingMail) -> tuple[OutgoingMail, dict[str, str]]:
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
        check_address("address", address, utf8=True)
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
    return _Mailbox(display_name, check_address(name, value))


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
        check_address("Bcc", addr)
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


def envelope_recipients(mail: OutgoingMail) -> list[str]:
    seen: set[str] = set()
    recipients: list[str] = []
    for addr in [*mail.to, *mail.cc, *mail.bcc]:
        if addr.lower() not in seen:
            seen.add(addr.lower())
            recipients.append(addr)
    return recipients


def dot_stuffed(payload: bytes) -> bytes:
    """Quote leading dots and add the terminating ``.`` line (RFC 5321 4.5.2)."""
    data = _LEADING_DOTS.sub(b"..", payload)
    if not data.endswith(b"\r\n"):
        data += b"\r\n"
    return data + b".\r\n"
