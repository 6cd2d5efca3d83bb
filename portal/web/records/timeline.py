"""A record's timeline: acceptance, every attempt with the other side's
reply, what happened without an attempt (a failure before one with its cause, a stretch of
deferrals, an end without a send, the sweep, the recipient suppressed), what people did to it
(retries, "retried anyway", cancels, resolutions, resends: one or many records at once, each
with who), provider events (delivered, bounced, complained, read), and the status callbacks
sent to the tenant with each endpoint's answer, in time order.

Each source is the row its event wrote when it happened, read by index: the attempts
(``idx_send_attempt_record``), the record's events (``idx_record_event_record``), the delivery
events (``idx_delivery_event_record``), the callback deliveries (``idx_callback_delivery_record``),
and the audit rows naming the record or its dead letter (``idx_audit_target``) for what the
record's events do not hold (a dead letter's triage).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, String, and_, cast, or_, select
from sqlalchemy.orm import Session

from portal.messaging.after_send.events import events_for
from portal.models import (
    AuditAction,
    AuditEvent,
    CallbackDelivery,
    CallbackEndpoint,
    Channel,
    DeadLetterMessage,
    DeliveryStatus,
    RecordEvent,
    RecordEventKind,
    SendAttempt,
    SendStatus,
)
from portal.web.machine.serialise import attempt_route, config_tiers

OUTCOME_WORDS = {
    "sent": ("Accepted by the server", "good"),
    "retry": ("Failed; will be retried", "wait"),
    "failed": ("Refused; not retried", "bad"),
    "dead_letter": ("Failed; retries used up", "bad"),
    "uncertain": ("No answer; outcome unknown", "wait"),
    "swept": ("Worker stopped mid-send; moved on by the sweep", "wait"),
}
EVENT_TONES = {"delivered": "good", "read": "good", "bounced": "bad", "complained": "bad"}
# What a record's event says (``RecordEventKind``): the line's kind, title and tone.
STEP_WORDS: dict[str, tuple[str, str, str]] = {
    RecordEventKind.NOT_ATTEMPTED: ("step", "Failed before any attempt", "bad"),
    RecordEventKind.DEFERRED: ("step", "Waiting; no retry used", "wait"),
    RecordEventKind.ENDED: ("step", "Ended without a send", "bad"),
    RecordEventKind.SWEPT: ("step", "Worker stopped before sending; moved on by the sweep", "wait"),
    RecordEventKind.SUPPRESSED: ("step", "Recipient suppressed", "bad"),
    RecordEventKind.RETRIED: ("action", "Retry pressed", "neutral"),
    RecordEventKind.CANCELLED: ("action", "Cancelled", "neutral"),
    RecordEventKind.RESOLVED: ("action", "Resolved", "neutral"),
    RecordEventKind.RESENT: ("action", "Sent again as a new message", "neutral"),
}
ENDED_WORDS = {
    "EXPIRED": "Expired before it was sent",
    "RETRY_WINDOW_EXPIRED": "Resend window over; not retried",
    "SUPPRESSED": "Not sent: the recipient is suppressed",
}
# Audit actions whose event the record's own rows hold (written by the domain with who did
# it); the audit log keeps them for its own page.
RECORDED = frozenset(
    {
        AuditAction.RETRY,
        AuditAction.BULK_RETRY,
        AuditAction.CANCEL,
        AuditAction.BULK_CANCEL,
        AuditAction.RESOLVE,
    }
)
CALLBACK_TONES = {DeliveryStatus.DELIVERED: "good", DeliveryStatus.DEAD: "bad"}
KINDS = ("accepted", "step", "attempt", "event", "action", "callback")
ACTION_WORDS = {
    "retry": "Retry pressed",
    "cancel": "Cancelled",
    "resolve": "Resolved",
    "dead_letter_triage": "Dead letter triaged",
}


@dataclass(frozen=True)
class Entry:
    """One line of the timeline."""

    at: datetime
    kind: str  # accepted | step | attempt | event | action | callback
    title: str
    tone: str  # good | wait | bad | neutral (the pill colours)
    detail: str = ""
    who: str | None = None  # the audit row's actor label
    number: int | None = None  # an attempt's number
    code: str | None = None
    where: str | None = None  # the server or provider; the worker for operators


def timeline(session: Session, channel: Channel, record: Any, *, operator: bool) -> list[Entry]:
    """Everything that happened to ``record``, oldest first. ``operator``: the person looking
    is a platform operator, who sees the platform's servers by name and the workers."""
    entries = [Entry(record.created_time, "accepted", "Accepted", "neutral")]
    attempts = list(
        session.scalars(
            select(SendAttempt)
            .where(SendAttempt.channel == channel.value, SendAttempt.record_id == record.id)
            .order_by(SendAttempt.number)
        )
    )
    tiers = config_tiers(session, channel.value, [a.config_id for a in attempts])
    for attempt in attempts:
        words, tone = OUTCOME_WORDS.get(attempt.outcome, (attempt.outcome, "neutral"))
        where = attempt_route(attempt, tiers, operator)
        if operator and attempt.worker:
            where = f"{where or 'unknown'} · worker {attempt.worker}"
        took = f" in {attempt.duration_ms:,} ms" if attempt.duration_ms is not None else ""
        ambiguous = " (ambiguous: it may have been accepted)" if attempt.ambiguous else ""
        entries.append(
            Entry(
                attempt.finished_at,
                "attempt",
                f"Attempt {attempt.number}: {words}{ambiguous}",
                tone,
                detail=(attempt.message or "") + took,
                number=attempt.number,
                code=attempt.code,
                where=where,
            )
        )
    for event in events_for(session, channel, record.id):
        detail = event.detail or {}
        entries.append(
            Entry(
                event.occurred_at or event.received_at,
                "event",
                event.event_type.capitalize(),
                EVENT_TONES.get(event.event_type, "neutral"),
                detail=str(detail.get("description") or ""),
                code=str(detail["code"]) if detail.get("code") else None,
                where=" · ".join(x for x in (event.provider, event.recipient) if x),
            )
        )
    letters = select(cast(DeadLetterMessage.id, String)).where(
        DeadLetterMessage.channel == channel.value,
        DeadLetterMessage.event_id == str(record.id),
    )
    actions = session.scalars(
        select(AuditEvent)
        .where(
            AuditEvent.tenant_id == record.tenant_id,
            or_(
                and_(
                    AuditEvent.target_type == type(record).__name__,
                    AuditEvent.target_id == str(record.id),
                ),
                and_(
                    AuditEvent.target_type == "dead_letter",
                    AuditEvent.target_id.in_(letters.scalar_subquery()),
                ),
            ),
        )
        .order_by(AuditEvent.id)
    )
    for row in actions:
        if row.action in RECORDED:
            continue
        entries.append(
            Entry(
                row.created_time,
                "action",
                ACTION_WORDS.get(row.action, row.action.replace("_", " ").capitalize()),
                "neutral",
                detail=row.remark,
                who=row.actor_label,
            )
        )
    entries += _steps(session, channel, record)
    entries += _callbacks(session, channel, record)
    entries.sort(key=lambda e: (e.at, KINDS.index(e.kind)))
    return _stretches(entries, record)


