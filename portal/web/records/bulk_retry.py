"""Bulk retry: the plan counts the selection by status and leaves out, unless asked, the
records whose diagnosis says they would fail again (counted by reason); the second step
requeues what was confirmed, its diagnoses read again."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from flask import flash, redirect
from flask.typing import ResponseReturnValue
from sqlalchemy import func

from portal.extensions import db
from portal.messaging.records.diagnosis import Diagnosis, refusal
from portal.messaging.records.diagnosis.reasons import REASON_LABEL, Reason
from portal.messaging.records.retry import retry_records
from portal.models import AuditAction
from portal.web.access import actor_label
from portal.web.records.bulk import (
    BulkRequest,
    StatusLine,
    audit_bulk,
    bulk_view,
    outcome_text,
    skipped_summary,
)
from portal.web.records.filters import parse_ids
from portal.web.records.kind import Kind, visible
from portal.web.records.record_page import RETRYABLE, diagnoses

FAIL_AGAIN = "left out: it would fail again (see below)"


@dataclass
class RetryPlan:
    """What "Retry" would do to a set of ids, counted by status, without changing anything."""

    ids: list[int]
    requeue: int
    skip: int
    lines: list[StatusLine]
    capped: bool = False
    ambiguous: int = 0  # of those requeued, how many had an ambiguous attempt (may go twice)
    expired: int = 0  # of the retryable ones, how many are past their expiry (skipped)
    reasons: list[ReasonGroup] = field(default_factory=list)  # those that would fail again
    groups: list[CodeGroup] = field(default_factory=list)  # the others, by error code
    blocked: int = 0  # of the retryable ones, how many would fail again (left out by default)
    tenants: list[tuple[str, int]] = field(default_factory=list)  # all-tenants view: per tenant
    needs_all_tenants: bool = False  # confirming needs the explicit "all tenants" choice
    scope: str = "selected"


@dataclass
class ReasonGroup:
    """Retryable records that would fail again for one reason (``diagnosis.Reason``)."""

    reason: Reason
    count: int
    whys: list[tuple[str, int]]  # (why, and what to change first; how many)

    @property
    def label(self) -> str:
        return REASON_LABEL[self.reason]


@dataclass
class CodeGroup:
    """Retryable records with one error code that nothing found stops."""

    code: str
    count: int


def plan_retry(kind: Kind, ids: Sequence[int], tenant: int | None) -> RetryPlan:
    """Count the ids by status: which would be requeued, which skipped and why; those that
    would fail again (their diagnosis) are counted by reason and left out unless asked."""
    model = kind.model
    stmt = visible(kind, ids, tenant, model.status, func.count()).group_by(model.status)
    counts: dict[str, int] = {status: n for status, n in db.session.execute(stmt)}
    lines = [
        StatusLine(status, counts[status], refusal(status))
        for status in sorted(counts, key=lambda s: (refusal(s) is not None, s))
    ]
    missing = len(ids) - sum(counts.values())
    if missing:
        lines.append(StatusLine("", missing, "no such record"))
    found = retryable_diagnoses(kind, ids, tenant)
    blocked = {i: d for i, d in found.items() if d.would_fail_again}
    if blocked:
        # A status's line counts only those requeued; the rest get a line of their own.
        held = Counter(status for _, status in found_statuses(kind, blocked, tenant))
        split: list[StatusLine] = []
        for line in lines:
            n = held.get(line.status, 0) if line.reason is None else 0
            if line.count - n:
                split.append(replace(line, count=line.count - n))
            if n:
                split.append(StatusLine(line.status, n, FAIL_AGAIN))
        lines = split
    requeue = sum(line.count for line in lines if line.reason is None)
    return RetryPlan(
        list(ids),
        requeue,
        len(ids) - requeue,
        lines,
        ambiguous=sum(1 for i, d in found.items() if d.ambiguous and i not in blocked),
        expired=sum(1 for d in blocked.values() if d.reason is Reason.EXPIRED),
        reasons=reason_groups(blocked),
        groups=code_groups(kind, [i for i in found if i not in blocked], tenant),
        blocked=len(blocked),
    )


def retryable_diagnoses(kind: Kind, ids: Sequence[int], tenant: int | None) -> dict[int, Diagnosis]:
    """Of ``ids`` (the viewer's), the retryable ones' diagnoses."""
    records = list(
        db.session.scalars(visible(kind, ids, tenant).where(kind.model.status.in_(RETRYABLE)))
    )
    return diagnoses(kind, records)


def blocked_ids(kind: Kind, ids: Sequence[int], tenant: int | None) -> dict[int, Diagnosis]:
    """Of ``ids`` (the viewer's), the retryable ones a retry now would not cure: their
    diagnosis says it would fail again (the causes as they are, not the status)."""
    found = retryable_diagnoses(kind, ids, tenant)
    return {i: d for i, d in found.items() if d.would_fail_again}


def found_statuses(kind: Kind, ids: Iterable[int], tenant: int | None) -> list[tuple[int, str]]:
    model = kind.model
    return [
        (int(i), str(status))
        for i, status in db.session.execute(visible(kind, ids, tenant, model.id, model.status))
    ]


def reason_groups(blocked: Mapping[int, Diagnosis]) -> list[ReasonGroup]:
    """Those that would fail again, by reason, the commonest first; each reason with its
    particular whys (one per server, template, tier ...)."""
    by_reason: dict[Reason, Counter[str]] = {}
    for found in blocked.values():
        if found.reason is None or found.why is None:
            continue  # not one that would fail again
        by_reason.setdefault(found.reason, Counter())[found.why] += 1
    groups = [
        ReasonGroup(reason, sum(whys.values()), whys.most_common())
        for reason, whys in by_reason.items()
    ]
    groups.sort(key=lambda g: (-g.count, g.reason.value))
    return groups


def code_groups(kind: Kind, ids: Sequence[int], tenant: int | None) -> list[CodeGroup]:
    """The retryable ones nothing found stops, by error code."""
    if not ids:
        return []
    model = kind.model
    rows = db.session.execute(visible(kind, ids, tenant, model.error_code))
    counts = Counter(code or "" for (code,) in rows)
    return [CodeGroup(code, n) for code, n in sorted(counts.items(), key=lambda c: (-c[1], c[0]))]


def bulk_retry_view(kind: Kind) -> ResponseReturnValue:
    """Two steps on one endpoint: without ``confirm`` count what would happen; with it, do it."""
    return bulk_view(kind, "retry", "_", plan_retry, _retry_confirmed)


def _retry_confirmed(bulk: BulkRequest) -> ResponseReturnValue:
    """Step two of a bulk retry: requeue the confirmed records."""
    ids, error = parse_ids([bulk.form.get("confirmed", "")])
    if error or not ids:
        return bulk.render("confirm", 422, error=error or "Nothing to retry.", plan=None)
    # Read again now: a quota raised or a template added since step one counts.
    blocked = blocked_ids(bulk.kind, ids, bulk.tenant)
    include = bulk.form.get("include_blocked") == "yes"
    left_out = {} if include else {i: f"{d.reason}: {d.why}" for i, d in blocked.items()}
    report = retry_records(
        db.session(),
        bulk.kind.model,
        [i for i in ids if i not in left_out],
        bulk.tenant,
        by=actor_label(),
        anyway={i: (str(d.reason), d.why or "") for i, d in blocked.items()} if include else None,
    )
    skipped = dict(report.skipped) | {
        i: f"left out: would fail again, {why}" for i, why in left_out.items()
    }
    tenant_of = dict(report.tenant_of)
    if left_out:
        model = bulk.kind.model
        found = visible(bulk.kind, left_out, bulk.tenant, model.id, model.tenant_id)
        tenant_of |= {int(rid): int(tid) for rid, tid in db.session.execute(found)}
    anyway = {i: f"{d.reason}" for i, d in blocked.items() if include and i in report.tenant_of}
    audit_bulk(AuditAction.BULK_RETRY, bulk, report.requeued, skipped, tenant_of, anyway)
    db.session.commit()  # the retry and its audit rows together
    summary = skipped_summary(report.skipped)
    left = skipped_summary(left_out)
    if not bulk.fragment:
        text = outcome_text(len(report.requeued), summary)
        if left_out:
            text += f" {len(left_out):,} left out because they would fail again."
        flash(text, "info")
        return redirect(bulk.list_url)
    return bulk.render(
        "outcome",
        requeued=len(report.requeued),
        summary=summary,
        left_out=left,
        left_out_count=len(left_out),
        **bulk.changed_rows(ids),
    )
