"""The JSON API under /api/v1/, authenticated by a tenant API key.

Every error answers with one shape, ``{"error": {"code", "field", "message"[, "index"]}}``:
malformed JSON, wrong types and oversize bodies are 400/413, rejected requests 422, a business
key reused for a different request 409; never a 500 for bad input.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from functools import wraps
from typing import Any, NamedTuple, ParamSpec, TypeVar

from flask import Blueprint, Response, current_app, g, jsonify, request
from markupsafe import escape
from sqlalchemy import Engine, event, or_, select, update
from sqlalchemy.orm import Session as OrmSession
from sqlalchemy.orm import object_session
from werkzeug.exceptions import BadRequest

from portal.config import Settings
from portal.extensions import csrf, db
from portal.messaging import acceptance, cancel, uncertain
from portal.messaging.acceptance import AcceptanceError
from portal.metrics import MESSAGE_ACCEPTED
from portal.models import ApiKey, AuditAction, MailSendRecord, SmsSendRecord, Tenant
from portal.models.tenant import ApiScope, hash_api_token
from portal.tenancy import PLATFORM_TENANT_ID, new_trace_id, tenant_context
from portal.web.machine.openapi import openapi_document
from portal.web.machine.serialise import mail_record_json, sms_record_json

bp = Blueprint("api", __name__, url_prefix="/api/v1")
csrf.exempt(bp)  # API keys, not cookies: there is no ambient credential to forge.

P = ParamSpec("P")
R = TypeVar("R")


def error_response(
    status: int, code: str, message: str, field: str | None = None, index: int | None = None
) -> Response:
    body: dict[str, Any] = {"code": code, "field": field, "message": message}
    if index is not None:
        body["index"] = index
    response = jsonify({"error": body})
    response.status_code = status
    return response


def _settings() -> Settings:
    settings = current_app.config["SETTINGS"]
    assert isinstance(settings, Settings)
    return settings


# --- API keys -----------------------------------------------------------------------------
#
# A valid key is remembered in this process for API_KEY_CACHE_S seconds (a setting, default
# 5; 0 turns the cache off), keyed by the token's SHA-256 digest (never the token), so a busy
# client costs one look-up per process per interval instead of one per request. Revoking a key
# or deactivating a tenant through the ORM (the portal's API keys page, the importer) clears
# this process's cache at once; other processes (gunicorn workers) notice within the interval.
# Unknown, revoked and inactive keys are never remembered: each such request asks the database.

API_KEY_CACHE_MAX = 10_000


class KeyAuth(NamedTuple):
    """A valid key: who it is, whose tenant it speaks for, and what it may do."""

    id: int
    tenant_id: int
    name: str
    scopes: frozenset[str]


# (app, digest) -> (valid until, key); the app in the key keeps two apps in one process (the
# tests' PostgreSQL and SQLite apps) from vouching for each other's keys.
_key_cache: dict[tuple[int, str], tuple[float, KeyAuth]] = {}
# Bumped at every change that may revoke a key: a look-up that began before a bump must not
# put its (possibly stale) answer in the cache.
_generation = [0]


def _forget_keys() -> None:
    _generation[0] += 1
    _key_cache.clear()


def _changed(target: Any, *_args: Any) -> None:
    """A key or tenant attribute was set: forget now, and again when its session commits
    (a request between the set and the commit may have read and cached the old row)."""
    _forget_keys()
    session = object_session(target)
    if session is not None:
        session.info["postroom_forget_api_keys"] = True


def _deleted(_mapper: Any, _connection: Any, target: Any) -> None:
    _changed(target)


def _committed(session: OrmSession) -> None:
    if session.info.pop("postroom_forget_api_keys", False):
        _forget_keys()


for _attribute in (
    ApiKey.revoked_at,
    ApiKey.token_hash,
    ApiKey.tenant_id,
    ApiKey.scopes,
    ApiKey.name,
    Tenant.is_active,
):
    event.listen(_attribute, "set", _changed)
event.listen(ApiKey, "after_delete", _deleted)
event.listen(Tenant, "after_delete", _deleted)
event.listen(OrmSession, "after_commit", _committed)


def _authenticate(token: str) -> tuple[tuple[int, str], KeyAuth] | None:
    """(cache key, the key) of a valid, unrevoked key of an active tenant."""
    cache_key = (id(current_app._get_current_object()), hash_api_token(token))  # type: ignore[attr-defined]
    ttl = _settings().api_key_cache_s
    now = time.monotonic()
    cached = _key_cache.get(cache_key)
    if cached is not None and cached[0] > now and ttl > 0:
        return cache_key, cached[1]
    generation = _generation[0]
    row = db.session.execute(
        select(ApiKey.id, ApiKey.tenant_id, ApiKey.name, ApiKey.scopes)
        .join(Tenant, Tenant.id == ApiKey.tenant_id)
        .where(
            ApiKey.token_hash == cache_key[1],
            ApiKey.revoked_at.is_(None),
            Tenant.is_active.is_(True),
        )
    ).first()
    if row is None:
        _key_cache.pop(cache_key, None)
        return None
    key = KeyAuth(row.id, row.tenant_id, row.name, frozenset((row.scopes or "").split()))
    if ttl > 0 and generation == _generation[0]:
        if len(_key_cache) >= API_KEY_CACHE_MAX:
            _key_cache.clear()
        _key_cache[cache_key] = (now + ttl, key)
    return cache_key, key


# --- last used --------------------------------------------------------------------------
#
# "Last used" is for people deciding whether a key can go, so a minute's precision is plenty:
# a request only looks at a dict (no lock, no statement); at most once per key per minute per
# process it hands the time to a thread of its own, which writes it. The UPDATE's condition
# (older than a minute) keeps several processes from writing the same minute again.

KEY_USE_INTERVAL_S = 60.0

log = logging.getLogger(__name__)


class KeyUses:
    """Writes API keys' ``last_used_at`` from a thread of its own, folded per interval."""

    def __init__(self, interval_s: float = KEY_USE_INTERVAL_S):
        self.interval_s = interval_s
        self._noted: dict[tuple[int, str], float] = {}  # (app, digest) -> monotonic time
        self._lock = threading.Lock()
        self._writing = threading.Lock()  # held while a batch is written (flush waits on it)
        self._due: dict[tuple[Engine, int], datetime] = {}
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = 0
        self.written = 0  # UPDATE statements run by this process (for tests and benchmarks)

    def used(self, cache_key: tuple[int, str], key_id: int) -> None:
        """Note a request with the key (in a request: ``db.engine`` is the app's)."""
        now = time.monotonic()
        last = self._noted.get(cache_key)
        if last is not None and now - last < self.interval_s:
            return
        with self._lock:
            last = self._noted.get(cache_key)
            if last is not None and now - last < self.interval_s:
                return
            if len(self._noted) >= API_KEY_CACHE_MAX:
                self._noted.clear()
            self._noted[cache_key] = now
            self._due[(db.engine, key_id)] = datetime.now(UTC)
            if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
                # First use in this process (gunicorn forks after import): start the thread.
                self._pid = os.getpid()
                self._wake = threading.Event()
                self._thread = threading.Thread(target=self._run, name="key-uses", daemon=True)
                self._thread.start()
            self._wake.set()

    def flush(self) -> None:
        """Write what is due now, in this thread (tests; the thread does it otherwise)."""
        with self._writing:
            self._write()

    def _run(self) -> None:
        wake = self._wake
        while True:
            wake.wait()
            wake.clear()
            with self._writing:
                self._write()

    def _write(self) -> None:
        with self._lock:
            due, self._due = self._due, {}
        for (engine, key_id), at in due.items():
            try:
                with engine.begin() as conn:
                    conn.execute(
                        update(ApiKey)
                        .where(
                            ApiKey.id == key_id,
                            or_(
                                ApiKey.last_used_at.is_(None),
                                ApiKey.last_used_at < at - timedelta(seconds=self.interval_s),
                            ),
                        )
                        .values(last_used_at=at)
                    )
                self.written += 1
            except Exception as exc:  # a convenience for people: never worth a failed send
                log.warning("could not note the use of API key %s (%s)", key_id, exc)


