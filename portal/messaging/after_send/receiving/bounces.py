"""What a received message says: a delivery status notification (RFC 3464), a read receipt
(a message disposition notification, RFC 8098), or something else.

Pure functions of the message bytes (no I/O). DSNs are read with the standard library's email
package; a bounce without a machine-readable part (Exim's X-Failed-Recipients, qmail, older
Postfix and the like) is recognised by flufl.bounce's detectors, and only in a message that looks
machine-generated, so an ordinary reply quoting an address is never taken for a bounce.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from email import message_from_bytes, policy
from email.header import decode_header, make_header
from email.message import Message
from email.parser import HeaderParser
from email.utils import getaddresses, parseaddr, parsedate_to_datetime
from enum import StrEnum

import flufl.bounce

MAX_DIAGNOSTIC_CHARS = 2000


class Kind(StrEnum):
    BOUNCE = "bounce"
    READ_RECEIPT = "read_receipt"
    OTHER = "other"


class Severity(StrEnum):
    PERMANENT = "permanent"
    TEMPORARY = "temporary"


@dataclass(frozen=True)
class RecipientStatus:
    """One recipient's fate as a bounce reports it."""

    recipient: str | None  # lower-cased address: Final-Recipient, else Original-Recipient
    original_recipient: str | None
    action: str | None  # failed | delayed | delivered | relayed | expanded
    status: str | None  # enhanced status code, "5.1.1"
    diagnostic: str | None  # "550 5.1.1 <ann@example.com>: Recipient address rejected ..."

    @property
    def severity(self) -> Severity | None:
        """Permanent for a 5.x.x status or a given-up delivery; temporary for 4.x.x / delayed."""
        if self.status and self.status.startswith("5"):
            return Severity.PERMANENT
        if self.action == "failed":
            return Severity.PERMANENT
        if self.action == "delayed" or (self.status and self.status.startswith("4")):
            return Severity.TEMPORARY
        return None

    @property
    def hard(self) -> bool:
        """The address itself is bad (5.x.x): worth suppressing. A delivery given up after
        4.x.x (say 4.4.7, expired) failed the mail but says nothing lasting about the address."""
        return self.severity is Severity.PERMANENT and (self.status or "5").startswith("5")

    @property
    def code(self) -> str | None:
        """``"550 5.1.1"``: the SMTP reply code from the diagnostic and the enhanced status."""
        return bounce_code(self.diagnostic, self.status)


@dataclass(frozen=True)
class Bounce:
    recipients: tuple[RecipientStatus, ...]
    source: str  # "dsn" (RFC 3464 report) or "heuristic" (flufl.bounce)

    @property
    def severity(self) -> Severity | None:
        found = {r.severity for r in self.recipients}
        if Severity.PERMANENT in found:
            return Severity.PERMANENT
        if Severity.TEMPORARY in found:
            return Severity.TEMPORARY
        return None

    @property
    def first(self) -> RecipientStatus | None:
        """The recipient that decides the code: the first permanent one, else the first."""
        wanted = self.severity
        for r in self.recipients:
            if r.severity is wanted:
                return r
        return self.recipients[0] if self.recipients else None


@dataclass(frozen=True)
class ReadReceipt:
    original_message_id: str | None
    disposition: str  # "manual-action/MDN-sent-manually; displayed"
    final_recipient: str | None
    date: datetime | None  # when the receipt was written (the reader's clock)

    @property
    def displayed(self) -> bool:
        """Shown to the reader (RFC 8098 "displayed"); "deleted" or "processed" are not reads."""
        _, _, kind = self.disposition.partition(";")
        return kind.strip().lower().split("/")[0].strip() == "displayed"


@dataclass(frozen=True)
class Report:
    """Everything we use from one received message."""

    kind: Kind
    message_id: str | None
    from_addr: str | None
    subject: str | None
    bounce: Bounce | None
    receipt: ReadReceipt | None
    referenced_ids: tuple[str, ...]  # Message-IDs of the original, most trusted first


# --- entry points ----------------------------------------------------------------------------


