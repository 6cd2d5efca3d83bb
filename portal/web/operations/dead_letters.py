"""Dead letters: records whose retries are used up, for operators to triage in one place.

Triage is Pending -> Resolved or Discarded with a remark; it never resends anything. To send
again, the page links to the send record and its Retry (seed 000, "Dead letters").
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from flask import Blueprint, abort, flash, redirect, render_template, request, url_for
from flask.typing import ResponseReturnValue
from sqlalchemy import Select, func, select
from sqlalchemy import update as sql_update

from portal.extensions import db
from portal.messaging.records.diagnosis import Diagnosis, refusal
from portal.models import AuditAction, Channel, DeadLetterMessage, TriageStatus, db_now
from portal.web.access import Permission, audit, audit_row, can, requires, user, viewed_tenant
from portal.web.forms import is_htmx
from portal.web.records import explain
from portal.web.records.bulk import ALL_TENANTS_CHOSEN
from portal.web.records.filters import (
    BULK_CAP,
    MAX_ID,
    ListFilters,
    parse_id,
    parse_ids,
)
from portal.web.records.kind import Kind
from portal.web.records.listing import PAGE_SIZE, tenant_names
from portal.web.records.mail_records import MAIL as MAIL_KIND
from portal.web.records.record_page import diagnoses, pretty_json, viewer_role
from portal.web.records.sms_records import SMS as SMS_KIND

bp = Blueprint("dead_letters", __name__, url_prefix="/dead-letters")

TRIAGE_STATUSES = [s.value for s in TriageStatus]
DECISIONS = [TriageStatus.RESOLVED.value, TriageStatus.DISCARDED.value]
CHANNELS = [c.value for c in Channel]
KINDS: dict[str, Kind] = {Channel.MAIL.value: MAIL_KIND, Channel.SMS.value: SMS_KIND}
MAX_REMARK_CHARS = 2000


@dataclass
class DeadLetterFilters(ListFilters):
    status: str = ""
    channel: str = ""
    code: str = ""
    tenant: int | None = None


def parse_filters(source: Any, all_tenants: bool) -> DeadLetterFilters:
    """Read and check the list's query; never raises."""
    filters = DeadLetterFilters.read(source, ("status", "channel", "code", "tenant"))
    filters.status = filters.choice(
        "status", TRIAGE_STATUSES, "Choose Pending, Resolved or Discarded."
    )
    filters.channel = filters.choice("channel", CHANNELS, "Choose mail or SMS.")
    filters.code = filters.code_text("code", "An error code")
    raw = filters.raw["tenant"]
    if raw and all_tenants:
        # The platform tier is -1; every other tenant id is positive.
        filters.tenant = -1 if raw == "-1" else parse_id(raw)
        if filters.tenant is None:
            filters.errors["tenant"] = "Choose a tenant from the list."
    return filters.cursor()


def waiting_by_tenant() -> dict[int, int]:
    """Dead letters waiting for triage, per tenant (operators: the all-tenants figures; read
    by the (tenant_id, status, id) index)."""
    rows = db.session.execute(
        select(DeadLetterMessage.tenant_id, func.count())
        .where(DeadLetterMessage.status == TriageStatus.PENDING.value)
        .group_by(DeadLetterMessage.tenant_id)
    )
    return {int(tid): int(n) for tid, n in rows}


def find_dead_letter(letter_id: int, tenant: int | None) -> DeadLetterMessage:
    """The dead letter, if it is in the tenant being viewed; 404 otherwise."""
    if letter_id > MAX_ID:
        abort(404)
    stmt = select(DeadLetterMessage).where(DeadLetterMessage.id == letter_id)
    if tenant is not None:
        stmt = stmt.where(DeadLetterMessage.tenant_id == tenant)
    letter = db.session.scalar(stmt)
    if letter is None:
        abort(404)
    return letter


@dataclass
class LinkedRecord:
    kind: Kind
    id: int
    status: str
    refusal: str | None
    diagnosis: Diagnosis  # the record's: would a retry work, what to do, who can


