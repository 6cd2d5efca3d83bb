"""Cancellation: stop queued work that has not gone out (one record or many).

A Pending or Retry record with no ambiguous earlier attempt becomes ``Cancelled``. The update is
conditional on the status, so a worker that claimed the record meanwhile wins: the record is
being sent and the cancel says so instead. A record with an ambiguous earlier attempt is never
cancelled: its message may already have gone out, and "cancelled" would hide that (seed 002);
resolve it instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from sqlalchemy import ColumnElement, select, update
from sqlalchemy.orm import Session

from portal.models import MailSendRecord, SendStatus, SmsSendRecord, db_now

Model = type[MailSendRecord] | type[SmsSendRecord]
MAX_BULK = 1000
CANCELLABLE = (SendStatus.PENDING.value, SendStatus.RETRY.value)

REFUSAL_REASONS = {
    SendStatus.SENDING.value: "being sent: a worker claimed it first",
    SendStatus.SENT.value: "already sent: the server or provider accepted it",
    SendStatus.CANCELLED.value: "already cancelled",
    SendStatus.SUPPRESSED.value: "not sent: the recipient is on the suppression list",
    SendStatus.UNCERTAIN.value: "its outcome is uncertain; resolve it instead",
}
AMBIGUOUS = "an earlier attempt may have been accepted; it cannot be cancelled, only resolved"


@dataclass
class CancelReport:
    cancelled: list[int] = field(default_factory=list)
    skipped: dict[int, str] = field(default_factory=dict)


def cancel_records(
    session: Session, model: Model, ids: Sequence[int], tenant_id: int | None
) -> CancelReport:
    """Cancel the cancellable ones among ``ids`` (of ``tenant_id``; None: any tenant), in the
    caller's transaction; the others are skipped, each with its reason."""
    wanted = list(dict.fromkeys(ids))
    report = CancelReport()
    if not wanted:
        return report
    owned: list[ColumnElement[bool]] = [model.id.in_(wanted)]
    if tenant_id is not None:
        owned.append(model.tenant_id == tenant_id)
    done = set(
        session.scalars(
            update(model)
            .where(
                *owned,
                model.status.in_(CANCELLABLE),
                model.ambiguous_attempt.is_(False),
            )
            .values(
                status=SendStatus.CANCELLED.value,
                cancelled_at=db_now(),
                next_retry_at=None,
                version=model.version + 1,
                updated_time=db_now(),
            )
            .returning(model.id)
            .execution_options(synchronize_session=False)
        ).all()
    )
    report.cancelled = [i for i in wanted if i in done]
    rest = [i for i in wanted if i not in done]
    if rest:
        found = {
            rid: (status, ambiguous)
            for rid, status, ambiguous in session.execute(
                select(model.id, model.status, model.ambiguous_attempt).where(
                    *owned[1:], model.id.in_(rest)
                )
            )
        }
        for record_id in rest:
            row = found.get(record_id)
            if row is None:
                report.skipped[record_id] = "no such record"
            elif row[0] in CANCELLABLE and row[1]:
                report.skipped[record_id] = AMBIGUOUS
            else:
                report.skipped[record_id] = REFUSAL_REASONS.get(
                    row[0], f"its status {row[0]} cannot be cancelled"
                )
    return report


__all__ = ["MAX_BULK", "CancelReport", "cancel_records"]