def parse(raw: bytes) -> Message:
    """The message as the standard library reads it (compat32: lenient with broken mail)."""
    return message_from_bytes(raw, policy=policy.compat32)


def read(raw: bytes) -> Report:
    """Classify a received message and pull out what applying it needs."""
    msg = parse(raw)
    bounce: Bounce | None = None
    receipt: ReadReceipt | None = None
    kind = Kind.OTHER
    param = msg.get_param("report-type", header="content-type")
    report_type = param.lower() if isinstance(param, str) else ""
    parts = list(msg.walk())
    dsn = [p for p in parts if p.get_content_type() == "message/delivery-status"]
    mdn = [p for p in parts if p.get_content_type() == "message/disposition-notification"]
    embedded = [h for p in parts for h in _embedded_headers(p)]
    if dsn or report_type == "delivery-status":
        bounce = _read_dsn(dsn)
        if bounce is None and looks_automatic(msg):
            bounce = _read_heuristic(msg)  # a report without readable recipient fields
        elif bounce is not None and bounce.severity is None:
            bounce = None  # a success report ("delivered", "relayed"): not a bounce
    elif mdn or report_type == "disposition-notification":
        receipt = _read_mdn(mdn, msg)
        kind = Kind.READ_RECEIPT
    elif looks_automatic(msg):
        bounce = _read_heuristic(msg)
    if bounce is not None:
        kind = Kind.BOUNCE
    # Most trusted first: the report's own fields, then the original's headers it carries,
    # then the threading headers some MTAs and mail programs set.
    ids: list[str] = []
    if receipt is not None and receipt.original_message_id:
        ids.append(receipt.original_message_id)
    for headers in embedded:
        ids.extend(message_ids(_all(headers, "Message-ID")))
    for header in ("In-Reply-To", "References"):
        ids.extend(message_ids(_all(msg, header)))
    if kind is Kind.BOUNCE:
        # A bounce without a machine-readable part quotes the original as text.
        ids.extend(_quoted_message_ids(msg))
    return Report(
        kind=kind,
        message_id=_first_id(msg.get("Message-ID")),
        from_addr=_address(msg.get("From")),
        subject=header_text(msg.get("Subject")),
        bounce=bounce,
        receipt=receipt,
        referenced_ids=tuple(dict.fromkeys(ids)),
    )


# --- DSN (RFC 3464) --------------------------------------------------------------------------


def _read_dsn(parts: list[Message]) -> Bounce | None:
    recipients: list[RecipientStatus] = []
    for part in parts:
        # The first block is per message (Reporting-MTA ...), the rest per recipient; a block
        # is taken for a recipient's by its fields, for MTAs that leave the first one out.
        for block in _field_blocks(part):
            if not any(block.get(f) for f in ("Final-Recipient", "Original-Recipient", "Action")):
                continue
            final = _typed_address(block.get("Final-Recipient"))
            original = _typed_address(block.get("Original-Recipient"))
            recipients.append(
                RecipientStatus(
                    recipient=final or original,
                    original_recipient=original,
                    action=(_unfold(block.get("Action")) or "").lower() or None,
                    status=_status(block.get("Status")),
                    diagnostic=_diagnostic(block.get("Diagnostic-Code")),
                )
            )
    return Bounce(tuple(recipients), "dsn") if recipients else None


def _field_blocks(part: Message) -> list[Message]:
    """A message/delivery-status body as blocks of fields (the email package usually splits
    it already; an encoded or oddly declared one is split here)."""
    payload = part.get_payload()
    if isinstance(payload, list):
        return [p for p in payload if isinstance(p, Message)]
    text = _text(part)
    chunks = re.split(r"\r?\n\s*\r?\n", text.strip())
    return [HeaderParser().parsestr(chunk.strip() + "\n") for chunk in chunks if chunk.strip()]


# --- MDN (RFC 8098) --------------------------------------------------------------------------


