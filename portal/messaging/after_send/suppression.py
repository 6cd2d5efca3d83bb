"""The suppression list: recipients a tenant must not send to on a channel.

Fed by permanent bounces and complaints, and managed by hand. A row is active while its
``removed_at`` is NULL; removing keeps the row (who, when, why), so the list is its own history.
There is at most one active row per (tenant, channel, address): ``suppress`` is idempotent.

Every function works in the caller's session and transaction and commits nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
from collections.abc import Mapping
from enum import StrEnum

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from portal.messaging.records import timeline
from portal.messaging.records.addresses import AddressError, parse_phone_number
from portal.models import (
    Channel,
    MailSendRecord,
    RecordEventKind,
    SmsSendRecord,
    Suppression,
    db_now,
)

MAX_ADDRESS_CHARS = 320


class SuppressionReason(StrEnum):
    HARD_BOUNCE = "hard_bounce"
    COMPLAINT = "complaint"
    MANUAL = "manual"


class InvalidAddress(ValueError):
    """The address is not a mail address or phone number this list can hold."""


def normalise(channel: Channel | str, address: str) -> str:
    """The form an address is stored and looked up in: mail lower-cased, SMS in E.164."""
    if Channel(channel) is Channel.SMS:
        try:
            e164, _country = parse_phone_number(address, "address")
        except AddressError as exc:
            raise InvalidAddress(exc.message) from None
        return e164
    value = address.strip() if isinstance(address, str) else ""
    if value.startswith("<") and value.endswith(">"):
        value = value[1:-1].strip()
    local, at, domain = value.rpartition("@")
    if not at or not local or not domain or len(value) > MAX_ADDRESS_CHARS:
        raise InvalidAddress(f"{address!r} is not a mail address")
    if any(c.isspace() for c in value):
        raise InvalidAddress(f"{address!r} is not a mail address")
    return value.lower()


def hashed(address: str) -> str:
    """A forgotten recipient's suppression keeps this instead of the address."""
    return "sha256:" + hashlib.sha256(address.encode()).hexdigest()


def active(
    session: Session, tenant_id: int, channel: Channel | str, address: str
) -> Suppression | None:
    """The active suppression of this address, or None."""
    return session.scalar(
        select(Suppression)
        .where(
            Suppression.tenant_id == tenant_id,
            Suppression.channel == Channel(channel).value,
            Suppression.address.in_(
                [normalise(channel, address), hashed(normalise(channel, address))]
            ),
            Suppression.removed_at.is_(None),
        )
        .order_by(Suppression.id)
        .limit(1)
    )


def suppress(
    session: Session,
    tenant_id: int,
    channel: Channel | str,
    address: str,
    reason: SuppressionReason | str,
    *,
    detail: str | None = None,
    by: str | None = None,
    record_id: int | None = None,
) -> Suppression:
    """Put an address on the list; an address already on it keeps its row (first reason wins)."""
    reason = SuppressionReason(reason)
    channel = Channel(channel)
    normalised = normalise(channel, address)
    _lock(session, tenant_id, channel, normalised)
    existing = active(session, tenant_id, channel, normalised)
    if existing is not None:
        return existing
    row = Suppression(
        tenant_id=tenant_id,
        channel=channel.value,
        address=normalised,
        reason=reason.value,
        detail=detail[:2000] if detail else None,
        source_record_id=record_id,
        created_by=by[:MAX_ADDRESS_CHARS] if by else None,
    )
    session.add(row)
    session.flush()
    return row


def unsuppress(
    session: Session,
    tenant_id: int,
    channel: Channel | str,
    address: str,
    *,
    by: str,
    reason: str,
) -> bool:
    """Take an address off the list (the row stays, marked removed); False if it was not on it."""
    if not reason or not reason.strip():
        raise ValueError("a reason is required to take an address off the suppression list")
    channel = Channel(channel)
    normalised = normalise(channel, address)
    _lock(session, tenant_id, channel, normalised)
    rows = session.scalars(
        select(Suppression).where(
            Suppression.tenant_id == tenant_id,
            Suppression.channel == channel.value,
            Suppression.address == normalised,
            Suppression.removed_at.is_(None),
        )
    ).all()
    for row in rows:
        row.removed_at = db_now()  # the database clock, like created_time
        row.removed_by = by[:MAX_ADDRESS_CHARS]
        row.removal_reason = reason.strip()[:2000]
    session.flush()
    return bool(rows)