def _about(
    model: type[RecordEvent] | type[CallbackDelivery], channel: Channel, record: Any
) -> tuple[ColumnElement[bool], ...]:
    """Which of ``model``'s rows are about ``record``: its channel, its id, in its tenant."""
    return (
        model.channel == channel.value,
        model.record_id == record.id,
        model.tenant_id == record.tenant_id,
    )


def _steps(session: Session, channel: Channel, record: Any) -> list[Entry]:
    """The record's own events (``record_event``)."""
    rows = session.scalars(
        select(RecordEvent).where(*_about(RecordEvent, channel, record)).order_by(RecordEvent.id)
    )
    entries = []
    for row in rows:
        kind, title, tone = STEP_WORDS.get(row.kind, ("step", row.kind.capitalize(), "neutral"))
        detail = row.message or ""
        if row.kind == RecordEventKind.ENDED:
            title = ENDED_WORDS.get(row.code or "", title)
        elif row.kind == RecordEventKind.RESOLVED:
            title = "Resolved: sent" if row.code == "accepted" else "Resolved: not sent"
        code = None if row.kind in (RecordEventKind.RESOLVED,) else row.code
        entries.append(Entry(row.at, kind, title, tone, detail=detail, who=row.actor, code=code))
    return entries


def _callbacks(session: Session, channel: Channel, record: Any) -> list[Entry]:
    """Each status callback owed to each of the tenant's endpoints, with its last answer."""
    rows = session.execute(
        select(CallbackDelivery, CallbackEndpoint.name)
        .join(CallbackEndpoint, CallbackEndpoint.id == CallbackDelivery.endpoint_id)
        .where(*_about(CallbackDelivery, channel, record))
        .order_by(CallbackDelivery.id)
    )
    entries = []
    for delivery, endpoint in rows:
        status = DeliveryStatus(delivery.status)
        if delivery.last_status_code is not None:
            answer = f"answered HTTP {delivery.last_status_code}"
        elif delivery.last_error:
            answer = f"no answer: {delivery.last_error}"
        else:
            answer = "not sent yet"
        took = f" in {delivery.last_duration_ms:,} ms" if delivery.last_duration_ms else ""
        tries = f" after {delivery.attempts} tries" if delivery.attempts > 1 else ""
        state = {
            DeliveryStatus.DELIVERED: "delivered",
            DeliveryStatus.DEAD: "given up",
        }.get(status, "pending")
        entries.append(
            Entry(
                delivery.last_attempt_at or delivery.created_time,
                "callback",
                f"Status callback {delivery.event_type} to {endpoint!r}: {state}",
                CALLBACK_TONES.get(status, "wait"),
                detail=f"{answer}{took}{tries}",
            )
        )
    return entries


def _stretches(entries: list[Entry], record: Any) -> list[Entry]:
    """A stretch of deferrals is one line from its first deferral: it lasts until the next
    line, or it goes on while the record still waits with that code."""
    out = []
    for i, entry in enumerate(entries):
        if entry.title == STEP_WORDS[RecordEventKind.DEFERRED][1]:
            after = entries[i + 1].at if i + 1 < len(entries) else None
            if after is not None:
                entry = replace(entry, detail=f"{entry.detail} (until {after:%H:%M:%S})")
            elif record.status == SendStatus.RETRY.value and record.error_code == entry.code:
                entry = replace(entry, detail=f"{entry.detail} (still waiting)")
        out.append(entry)
    return out