def _read_mdn(parts: list[Message], msg: Message) -> ReadReceipt:
    fields: Message | None = None
    for part in parts:
        blocks = _field_blocks(part)
        if blocks:
            fields = blocks[0]
            break
    disposition = _unfold(fields.get("Disposition")) if fields is not None else None
    original = _first_id(fields.get("Original-Message-ID")) if fields is not None else None
    final = _typed_address(fields.get("Final-Recipient")) if fields is not None else None
    return ReadReceipt(
        original_message_id=original,
        disposition=disposition or "",
        final_recipient=final,
        date=_date(msg.get("Date")),
    )


# --- bounces without a report ----------------------------------------------------------------


_AUTOMATIC_SENDERS = re.compile(r"^(mailer-daemon|postmaster|mail-daemon|mmdf)\b", re.I)


def looks_automatic(msg: Message) -> bool:
    """Machine-generated mail: a null return path, a daemon sender, Auto-Submitted, or Exim's
    X-Failed-Recipients (the only kinds of message flufl.bounce's heuristics are run on)."""
    if msg.get("X-Failed-Recipients"):
        return True
    auto = (_unfold(msg.get("Auto-Submitted")) or "no").lower()
    if auto != "no":
        return True
    return_path = _unfold(msg.get("Return-Path"))
    if return_path is not None and return_path.strip("<> ") == "":
        return True
    sender = _address(msg.get("From")) or ""
    return bool(_AUTOMATIC_SENDERS.match(sender))


def _read_heuristic(msg: Message) -> Bounce | None:
    temporary, permanent = flufl.bounce.all_failures(msg)
    if not temporary and not permanent:
        return None
    text = "\n".join(_text(p) for p in msg.walk() if p.get_content_type() == "text/plain")
    found_status, line = _code_in_text(text)
    recipients: list[RecipientStatus] = []
    for severity, addresses in (
        (Severity.PERMANENT, permanent),
        (Severity.TEMPORARY, temporary),
    ):
        klass = "5" if severity is Severity.PERMANENT else "4"
        # The code in the text counts only when it agrees with the detector's verdict.
        agrees = found_status is not None and found_status.startswith(klass)
        for address in sorted(addresses):
            recipients.append(
                RecipientStatus(
                    recipient=address.decode("ascii", "replace").strip("<>").lower(),
                    original_recipient=None,
                    action="failed" if severity is Severity.PERMANENT else "delayed",
                    status=found_status if agrees else f"{klass}.0.0",
                    diagnostic=line if agrees else None,
                )
            )
    return Bounce(tuple(recipients), "heuristic")


_REPLY_AND_STATUS = re.compile(r"\b([45]\d\d)[ -]#?([45]\.\d{1,3}\.\d{1,3})\b")
_STATUS = re.compile(r"(?<![\d.])#?([45]\.\d{1,3}\.\d{1,3})(?![\d.])")
_REPLY = re.compile(r"^\s*([45]\d\d)(?:[ -]|$)")


def _code_in_text(text: str) -> tuple[str | None, str | None]:
    """(enhanced status, the line it stands on) from a human-readable bounce; a line with a
    reply code and a status ("550 5.1.1", "550-5.1.1") wins over a bare status ("#5.1.1")."""
    lines = text.splitlines()
    for pattern in (_REPLY_AND_STATUS, _STATUS):
        for line in lines:
            m = pattern.search(line)
            if m:
                return m.group(m.lastindex or 1), _clip(" ".join(line.split()))
    return None, None


def bounce_code(diagnostic: str | None, status: str | None) -> str | None:
    """``"550 5.1.1"`` from a diagnostic and a status; whichever half is known alone."""
    reply = None
    if diagnostic:
        m = _REPLY.match(diagnostic)
        if m:
            reply = m.group(1)
        elif (pair := _REPLY_AND_STATUS.search(diagnostic)) is not None:
            reply = pair.group(1)
            status = status or pair.group(2)
        if status is None and (found := _STATUS.search(diagnostic)) is not None:
            status = found.group(1)
    if reply and status:
        return f"{reply} {status}"
    return reply or status


# --- Message-IDs -----------------------------------------------------------------------------


_MESSAGE_ID = re.compile(r"<[^<>\s]+@[^<>\s]+>")
_QUOTED_MESSAGE_ID = re.compile(r"^\s*>?\s*Message-ID:\s*(<[^<>\s]+@[^<>\s]+>)", re.I | re.M)


