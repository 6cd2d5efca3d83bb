"""The suppression list: recipients a tenant must not send to on a channel.

Fed by permanent bounces and complaints, and managed by hand. A row is active while its
``removed_at`` is NULL; removing keeps the row (who, when, why), so the list is its own history.
There is at most one active row per (tenant, channel, address): ``suppress`` is idempotent.

Every function works in the caller's session and transaction and commits nothing.
"""

from __future__ import annotations

import hashlib
from enum import StrEnum

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from portal.messaging.addresses import AddressError, parse_phone_number
from portal.models import Channel, Suppression, db_now

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
    "suppress",
    "unsuppress",
]
