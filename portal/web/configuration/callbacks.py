"""Status callbacks: a tenant admin's endpoints, their delivery logs, and what a record caused.

A generated signing secret is shown once, on the page that answers the create (or rotate)
POST, never again: it is stored encrypted. After a rotation the old secret signs too for 24
hours, so receivers can switch without losing a delivery.
"""

from __future__ import annotations

from datetime import UTC, datetime

from flask import (
    Blueprint,
    abort,
    flash,
    make_response,
    redirect,
    render_template,
    request,
    url_for,
)
from flask.typing import ResponseReturnValue
from sqlalchemy import func, select

from portal.extensions import db
from portal.importer import callback_endpoints_full
from portal.messaging.after_send import callbacks
from portal.models import AuditAction, CallbackDelivery, CallbackEndpoint, DeliveryStatus
from portal.web.access import Permission, audit_row, requires, viewed_tenant
from portal.web.configuration.config_pages import confirmed
from portal.web.forms import (
    Form,
    form_data,
    is_htmx,
    owned,
    owned_under,
    settings,
    tier_name,
    varies,
    viewed_tier,
)

bp = Blueprint("callbacks", __name__, url_prefix="/callbacks")

LABELS = {"name": "Name", "url": "URL", "events": "Events", "since": "Since"}
PAGE = 50
AUDIT_TYPE = "callback_endpoint"  # the audit rows' target_type


def _endpoints(tier: int) -> list[CallbackEndpoint]:
    return list(
        db.session.scalars(
            select(CallbackEndpoint)
            .where(CallbackEndpoint.tenant_id == tier)
            .order_by(CallbackEndpoint.name)
        )
    )


def _back(endpoint: CallbackEndpoint, message: str, category: str) -> ResponseReturnValue:
    """Flash ``message`` and go back to the endpoint's page."""
    flash(message, category)
    return redirect(url_for("callbacks.show", endpoint_id=endpoint.id), 303)


def _read(form: Form, tier: int, current: CallbackEndpoint | None) -> tuple[str, str, list[str]]:
    """Name, URL and events from the form, each checked (errors recorded on ``form``)."""
    name = form.text("name", required=True, max_len=200) or ""
    if name:
        clash = db.session.scalar(
            select(CallbackEndpoint.id).where(
                CallbackEndpoint.tenant_id == tier, CallbackEndpoint.name == name
            )
        )
        if clash is not None and (current is None or clash != current.id):
            form.fail("name", f"{name!r} is already the name of an endpoint; choose another")
    url = form.text("url", required=True, max_len=callbacks.MAX_URL_CHARS) or ""
    if url:
        problem = callbacks.check_at_save(url, settings())
        if problem:
            form.fail("url", f"cannot be used: {problem}")
    events = request.form.getlist("events")
    if any(e not in callbacks.EVENT_TYPES for e in events):
        form.fail("events", "must be among the listed events")
    elif not events:
        form.fail("events", "need at least one: an endpoint told nothing is no use")
    return name, url, events


def _index(form: Form, chosen: list[str], status: int = 200) -> tuple[str, int]:
    tier = viewed_tier()
    rows = _endpoints(tier)
    pending = dict(
        db.session.execute(
            select(CallbackDelivery.endpoint_id, func.count())
            .where(
                CallbackDelivery.tenant_id == tier,
                CallbackDelivery.status.in_(["pending", "sending"]),
            )
            .group_by(CallbackDelivery.endpoint_id)
        ).all()
    )
    return render_template(
        "callbacks/index.html",
        endpoints=rows,
        pending=pending,
        form=form,
        chosen=chosen,
        event_types=callbacks.EVENT_TYPES,
        tier_name=tier_name(tier),
        now=datetime.now(UTC),
    ), status


@bp.get("/")
@requires(Permission.API_KEYS)
def index() -> tuple[str, int]:
    """The tier's endpoints (URL, events, state, deliveries waiting) and the form for a new one."""
    return _index(Form({}, LABELS), [e for e in callbacks.EVENT_TYPES if not e.endswith("queued")])


@bp.post("/")
@requires(Permission.API_KEYS)
def create() -> tuple[str, int]:
    """Create an endpoint and show its signing secret, this once."""
    tier = viewed_tier()
    form = Form(request.form, LABELS)
    name, url, events = _read(form, tier, None)
    full = callback_endpoints_full(db.session(), tier, settings().callback_endpoints_max)
    if full:
        form.fail("name", f"cannot be added: {full}")
    if not form.ok:
        return _index(form, events, 422)
    secret = callbacks.new_secret()
    row = CallbackEndpoint(tenant_id=tier, name=name, url=url, enabled=True)
    row.event_list = events
    row.secret = secret
    db.session.add(row)
    db.session.flush()
    audit_row(AuditAction.CONFIG_CREATE, AUDIT_TYPE, row, f"{name}: {url}")
    db.session.commit()
    return render_template("callbacks/secret.html", endpoint=row, secret=secret, rotated=False), 200


