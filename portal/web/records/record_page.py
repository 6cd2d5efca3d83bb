"""One record's page: what it shows (its diagnosis, timeline and dead letter, the servers it
names as the viewer may see them) and what is done to it alone: Retry, which asks first when
the diagnosis says it would fail again, when it may deliver twice or when it has expired; and
sending an uncertain one again as a new message. ``diagnoses`` and ``viewer_role`` serve every
page that shows a record's diagnosis."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from flask import (
    current_app,
    flash,
    has_request_context,
    make_response,
    redirect,
    render_template,
    request,
    url_for,
)
from flask.typing import ResponseReturnValue
from flask_login import current_user
from sqlalchemy import select

from portal.extensions import db
from portal.messaging.records import diagnosis
from portal.messaging.records.diagnosis import Diagnosis, refusal
from portal.messaging.records.diagnosis.reasons import Reason
from portal.messaging.records.retry import new_expiry, resend_as_new, retry_records
from portal.messaging.records.validation import AcceptanceError
from portal.models import AuditAction, DeadLetterMessage, Role, SendStatus, Tenant
from portal.models.enums import RETRYABLE_BY_HAND
from portal.tenancy import PLATFORM_TENANT_ID, names_config
from portal.web.access import actor_label, audit, is_operator, viewed_tenant
from portal.web.forms import is_htmx
from portal.web.records import explain
from portal.web.records.kind import Kind, find_record
from portal.web.records.listing import tenant_column
from portal.web.records.timeline import timeline
from portal.web.security import safe_next

RETRYABLE = frozenset(s.value for s in RETRYABLE_BY_HAND)


def pretty_json(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True, default=str)


@dataclass(frozen=True)
class ConfigName:
    """How a record page names the server or provider a record names."""

    name: str
    platform: bool  # the platform tier's, named to a tenant only as "platform ... service"
    hidden: bool  # so its name, id and kind are not shown (a tenant looking)


def config_names(kind: Kind, record: Any, ids: Iterable[int | None]) -> dict[int, ConfigName]:
    """The names of the configs ``ids`` a record of ``record.tenant_id`` names: its own
    tenant's and the platform tier's (the only ones it can be sent through).

    The platform tier's rows are invisible to tenants (DESIGN, "Tenancy and roles"): a tenant
    sees "platform mail service" (or SMS) instead of the name; operators see the real one. The
    rule, by the config's tier and not the record's scope, is ``serialise.names_config``.
    """
    wanted = {i for i in ids if i is not None}
    if not wanted:
        return {}
    config = kind.config
    rows = db.session.execute(
        select(config.id, config.tenant_id, config.name).where(
            config.id.in_(wanted),
            config.tenant_id.in_([record.tenant_id, PLATFORM_TENANT_ID]),
        )
    ).all()
    operator = is_operator()
    names = {}
    for config_id, tenant_id, name in rows:
        platform = tenant_id == PLATFORM_TENANT_ID and record.tenant_id != PLATFORM_TENANT_ID
        hidden = not names_config(tenant_id, operator)
        names[config_id] = ConfigName(kind.platform_service if hidden else name, platform, hidden)
    return names


def diagnoses(kind: Kind, records: Sequence[Any]) -> dict[int, Diagnosis]:
    """The records' diagnoses (the viewer's records, already scoped), as this viewer may
    read them: a platform operator sees the platform's servers by name."""
    settings = current_app.config["SETTINGS"]
    operator = viewer_role() == Role.PLATFORM_OPERATOR
    return diagnosis.diagnose_many(db.session(), kind.channel, records, settings, operator=operator)


def viewer_role() -> str | None:
    """The signed-in person's role (None: nobody, or no request), for "who can act" lines."""
    if not has_request_context() or not current_user.is_authenticated:
        return None
    return str(current_user.role)


def show_context(kind: Kind, record: Any) -> dict[str, Any]:
    found = diagnoses(kind, [record])[record.id]
    return {
        "kind": kind,
        "record": record,
        "diagnosis": found,
        "tone": explain.tone(record.status, found),
        "who_can": explain.who_can(found, viewer_role()),
        "refusal": refusal(record.status),
        "tenant_name": db.session.scalar(select(Tenant.name).where(Tenant.id == record.tenant_id)),
        "pretty_json": pretty_json,
        "channel": kind.channel,
        # Provider events are on the timeline (read once, there).
        "timeline": timeline(db.session(), kind.channel, record, operator=is_operator()),
        "dead_letter": dead_letter_of(kind, record),
    }


def dead_letter_of(kind: Kind, record: Any) -> DeadLetterMessage | None:
    """The dead letter that archived this record (its newest, should it have died twice):
    the record page shows its triage state and remark."""
    return db.session.scalar(
        select(DeadLetterMessage)
        .where(
            DeadLetterMessage.channel == kind.channel.value,
            DeadLetterMessage.event_id == str(record.id),
            DeadLetterMessage.tenant_id == record.tenant_id,
        )
        .order_by(DeadLetterMessage.id.desc())
        .limit(1)
    )


def expired(record: Any) -> bool:
    """Past its ``expiresAt``: a retry needs a new one."""
    return record.expires_at is not None and record.expires_at <= datetime.now(UTC)


