"""Resolving a record whose outcome is in doubt, by hand (seed 002 "Resolve an uncertain
record").

Someone who has checked with the provider says what happened: accepted, with the provider's
message id (one not already assigned to another record on the same route), which makes the
record Sent and applies any delivery events kept for that id; or failed, with a reason. It never
resends, and the ambiguity stays recorded (``ambiguous_attempt``).

What can be resolved: an Uncertain record, and a Failed, DeadLetter or Suppressed one with an
ambiguous attempt not yet resolved (an earlier attempt may have gone out: the "needs a decision"
list). For the latter, "failed" keeps its status and error (seed 002: a later definitive error
does not erase the ambiguity; the decision is recorded beside it), and "accepted" makes it Sent;
its dead-letter archive row stays.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from portal.messaging import transitions
from portal.messaging.after_send import events
from portal.messaging.records import timeline
from portal.messaging.sending.classify import MarkerCode
from portal.messaging.transitions import Cause
from portal.models import (
    Channel,
    MailSendRecord,
    RecordEventKind,
    SendStatus,
    SmsSendRecord,
    db_now,
)
from portal.models.by_channel import PARTS

MAX_REASON_CHARS = 2000
RESOLVED_FAILED = MarkerCode.RESOLVED_FAILED.value
# Each by the version and the status the resolution read.
_ACCEPTED = transitions.change(Cause.RESOLVED, SendStatus.SENT)
_NOT_SENT = transitions.change(Cause.RESOLVED, SendStatus.FAILED)  # an Uncertain record
_DECIDED = transitions.change(Cause.RESOLVED, None)  # an ended one: its status stays


class ResolveError(Exception):
    """The resolution was refused; ``status`` is the HTTP status that fits."""

    def __init__(self, status: int, code: str, message: str, field: str | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.field = status, code, message, field


@dataclass(frozen=True)
class Resolved:
    id: int
    status: str
    provider_message_id: str | None
    tenant_id: int


def resolve_uncertain(
    session: Session,
    channel: Channel | str,
    record_id: int,
    *,
    accepted: bool,
    provider_message_id: str | None = None,
    reason: str | None = None,
    by: str,
    tenant_id: int | None = None,
) -> Resolved:
    """Resolve one Uncertain record (of ``tenant_id``; None: any), in the caller's transaction.

    Raises ResolveError: 404 no such record, 409 not Uncertain (or resolved meanwhile) or the
    provider id is taken on that route, 422 a missing provider id or reason.
    """
    channel = Channel(channel)
    model = PARTS[channel].record
    where: list[Any] = [model.id == record_id]
    if tenant_id is not None:
        where.append(model.tenant_id == tenant_id)
    record: MailSendRecord | SmsSendRecord | None = session.scalar(  # type: ignore[assignment]
        select(model).where(*where)
    )
    if record is None:
        raise ResolveError(404, "not_found", "no such record", "id")
    if not resolvable(record):
        raise ResolveError(
            409,
            "not_uncertain",
            f"record {record_id} is {record.status}, with no undecided ambiguous attempt: only "
            "an uncertain outcome is resolved by hand",
            "id",
        )
    reason = (reason or "").strip() or None
    values: dict[str, Any] = {
        "version": model.version + 1,
        "updated_time": db_now(),
        "next_retry_at": None,
        "resolved_by": by[:320],
        "resolved_at": db_now(),
        "resolution_reason": reason[:MAX_REASON_CHARS] if reason else None,
    }
    pid = (provider_message_id or "").strip() or None
    if accepted:
        if pid is None or len(pid) > 200:
            raise ResolveError(
                422,
                "required",
                "an accepted resolution needs the provider's message id (at most 200 characters)",
                "providerMessageId",
            )
        route_col: Any = (
            MailSendRecord.server_config_id
            if channel is Channel.MAIL
            else SmsSendRecord.provider_config_id
        )
        route = (
            record.server_config_id
            if isinstance(record, MailSendRecord)
            else record.provider_config_id
        )
        taken = session.execute(
            select(model.id, model.tenant_id)
            .where(route_col == route, model.provider_message_id == pid, model.id != record.id)
            .limit(1)
        ).first()
        if taken is not None:
            # A platform-tier route is shared by every tenant: another tenant's record is
            # never named (nor is it said to be another tenant's).
            which = f"record {taken.id}" if taken.tenant_id == record.tenant_id else "a record"
            raise ResolveError(
                409,
                "provider_id_taken",
                f"provider message id {pid!r} is already assigned to {which} on this route",
                "providerMessageId",
            )
        values |= {
            **_ACCEPTED.values,
            "resolution": "accepted",
            "provider_message_id": pid,
            "sent_at": record.sent_at or db_now(),
            "error_code": None,
            "error_message": None,
        }
    else:
        if reason is None:
            raise ResolveError(422, "required", "a failed resolution needs a reason", "reason")
        values |= {"resolution": "failed"}
        if record.status == SendStatus.UNCERTAIN.value:
            values |= {
                **_NOT_SENT.values,
                "error_code": RESOLVED_FAILED,
                "error_message": reason[:MAX_REASON_CHARS],
            }
    result = session.execute(
        update(model)
        .where(
            model.id == record.id,
            model.version == record.version,
            model.status == record.status,
            *([] if record.status == SendStatus.UNCERTAIN.value else [model.resolution.is_(None)]),
        )
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:  # type: ignore[attr-defined]
        raise ResolveError(409, "conflict", "the record changed meanwhile; look again", "id")
    how = f"accepted by the server or provider, message id {pid}" if accepted else "not sent"
    timeline.note(
        session,
        channel,
        record.id,
        record.tenant_id,
        RecordEventKind.RESOLVED,
        code=str(values["resolution"]),
        message=how + (f": {reason}" if reason else ""),
        actor=by,
    )
    if accepted:
        events.apply_retained(session, channel, record.id)
    return Resolved(
        record.id,
        values.get("status", record.status),
        pid if accepted else record.provider_message_id,
        record.tenant_id,
    )


# Not sent, but an earlier attempt may have gone out: decided by a person, once.
AMBIGUOUS_NOT_SENT = frozenset(_DECIDED.froms)  # Failed, DeadLetter, Suppressed


def resolvable(record: MailSendRecord | SmsSendRecord) -> bool:
    """Whether a person may resolve ``record`` now (the rule of this module's docstring)."""
    if record.status == SendStatus.UNCERTAIN.value:
        return True
    return (
        record.status in AMBIGUOUS_NOT_SENT
        and bool(record.ambiguous_attempt)
        and record.resolution is None
    )


__all__ = [
    "AMBIGUOUS_NOT_SENT",
    "RESOLVED_FAILED",
    "ResolveError",
    "Resolved",
    "resolvable",
    "resolve_uncertain",
]