def _deliveries(endpoint: CallbackEndpoint, before: int | None) -> list[CallbackDelivery]:
    query = select(CallbackDelivery).where(
        CallbackDelivery.tenant_id == endpoint.tenant_id,
        CallbackDelivery.endpoint_id == endpoint.id,
    )
    if before is not None:
        query = query.where(CallbackDelivery.id < before)
    return list(db.session.scalars(query.order_by(CallbackDelivery.id.desc()).limit(PAGE)))


def _before() -> int | None:
    raw = request.args.get("before", "")
    if not raw:
        return None
    if not raw.isdigit() or len(raw) > 18:
        abort(404)
    return int(raw)


@bp.get("/<int:endpoint_id>")
@requires(Permission.API_KEYS)
def show(endpoint_id: int) -> ResponseReturnValue:
    """One endpoint: its settings, the delivery log (newest first, 50 a page) and actions."""
    endpoint = owned(CallbackEndpoint, endpoint_id, viewed_tier())
    rows = _deliveries(endpoint, _before())
    context = {
        "endpoint": endpoint,
        "deliveries": rows,
        "more": rows[-1].id if len(rows) == PAGE else None,
        "now": datetime.now(UTC),
    }
    if is_htmx():
        return varies(make_response(render_template("callbacks/_log.html", **context)))
    return varies(make_response(render_template("callbacks/show.html", **context)))


@bp.route("/<int:endpoint_id>/edit", methods=["GET", "POST"])
@requires(Permission.API_KEYS)
def edit(endpoint_id: int) -> ResponseReturnValue:
    """Change an endpoint's name, URL, events and whether it is enabled."""
    tier = viewed_tier()
    endpoint = owned(CallbackEndpoint, endpoint_id, tier)
    if request.method == "GET":
        form = Form(form_data(name=endpoint.name, url=endpoint.url), LABELS)
        return _edit_page(endpoint, form, endpoint.event_list, endpoint.enabled, 200)
    form = Form(request.form, LABELS)
    name, url, events = _read(form, tier, endpoint)
    enabled = request.form.get("enabled") == "on"
    if not form.ok:
        return _edit_page(endpoint, form, events, enabled, 422)
    endpoint.name, endpoint.url, endpoint.enabled = name, url, enabled
    endpoint.event_list = events
    if enabled:  # enabling again starts a fresh count of failures
        endpoint.consecutive_failures, endpoint.paused_until = 0, None
    remark = f"{name}: {url}{'' if enabled else ' (disabled)'}"
    audit_row(AuditAction.CONFIG_UPDATE, AUDIT_TYPE, endpoint, remark)
    db.session.commit()
    return _back(endpoint, f"Endpoint {name!r} saved.", "success")


def _edit_page(
    endpoint: CallbackEndpoint, form: Form, chosen: list[str], enabled: bool, status: int
) -> tuple[str, int]:
    return render_template(
        "callbacks/edit.html",
        endpoint=endpoint,
        form=form,
        chosen=chosen,
        enabled=enabled,
        event_types=callbacks.EVENT_TYPES,
    ), status


@bp.post("/<int:endpoint_id>/rotate")
@requires(Permission.API_KEYS)
def rotate(endpoint_id: int) -> ResponseReturnValue:
    """A new signing secret, shown once; the old one signs too for 24 hours."""
    endpoint = owned(CallbackEndpoint, endpoint_id, viewed_tier())
    secret = callbacks.rotate_secret(endpoint, datetime.now(UTC))
    remark = f"{endpoint.name}: signing secret rotated"
    audit_row(AuditAction.CONFIG_UPDATE, AUDIT_TYPE, endpoint, remark)
    db.session.commit()
    return render_template("callbacks/secret.html", endpoint=endpoint, secret=secret, rotated=True)


@bp.post("/<int:endpoint_id>/test")
@requires(Permission.API_KEYS)
def test(endpoint_id: int) -> ResponseReturnValue:
    """Send a ``test`` event now and say how the endpoint answered (retried if it failed)."""
    endpoint = owned(CallbackEndpoint, endpoint_id, viewed_tier())
    problem = callbacks.check_at_save(endpoint.url, settings())
    if problem:
        return _back(endpoint, f"Not sent: {problem}.", "error")
    delivery = callbacks.test_event(db.session(), endpoint)
    delivery.status = DeliveryStatus.SENDING.value
    delivery.attempts = 1
    db.session.commit()
    claimed = callbacks.Claimed(delivery.id, endpoint.id, 1)
    with callbacks.new_client() as client:
        callbacks.attempt(db.engine, settings(), client, claimed)
    db.session.expire_all()
    row = db.session.get(CallbackDelivery, claimed.id)
    if row is not None and row.status == DeliveryStatus.DELIVERED.value:
        took = f"HTTP {row.last_status_code} in {row.last_duration_ms} ms"
        return _back(endpoint, f"Test event delivered: {took}.", "success")
    why = row.last_error if row is not None else "unknown"
    return _back(endpoint, f"Test event not delivered ({why}); it will be retried.", "error")


