"""A bulk action on records (retry, cancel) in two steps on one endpoint: what it would do to
the selection, or to everything the filter matches (the action's plan, counted); then,
confirmed, done and audited, a row per tenant it reached. ``bulk_retry`` and ``bulk_cancel``
give each action's plan and second step."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol, TypeVar

from flask import redirect, render_template, request, url_for
from flask.typing import ResponseReturnValue
from sqlalchemy import func, select
from werkzeug.datastructures import MultiDict

from portal.extensions import db
from portal.models import AuditAction
from portal.web.access import audit, viewed_tenant
from portal.web.forms import is_htmx
from portal.web.records.filters import BULK_CAP, Filters, parse_confirmed, parse_filters, parse_ids
from portal.web.records.kind import Kind, visible
from portal.web.records.listing import conditions, tenant_names

AUDIT_IDS_LISTED = 50  # of the records a bulk action changed, its audit remark names this many
ALL_TENANTS_CHOSEN = "yes"  # the value of the confirmation's "all_tenants" checkbox


@dataclass
class StatusLine:
    status: str
    count: int
    reason: str | None  # None: it will be requeued


class Plan(Protocol):
    """What the two steps need of an action's plan (``RetryPlan``, ``CancelPlan``)."""

    capped: bool  # the selection was everything matching the filter, cut at BULK_CAP
    tenants: list[tuple[str, int]]  # all-tenants view: how many records per tenant
    needs_all_tenants: bool  # confirming needs the explicit "all tenants" choice
    scope: str  # what was planned: "selected" or "filter"


PlanT = TypeVar("PlanT", bound=Plan)


def matching_ids(kind: Kind, filters: Filters, tenant: int | None) -> tuple[list[int], bool]:
    """The newest BULK_CAP ids matching the filter (every page, not just this one)."""
    unpaged = replace(filters, before=None)
    where, _ = conditions(kind, unpaged, tenant)
    ids = list(
        db.session.scalars(
            select(kind.model.id).where(*where).order_by(kind.model.id.desc()).limit(BULK_CAP + 1)
        )
    )
    return ids[:BULK_CAP], len(ids) > BULK_CAP


def tenant_counts(kind: Kind, ids: Sequence[int]) -> list[tuple[str, int]]:
    """How many of ``ids`` each tenant holds, by name (the all-tenants view's bulk actions)."""
    model = kind.model
    stmt = visible(kind, ids, None, model.tenant_id, func.count()).group_by(model.tenant_id)
    names = tenant_names(None)
    counts = [(names.get(tid, f"tenant {tid}"), int(n)) for tid, n in db.session.execute(stmt)]
    return sorted(counts, key=lambda c: (-c[1], c[0]))


def skipped_summary(skipped: Mapping[int, str]) -> list[tuple[str, int]]:
    """Skipped ids grouped by reason, the commonest first."""
    return Counter(skipped.values()).most_common()


@dataclass
class BulkRequest:
    """One post of a bulk form (retry or cancel), read once: whose records, the filter it
    carries, the list to go back to, and whether htmx wants a fragment or the page."""

    kind: Kind
    verb: str  # "retry" or "cancel": the endpoint is bulk_<verb>, the page bulk_<verb>.html
    fragments: str  # the fragments' prefix: <prefix>confirm.html and <prefix>outcome.html
    tenant: int | None
    form: MultiDict[str, str]
    filters: Filters
    list_url: str
    fragment: bool

    def render(self, step: str, status: int = 200, **context: Any) -> ResponseReturnValue:
        """The step's fragment (htmx) or the page that holds the confirmation."""
        page = f"{self.fragments}{step}" if self.fragment else f"bulk_{self.verb}"
        html = render_template(
            f"{self.kind.blueprint}/{page}.html",
            kind=self.kind,
            filters=self.filters,
            list_url=self.list_url,
            verb=self.verb,
            step=step,
            **context,
        )
        return html, status, {"Vary": "HX-Request"}

    def changed_rows(self, ids: Iterable[int]) -> dict[str, Any]:
        """The rows on the page (``shown``) among ``ids``, re-read, for the outcome to swap."""
        shown, _ = parse_ids(self.form.getlist("shown"))
        wanted = set(shown) & set(ids)
        rows = []
        if wanted:
            model = self.kind.model
            rows = list(
                db.session.scalars(
                    visible(self.kind, wanted, self.tenant).order_by(model.id.desc())
                )
            )
        return {
            "rows": rows,
            "all_tenants": self.tenant is None,
            "names": tenant_names(self.tenant),
        }


