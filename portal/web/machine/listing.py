"""The messages API's lists: ``GET /api/v1/mail`` and ``/api/v1/sms`` for a
tenant's own application, newest first, in keyset pages.

Filters: ``to`` (an exact address or number), ``toPrefix``, ``status``, ``templateCode``,
``businessKey``, ``createdFrom``/``createdTo``, ``updatedFrom`` (for applications that sync
without callbacks) and ``stream``. Every query is scoped to the caller's tenant
(``acting_tenant``) and walks ``(tenant_id, id)`` backwards from the cursor; a recipient filter
goes through the recipient index (mail: ``mail_send_recipient``; SMS: ``(tenant_id,
phone_number, id)``). A bad value is a 422 naming its parameter. Each key may list
``API_LIST_PER_MINUTE`` times a minute (counted in Redis; without Redis the lists are not
limited rather than refused).
"""

from __future__ import annotations

import base64
import binascii
import logging
import re
import time
from datetime import UTC, datetime
from typing import Any

import redis
from flask import Response, g, jsonify, request
from sqlalchemy import select

from portal.extensions import db
from portal.messaging.records import validation
from portal.messaging.records.addresses import AddressError, email_address, parse_phone_number
from portal.models import Channel, MailSendRecipient, MailSendRecord, SendStatus, SmsSendRecord
from portal.models.by_channel import PARTS
from portal.models.record import Stream
from portal.redis_store import connect
from portal.web.machine.endpoint import ApiError, acting_tenant, app_settings, error_response
from portal.web.machine.serialise import mail_record_json, record_tiers, sms_record_json

log = logging.getLogger("portal.api")

DEFAULT_LIMIT = 50
MAX_LIMIT = 500
MIN_PREFIX = 3
STATUSES = [s.value for s in SendStatus]
STREAMS = [s.value for s in Stream]
_CURSOR = re.compile(r"^[A-Za-z0-9_-]{1,40}$")
_PREFIX_SPECIALS = str.maketrans({"%": r"\%", "_": r"\_", "\\": r"\\"})


def _cursor_id(raw: str | None) -> int | None:
    """The id a ``nextCursor`` continues below (opaque to callers: base64 of ``r<id>``)."""
    if raw is None:
        return None
    if not _CURSOR.fullmatch(raw):
        raise ApiError("invalid", "cursor is not one this API gave", 422, "cursor")
    try:
        text = base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)).decode("ascii")
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise ApiError("invalid", "cursor is not one this API gave", 422, "cursor") from None
    if not text.startswith("r") or not text[1:].isdigit() or len(text) > 20:
        raise ApiError("invalid", "cursor is not one this API gave", 422, "cursor")
    return int(text[1:])


def _next_cursor(record_id: int) -> str:
    return base64.urlsafe_b64encode(f"r{record_id}".encode()).decode().rstrip("=")


def _limit(raw: str | None) -> int:
    if raw is None:
        return DEFAULT_LIMIT
    if not raw.isascii() or not raw.isdigit() or not 1 <= int(raw) <= MAX_LIMIT:
        raise ApiError(
            "invalid", f"limit must be a whole number from 1 to {MAX_LIMIT}", 422, "limit"
        )
    return int(raw)


def _time(name: str) -> datetime | None:
    raw = request.args.get(name)
    if raw is None:
        return None
    try:
        value = datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError:
        raise ApiError(
            "invalid", f"{name} must be a date-time like 2026-12-01T09:30:00Z", 422, name
        ) from None
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def _choice(name: str, allowed: list[str]) -> str | None:
    raw = request.args.get(name)
    if raw is not None and raw not in allowed:
        raise ApiError("invalid", f"{name} must be one of {', '.join(allowed)}", 422, name)
    return raw


def _text(name: str, longest: int) -> str | None:
    raw = request.args.get(name)
    if raw is not None and (not raw or len(raw) > longest or "\x00" in raw):
        raise ApiError("invalid", f"{name} must be 1 to {longest} characters", 422, name)
    return raw