def retry_one(kind: Kind, record_id: int) -> ResponseReturnValue:
    """Requeue one record; the list row swaps itself, a page form redirects back.

    A record whose diagnosis says it would fail again, with an ambiguous attempt, or past its
    expiry first gets a confirm page (the reason, and who can change it; the risk of a
    duplicate; a new expiry to fill in). Only ``confirm=yes`` with what it asks retries:
    for a record that would fail again, ``anyway`` naming the reason the page showed, so a
    confirmation given for another reason (or none) never requeues it into that failure.
    Anything else is retried in one step.
    """
    tenant = viewed_tenant(allow_all=True)
    record = find_record(kind, record_id, tenant)
    found = diagnoses(kind, [record])[record.id]
    again = found.would_fail_again and found.reason is not Reason.EXPIRED
    asks = record.status in RETRYABLE and (record.ambiguous_attempt or expired(record) or again)
    expires_at = None
    error = None
    confirmed = request.form.get("confirm") == "yes"
    if again and request.form.get("anyway") != found.reason:
        confirmed = False
    if asks and expired(record) and confirmed:
        try:
            expires_at = new_expiry(request.form.get("expiresAt", ""), datetime.now(UTC))
        except AcceptanceError as exc:
            error = exc.message
    if asks and (not confirmed or error):
        if is_htmx() and request.form.get("view") == "row" and not error:
            # The list row's one-click Retry: nothing requeued; the row says why and offers
            # the confirm page instead.
            return _row_response(
                kind,
                record_id,
                tenant,
                f"Not retried: it would fail again — {found.reason}: {found.why}."
                if again
                else "Not retried: it needs a confirmation first (Retry…).",
                ask_first=True,
            )
        page = render_template(
            "mail_records/retry.html",
            kind=kind,
            record=record,
            expired=expired(record),
            diagnosis=found,
            fail_again=again,
            who_can=explain.who_can(found, viewer_role()),
            error=error,
            next_url=safe_next(
                request.form.get("next"), url_for(kind.endpoint("show"), record_id=record_id)
            ),
        )
        return page, 422 if error else 200
    report = retry_records(
        db.session(),
        kind.model,
        [record_id],
        tenant,
        expires_at=expires_at,
        by=actor_label(),
        anyway={record_id: (str(found.reason), found.why or "")} if again else None,
    )
    if report.requeued:
        message, category = f"Record {record_id} requeued: it will be sent again shortly.", "info"
        remark = "requeued" + (f" with a new expiry {expires_at.isoformat()}" if expires_at else "")
        if again:
            remark += f", retried anyway: would fail again ({found.reason}): {found.why}"
    else:
        message = f"Record {record_id} not retried — {report.skipped[record_id]}."
        category = "error"
        remark = f"not retried: {report.skipped[record_id]}"
    audit(
        AuditAction.RETRY,
        tenant_id=record.tenant_id,
        target_type=kind.model.__name__,
        target_id=record_id,
        remark=remark,
    )
    db.session.commit()  # the retry and its audit row together
    if is_htmx() and request.form.get("view") == "row":
        return _row_response(kind, record_id, tenant, message)
    flash(message, category)
    fallback = url_for(kind.endpoint("show"), record_id=record_id)
    return redirect(safe_next(request.form.get("next"), fallback))


def _row_response(
    kind: Kind, record_id: int, tenant: int | None, message: str, *, ask_first: bool = False
) -> ResponseReturnValue:
    """The list row of one record, swapped in by its Retry, with what happened."""
    row = find_record(kind, record_id, tenant)
    response = make_response(
        render_template(
            f"{kind.blueprint}/_row.html",
            kind=kind,
            r=row,
            **tenant_column(tenant),
            row_message=message,
            ask_first=ask_first,
        )
    )
    response.headers["Vary"] = "HX-Request"
    return response


def resend_one(kind: Kind, record_id: int) -> ResponseReturnValue:
    """Send an Uncertain record's request again as a new message (a new record with a new
    business key); without ``confirm=yes``, the page that says what that risks."""
    tenant = viewed_tenant(allow_all=True)
    record = find_record(kind, record_id, tenant)
    if record.status != SendStatus.UNCERTAIN.value:
        flash(
            f"Record {record_id} is {explain.label(record.status)}, not uncertain: "
            "retry it instead.",
            "error",
        )
        return redirect(url_for(kind.endpoint("show"), record_id=record_id), 303)
    error = None
    if request.form.get("confirm") == "yes":
        try:
            accepted = resend_as_new(
                db.session(), record, current_app.config["SETTINGS"], by=actor_label()
            )
        except AcceptanceError as exc:
            db.session.rollback()
            error = f"It cannot be sent again as it was: {exc.message}."
        else:
            audit(
                AuditAction.RETRY,
                tenant_id=record.tenant_id,
                target_type=kind.model.__name__,
                target_id=record_id,
                remark=f"sent again as a new message: record {accepted.id}",
            )
            db.session.commit()  # the new record and its audit row together
            flash(
                f"Sent again as a new message, record {accepted.id}. Record {record_id} "
                "stays uncertain until it is resolved.",
                "info",
            )
            return redirect(url_for(kind.endpoint("show"), record_id=accepted.id), 303)
    page = render_template("mail_records/resend.html", kind=kind, record=record, error=error)
    return page, 422 if error else 200