def linked_records(
    letters: Sequence[DeadLetterMessage], tenant: int | None
) -> dict[int, LinkedRecord]:
    """Dead letter id -> the send record it archived, for those whose record still exists
    and may be seen (its own tenant's, within the viewed one), each with its diagnosis; one
    read and one diagnosis per channel."""
    found: dict[int, LinkedRecord] = {}
    for channel, kind in KINDS.items():
        wanted = {
            letter.id: (record_id, letter.tenant_id)
            for letter in letters
            if letter.channel == channel and (record_id := parse_id(letter.event_id)) is not None
        }
        if not wanted:
            continue
        model: Any = kind.model
        stmt = select(model).where(model.id.in_({rid for rid, _ in wanted.values()}))
        if tenant is not None:
            stmt = stmt.where(model.tenant_id == tenant)
        records: dict[int, Any] = {r.id: r for r in db.session.scalars(stmt)}
        found_diagnoses = diagnoses(kind, list(records.values()))
        for letter_id, (record_id, tenant_id) in wanted.items():
            record = records.get(record_id)
            if record is None or record.tenant_id != tenant_id:
                continue
            found[letter_id] = LinkedRecord(
                kind, record.id, record.status, refusal(record.status), found_diagnoses[record.id]
            )
    return found


def linked_record(letter: DeadLetterMessage, tenant: int | None) -> LinkedRecord | None:
    """The send record the dead letter archived, if it still exists and may be seen."""
    return linked_records([letter], tenant).get(letter.id)


def _show(
    letter: DeadLetterMessage,
    tenant: int | None,
    *,
    errors: dict[str, str] | None = None,
    form: dict[str, str] | None = None,
    status: int = 200,
) -> ResponseReturnValue:
    fragment = is_htmx()
    template = "dead_letters/_triage.html" if fragment else "dead_letters/show.html"
    record = linked_record(letter, tenant)
    html = render_template(
        template,
        letter=letter,
        record=record,
        who_can=explain.who_can(record.diagnosis, viewer_role()) if record else None,
        payload=pretty_json(letter.payload) if letter.payload is not None else None,
        names=tenant_names(None),
        errors=errors or {},
        form=form or {},
        decisions=DECISIONS,
        can_retry=can(Permission.RETRY),
        max_remark=MAX_REMARK_CHARS,
    )
    return html, status, {"Vary": "HX-Request"}


def matching(filters: DeadLetterFilters, tenant: int | None) -> Select[Any]:
    """The dead letters the filter matches in the viewed tenant (None: every tenant, then the
    filter's own tenant if it names one), without the cursor."""
    stmt = select(DeadLetterMessage)
    scope = tenant if tenant is not None else filters.tenant
    if scope is not None:
        stmt = stmt.where(DeadLetterMessage.tenant_id == scope)
    if filters.status:
        stmt = stmt.where(DeadLetterMessage.status == filters.status)
    if filters.channel:
        stmt = stmt.where(DeadLetterMessage.channel == filters.channel)
    if filters.code:
        stmt = stmt.where(DeadLetterMessage.error_code == filters.code)
    return stmt


def _index(
    filters: DeadLetterFilters,
    tenant: int | None,
    *,
    bulk_errors: dict[str, str] | None = None,
    bulk_form: dict[str, str] | None = None,
) -> ResponseReturnValue:
    rows: list[DeadLetterMessage] = []
    older = None
    if not filters.errors:
        stmt = matching(filters, tenant)
        if filters.before is not None:
            stmt = stmt.where(DeadLetterMessage.id < filters.before)
        found = list(
            db.session.scalars(stmt.order_by(DeadLetterMessage.id.desc()).limit(PAGE_SIZE + 1))
        )
        rows = found[:PAGE_SIZE]
        older = found[PAGE_SIZE - 1].id if len(found) > PAGE_SIZE else None
    names = tenant_names(None)
    waiting = waiting_by_tenant()
    html = render_template(
        "dead_letters/index.html",
        filters=filters,
        rows=rows,
        records=linked_records(rows, tenant),
        older=older,
        all_tenants=tenant is None,
        viewed=tenant,
        names=names,
        statuses=TRIAGE_STATUSES,
        channels=CHANNELS,
        decisions=DECISIONS,
        max_remark=MAX_REMARK_CHARS,
        waiting=sorted(
            ((tid, names.get(tid, f"tenant {tid}"), n) for tid, n in waiting.items()),
            key=lambda w: (-w[2], w[1]),
        ),
        bulk_errors=bulk_errors or {},
        bulk_form=bulk_form or {},
    )
    failed = filters.errors or bulk_errors
    return html, 422 if failed else 200


