"""Manual retry (seed 000 "Manual retry"): one record or many, back to Retry due now.

Pending, Retry, Failed and DeadLetter can be retried; Sent and Sending are refused. The update
is conditional on the status, so a record a worker claimed meanwhile is skipped, never sent
twice. A manual retry counts as one retry: a record whose retries are used up gets exactly this
one chance and returns to DeadLetter if it fails again. A record that failed before it was
prepared has no ``prepared_at`` and is prepared afresh on its next attempt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from sqlalchemy import ColumnElement, select, update
from sqlalchemy.orm import Session

from portal.models import MailSendRecord, SendStatus, SmsSendRecord, db_now
from portal.models.enums import RETRYABLE_BY_HAND

Model = type[MailSendRecord] | type[SmsSendRecord]
MAX_BULK = 1000

REFUSAL_REASONS = {
    SendStatus.SENT.value: "already sent: the server or provider accepted it",
    SendStatus.SENDING.value: "being sent right now",
    SendStatus.CANCELLED.value: "cancelled",
    SendStatus.SUPPRESSED.value: "the recipient is on the suppression list",
    SendStatus.UNCERTAIN.value: "its outcome is uncertain; resolve it instead of resending",
}


@dataclass
class RetryReport:
    """What happened to each id. ``tenant_of`` holds the tenant of every id that exists within
    the scope asked for (requeued or skipped for its status), so a caller acting across
    tenants can say whose records it touched (the audit log does)."""

    requeued: list[int] = field(default_factory=list)
    skipped: dict[int, str] = field(default_factory=dict)
    tenant_of: dict[int, int] = field(default_factory=dict)


def retry_records(
    session: Session, model: Model, ids: Sequence[int], tenant_id: int | None
) -> RetryReport:
    """Requeue the retryable ones among ``ids`` (of ``tenant_id``; None: any tenant)."""
    wanted = list(dict.fromkeys(ids))
    report = RetryReport()
    if not wanted:
        return report
    owned: list[ColumnElement[bool]] = [model.id.in_(wanted)]
    if tenant_id is not None:
        owned.append(model.tenant_id == tenant_id)
    requeued = session.execute(
        update(model)
        .where(*owned, model.status.in_([s.value for s in RETRYABLE_BY_HAND]))
        .values(
            status=SendStatus.RETRY.value,
            next_retry_at=db_now(),
            retry_count=model.retry_count + 1,
            version=model.version + 1,
            updated_time=db_now(),
        )
        .returning(model.id, model.tenant_id)
        .execution_options(synchronize_session=False)
    ).all()
    report.tenant_of = {rid: tid for rid, tid in requeued}
    report.requeued = [i for i in wanted if i in report.tenant_of]
    rest = [i for i in wanted if i not in report.tenant_of]
    if rest:
        statuses: dict[int, str] = {}
        for rid, status, tid in session.execute(
            select(model.id, model.status, model.tenant_id).where(*owned[1:], model.id.in_(rest))
        ):
            statuses[rid] = status
            report.tenant_of[rid] = tid
        for record_id in rest:
            found = statuses.get(record_id)
            report.skipped[record_id] = (
                "no such record"
                if found is None
                else REFUSAL_REASONS.get(found, f"its status {found} cannot be retried")
            )
    return report