def message_ids(values: Iterable[str]) -> list[str]:
    """Every ``<id@host>`` in header values, in order."""
    return [m.group(0) for value in values for m in _MESSAGE_ID.finditer(value)]


def _first_id(value: object) -> str | None:
    found = message_ids([str(value)]) if value is not None else []
    return found[0] if found else None


def _embedded_headers(part: Message) -> Iterator[Message]:
    """The original's headers, from a message/rfc822 or text/rfc822-headers part."""
    ctype = part.get_content_type()
    if ctype in ("message/rfc822", "message/global"):
        payload = part.get_payload()
        if isinstance(payload, list):
            yield from (p for p in payload if isinstance(p, Message))
    elif ctype in ("text/rfc822-headers", "message/rfc822-headers", "message/global-headers"):
        yield HeaderParser().parsestr(_text(part))


def _quoted_message_ids(msg: Message) -> list[str]:
    """Message-ID lines of an original quoted as text (Exim's "copy of the message")."""
    found: list[str] = []
    for part in msg.walk():
        if part.get_content_type() == "text/plain":
            found.extend(m.group(1) for m in _QUOTED_MESSAGE_ID.finditer(_text(part)))
    return found


# --- small readers ---------------------------------------------------------------------------


def _all(msg: Message, name: str) -> list[str]:
    return [str(v) for v in msg.get_all(name, [])]


def _unfold(value: object) -> str | None:
    if value is None:
        return None
    text = " ".join(str(value).split())
    return text or None


def _clip(text: str | None) -> str | None:
    return text[:MAX_DIAGNOSTIC_CHARS] if text else text


def _typed_address(value: object) -> str | None:
    """``rfc822; Ann@Example.com`` -> ``ann@example.com``."""
    text = _unfold(value)
    if not text:
        return None
    _, sep, address = text.partition(";")
    address = (address if sep else text).strip().strip("<>").strip()
    return address.lower() or None


def _status(value: object) -> str | None:
    text = _unfold(value)
    if not text:
        return None
    m = re.match(r"([245])\.(\d{1,3})\.(\d{1,3})", text)
    return m.group(0) if m else None


def _diagnostic(value: object) -> str | None:
    """``smtp; 550 5.1.1 ...`` -> ``550 5.1.1 ...`` (the diagnostic type dropped)."""
    text = _unfold(value)
    if not text:
        return None
    kind, sep, rest = text.partition(";")
    if sep and re.fullmatch(r"[A-Za-z][A-Za-z0-9-]*", kind.strip()):
        text = rest.strip()
    return _clip(text)


def _address(value: object) -> str | None:
    if value is None:
        return None
    _, address = parseaddr(header_text(value) or "")
    if not address:
        pairs = getaddresses([str(value)])
        address = pairs[0][1] if pairs else ""
    return address.lower() or None


def header_text(value: object) -> str | None:
    """A header value as text, encoded words decoded, whitespace unfolded."""
    if value is None:
        return None
    try:
        text = str(make_header(decode_header(str(value))))
    except (LookupError, UnicodeError, ValueError):
        text = str(value)
    return _unfold(text)


def _date(value: object) -> datetime | None:
    if value is None:
        return None
    try:
        when = parsedate_to_datetime(str(value))
    except (TypeError, ValueError, IndexError):
        return None
    return when if when.tzinfo is not None else None


def _text(part: Message) -> str:
    payload = part.get_payload(decode=True)
    if isinstance(payload, bytes):
        charset = part.get_content_charset() or "utf-8"
        try:
            return payload.decode(charset, "replace")
        except LookupError:
            return payload.decode("utf-8", "replace")
    raw = part.get_payload()
    return raw if isinstance(raw, str) else ""


__all__ = [
    "Bounce",
    "Kind",
    "ReadReceipt",
    "RecipientStatus",
    "Report",
    "Severity",
    "bounce_code",
    "header_text",
    "looks_automatic",
    "message_ids",
    "parse",
    "read",
]
