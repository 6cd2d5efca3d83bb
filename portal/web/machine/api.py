"""The JSON API under /api/v1/, authenticated by a tenant API key.

Every error answers with one shape, ``{"error": {"code", "field", "message"[, "index"]}}``:
malformed JSON, wrong types and oversize bodies are 400/413, rejected requests 422 (a request
that could never be sent among them), a business key reused for a different request 409;
never a 500 for bad input. A lost database connection is a 503 with Retry-After; a send whose
connection was lost before anything could be written is tried once more first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flask import Blueprint, Response, g, jsonify, request
from flask_login import current_user
from markupsafe import escape
from sqlalchemy import select

from portal.extensions import csrf, db
from portal.messaging.records import acceptance, cancel, uncertain, validation
from portal.messaging.records.validation import AcceptanceError
from portal.metrics import MESSAGE_ACCEPTED
from portal.models import AuditAction, Channel, MailSendRecord, SendAttempt, SmsSendRecord
from portal.models.by_channel import PARTS
from portal.models.enums import ApiScope
from portal.web.access import Permission, actor_label, can
from portal.web.machine import listing
from portal.web.machine.endpoint import (
    ApiError,
    acting_tenant,
    api_error_response,
    api_key_required,
    app_settings,
    audit_records,
    error_response,
    json_body,
    key_or_session,
    once_more_if_connection_lost,
    unknown_query_parameter,
)
from portal.web.machine.openapi import openapi_document
from portal.web.machine.serialise import (
    attempts_json,
    diagnosis_json,
    mail_record_json,
    record_tiers,
    sms_record_json,
)

bp = Blueprint("api", __name__, url_prefix="/api/v1")
csrf.exempt(bp)  # API keys, not cookies: there is no ambient credential to forge.
bp.before_request(unknown_query_parameter)
bp.register_error_handler(ApiError, api_error_response)


@bp.errorhandler(AcceptanceError)
def _rejected(exc: AcceptanceError) -> Response:
    db.session.rollback()
    # as_dict: an error may carry more than the common fields (missing_variables: missing).
    response = jsonify({"error": exc.as_dict()})
    response.status_code = exc.status
    return response


def _accepted(channel: str, results: list[acceptance.Accepted]) -> list[dict[str, Any]]:
    MESSAGE_ACCEPTED.labels(channel).inc(sum(not r.duplicate for r in results))
    return [{"id": r.id, "duplicate": r.duplicate} for r in results]


def _batch_items(data: Any) -> Any:
    if not isinstance(data, dict):
        raise AcceptanceError("invalid", "body", "a batch must be an object with items")
    unknown = sorted(set(data) - {"items"})
    if unknown:
        raise AcceptanceError("invalid", unknown[0], f"unknown field {unknown[0]!r}")
    if "items" not in data:
        raise AcceptanceError("required", "items", "items is required")
    return data["items"]


def _own_record(model: type[MailSendRecord] | type[SmsSendRecord], record_id: int) -> Any:
    tenant_id = acting_tenant(f"no such {PARTS[model.channel].noun} record")
    if record_id > validation.MAX_ID:
        return None
    where = [model.id == record_id]
    if tenant_id is not None:
        where.append(model.tenant_id == tenant_id)
    return db.session.scalar(select(model).where(*where))


def _attempts(record: MailSendRecord | SmsSendRecord) -> dict[str, Any]:
    """``attempts``: every attempt that reached the transport, oldest first."""
    channel = "mail" if isinstance(record, MailSendRecord) else "sms"
    rows = list(
        db.session.scalars(
            select(SendAttempt)
            .where(SendAttempt.channel == channel, SendAttempt.record_id == record.id)
            .order_by(SendAttempt.number)
        )
    )
    return {"attempts": attempts_json(db.session(), rows, g.tenant_id)}


def _add_channel_routes(
    channel: acceptance.ChannelAcceptance[Any, Any],
    noun: str,
    record_json: Callable[[Any, int, dict[int, int]], dict[str, Any]],
) -> None:
    """A channel's routes, each ``<channel>_<view>``: POST /<channel> (one message, committed)
    and /<channel>/batch (up to 500, all or none); GET /<channel> (its records) and
    /<channel>/<id> (one record). ``noun`` names a record of it in errors."""
    name = channel.channel

    @once_more_if_connection_lost
    @api_key_required(ApiScope.SEND)
    def create() -> tuple[Response, int]:
        """Accept one message."""
        result = channel.committed(db.session(), json_body(), settings=app_settings())
        (item,) = _accepted(name, [result])
        return jsonify(item), 202

    @once_more_if_connection_lost
    @api_key_required(ApiScope.SEND)
    def batch() -> tuple[Response, int]:
        """Accept up to 500 messages at once, all or none."""
        items = _batch_items(json_body())
        results = channel.batch(db.session(), items, settings=app_settings())
        db.session.commit()
        return jsonify({"items": _accepted(name, results)}), 202

    @api_key_required(ApiScope.READ)
    def records() -> Response:
        """The caller's records, newest first, filtered, in pages (``listing``)."""
        return listing.record_list(name)

    @api_key_required(ApiScope.READ)
    def show(record_id: int) -> Response:
        """One of the caller's records, with its status, last error and diagnosis."""
        record = _own_record(channel.model, record_id)
        if record is None:
            return error_response(404, "not_found", f"no such {noun} record", "id")
        tiers = record_tiers(db.session(), name, [record])
        diagnosis = diagnosis_json(db.session(), record, app_settings(), g.tenant_id)
        return jsonify(record_json(record, g.tenant_id, tiers) | _attempts(record) | diagnosis)

    bp.add_url_rule(f"/{name}", f"{name}_create", create, methods=["POST"])
    bp.add_url_rule(f"/{name}/batch", f"{name}_batch", batch, methods=["POST"])
    bp.add_url_rule(f"/{name}", f"{name}_list", records, methods=["GET"])
    bp.add_url_rule(f"/{name}/<int:record_id>", f"{name}_show", show, methods=["GET"])