KEY_USES = KeyUses()


def api_key_required(scope: ApiScope) -> Callable[[Callable[P, R]], Callable[P, R | Response]]:
    """Authenticate ``Authorization: Bearer <key>`` holding ``scope``; the key fixes the tenant."""

    def decorate(view: Callable[P, R]) -> Callable[P, R | Response]:
        @wraps(view)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R | Response:
            header = request.headers.get("Authorization", "")
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                return _unauthorised("send Authorization: Bearer <api key>")
            found = _authenticate(token.strip())
            if found is None:
                return _unauthorised("the API key is not valid or has been revoked")
            cache_key, key = found
            KEY_USES.used(cache_key, key.id)
            if scope not in key.scopes:
                return _insufficient_scope(scope)
            g.api_key_id, g.api_key_name, g.tenant_id = key.id, key.name, key.tenant_id
            trace = request.headers.get("X-Trace-Id", "")
            trace_id = trace if trace.isalnum() and 8 <= len(trace) <= 64 else new_trace_id()
            g.trace_id = trace_id
            with tenant_context(g.tenant_id, trace_id):
                return view(*args, **kwargs)

        return wrapper

    return decorate


def _insufficient_scope(scope: ApiScope) -> Response:
    response = error_response(
        403, "insufficient_scope", f"this API key does not have the {scope!s} scope"
    )
    response.headers["WWW-Authenticate"] = (
        f'Bearer realm="postroom", error="insufficient_scope", scope="{scope!s}"'
    )
    return response


