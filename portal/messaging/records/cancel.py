"""Cancellation: stop queued work that has not gone out (one record or many).

A Pending or Retry record with no ambiguous earlier attempt becomes ``Cancelled``. The update is
conditional on the status, so a worker that claimed the record meanwhile wins: the record is
being sent and the cancel says so instead. A record with an ambiguous earlier attempt is never
cancelled: its message may already have gone out, and "cancelled" would hide that (seed 002);
resolve it instead.

A bulk cancel from the portal is confirmed first, so it cancels *by version*: each record only
at the version the person saw when they confirmed (``versions``). A record that changed in
between (a worker claimed it, or someone retried it) is left alone and reported, and a record
that was not cancellable when confirmed is never cancelled, whatever it has become since.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from sqlalchemy import ColumnElement, select, tuple_, update
from sqlalchemy.orm import Session

from portal.messaging import transitions
from portal.messaging.records import timeline
from portal.messaging.transitions import Cause
from portal.models import (
    Channel,
    MailSendRecord,
    RecordEventKind,
    SendStatus,
    SmsSendRecord,
    db_now,
)

Model = type[MailSendRecord] | type[SmsSendRecord]
MAX_BULK = 1000
_CANCEL = transitions.change(Cause.CANCELLED, SendStatus.CANCELLED)
CANCELLABLE = _CANCEL.froms  # Pending, Retry


def picked(model: Model, ids: Sequence[int], tenant_id: int | None) -> list[ColumnElement[bool]]:
    """The conditions for the records among ``ids`` a bulk action (cancel, retry) may touch:
    the tenant's own, or any tenant's for the platform (``tenant_id`` None)."""
    owned: list[ColumnElement[bool]] = [model.id.in_(ids)]
    if tenant_id is not None:
        owned.append(model.tenant_id == tenant_id)
    return owned


REFUSAL_REASONS = {
    SendStatus.SENDING.value: "being sent: a worker claimed it first",
    SendStatus.SENT.value: "already sent: the server or provider accepted it",
    SendStatus.CANCELLED.value: "already cancelled",
    SendStatus.SUPPRESSED.value: "not sent: the recipient is on the suppression list",
    SendStatus.UNCERTAIN.value: "its outcome is uncertain; resolve it instead",
    SendStatus.FAILED.value: "already failed: nothing is queued to cancel",
    SendStatus.DEAD_LETTER.value: "in the dead letters: nothing is queued to cancel",
}
AMBIGUOUS = "an earlier attempt may have been accepted; it cannot be cancelled, only resolved"
CLAIMED = "a worker claimed it first"
NOT_CONFIRMED = "it was not cancellable when you confirmed; look at it again"


@dataclass
class CancelReport:
    """What happened to each id: cancelled, or skipped with its reason. ``claimed`` are the
    skipped ids a worker got to first (being sent, or changed by a send after you confirmed);
    the other skipped ids were never cancellable. ``tenant_of`` holds the tenant of every id
    that exists within the scope asked for, so a caller acting across tenants can say whose
    records it touched (the audit log does)."""

    cancelled: list[int] = field(default_factory=list)
    skipped: dict[int, str] = field(default_factory=dict)
    claimed: list[int] = field(default_factory=list)
    tenant_of: dict[int, int] = field(default_factory=dict)


def cancel_records(
    session: Session,
    model: Model,
    ids: Sequence[int],
    tenant_id: int | None,
    versions: Mapping[int, int] | None = None,
    *,
    by: str | None = None,
) -> CancelReport:
    """Cancel the cancellable ones among ``ids`` (of ``tenant_id``; None: any tenant), in the
    caller's transaction, each with its event (``by``: who, as the audit log labels them); the
    others are skipped, each with its reason.

    With ``versions`` (id -> the version seen when the cancel was confirmed) only those ids are
    cancelled, each only while it is still at that version; ids without one are reported only.
    """
    wanted = list(dict.fromkeys(ids))
    report = CancelReport()
    if not wanted:
        return report
    owned = picked(model, wanted, tenant_id)
    target: list[ColumnElement[bool]] = list(owned)
    if versions is not None:
        pairs = [(i, versions[i]) for i in wanted if i in versions]
        if not pairs:
            target.append(model.id.in_([]))
        else:
            target.append(tuple_(model.id, model.version).in_(pairs))
    done: dict[int, int] = dict(
        session.execute(
            update(model)
            .where(
                *target,
                _CANCEL.where(model.status),
                model.ambiguous_attempt.is_(False),
            )
            .values(
                **_CANCEL.values,
                cancelled_at=db_now(),
                next_retry_at=None,
                version=model.version + 1,
                updated_time=db_now(),
            )
            .returning(model.id, model.tenant_id)
            .execution_options(synchronize_session=False)
        ).all()
    )
    report.tenant_of = dict(done)
    channel = Channel.SMS if model is SmsSendRecord else Channel.MAIL
    timeline.note_many(session, channel, done, RecordEventKind.CANCELLED, actor=by, code=None)
    report.cancelled = [i for i in wanted if i in done]
    rest = [i for i in wanted if i not in done]
    if rest:
        found: dict[int, tuple[str, bool, int]] = {}
        for rid, status, ambiguous, version, tid in session.execute(
            select(
                model.id, model.status, model.ambiguous_attempt, model.version, model.tenant_id
            ).where(*owned[1:], model.id.in_(rest))
        ):
            found[rid] = (status, ambiguous, version)
            report.tenant_of[rid] = tid
        for record_id in rest:
            row = found.get(record_id)
            if row is None:
                report.skipped[record_id] = "no such record"
                continue
            status, ambiguous, version = row
            seen = versions.get(record_id) if versions is not None else None
            moved = seen is not None and version != seen
            if status == SendStatus.SENDING.value or (
                moved and status != SendStatus.CANCELLED.value
            ):
                report.claimed.append(record_id)
                report.skipped[record_id] = (
                    REFUSAL_REASONS[status]
                    if status == SendStatus.SENDING.value
                    else f"{CLAIMED}: it changed after you confirmed and is now {status}"
                )
            elif status in CANCELLABLE and ambiguous:
                report.skipped[record_id] = AMBIGUOUS
            elif status in CANCELLABLE and versions is not None:
                report.skipped[record_id] = NOT_CONFIRMED
            else:
                report.skipped[record_id] = REFUSAL_REASONS.get(
                    status, f"its status {status} cannot be cancelled"
                )
    return report


def cancellable(status: str, ambiguous: bool) -> str | None:
    """Why a record in ``status`` cannot be cancelled, or None when it can."""
    if status in CANCELLABLE:
        return AMBIGUOUS if ambiguous else None
    return REFUSAL_REASONS.get(status, f"its status {status} cannot be cancelled")


__all__ = ["MAX_BULK", "CancelReport", "cancel_records", "cancellable"]