_add_channel_routes(acceptance.MAIL, "mail", mail_record_json)
_add_channel_routes(acceptance.SMS, "SMS", sms_record_json)


# --- cancel and resolve ----------------------------------------------------------------


def _for_portal(response: Response) -> Response:
    """The portal's record page posts these with htmx (a signed-in session): on success it is
    told to reload (``HX-Refresh``); an error comes back as a line of HTML for its error slot.
    API clients (no ``HX-Request``) get the JSON answer unchanged."""
    if request.headers.get("HX-Request") != "true" or getattr(g, "api_key_id", None):
        return response
    if response.status_code < 300:
        reload = Response(status=204)
        reload.headers["HX-Refresh"] = "true"
        return reload
    data = response.get_json(silent=True) or {}
    message = str((data.get("error") or {}).get("message") or "That did not work.")
    html = Response(
        f'<p class="field-error" role="alert">{escape(message)}</p>', 200, mimetype="text/html"
    )
    html.vary.add("HX-Request")
    return html


def _portal_form() -> dict[str, Any] | None:
    """A form-encoded body from a signed-in portal session (the record page's buttons)."""
    if (
        request.is_json
        or getattr(g, "api_key_id", None)
        or request.mimetype
        not in (
            "application/x-www-form-urlencoded",
            "multipart/form-data",
        )
    ):
        return None
    return {k: v for k, v in request.form.items() if k != "csrf_token"}


def _ids_body() -> list[int]:
    ids: Any
    if _portal_form() is not None:  # the records list's checkboxes: ids=1&ids=2
        raw = request.form.getlist("ids")
        ids = [int(i) if i.isascii() and i.isdigit() and len(i) <= 19 else i for i in raw]
    else:
        body: Any = json_body()
        ids = body.get("ids") if isinstance(body, dict) else None
    if not isinstance(ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 < i <= validation.MAX_ID for i in ids
    ):
        raise ApiError("invalid", "ids must be a list of positive whole numbers", 422, "ids")
    if len(ids) > cancel.MAX_BULK:
        raise ApiError("too_large", f"at most {cancel.MAX_BULK} ids at once", 422, "ids")
    return ids


@bp.post("/<any(mail, sms):channel>/<int:record_id>/cancel")
@key_or_session(Permission.RETRY, ApiScope.SEND)
def cancel_one(channel: str, record_id: int) -> Response:
    """Cancel one Pending or Retry record that has no ambiguous earlier attempt."""
    try:
        tenant_id = acting_tenant("no such record")
    except ApiError as exc:
        return _for_portal(error_response(exc.status, exc.code, exc.message, exc.field))
    if record_id > validation.MAX_ID:
        return _for_portal(error_response(404, "not_found", "no such record", "id"))
    model = PARTS[Channel(channel)].record
    report = cancel.cancel_records(db.session(), model, [record_id], tenant_id, by=actor_label())
    if report.cancelled:
        audit_records(AuditAction.CANCEL, model, report.cancelled, tenant_id, "")
    db.session.commit()
    if report.cancelled:
        return _for_portal(jsonify({"id": record_id, "status": "Cancelled"}))
    reason = report.skipped[record_id]
    if reason == "no such record":
        return _for_portal(error_response(404, "not_found", "no such record", "id"))
    return _for_portal(
        error_response(
            409, "not_cancellable", f"record {record_id} cannot be cancelled: {reason}", "id"
        )
    )