@bp.get("/")
@requires(Permission.DEAD_LETTERS)
def index() -> ResponseReturnValue:
    """Dead letters, newest first, filtered by triage status, channel, error code and tenant."""
    tenant = viewed_tenant(allow_all=True)
    return _index(parse_filters(request.args, all_tenants=tenant is None), tenant)


def triage_errors(decision: str, remark: str) -> dict[str, str]:
    """What is wrong with a triage's decision and remark (one or many dead letters)."""
    errors: dict[str, str] = {}
    if decision not in DECISIONS:
        errors["decision"] = "Choose Resolved or Discarded."
    if not remark:
        errors["remark"] = "Write a remark: what was done, or why it is discarded."
    elif len(remark) > MAX_REMARK_CHARS:
        errors["remark"] = f"Keep the remark to {MAX_REMARK_CHARS:,} characters."
    return errors


@bp.post("/triage")
@requires(Permission.DEAD_LETTERS)
def bulk_triage() -> ResponseReturnValue:
    """Triage many at once: the selected dead letters, or every one waiting that the filter
    matches (the newest BULK_CAP); one decision and one remark, each audited."""
    tenant = viewed_tenant(allow_all=True)
    form = request.form
    filters = parse_filters(form, all_tenants=tenant is None)
    decision = (form.get("decision") or "").strip()
    remark = (form.get("remark") or "").strip()
    over_filter = form.get("scope") == "filter"
    bulk_form = {"decision": decision, "remark": remark, "scope": "filter" if over_filter else ""}
    errors = triage_errors(decision, remark)
    waiting = DeadLetterMessage.status == TriageStatus.PENDING.value
    capped = False
    if over_filter:
        if filters.errors:
            return _index(filters, tenant, bulk_errors=errors, bulk_form=bulk_form)
        found = [
            (int(i), int(t))
            for i, t in db.session.execute(
                matching(filters, tenant)
                .with_only_columns(DeadLetterMessage.id, DeadLetterMessage.tenant_id)
                .where(waiting)
                .order_by(DeadLetterMessage.id.desc())
                .limit(BULK_CAP + 1)
            )
        ]
        capped = len(found) > BULK_CAP
        letters = found[:BULK_CAP]
    else:
        ids, error = parse_ids(form.getlist("letter_ids"))
        if error:
            errors["letter_ids"] = "Those dead letters are not valid: reload and select again."
        stmt = select(DeadLetterMessage.id, DeadLetterMessage.tenant_id).where(
            DeadLetterMessage.id.in_(ids), waiting
        )
        if tenant is not None:
            stmt = stmt.where(DeadLetterMessage.tenant_id == tenant)
        letters = [(int(i), int(t)) for i, t in db.session.execute(stmt)]
    if not letters and "letter_ids" not in errors:
        errors["letter_ids"] = (
            "No dead letter waiting for triage matches this filter."
            if over_filter
            else "Select at least one dead letter waiting for triage."
        )
    per_tenant = Counter(tid for _, tid in letters)
    # Everything matching, across tenants: whose they are was not picked row by row.
    spans = over_filter and filters.tenant is None
    if tenant is None and spans and form.get("all_tenants") != ALL_TENANTS_CHOSEN:
        names = tenant_names(None)
        counts = ", ".join(f"{names.get(t, t)} {n:,}" for t, n in per_tenant.most_common())
        errors["all_tenants"] = (
            f"This marks dead letters of {len(per_tenant)} tenant"
            f"{'s' if len(per_tenant) != 1 else ''} ({counts}): tick "
            "\u201cYes, all tenants\u201d to go on, or filter by one tenant."
        )
    if errors:
        return _index(filters, tenant, bulk_errors=errors, bulk_form=bulk_form)
    # Conditional on Pending: a dead letter someone else triaged meanwhile is left as it is.
    owned = [DeadLetterMessage.id.in_([i for i, _ in letters]), waiting]
    if tenant is not None:
        owned.append(DeadLetterMessage.tenant_id == tenant)
    done = db.session.execute(
        sql_update(DeadLetterMessage)
        .where(*owned)
        .values(status=decision, remark=remark, handled_by=user().email, handled_at=db_now())
        .returning(DeadLetterMessage.id, DeadLetterMessage.tenant_id)
        .execution_options(synchronize_session=False)
    ).all()
    for letter_id, tenant_id in done:
        audit(
            AuditAction.DEAD_LETTER_TRIAGE,
            tenant_id=tenant_id,
            target_type="dead_letter",
            target_id=letter_id,
            remark=f"{decision}: {remark}",
        )
    db.session.commit()
    message = f"{len(done):,} dead letter{'s' if len(done) != 1 else ''} marked {decision}."
    if len(done) < len(letters):
        message += f" {len(letters) - len(done):,} had been handled by someone else meanwhile."
    if capped:
        message += f" Only the newest {BULK_CAP:,} were included: mark the rest next."
    flash(message, "info")
    return redirect(url_for("dead_letters.index", **filters.args()), 303)