def _unauthorised(message: str) -> Response:
    response = error_response(401, "unauthorized", message)
    response.headers["WWW-Authenticate"] = 'Bearer realm="postroom"'
    return response


def _json_body() -> Any:
    if not request.is_json:
        raise _BadRequest("unsupported_media_type", "send Content-Type: application/json", 415)
    try:
        data = request.get_json()
    except (BadRequest, RecursionError):  # RecursionError: "[[[[..." past the decoder's stack
        raise _BadRequest("malformed_json", "the request body is not valid JSON") from None
    if data is None:  # the JSON document null: valid JSON, but no request
        raise _BadRequest("invalid", "the request body must be a JSON object", 422)
    return data


class _BadRequest(Exception):
    def __init__(self, code: str, message: str, status: int = 400, field: str | None = "body"):
        super().__init__(message)
        self.code, self.message, self.status, self.field = code, message, status, field


@bp.errorhandler(_BadRequest)
def _bad_request(exc: _BadRequest) -> Response:
    return error_response(exc.status, exc.code, exc.message, exc.field)


# (method, path pattern, query parameters) of every operation the OpenAPI document describes.
_QUERY_RULES: list[tuple[str, re.Pattern[str], frozenset[str]]] = []


def _documented_query(method: str, path: str) -> frozenset[str] | None:
    """The query parameters the document gives the operation at ``path`` (None: an operation
    it does not describe, such as the document itself)."""
    if not _QUERY_RULES:
        for template, operations in openapi_document()["paths"].items():
            pattern = re.compile(re.sub(r"\\\{[^}]+\\\}", "[^/]+", re.escape(template)) + "$")
            for verb, operation in operations.items():
                names = frozenset(
                    p["name"] for p in operation.get("parameters", []) if p.get("in") == "query"
                )
                _QUERY_RULES.append((verb.upper(), pattern, names))
    for verb, pattern, names in _QUERY_RULES:
        if verb == method and pattern.match(path):
            return names
    return None


# (method, url rule) -> its documented query parameters: the patterns are matched once per
# rule, not at every request (acceptance is a hot path).
_QUERY_BY_RULE: dict[tuple[str, str], frozenset[str] | None] = {}


def unknown_query_parameter() -> Response | None:
    """A query parameter the operation does not take is refused (422 naming it), not ignored:
    a misspelt ``tenantID`` must not silently act on the caller's own tenant."""
    if not request.args:
        return None
    rule = (request.method, request.url_rule.rule if request.url_rule else request.path)
    if rule not in _QUERY_BY_RULE:
        _QUERY_BY_RULE[rule] = _documented_query(request.method, request.path)
    allowed = _QUERY_BY_RULE[rule]
    if allowed is None:
        return None
    for name in request.args:
        if name not in allowed:
            takes = ", ".join(sorted(allowed)) or "none"
            return error_response(
                422, "invalid", f"unknown query parameter {name!r} (this takes: {takes})", name
            )
    return None


bp.before_request(unknown_query_parameter)


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


@bp.post("/mail")
@api_key_required(ApiScope.SEND)
def mail_create() -> tuple[Response, int]:
    """Accept one mail."""
    result = acceptance.send_mail_committed(db.session(), _json_body(), settings=_settings())
    (item,) = _accepted("mail", [result])
    return jsonify(item), 202


@bp.post("/mail/batch")
@api_key_required(ApiScope.SEND)
def mail_batch() -> tuple[Response, int]:
    """Accept up to 500 mails at once, all or none."""
    items = _batch_items(_json_body())
    results = acceptance.send_mail_batch(db.session(), items, settings=_settings())
    db.session.commit()
    return jsonify({"items": _accepted("mail", results)}), 202