@bp.post("/<any(mail, sms):channel>/cancel")
@key_or_session(Permission.RETRY, ApiScope.SEND)
def cancel_many(channel: str) -> Response:
    """Cancel many records; those that cannot be cancelled are skipped, each with its reason."""
    try:
        tenant_id = acting_tenant("no such record", "tenantId")
        ids = _ids_body()
    except ApiError as exc:
        return _for_portal(error_response(exc.status, exc.code, exc.message, exc.field))
    model = PARTS[Channel(channel)].record
    report = cancel.cancel_records(db.session(), model, ids, tenant_id, by=actor_label())
    if report.cancelled:
        remark = f"{len(report.cancelled)} cancelled, {len(report.skipped)} skipped"
        audit_records(AuditAction.BULK_CANCEL, model, report.cancelled, tenant_id, remark)
    db.session.commit()
    return _for_portal(
        jsonify(
            {
                "cancelled": len(report.cancelled),
                "cancelledIds": report.cancelled,
                "skipped": [{"id": i, "reason": r} for i, r in report.skipped.items()],
            }
        )
    )


@bp.post("/<any(mail, sms):channel>/<int:record_id>/resolve")
@key_or_session(Permission.RETRY, ApiScope.SEND)
def resolve(channel: str, record_id: int) -> Response:
    """Resolve an Uncertain record: its tenant's API keys and admins, platform operators."""
    try:
        return _for_portal(_resolve(channel, record_id))
    except ApiError as exc:
        return _for_portal(error_response(exc.status, exc.code, exc.message, exc.field))


def _resolve(channel: str, record_id: int) -> Response:
    """Seed 002: resolving is done "from trusted server code" (an API key) or by someone who
    runs the tenant (Permission.RESOLVE: its admins; operators for the tenant they view);
    support staff only look."""
    by_key = getattr(g, "api_key_id", None) is not None
    if not by_key and not can(Permission.RESOLVE):
        return error_response(
            403, "forbidden", "only tenant admins and platform operators resolve records"
        )
    tenant_id = acting_tenant("no such record")
    body: Any = _portal_form()
    if body is None:
        body = json_body()
    if not isinstance(body, dict):
        raise ApiError("invalid", "the body must be a JSON object", 422)
    outcome = body.get("outcome")
    if outcome not in ("accepted", "failed"):
        raise ApiError("invalid", "outcome must be accepted or failed", 422, "outcome")
    pid, reason = body.get("providerMessageId"), body.get("reason")
    for name, value in (("providerMessageId", pid), ("reason", reason)):
        if value is not None and not isinstance(value, str):
            raise ApiError("invalid", f"{name} must be a string", 422, name)
        if value is not None and "\x00" in value:  # refused here, not by the database
            raise ApiError("invalid", f"{name} must not contain a NUL character", 422, name)
    if record_id > validation.MAX_ID:
        return error_response(404, "not_found", "no such record", "id")
    by = f"api-key:{g.api_key_id}" if by_key else str(current_user.email)
    try:
        result = uncertain.resolve_uncertain(
            db.session(),
            channel,
            record_id,
            accepted=outcome == "accepted",
            provider_message_id=pid,
            reason=reason,
            by=by,
            tenant_id=tenant_id,
        )
    except uncertain.ResolveError as exc:
        db.session.rollback()
        return error_response(exc.status, exc.code, exc.message, exc.field)
    remark = f"{outcome}" + (f" as {result.provider_message_id}" if outcome == "accepted" else "")
    if reason:
        remark += f": {reason}"
    audit_records(
        AuditAction.RESOLVE, PARTS[Channel(channel)].record, [result.id], result.tenant_id, remark
    )
    db.session.commit()
    return jsonify(
        {
            "id": result.id,
            "status": result.status,
            "providerMessageId": result.provider_message_id,
        }
    )


@bp.get("/openapi.json")
def openapi() -> Response:
    """The OpenAPI 3 document of this API."""
    return jsonify(openapi_document())
