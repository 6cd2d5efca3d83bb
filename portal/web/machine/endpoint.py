"""What every machine endpoint shares (the JSON API and the seed's operator endpoints): who calls
(an API key, or a portal session with the CSRF token), whose rows the request reaches
(``acting_tenant``), how a JSON body is read (``request_body``: never past the size limit,
chunked or not), which query parameters are taken, the audit row of a change to records, the
one error shape ``{"error": {"code", "field", "message"}}``, and what a lost database
connection answers (``database_unavailable``; a send tries once more when it safely can).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from functools import wraps
from typing import IO, Any, NamedTuple, ParamSpec, TypeVar

from flask import Response, current_app, g, jsonify, request
from flask_login import current_user
from sqlalchemy import Engine, event, or_, select, update
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session as OrmSession
from sqlalchemy.orm import object_session
from werkzeug.exceptions import RequestEntityTooLarge

from portal.config import Settings
from portal.extensions import connection_lost, csrf, db
from portal.messaging.records import acceptance
from portal.models import ApiKey, AuditAction, MailSendRecord, SmsSendRecord, Tenant
from portal.models.enums import ApiScope
from portal.models.tenant import hash_api_token
from portal.process_thread import ProcessThread
from portal.tenancy import PLATFORM_TENANT_ID, new_trace_id, tenant_context
from portal.web.access import Permission, audit, can, viewed_tenant
from portal.web.machine.openapi import openapi_document

log = logging.getLogger(__name__)

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


def app_settings() -> Settings:
    """The app's settings, typed."""
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
    ttl = app_settings().api_key_cache_s
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


class KeyUses:
    """Writes API keys' ``last_used_at`` from a thread of its own, folded per interval."""

    def __init__(self, interval_s: float = KEY_USE_INTERVAL_S):
        self.interval_s = interval_s
        self._noted: dict[tuple[int, str], float] = {}  # (app, digest) -> monotonic time
        self._lock = threading.Lock()
        self._writing = threading.Lock()  # held while a batch is written (flush waits on it)
        self._due: dict[tuple[Engine, int], datetime] = {}
        self._thread = ProcessThread("key-uses", self.flush)
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
            self._thread.wake()

    def flush(self) -> None:
        """Write what is due now, in the calling thread (the key-uses thread; tests)."""
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


_BODY = "postroom.body"  # the environ key of a chunked body once read


def request_body() -> bytes:
    """The request's body; 413 when it is over MAX_CONTENT_LENGTH, with or without a length.

    A Content-Length over the limit werkzeug refuses before reading anything. A chunked body
    (Transfer-Encoding: chunked, no Content-Length) has no length to check, and werkzeug's
    stream stops quietly at the limit, so an oversize body read as a shorter one and answered
    400 as malformed JSON. Such a body is read here from the server's own stream (which ends
    it at the last chunk), one byte past the limit at most: that byte means 413.
    """
    environ = request.environ
    limit = request.max_content_length
    if request.content_length is not None or limit is None:
        return request.get_data(cache=True)
    if not environ.get("wsgi.input_terminated"):
        # A server that does not end a chunked stream: werkzeug reads none of it (unsafe).
        return request.get_data(cache=True)
    body: bytes | None = environ.get(_BODY)
    if body is None:
        body = environ[_BODY] = _read_at_most(environ["wsgi.input"], limit + 1)
    if len(body) > limit:
        raise RequestEntityTooLarge()
    return body


def _read_at_most(stream: IO[bytes], size: int) -> bytes:
    parts: list[bytes] = []
    left = size
    while left > 0:
        part = stream.read(min(left, 64 * 1024))
        if not part:
            break
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def json_body() -> Any:
    if not request.is_json:
        raise ApiError("unsupported_media_type", "send Content-Type: application/json", 415)
    try:
        data = json.loads(request_body())
    except (ValueError, RecursionError):  # RecursionError: "[[[[..." past the decoder's stack
        raise ApiError("malformed_json", "the request body is not valid JSON") from None
    if data is None:  # the JSON document null: valid JSON, but no request
        raise ApiError("invalid", "the request body must be a JSON object", 422)
    return data