def _rate_limited() -> Response | None:
    """429 once this key has listed ``API_LIST_PER_MINUTE`` times this minute."""
    settings = app_settings()
    window = int(time.time() // 60)
    key = f"api:list:{g.api_key_id}:{window}"
    try:
        client = connect(settings.redis_url)
        with client.pipeline() as pipe:
            pipe.incr(key)
            pipe.expire(key, 120)
            used = int(pipe.execute()[0])
    except redis.RedisError:
        log.warning("the list rate limit could not be counted (Redis); not limited")
        return None
    if used <= settings.api_list_per_minute:
        return None
    response = error_response(
        429,
        "rate_limited",
        f"at most {settings.api_list_per_minute} list requests a minute per API key",
        None,
    )
    response.headers["Retry-After"] = str(60 - int(time.time()) % 60)
    return response


def _filtered(model: type[MailSendRecord] | type[SmsSendRecord], tenant: int | None) -> Any:
    """The list's query for the request's filters (422 naming a bad one)."""
    query = select(model)
    if tenant is not None:
        query = query.where(model.tenant_id == tenant)
    mail = model is MailSendRecord
    to = request.args.get("to")
    prefix = request.args.get("toPrefix")
    try:
        if to is not None:
            if mail:
                address = email_address(to, "to").lower()
            else:
                address, _country = parse_phone_number(to, "to")
        if prefix is not None:
            cleaned = prefix.strip().lower() if mail else prefix.strip().lstrip("+")
            if len(cleaned) < MIN_PREFIX or len(cleaned) > 320 or "\x00" in cleaned:
                raise AddressError("toPrefix", f"toPrefix must be {MIN_PREFIX} to 320 characters")
            if not mail and not cleaned.isdigit():
                raise AddressError("toPrefix", "toPrefix must be digits (+ optional)")
    except AddressError as exc:
        raise ApiError(exc.code, exc.message, 422, exc.field) from None
    if mail:
        recipients = select(MailSendRecipient.record_id)
        if tenant is not None:
            recipients = recipients.where(MailSendRecipient.tenant_id == tenant)
        if to is not None:
            query = query.where(
                model.id.in_(recipients.where(MailSendRecipient.address == address))
            )
        if prefix is not None:
            like = cleaned.translate(_PREFIX_SPECIALS) + "%"
            query = query.where(
                model.id.in_(recipients.where(MailSendRecipient.address.like(like, escape="\\")))
            )
    else:
        if to is not None:
            query = query.where(SmsSendRecord.phone_number == address)
        if prefix is not None:
            query = query.where(SmsSendRecord.phone_number.like("+" + cleaned + "%"))
    status = _choice("status", STATUSES)
    if status is not None:
        query = query.where(model.status == status)
    stream = _choice("stream", STREAMS)
    if stream is not None:
        query = query.where(model.stream == stream)
    code = _text("templateCode", validation.MAX_CODE_CHARS)
    if code is not None:
        query = query.where(model.template_code == code)
    business_key = _text("businessKey", 200)
    if business_key is not None:
        query = query.where(model.business_key == business_key)
    for name, column, compare in (
        ("createdFrom", model.created_time, "ge"),
        ("createdTo", model.created_time, "lt"),
        ("updatedFrom", model.updated_time, "ge"),
    ):
        value = _time(name)
        if value is not None:
            query = query.where(column >= value if compare == "ge" else column < value)
    return query


def record_list(channel: str) -> Response:
    """One page of the caller's records of ``channel``, newest first."""
    limited = _rate_limited()
    if limited is not None:
        return limited
    parts = PARTS[Channel(channel)]
    model = parts.record
    tenant = acting_tenant(f"no such {parts.noun} record", "tenantId")
    limit = _limit(request.args.get("limit"))
    before = _cursor_id(request.args.get("cursor"))
    query = _filtered(model, tenant)
    if before is not None:
        query = query.where(model.id < before)
    rows = list(db.session.scalars(query.order_by(model.id.desc()).limit(limit + 1)))
    more = len(rows) > limit
    rows = rows[:limit]
    shape = mail_record_json if channel == "mail" else sms_record_json
    tiers = record_tiers(db.session(), channel, rows)
    return jsonify(
        {
            "items": [shape(row, g.tenant_id, tiers) for row in rows],
            "nextCursor": _next_cursor(rows[-1].id) if more and rows else None,
        }
    )