# SMTP enhanced statuses that name the recipient's address as bad for good (RFC 3463): the
# destination mailbox does not exist (5.1.1), nor its domain (5.1.2), it is malformed (5.1.3),
# moved away (5.1.6), its domain takes no mail (5.1.10), the mailbox is disabled (5.2.1).
# Statuses about the sender (5.1.7, 5.1.8), policy (5.7.x) or size (5.2.2, 5.3.4) say nothing
# about the address, and a bare 550 may have come at MAIL FROM: none of those suppresses.
_ADDRESS_GONE = frozenset({"5.1.1", "5.1.2", "5.1.3", "5.1.6", "5.1.10", "5.2.1"})
_ENHANCED = re.compile(r"^5\d\d[ -](5\.\d{1,3}\.\d{1,3})(?!\d)")
# The SMS adapters' codes for a number the provider will never deliver to: not a valid
# mobile number, or barred or unsubscribed there (``transports.sms.result.SmsErrorCode``).
_NUMBER_GONE = frozenset({"SMS_INVALID_RECIPIENT", "SMS_RECIPIENT_REFUSED"})
REFUSED_BY = "refused at send"  # the list's "by whom" for a refusal a send met


def refuses_recipient(channel: Channel | str, code: str | None) -> bool:
    """Whether a server's or provider's answer with ``code`` refuses the recipient for good,
    as a hard bounce does: an SMTP enhanced status naming the address as gone, or an SMS
    provider's code for a number it never delivers to."""
    normalised = (code or "").strip()
    if Channel(channel) is Channel.SMS:
        return normalised.upper() in _NUMBER_GONE
    match = _ENHANCED.match(normalised)
    return match is not None and match.group(1) in _ADDRESS_GONE


def recipients(record: MailSendRecord | SmsSendRecord) -> list[str]:
    """A record's distinct recipients as the list holds them (the number of an SMS; the To,
    Cc and Bcc of a mail), in order; an address the list cannot hold is left out."""
    if isinstance(record, SmsSendRecord):
        raw, channel = ([record.phone_number] if record.phone_number else []), Channel.SMS
    else:
        raw = [*(record.to_addrs or []), *(record.cc_addrs or []), *(record.bcc_addrs or [])]
        channel = Channel.MAIL
    found: list[str] = []
    for address in raw:
        try:
            normalised = normalise(channel, address)
        except InvalidAddress:
            continue
        if normalised not in found:
            found.append(normalised)
    return found


def suppress_refused(
    session: Session,
    channel: Channel | str,
    record_id: int,
    tenant_id: int,
    code: str | None,
    message: str | None,
    *,
    refused: Mapping[str, tuple[str, str]] | None = None,
) -> list[str]:
    """A send refused for good because of its recipient puts that recipient on its tenant's
    list, as a hard bounce does (``reason`` hard_bounce, the refusal as the detail, the record
    as its source); taken off the list the same way. Called where the failure is written, in
    its transaction.

    ``refused`` (mail): each recipient the server refused with its own reply, so each one gone
    for good is listed, however many the mail had. Without it, the send's answer names the
    recipient only when the record has one: a refusal of several by one reply does not say
    which is gone. Returns the addresses put on the list (none when no answer says a
    recipient is gone)."""
    channel = Channel(channel)
    gone: dict[str, tuple[str | None, str | None]] = {}
    if refused:
        for address, (own_code, own_text) in refused.items():
            if refuses_recipient(channel, own_code):
                with contextlib.suppress(InvalidAddress):
                    gone.setdefault(normalise(channel, address), (own_code, own_text))
    if not gone and refuses_recipient(channel, code):
        record: MailSendRecord | SmsSendRecord | None = (
            session.get(SmsSendRecord, record_id)
            if channel is Channel.SMS
            else session.get(MailSendRecord, record_id)
        )
        addresses = recipients(record) if record is not None else []
        if len(addresses) == 1:
            gone[addresses[0]] = (code, message)
    for address, (said_code, said_text) in gone.items():
        suppress(
            session,
            tenant_id,
            channel,
            address,
            SuppressionReason.HARD_BOUNCE,
            detail=" ".join(x for x in (said_code, said_text) if x),
            by=REFUSED_BY,
            record_id=record_id,
        )
        timeline.note(
            session,
            channel,
            record_id,
            tenant_id,
            RecordEventKind.SUPPRESSED,
            code=said_code,
            message=f"{address} put on the suppression list: the answer refuses it for good",
        )
    return list(gone)


def _lock(session: Session, tenant_id: int, channel: Channel, address: str) -> None:
    """Serialise writers of one address until the caller's transaction ends (PostgreSQL), so
    two bounces of the same address processed at once leave one active row. SQLite writers
    are serialised by its database lock (BEGIN IMMEDIATE) already."""
    if session.get_bind().dialect.name != "postgresql":
        return
    digest = hashlib.sha256(f"suppression:{tenant_id}:{channel.value}:{address}".encode()).digest()
    session.execute(select(func.pg_advisory_xact_lock(int.from_bytes(digest[:8], signed=True))))


__all__ = [
    "InvalidAddress",
    "SuppressionReason",
    "active",
    "normalise",
    "recipients",
    "refuses_recipient",
    "suppress",
    "suppress_refused",
    "unsuppress",
]
