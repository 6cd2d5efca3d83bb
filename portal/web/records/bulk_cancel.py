"""Bulk cancel: the plan says which records can be cancelled now and carries the versions
seen, so the second step cancels exactly those (a worker that claimed one meanwhile wins)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from flask import flash, redirect
from flask.typing import ResponseReturnValue

from portal.extensions import db
from portal.messaging.records import cancel
from portal.models import AuditAction
from portal.web.access import actor_label
from portal.web.records.bulk import BulkRequest, StatusLine, audit_bulk, bulk_view, skipped_summary
from portal.web.records.filters import parse_confirmed
from portal.web.records.kind import Kind, visible


@dataclass
class CancelPlan:
    """What "Cancel" would do to a set of ids, without changing anything: the versions seen
    (the cancellable ones') go into the confirmation, so the cancel takes exactly those."""

    ids: list[int]
    versions: dict[int, int]  # cancellable ids -> the version seen now
    lines: list[StatusLine]
    capped: bool = False
    tenants: list[tuple[str, int]] = field(default_factory=list)
    needs_all_tenants: bool = False
    scope: str = "selected"

    @property
    def cancel(self) -> int:
        return len(self.versions)

    @property
    def keep(self) -> int:
        return len(self.ids) - len(self.versions)

    @property
    def confirmed(self) -> str:
        """``id:version`` for each cancellable id, the bare id for the others."""
        return ",".join(
            f"{i}:{self.versions[i]}" if i in self.versions else str(i) for i in self.ids
        )


def plan_cancel(kind: Kind, ids: Sequence[int], tenant: int | None) -> CancelPlan:
    """Which of the ids can be cancelled now (Pending or Retry, no ambiguous attempt) and why
    the others cannot, counted by status."""
    model = kind.model
    stmt = visible(
        kind, ids, tenant, model.id, model.status, model.ambiguous_attempt, model.version
    )
    versions: dict[int, int] = {}
    counts: Counter[tuple[str, str | None]] = Counter()
    for record_id, status, ambiguous, version in db.session.execute(stmt):
        reason = cancel.cancellable(status, bool(ambiguous))
        if reason is None:
            versions[record_id] = version
        counts[(status, reason)] += 1
    lines = [
        StatusLine(status, n, reason)
        for (status, reason), n in sorted(
            counts.items(), key=lambda item: (item[0][1] is not None, item[0][0])
        )
    ]
    missing = len(ids) - sum(counts.values())
    if missing:
        lines.append(StatusLine("", missing, "no such record"))
    return CancelPlan(list(ids), versions, lines)


@dataclass
class CancelOutcome:
    """Step two's answer: what happened to each record, in three plain groups."""

    cancelled: list[int]
    claimed: list[tuple[int, str]]  # a worker got there first: (id, what it is now)
    refused: list[tuple[str, int]]  # never cancellable: (reason, how many)

    @property
    def text(self) -> str:
        """The no-JavaScript flash."""
        parts = [f"{len(self.cancelled):,} cancelled"]
        if self.claimed:
            ids = ", ".join(str(i) for i, _ in self.claimed[:20])
            more = "…" if len(self.claimed) > 20 else ""
            parts.append(
                f"{len(self.claimed):,} not cancelled because a worker claimed it first "
                f"(record {ids}{more})"
            )
        if self.refused:
            total = sum(n for _, n in self.refused)
            reasons = " · ".join(f"{n:,}: {reason}" for reason, n in self.refused)
            parts.append(f"{total:,} not cancellable ({reasons})")
        return "; ".join(parts) + "."


def cancel_outcome(report: cancel.CancelReport) -> CancelOutcome:
    claimed = set(report.claimed)
    return CancelOutcome(
        cancelled=report.cancelled,
        claimed=[(i, report.skipped[i]) for i in report.claimed],
        refused=skipped_summary({i: r for i, r in report.skipped.items() if i not in claimed}),
    )


def bulk_cancel_view(kind: Kind) -> ResponseReturnValue:
    """Two steps, as bulk retry: count what a cancel would do; then cancel by version."""
    return bulk_view(kind, "cancel", "_cancel_", plan_cancel, _cancel_confirmed)


def _cancel_confirmed(bulk: BulkRequest) -> ResponseReturnValue:
    """Step two of a bulk cancel: cancel the confirmed records at the versions seen."""
    ids, versions, error = parse_confirmed(bulk.form.get("confirmed", ""))
    if error or not ids:
        return bulk.render("confirm", 422, error=error or "Nothing to cancel.", plan=None)
    report = cancel.cancel_records(
        db.session(), bulk.kind.model, ids, bulk.tenant, versions, by=actor_label()
    )
    audit_bulk(AuditAction.BULK_CANCEL, bulk, report.cancelled, report.skipped, report.tenant_of)
    db.session.commit()  # the cancel and its audit rows together
    outcome = cancel_outcome(report)
    if not bulk.fragment:
        flash(outcome.text, "info" if not report.skipped else "error")
        return redirect(bulk.list_url)
    return bulk.render("outcome", outcome=outcome, **bulk.changed_rows(ids))
