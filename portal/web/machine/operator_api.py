"""The seed's operator endpoints, kept at their paths: manual retry and quota usage.

Authorised by an API key with the scope the endpoint needs (``send`` to retry, ``read`` for
usage), or by a signed-in portal session whose role holds the permission; a session is an
ambient cookie credential, so those requests must carry the CSRF token (API-key requests need
none: nothing ambient to forge). Either way the rows reached are ``endpoint.acting_tenant()``'s: the
key's tenant or the viewed one, another only by ``?tenantId=`` for a platform key or an
operator viewing every tenant.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

from flask import Blueprint, Response, current_app, g, jsonify, request
from sqlalchemy import select

from portal.extensions import csrf, db
from portal.messaging.records import diagnosis
from portal.messaging.records.retry import (
    EXPIRED_REASON,
    MAX_BULK,
    Model,
    new_expiry,
    retry_records,
)
from portal.messaging.records.validation import AcceptanceError
from portal.messaging.sending import quota
from portal.models import AuditAction, MailSendRecord, SmsSendRecord
from portal.models.enums import RETRYABLE_BY_HAND, ApiScope
from portal.tenancy import PLATFORM_TENANT_ID
from portal.web.access import Permission, actor_label
from portal.web.machine.endpoint import (
    ApiError,
    acting_tenant,
    api_error_response,
    audit_records,
    error_response,
    json_body,
    key_or_session,
    unknown_query_parameter,
)

bp = Blueprint("operator_api", __name__)
csrf.exempt(bp)  # checked by hand below, for session-authenticated requests only
bp.before_request(unknown_query_parameter)
bp.register_error_handler(ApiError, api_error_response)

MODELS: dict[str, Model] = {"MailSendRecord": MailSendRecord, "SmsSendRecord": SmsSendRecord}


_ID = re.compile(r"[0-9]{1,18}")  # ASCII digits only: str.isdigit() also accepts "²" and "٣"


def _id_arg() -> int:
    raw = request.args.get("id", "")
    if not _ID.fullmatch(raw):
        raise ApiError("invalid", "id must be a positive whole number", 422, "id")
    return int(raw)


def _expiry(body: Any) -> datetime | None:
    """The optional new ``expiresAt`` of a retry body (none, or an object without it: None)."""
    if not isinstance(body, dict) or body.get("expiresAt") is None:
        return None
    try:
        return new_expiry(body["expiresAt"], datetime.now(UTC))
    except AcceptanceError as exc:
        raise ApiError(exc.code, exc.message, 422, "expiresAt") from None


def _optional_body() -> Any:
    """A retry's body is optional (the seed's endpoint takes none): a JSON one is read, any
    other (a portal session's form with its CSRF token) carries nothing for it."""
    if not request.is_json:
        return None
    return json_body()


def _would_fail_again(
    kind: str, ids: list[int], tenant_id: int | None
) -> dict[int, dict[str, Any]]:
    """Of ``ids`` (the caller's, retryable), those a retry now would not cure, with the error
    code, the reason code and why (their diagnosis, as the portal's Retry and bulk retry
    say). Read before the requeue; the answer names those of them it requeued all the same."""
    model: Any = MODELS[kind]
    stmt = select(model).where(
        model.id.in_(ids), model.status.in_([s.value for s in RETRYABLE_BY_HAND])
    )
    if tenant_id is not None:
        stmt = stmt.where(model.tenant_id == tenant_id)
    records = list(db.session.scalars(stmt))
    channel = model.channel
    operator = g.tenant_id is None or g.tenant_id == PLATFORM_TENANT_ID
    found = diagnosis.diagnose_many(
        db.session(), channel, records, current_app.config["SETTINGS"], operator=operator
    )
    codes = {record.id: record.error_code for record in records}
    return {
        i: {"id": i, "code": codes[i], "reasonCode": d.reason, "reason": d.why}
        for i, d in sorted(found.items())
        if d.would_fail_again
    }


@bp.post("/<any(MailSendRecord, SmsSendRecord):kind>/retry")
@key_or_session(Permission.RETRY, ApiScope.SEND)
def retry(kind: str) -> Response:
    """Requeue one record: Pending, Retry, Failed, DeadLetter -> Retry due now. One past its
    ``expiresAt`` only with a new one in the body (``{"expiresAt": ...}``), else 409."""
    tenant_id = acting_tenant("no such record")
    record_id = _id_arg()
    expires_at = _expiry(_optional_body())
    again = _would_fail_again(kind, [record_id], tenant_id)
    report = retry_records(
        db.session(),
        MODELS[kind],
        [record_id],
        tenant_id,
        expires_at=expires_at,
        by=actor_label(),
        anyway={i: (str(a["reasonCode"]), str(a["reason"])) for i, a in again.items()},
    )
    if report.requeued:
        audit_records(AuditAction.RETRY, MODELS[kind], report.requeued, tenant_id, "")
    db.session.commit()
    if report.requeued:
        return jsonify(
            {
                "id": record_id,
                "status": "Retry",
                "requeued": 1,
                "wouldFailAgain": [again[i] for i in report.requeued if i in again],
            }
        )
    reason = report.skipped[record_id]
    if reason == "no such record":
        return error_response(404, "not_found", "no such record", "id")
    if reason == EXPIRED_REASON:
        return error_response(
            409, "expired", f"record {record_id} cannot be retried: {reason}", "expiresAt"
        )
    return error_response(
        409, "not_retryable", f"record {record_id} cannot be retried: {reason}", "id"
    )


@bp.post("/<any(MailSendRecord, SmsSendRecord):kind>/retryByIds")
@key_or_session(Permission.RETRY, ApiScope.SEND)
def retry_by_ids(kind: str) -> Response:
    """Requeue many records; those that cannot be retried are skipped, each with its reason.
    An optional ``expiresAt`` is the new expiry of every record requeued (expired ones are
    skipped without it)."""
    tenant_id = acting_tenant("no such record", "tenantId")
    body: Any = json_body()
    ids = body.get("ids") if isinstance(body, dict) else None
    if not isinstance(ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 < i < 2**63 for i in ids
    ):
        raise ApiError("invalid", "ids must be a list of positive whole numbers", 422, "ids")
    if len(ids) > MAX_BULK:
        raise ApiError("too_large", f"at most {MAX_BULK} ids at once", 422, "ids")
    expires_at = _expiry(body)
    again = _would_fail_again(kind, ids, tenant_id)
    report = retry_records(
        db.session(),
        MODELS[kind],
        ids,
        tenant_id,
        expires_at=expires_at,
        by=actor_label(),
        anyway={i: (str(a["reasonCode"]), str(a["reason"])) for i, a in again.items()},
    )
    if report.requeued:
        remark = f"{len(report.requeued)} requeued, {len(report.skipped)} skipped"
        audit_records(AuditAction.BULK_RETRY, MODELS[kind], report.requeued, tenant_id, remark)
    db.session.commit()
    return jsonify(
        {
            "requeued": len(report.requeued),
            "requeuedIds": report.requeued,
            "skipped": [{"id": i, "reason": r} for i, r in report.skipped.items()],
            "wouldFailAgain": [again[i] for i in report.requeued if i in again],
        }
    )


@bp.get("/TenantMessageQuota/usage")
@key_or_session(Permission.VIEW_QUOTA, ApiScope.READ)
def quota_usage() -> Response:
    """This month's usage of a bucket and the ceilings in force (a tenant reads its own)."""
    tenant_id = acting_tenant("no such quota bucket", "tenantId")
    if tenant_id is None:
        return error_response(
            422, "required", "tenantId is required when viewing all tenants", "tenantId"
        )
    result = quota.usage(db.session(), tenant_id, current_app.config["SETTINGS"])
    return jsonify(
        {
            "tenantId": result.tenant_id,
            "month": result.month,
            "mail": {"used": result.mail_used, "limit": result.mail_limit},
            "sms": {"used": result.sms_used, "limit": result.sms_limit},
        }
    )