@bp.post("/sms")
@api_key_required(ApiScope.SEND)
def sms_create() -> tuple[Response, int]:
    """Accept one SMS."""
    result = acceptance.send_sms_committed(db.session(), _json_body(), settings=_settings())
    (item,) = _accepted("sms", [result])
    return jsonify(item), 202


@bp.post("/sms/batch")
@api_key_required(ApiScope.SEND)
def sms_batch() -> tuple[Response, int]:
    """Accept up to 500 SMS at once, all or none."""
    items = _batch_items(_json_body())
    results = acceptance.send_sms_batch(db.session(), items, settings=_settings())
    db.session.commit()
    return jsonify({"items": _accepted("sms", results)}), 202


# --- whose records a request reaches ------------------------------------------------------

_TENANT_ID = re.compile(r"-?[0-9]{1,40}")  # ASCII digits only; the range is checked after
_BIGINT = 2**63


def acting_tenant(not_found: str, field: str = "id") -> int | None:
    """The tenant whose rows this request reaches: the API key's tenant, or the tenant a
    portal session views (None: an operator viewing every tenant). ``?tenantId=`` picks
    another tenant only for a platform key or an operator viewing every tenant; for anyone
    else it must name their own tenant, and any other answers 404 with ``not_found`` (on
    ``field``), exactly as an id of another tenant does. Every endpoint that takes record ids
    or a tenant id scopes its query with this."""
    own: int | None = g.tenant_id
    raw = request.args.get("tenantId")
    if raw is None:
        return own
    if not _TENANT_ID.fullmatch(raw):
        raise _BadRequest("invalid", "tenantId must be a whole number", 422, "tenantId")
    chosen = int(raw)
    platform_key = g.get("api_key_id") is not None and own == PLATFORM_TENANT_ID
    if (own is None or platform_key or chosen == own) and -_BIGINT <= chosen < _BIGINT:
        return chosen
    raise _BadRequest("not_found", not_found, 404, field)


def _own_record(model: type[MailSendRecord] | type[SmsSendRecord], record_id: int) -> Any:
    tenant_id = acting_tenant(f"no such {'mail' if model is MailSendRecord else 'SMS'} record")
    if record_id > acceptance.MAX_ID:
        return None
    where = [model.id == record_id]
    if tenant_id is not None:
        where.append(model.tenant_id == tenant_id)
    return db.session.scalar(select(model).where(*where))


@bp.get("/mail/<int:record_id>")
@api_key_required(ApiScope.READ)
def mail_show(record_id: int) -> Response:
    """One of the caller's mail records, with its status and last error."""
    record = _own_record(MailSendRecord, record_id)
    if record is None:
        return error_response(404, "not_found", "no such mail record", "id")
    return jsonify(mail_record_json(record, g.tenant_id))


@bp.get("/sms/<int:record_id>")
@api_key_required(ApiScope.READ)
def sms_show(record_id: int) -> Response:
    """One of the caller's SMS records, with its status and last error."""
    record = _own_record(SmsSendRecord, record_id)
    if record is None:
        return error_response(404, "not_found", "no such SMS record", "id")
    return jsonify(sms_record_json(record, g.tenant_id))


# --- cancel and resolve ----------------------------------------------------------------


def _key_or_session(
    permission: str, scope: ApiScope
) -> Callable[[Callable[P, Response]], Callable[P, Response]]:
    """An API key with ``scope`` or a portal session with ``permission`` and the CSRF token,
    as the seed's operator endpoints (``operator_api.key_or_session``, imported late: that
    module imports this one)."""

    def decorate(view: Callable[P, Response]) -> Callable[P, Response]:
        @wraps(view)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> Response:
            from portal.web.access import Permission
            from portal.web.machine.operator_api import key_or_session

            return key_or_session(Permission(permission), scope)(view)(*args, **kwargs)

        return wrapper

    return decorate


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


CHANNEL_MODELS: dict[str, type[MailSendRecord] | type[SmsSendRecord]] = {
    "mail": MailSendRecord,
    "sms": SmsSendRecord,
}