@bp.get("/<int:letter_id>")
@requires(Permission.DEAD_LETTERS)
def show(letter_id: int) -> ResponseReturnValue:
    """One dead letter: why, its payload, the record it came from, and the triage form."""
    tenant = viewed_tenant(allow_all=True)
    return _show(find_dead_letter(letter_id, tenant), tenant)


@bp.post("/<int:letter_id>")
@requires(Permission.DEAD_LETTERS)
def update(letter_id: int) -> ResponseReturnValue:
    """Triage: Pending -> Resolved or Discarded, with a remark (it resends nothing)."""
    tenant = viewed_tenant(allow_all=True)
    letter = find_dead_letter(letter_id, tenant)
    decision = (request.form.get("decision") or "").strip()
    remark = (request.form.get("remark") or "").strip()
    form = {"decision": decision, "remark": remark}
    errors = triage_errors(decision, remark)
    if letter.status != TriageStatus.PENDING.value:
        errors["decision"] = "This dead letter has already been handled."
    if errors:
        return _show(letter, tenant, errors=errors, form=form, status=422)
    # Conditional on Pending: two operators triaging at once cannot both win.
    done = db.session.execute(
        sql_update(DeadLetterMessage)
        .where(
            DeadLetterMessage.id == letter.id,
            DeadLetterMessage.status == TriageStatus.PENDING.value,
        )
        .values(
            status=decision,
            remark=remark,
            handled_by=user().email,
            handled_at=db_now(),
        )
        .execution_options(synchronize_session=False)
    )
    if done.rowcount:  # type: ignore[attr-defined]
        audit_row(AuditAction.DEAD_LETTER_TRIAGE, "dead_letter", letter, f"{decision}: {remark}")
    db.session.commit()
    db.session.refresh(letter)
    if not done.rowcount:  # type: ignore[attr-defined]
        errors["decision"] = "Someone else handled this dead letter a moment ago."
        return _show(letter, tenant, errors=errors, form=form, status=422)
    if is_htmx():
        return _show(letter, tenant)
    flash(f"Dead letter {letter.id} marked {decision}.", "info")
    return redirect(url_for("dead_letters.show", letter_id=letter.id))