class ApiError(Exception):
    """A request the API refuses, answered in its error shape (``api_error_response``)."""

    def __init__(self, code: str, message: str, status: int = 400, field: str | None = "body"):
        super().__init__(message)
        self.code, self.message, self.status, self.field = code, message, status, field


def api_error_response(exc: ApiError) -> Response:
    """The API's error shape for an ``ApiError`` (each blueprint registers it)."""
    return error_response(exc.status, exc.code, exc.message, exc.field)


# --- a lost database connection -------------------------------------------------------------

RETRY_AFTER_S = 2  # a restarted or failed-over database takes a few seconds to take sessions


def database_unavailable(in_doubt: bool = False) -> Response:
    """503 with Retry-After for a request whose database connection was lost. ``in_doubt``: a
    write that commits had gone out, so the record may have been written; a repeat with the
    same businessKey returns it instead of writing a second one."""
    message = "the database connection was lost; try again"
    if in_doubt:
        message += (
            " (it may have been accepted all the same: repeated with the same businessKey, a "
            "record written meanwhile comes back as a duplicate instead of a second one)"
        )
    response = error_response(503, "database_unavailable", message)
    response.headers["Retry-After"] = str(RETRY_AFTER_S)
    return response


def roll_back_quietly() -> None:
    """End the session's transaction after a lost connection (whose rollback may fail too)."""
    with contextlib.suppress(SQLAlchemyError):
        db.session.rollback()


def once_more_if_connection_lost(view: Callable[P, R]) -> Callable[P, R | Response]:
    """Run ``view`` (a send) again, once, when its database connection was lost before any
    write that commits went out: nothing of it can have been written, so the second run is
    the only one to write. Lost after that (a COMMIT, or the single send's insert in
    autocommit, whose outcome is unknown), or lost again, it answers 503 with Retry-After and
    is never run again here: that could write the record twice."""

    @wraps(view)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R | Response:
        for attempt in (1, 2):
            with acceptance.watching_writes() as written:
                try:
                    return view(*args, **kwargs)
                except Exception as exc:
                    if not connection_lost(exc):
                        raise
                    roll_back_quietly()
                    if written() or attempt == 2:
                        log.warning(
                            "database connection lost on %s %s (%s); answered 503",
                            request.method,
                            request.path,
                            "the write may have happened" if written() else "nothing written",
                        )
                        return database_unavailable(in_doubt=written())
                    log.info("database connection lost before any write; trying once more")
        raise AssertionError("unreachable")

    return wrapper


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
        raise ApiError("invalid", "tenantId must be a whole number", 422, "tenantId")
    chosen = int(raw)
    platform_key = g.get("api_key_id") is not None and own == PLATFORM_TENANT_ID
    if (own is None or platform_key or chosen == own) and -_BIGINT <= chosen < _BIGINT:
        return chosen
    raise ApiError("not_found", not_found, 404, field)


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


# --- who may call: an API key, or a portal session ----------------------------------------


def key_or_session(
    permission: Permission, scope: ApiScope
) -> Callable[[Callable[P, Response]], Callable[P, Response]]:
    """An API key with ``scope`` (its tenant), else a portal session with ``permission`` (the
    viewed tenant)."""

    def decorate(view: Callable[P, Response]) -> Callable[P, Response]:
        by_key = api_key_required(scope)(view)

        @wraps(view)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> Response:
            if "Authorization" in request.headers or not current_user.is_authenticated:
                return by_key(*args, **kwargs)
            if not can(permission):
                return error_response(403, "forbidden", "your role does not allow this")
            csrf.protect()  # raises a 400 CSRFError when the token is missing or wrong
            g.tenant_id = viewed_tenant(allow_all=True)
            with tenant_context(g.tenant_id):
                return view(*args, **kwargs)

        return wrapper

    return decorate