@bp.post("/<int:endpoint_id>/deliveries/<int:delivery_id>/resend")
@requires(Permission.API_KEYS)
def resend(endpoint_id: int, delivery_id: int) -> ResponseReturnValue:
    """Post one delivery again (same webhook-id), due now with a fresh retry window."""
    endpoint = owned(CallbackEndpoint, endpoint_id, viewed_tier())
    delivery = owned_under(CallbackDelivery, delivery_id, endpoint, "endpoint_id")
    problem = callbacks.check_at_save(endpoint.url, settings())
    if problem:  # checked at resend too: the URL may have come to resolve privately
        return _back(endpoint, f"Not resent: {problem}.", "error")
    done = callbacks.resend(
        db.session(), endpoint.tenant_id, [delivery.id], settings().callback_give_up_s
    )
    db.session.commit()
    if done:
        return _back(endpoint, "Delivery due again now.", "success")
    return _back(endpoint, "That delivery is being posted right now.", "info")


@bp.post("/<int:endpoint_id>/replay")
@requires(Permission.API_KEYS)
def replay(endpoint_id: int) -> ResponseReturnValue:
    """Every delivery to this endpoint since a date and time (UTC) due again."""
    endpoint = owned(CallbackEndpoint, endpoint_id, viewed_tier())
    raw = request.form.get("since", "").strip()
    try:
        since = datetime.fromisoformat(raw)
    except ValueError:
        return _back(
            endpoint, "Since must be a date and time, e.g. 2026-12-01T09:00 (UTC).", "error"
        )
    if since.tzinfo is None:
        since = since.replace(tzinfo=UTC)
    if not 2000 <= since.year <= 9999:
        return _back(endpoint, "Since must be a date and time after 2000.", "error")
    problem = callbacks.check_at_save(endpoint.url, settings())
    if problem:
        return _back(endpoint, f"Not replayed: {problem}.", "error")
    count = callbacks.replay_since(
        db.session(), endpoint.tenant_id, endpoint.id, since, settings().callback_give_up_s
    )
    db.session.commit()
    return _back(endpoint, f"{count:,} deliveries due again.", "success")


@bp.route("/<int:endpoint_id>/delete", methods=["GET", "POST"])
@requires(Permission.API_KEYS)
def delete(endpoint_id: int) -> ResponseReturnValue:
    """Delete an endpoint and its delivery log, after a confirm page."""
    endpoint = owned(CallbackEndpoint, endpoint_id, viewed_tier())
    if not confirmed():
        return render_template("callbacks/delete.html", endpoint=endpoint)
    audit_row(AuditAction.CONFIG_DELETE, AUDIT_TYPE, endpoint, endpoint.name)
    db.session.delete(endpoint)
    db.session.commit()
    flash(f"Endpoint {endpoint.name!r} deleted.", "success")
    return redirect(url_for("callbacks.index"), 303)


@bp.get("/records/<channel>/<int:record_id>")
@requires(Permission.VIEW_RECORDS)
def record(channel: str, record_id: int) -> ResponseReturnValue:
    """The callbacks one record caused (a fragment of the record's page)."""
    from portal.web.records.kind import find_record
    from portal.web.records.mail_records import MAIL
    from portal.web.records.sms_records import SMS

    kind = {"mail": MAIL, "sms": SMS}.get(channel)
    if kind is None:
        abort(404)
    row = find_record(kind, record_id, viewed_tenant(allow_all=True))
    deliveries = list(
        db.session.scalars(
            select(CallbackDelivery)
            .where(
                CallbackDelivery.tenant_id == row.tenant_id,
                CallbackDelivery.channel == channel,
                CallbackDelivery.record_id == row.id,
            )
            .order_by(CallbackDelivery.id)
            .limit(200)
        )
    )
    names = dict(
        db.session.execute(
            select(CallbackEndpoint.id, CallbackEndpoint.name).where(
                CallbackEndpoint.tenant_id == row.tenant_id
            )
        ).all()
    )
    return varies(
        make_response(
            render_template(
                "callbacks/_record.html", deliveries=deliveries, names=names, now=datetime.now(UTC)
            )
        )
    )