def _ids_body() -> list[int]:
    ids: Any
    if _portal_form() is not None:  # the records list's checkboxes: ids=1&ids=2
        raw = request.form.getlist("ids")
        ids = [int(i) if i.isascii() and i.isdigit() and len(i) <= 19 else i for i in raw]
    else:
        body: Any = _json_body()
        ids = body.get("ids") if isinstance(body, dict) else None
    if not isinstance(ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 < i <= acceptance.MAX_ID for i in ids
    ):
        raise _BadRequest("invalid", "ids must be a list of positive whole numbers", 422, "ids")
    if len(ids) > cancel.MAX_BULK:
        raise _BadRequest("too_large", f"at most {cancel.MAX_BULK} ids at once", 422, "ids")
    return ids


def audit_records(
    action: AuditAction,
    model: type[MailSendRecord] | type[SmsSendRecord],
    ids: list[int],
    tenant_id: int | None,
    remark: str,
) -> None:
    """The audit row of a retry, cancel or resolve that changed ``ids`` (in the caller's
    transaction). Its tenant is the records' (looked up only for an operator viewing every
    tenant); one record is the target, many are counted in ``remark``."""
    from portal.web.access import audit

    if tenant_id is None:
        owners = set(db.session.scalars(select(model.tenant_id).where(model.id.in_(ids))))
        tenant_id = owners.pop() if len(owners) == 1 else None
    audit(
        action,
        tenant_id=tenant_id,
        target_type=model.__name__,
        target_id=ids[0] if len(ids) == 1 else None,
        remark=remark,
    )


@bp.post("/<any(mail, sms):channel>/<int:record_id>/cancel")
@_key_or_session("retry", ApiScope.SEND)
def cancel_one(channel: str, record_id: int) -> Response:
    """Cancel one Pending or Retry record that has no ambiguous earlier attempt."""
    try:
        tenant_id = acting_tenant("no such record")
    except _BadRequest as exc:
        return _for_portal(error_response(exc.status, exc.code, exc.message, exc.field))
    if record_id > acceptance.MAX_ID:
        return _for_portal(error_response(404, "not_found", "no such record", "id"))
    model = CHANNEL_MODELS[channel]
    report = cancel.cancel_records(db.session(), model, [record_id], tenant_id)
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
@_key_or_session("retry", ApiScope.SEND)
def cancel_many(channel: str) -> Response:
    """Cancel many records; those that cannot be cancelled are skipped, each with its reason."""
    try:
        tenant_id = acting_tenant("no such record", "tenantId")
        ids = _ids_body()
    except _BadRequest as exc:
        return _for_portal(error_response(exc.status, exc.code, exc.message, exc.field))
    model = CHANNEL_MODELS[channel]
    report = cancel.cancel_records(db.session(), model, ids, tenant_id)
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
@_key_or_session("retry", ApiScope.SEND)
def resolve(channel: str, record_id: int) -> Response:
    """Resolve an Uncertain record: its tenant's API keys and admins, platform operators."""
    try:
        return _for_portal(_resolve(channel, record_id))
    except _BadRequest as exc:
        return _for_portal(error_response(exc.status, exc.code, exc.message, exc.field))


def _resolve(channel: str, record_id: int) -> Response:
    """Seed 002: resolving is done "from trusted server code" (an API key) or by someone who
    runs the tenant (Permission.RESOLVE: its admins; operators for the tenant they view);
    support staff only look."""
    from flask_login import current_user

    from portal.web.access import Permission, can

    by_key = getattr(g, "api_key_id", None) is not None
    if not by_key and not can(Permission.RESOLVE):
        return error_response(
            403, "forbidden", "only tenant admins and platform operators resolve records"
        )
    tenant_id = acting_tenant("no such record")
    body: Any = _portal_form()
    if body is None:
        body = _json_body()
    if not isinstance(body, dict):
        raise _BadRequest("invalid", "the body must be a JSON object", 422)
    outcome = body.get("outcome")
    if outcome not in ("accepted", "failed"):
        raise _BadRequest("invalid", "outcome must be accepted or failed", 422, "outcome")
    pid, reason = body.get("providerMessageId"), body.get("reason")
    for name, value in (("providerMessageId", pid), ("reason", reason)):
        if value is not None and not isinstance(value, str):
            raise _BadRequest("invalid", f"{name} must be a string", 422, name)
        if value is not None and "\x00" in value:  # refused here, not by the database
            raise _BadRequest("invalid", f"{name} must not contain a NUL character", 422, name)
    if record_id > acceptance.MAX_ID:
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
        AuditAction.RESOLVE, CHANNEL_MODELS[channel], [result.id], result.tenant_id, remark
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