def bulk_view(
    kind: Kind,
    verb: str,
    fragments: str,
    plan: Callable[[Kind, Sequence[int], int | None], PlanT],
    confirmed: Callable[[BulkRequest], ResponseReturnValue],
) -> ResponseReturnValue:
    """A bulk action's two steps on one endpoint: without ``confirm``, ``plan`` counts what
    would happen to the selection (or everything matching the filter); with ``confirm=yes``,
    ``confirmed`` does it; ``confirm=no`` clears the confirmation."""
    form: MultiDict[str, str] = request.form
    filters = parse_filters(form)
    bulk = BulkRequest(
        kind=kind,
        verb=verb,
        fragments=fragments,
        tenant=viewed_tenant(allow_all=True),
        form=form,
        filters=filters,
        list_url=url_for(kind.endpoint("index"), **filters.args()),
        fragment=is_htmx(),
    )
    decision = form.get("confirm", "")
    if decision == "no":
        return ("", 200, {"Vary": "HX-Request"}) if bulk.fragment else redirect(bulk.list_url)
    if decision == "yes":
        return _all_tenants_unchosen(bulk, plan) or confirmed(bulk)

    # Step one: which records, and what would happen to them.
    if form.get("scope") == "filter":
        if filters.errors:
            return bulk.render("confirm", 422, error=next(iter(filters.errors.values())), plan=None)
        ids, capped = matching_ids(kind, filters, bulk.tenant)
        if not ids:
            return bulk.render("confirm", 422, error="No records match this filter.", plan=None)
    else:
        ids, error = parse_ids(form.getlist("ids"))
        capped = False
        if error or not ids:
            error = error or f"Select at least one record to {verb}."
            return bulk.render("confirm", 422, error=error, plan=None)
    planned = plan(kind, ids, bulk.tenant)
    planned.capped = capped
    scope = form.get("scope", "")
    return bulk.render("confirm", plan=_for_viewer(bulk, planned, ids, scope), error=None)


def _for_viewer(bulk: BulkRequest, planned: PlanT, ids: Sequence[int], scope: str) -> PlanT:
    """The plan with what the all-tenants view adds: counts per tenant, and whether confirming
    needs the explicit "all tenants" choice (everything matching the filter: whose records
    those are is not something the operator picked row by row).

    The confirmation carries the scope it was planned for as ``planned_scope``, not ``scope``:
    a confirmation left on the page must not turn the next "Retry selected" into "all
    matching"."""
    planned.scope = "filter" if scope == "filter" else "selected"
    if bulk.tenant is None:
        planned.tenants = tenant_counts(bulk.kind, ids)
        planned.needs_all_tenants = planned.scope == "filter"
    return planned


def _all_tenants_unchosen(
    bulk: BulkRequest, plan: Callable[[Kind, Sequence[int], int | None], PlanT]
) -> ResponseReturnValue | None:
    """Step two in the all-tenants view over everything matching the filter (the
    confirmation carries ``planned_scope=filter``), without the explicit choice: the
    confirmation again (422), saying what to tick; else None."""
    if bulk.tenant is None and bulk.form.get("planned_scope") == "filter":
        ids, _versions, error = parse_confirmed(bulk.form.get("confirmed", ""))
        if error or not ids:
            return None  # the action's own step two says what is wrong
        planned = _for_viewer(bulk, plan(bulk.kind, ids, bulk.tenant), ids, "filter")
        if planned.needs_all_tenants and bulk.form.get("all_tenants") != ALL_TENANTS_CHOSEN:
            choice = (
                f"This would {bulk.verb} records of every tenant listed: tick "
                "“Yes, all these tenants” to go on, or choose one tenant under Viewing."
            )
            return bulk.render("confirm", 422, plan=planned, error=None, choice_error=choice)
    return None


def outcome_text(done: int, summary: list[tuple[str, int]], verb: str = "requeued") -> str:
    """The no-JavaScript flash: "3 requeued, 2 skipped (1: already sent · 1: ...)."."""
    if not summary:
        return f"{done:,} {verb}."
    skipped = sum(n for _, n in summary)
    reasons = " · ".join(f"{n:,}: {reason}" for reason, n in summary)
    return f"{done:,} {verb}, {skipped:,} skipped ({reasons})."


def audit_bulk(
    action: AuditAction,
    bulk: BulkRequest,
    done: Sequence[int],
    skipped: Mapping[int, str],
    tenant_of: Mapping[int, int],
    anyway: Mapping[int, str] | None = None,
) -> None:
    """The audit rows of one confirmed bulk request (in its transaction): one row in the
    viewed tenant. ``anyway``: the records requeued although they would fail again (the
    person ticked to include them), with the reason, counted in the remark.

    An operator looking at every tenant writes one row per tenant whose records the request
    reached, so each tenant's admins see it in their own log, plus one without a tenant for
    ids that matched no record. Each remark counts what happened to that tenant's records
    ("3 requeued, 1 skipped (1: already sent).") and names the first ones changed.
    """
    verb = "requeued" if action is AuditAction.BULK_RETRY else "cancelled"
    groups: dict[int | None, set[int]] = {}
    for record_id in [*done, *skipped]:
        groups.setdefault(tenant_of.get(record_id, bulk.tenant), set()).add(record_id)
    for tenant_id, ids in groups.items():
        changed = [i for i in done if i in ids]
        remark = outcome_text(
            len(changed), skipped_summary({i: r for i, r in skipped.items() if i in ids}), verb
        )
        if changed:
            listed = ", ".join(str(i) for i in changed[:AUDIT_IDS_LISTED])
            rest = len(changed) - AUDIT_IDS_LISTED
            more = f" and {rest:,} more" if rest > 0 else ""
            remark += f" {verb.capitalize()}: {listed}{more}."
        forced = skipped_summary({i: r for i, r in (anyway or {}).items() if i in changed})
        if forced:
            reasons = " · ".join(f"{n:,}: {reason}" for reason, n in forced)
            remark += (
                f" Retried anyway although they would fail again: "
                f"{sum(n for _, n in forced):,} ({reasons})."
            )
        audit(action, tenant_id=tenant_id, target_type=bulk.kind.model.__name__, remark=remark)
