"""Provider delivery events: stored once in ``delivery_event``, applied to the send record.

An event is correlated by route (the mail server or SMS provider config it came in on),
provider message id and, when it names one, the recipient. It is applied as the record's
delivery outcome, which never downgrades: complained beats bounced beats delivered. A
permanent bounce also turns a Sent record into Failed with the bounce code (as the IMAP
bounce path does) and, like a complaint, puts the recipient on the suppression list.

An event that arrives before the record has its provider id is stored unmatched and applied
by ``apply_retained`` when the id is written (``sent_write.record_sent``, ``resolve_uncertain``).

Every function works in the caller's session and transaction and commits nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import Engine, case, exists, func, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from portal.messaging import transitions
from portal.messaging.after_send import suppression
from portal.messaging.transitions import Cause
from portal.models import (
    Channel,
    DeliveryEvent,
    MailSendRecord,
    SendStatus,
    SmsSendRecord,
    db_now,
    db_now_plus,
)
from portal.models.by_channel import PARTS
from portal.tenancy import tenant_context

log = logging.getLogger("portal.events")


def clean_text(value: str, limit: int = 200) -> str | None:
    """An id or a short text from a provider as records and events keep it, the same on both
    sides so that they match: NUL removed (PostgreSQL's text refuses it), stripped, at most
    ``limit`` characters; None when nothing is left."""
    return value.replace("\x00", "").strip()[:limit] or None


MAX_VERSION_TRIES = 3
MAX_ERROR_CHARS = 2000
_BOUNCED = transitions.change(Cause.BOUNCED, SendStatus.FAILED)  # from Sent, by version


class EventType(StrEnum):
    DELIVERED = "delivered"
    BOUNCED = "bounced"  # permanent only: a temporary failure is "other"
    COMPLAINED = "complained"
    OTHER = "other"


# An outcome never downgrades: a higher rank wins.
RANK = {EventType.DELIVERED: 1, EventType.BOUNCED: 2, EventType.COMPLAINED: 3}


@dataclass(frozen=True)
class ProviderEvent:
    """One event as a provider adapter parsed it (not yet stored)."""

    dedup_key: str
    event_type: EventType
    provider_message_id: str | None
    recipient: str | None = None
    occurred_at: datetime | None = None
    code: str | None = None  # the provider's error or bounce code
    description: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Stored:
    stored: bool  # False: a replay (the same dedup key on this route)
    record_id: int | None = None
    applied: bool = False
    event_id: int | None = None


def _route_column(channel: Channel) -> Any:
    return (
        MailSendRecord.server_config_id
        if channel is Channel.MAIL
        else (SmsSendRecord.provider_config_id)
    )


def store(
    session: Session,
    channel: Channel,
    *,
    tenant_id: int,
    config_id: int,
    provider: str,
    event: ProviderEvent,
    locked: bool = False,
) -> Stored:
    """Store one event (a replay is a no-op) and apply it to its record when there is one.

    ``locked``: the caller took the event locks of its whole batch first (lock_for_events),
    as a webhook does; otherwise this event's lock is taken here."""
    values = {
        "tenant_id": tenant_id,
        "channel": channel.value,
        "config_id": config_id,
        "provider": provider[:32],
        "dedup_key": event.dedup_key[:200],
        "provider_message_id": (event.provider_message_id or None)
        and event.provider_message_id[:200],
        "recipient": (event.recipient or None) and event.recipient[:320],
        "event_type": event.event_type.value,
        "detail": _detail(event),
        "occurred_at": event.occurred_at,
    }
    if not locked:
        lock_for_events(session, channel, config_id, [event.provider_message_id])
    insert = pg_insert if session.get_bind().dialect.name == "postgresql" else sqlite_insert
    event_id = session.scalar(
        insert(DeliveryEvent)
        .values(**values)
        .on_conflict_do_nothing(index_elements=["channel", "config_id", "dedup_key"])
        .returning(DeliveryEvent.id)
    )
    if event_id is None:
        return Stored(stored=False)
    row = session.get(DeliveryEvent, event_id)
    assert row is not None
    record = _find(session, channel, row)
    if record is None:
        log.info(
            "delivery event stored unmatched",
            extra={"channel": channel.value, "config_id": config_id, "event_id": event_id},
        )
        return Stored(stored=True, event_id=event_id)
    applied = apply(session, channel, record, row)
    return Stored(stored=True, record_id=record.id, applied=applied, event_id=event_id)


def lock_for_events(
    session: Session,
    channel: Channel,
    config_id: int,
    provider_message_ids: Iterable[str | None],
) -> None:
    """PostgreSQL: take, until the transaction ends, the locks a Sent write takes before it
    looks for waiting events of these provider ids (migration 0006), so that it cannot look
    while an event for one of them is being stored. Sorted, so that two webhooks storing the
    same ids in different orders cannot deadlock; taking one again is a no-op."""
    if session.get_bind().dialect.name != "postgresql":
        return
    for pmid in sorted({p[:200] for p in provider_message_ids if p}):
        session.execute(select(func.postroom_event_lock(channel.value, config_id, pmid)))


def match_again(session: Session, channel: Channel, event_id: int) -> int | None:
    """Look once more for the record of an event stored unmatched, after its insert committed.

    Closes the race with ``record_sent``: if the provider id was written after ``store``
    looked but before this look, it is found here; if it is written later, ``apply_retained``
    sees the committed event. (Both may apply it; applying is idempotent.)
    """
    row = session.get(DeliveryEvent, event_id)
    if row is None or row.record_id is not None:
        return None
    record = _find(session, channel, row)
    if record is None:
        return None
    apply(session, channel, record, row)
    return record.id


MATCH_BATCH = 500
MATCH_MAX_AGE_S = 7 * 86400


@dataclass(frozen=True)
class MatchReport:
    looked: int
    applied: int


def match_waiting(
    engine: Engine, *, limit: int = MATCH_BATCH, max_age_s: float = MATCH_MAX_AGE_S
) -> MatchReport:
    """The safety net behind ``match_again`` and ``apply_retained``: unmatched events of the
    last ``max_age_s`` whose route now has a record with their provider id are applied,
    oldest first, each in its own transaction in its tenant.

    The two looks close the race between a webhook and the Sent write; what they cannot cover
    is a process that died between them (the worker after its Sent commit, the portal after
    storing the event). A scheduled chore (``portal.delivery.chores``) runs this, so such an
    event waits minutes, not forever.
    """
    looked = applied = 0
    for channel in Channel:
        model = PARTS[channel].record
        has_record = exists().where(
            _route_column(channel) == DeliveryEvent.config_id,
            model.provider_message_id == DeliveryEvent.provider_message_id,
        )
        with Session(engine) as session:
            waiting = session.execute(
                select(DeliveryEvent.id, DeliveryEvent.tenant_id)
                .where(
                    DeliveryEvent.channel == channel.value,
                    DeliveryEvent.record_id.is_(None),
                    DeliveryEvent.provider_message_id.is_not(None),
                    DeliveryEvent.received_at >= db_now_plus(-max_age_s),
                    has_record,
                )
                .order_by(DeliveryEvent.id)
                .limit(limit)
            ).all()
        for event_id, tenant_id in waiting:
            looked += 1
            with tenant_context(tenant_id), Session(engine) as session, session.begin():
                if match_again(session, channel, event_id) is not None:
                    applied += 1
    if applied:
        log.warning(
            "applied delivery events that had waited unmatched",
            extra={"applied": applied, "looked": looked},
        )
    return MatchReport(looked, applied)


def _detail(event: ProviderEvent) -> dict[str, Any]:
    detail = dict(event.detail)
    if event.code:
        detail["code"] = event.code[:100]
    if event.description:
        detail["description"] = event.description[:500]
    return detail


def _find(
    session: Session, channel: Channel, row: DeliveryEvent
) -> MailSendRecord | SmsSendRecord | None:
    if not row.provider_message_id:
        return None
    model = PARTS[channel].record
    record: MailSendRecord | SmsSendRecord | None = session.scalar(  # type: ignore[assignment]
        select(model)
        .where(
            _route_column(channel) == row.config_id,
            model.provider_message_id == row.provider_message_id,
        )
        .order_by(model.id)
        .limit(1)
    )
    if record is None or not _recipient_matches(channel, record, row.recipient):
        return None
    return record


def recipients(record: MailSendRecord | SmsSendRecord) -> list[str]:
    """The record's recipients as the suppression list stores them."""
    if isinstance(record, SmsSendRecord):
        raw = [record.phone_number]
    else:
        raw = [*record.to_addrs, *(record.cc_addrs or []), *(record.bcc_addrs or [])]
    out: list[str] = []
    for address in raw:
        try:
            out.append(suppression.normalise(_channel_of(record), address))
        except suppression.InvalidAddress:
            continue
    return out


def _channel_of(record: MailSendRecord | SmsSendRecord) -> Channel:
    return Channel.SMS if isinstance(record, SmsSendRecord) else Channel.MAIL


def _recipient_matches(
    channel: Channel, record: MailSendRecord | SmsSendRecord, recipient: str | None
) -> bool:
    if not recipient:
        return True
    try:
        wanted = suppression.normalise(channel, recipient)
    except suppression.InvalidAddress:
        return False
    return wanted in recipients(record)


def apply(
    session: Session,
    channel: Channel,
    record: MailSendRecord | SmsSendRecord,
    row: DeliveryEvent,
) -> bool:
    """Apply a stored event to its record; True when the record changed."""
    row.record_id = record.id
    row.applied_at = db_now()
    kind = EventType(row.event_type)
    if kind is EventType.OTHER:
        session.flush()
        return False
    changed = _raise_outcome(session, channel, record, row, kind)
    if kind in (EventType.BOUNCED, EventType.COMPLAINED):
        _suppress(session, channel, record, row, kind)
    session.flush()
    return changed


def _raise_outcome(
    session: Session,
    channel: Channel,
    record: MailSendRecord | SmsSendRecord,
    row: DeliveryEvent,
    kind: EventType,
) -> bool:
    """Set the delivery outcome by version unless it is already as high; a permanent bounce
    also turns a Sent record into Failed with the code."""
    model = PARTS[channel].record
    rank = case({k.value: v for k, v in RANK.items()}, value=model.delivery_outcome, else_=0)
    code = str((row.detail or {}).get("code") or "BOUNCED")
    description = (row.detail or {}).get("description")
    status, version = record.status, record.version
    for _ in range(MAX_VERSION_TRIES):
        values: dict[str, Any] = {
            "delivery_outcome": kind.value,
            "delivery_outcome_at": row.occurred_at or db_now(),
            "version": model.version + 1,
            "updated_time": db_now(),
        }
        if kind is EventType.BOUNCED and status in _BOUNCED.froms:
            values |= {
                **_BOUNCED.values,
                "next_retry_at": None,
                "error_code": code[:100],
                "error_message": (str(description) if description else f"bounced: {code}")[
                    :MAX_ERROR_CHARS
                ],
            }
            if channel is Channel.MAIL:
                values["bounce_code"] = code[:64]
        result = session.execute(
            update(model)
            .where(model.id == record.id, model.version == version, rank < RANK[kind])
            .values(**values)
            .execution_options(synchronize_session=False)
        )
        if result.rowcount == 1:  # type: ignore[attr-defined]
            log.info(
                "delivery outcome recorded",
                extra={"record_id": record.id, "channel": channel.value, "outcome": kind.value},
            )
            return True
        now = session.execute(
            select(model.status, model.version, rank).where(model.id == record.id)
        ).one_or_none()
        if now is None or now[2] >= RANK[kind]:
            return False  # gone, or already as high: never downgrade
        status, version = now[0], now[1]
    return False


def _suppress(
    session: Session,
    channel: Channel,
    record: MailSendRecord | SmsSendRecord,
    row: DeliveryEvent,
    kind: EventType,
) -> None:
    ours = recipients(record)
    if row.recipient:
        try:
            targets = [suppression.normalise(channel, row.recipient)]
        except suppression.InvalidAddress:
            targets = []
    else:
        targets = ours[:1] if len(set(ours)) == 1 else []
    reason = (
        suppression.SuppressionReason.COMPLAINT
        if kind is EventType.COMPLAINED
        else suppression.SuppressionReason.HARD_BOUNCE
    )
    code = (row.detail or {}).get("code")
    for address in targets:
        suppression.suppress(
            session,
            record.tenant_id,
            channel,
            address,
            reason,
            detail=f"{row.provider} event {row.event_type}" + (f" ({code})" if code else ""),
            by=f"webhook:{row.provider}",
            record_id=record.id,
        )


def apply_retained(session: Session, channel: Channel, record_id: int) -> int:
    """Apply the unmatched events kept for this record's route and provider id (oldest first);
    called once the provider id is written. Returns how many were applied."""
    model = PARTS[channel].record
    record: MailSendRecord | SmsSendRecord | None = session.get(  # type: ignore[assignment]
        model, record_id, populate_existing=True
    )
    if record is None or not record.provider_message_id:
        return 0
    route = (
        record.server_config_id
        if isinstance(record, MailSendRecord)
        else (record.provider_config_id)
    )
    if route is None:
        return 0
    rows = session.scalars(
        select(DeliveryEvent)
        .where(
            DeliveryEvent.channel == channel.value,
            DeliveryEvent.config_id == route,
            DeliveryEvent.provider_message_id == record.provider_message_id,
            DeliveryEvent.record_id.is_(None),
        )
        .order_by(DeliveryEvent.id)
    ).all()
    applied = 0
    for row in rows:
        if not _recipient_matches(channel, record, row.recipient):
            continue
        apply(session, channel, record, row)
        applied += 1
        session.refresh(record)
    return applied


def events_for(session: Session, channel: Channel | str, record_id: int) -> list[DeliveryEvent]:
    """The record's event timeline, oldest first (for the record detail page)."""
    return list(
        session.scalars(
            select(DeliveryEvent)
            .where(
                DeliveryEvent.channel == Channel(channel).value,
                DeliveryEvent.record_id == record_id,
            )
            .order_by(DeliveryEvent.id)
        )
    )


__all__ = [
    "EventType",
    "ProviderEvent",
    "Stored",
    "apply",
    "apply_retained",
    "events_for",
    "lock_for_events",
    "match_again",
    "store",
]
