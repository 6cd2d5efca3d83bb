"""A record's timeline: acceptance, every attempt with the other side's
reply, provider events (delivered, bounced, complained, read), and what people did to it (the
audit log's retries, cancels, resolutions and dead-letter triage), in time order.

Four reads by index: the attempts (``idx_send_attempt_record``), the events
(``idx_delivery_event_record``), the audit rows naming the record or its dead letter
(``idx_audit_target``), and the dead letter's id. Bulk actions name their records in the audit
remark, not as the target, so they are not on a record's timeline.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import String, and_, cast, or_, select
from sqlalchemy.orm import Session

from portal.messaging.events import events_for
from portal.models import AuditEvent, Channel, DeadLetterMessage, SendAttempt
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
    kind: str  # accepted | attempt | event | action
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
    entries.sort(key=lambda e: (e.at, ("accepted", "attempt", "event", "action").index(e.kind)))
    return entries
