"""Acceptance: check a validated request against the tenant's tier and write a Pending record in
the caller's transaction.

The request's shape and values are checked first, with no database access, by ``validation``
(addresses and numbers by ``addresses``); here its template, stream and server are looked up
and the record is written. Nothing here commits. A rejection raises ``AcceptanceError`` before
anything is written, so the caller's transaction stays usable; a business key already used by
the same tenant returns the existing record instead of writing a second one (idempotent
acceptance).

Each channel is a ``ChannelAcceptance`` (``MAIL``, ``SMS``) whose methods are the entry points
(``send_mail`` is ``MAIL.send``). On PostgreSQL every call writes with one statement (records
and recipients together); the API's single sends use ``send_mail_committed`` /
``send_sms_committed``, which write and commit in that one statement when the caller holds no
transaction. Workers are woken by a
NOTIFY sent after the commit from a thread of this process, folded to a few a second.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import psycopg
from sqlalchemy import Connection, Engine, delete, event, select
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.orm import Session, SessionTransaction, scoped_session

from portal.config import Settings
from portal.messaging.records.references import (
    check_server,
    check_template,
    fetcher_of,
    resolve_streams,
)
from portal.messaging.records.validation import (
    AcceptanceError,
    BusinessKeyConflict,
    MailRequest,
    SmsRequest,
    check_batch,
    unique_keys,
    validate_mail,
    validate_sms,
)
from portal.messaging.templating import checks as template_checks
from portal.models import (
    MailSendRecipient,
    MailSendRecord,
    MailTemplate,
    SendStatus,
    SmsSendRecord,
    SmsTemplate,
)
from portal.models.record import Stream
from portal.process_thread import ProcessThread
from portal.tenancy import current_tenant_id, current_trace_id, new_trace_id

log = logging.getLogger(__name__)


# Wake-up channels for the delivery loop (PostgreSQL LISTEN/NOTIFY).
NOTIFY_CHANNEL = {"mail": "postroom_mail_due", "sms": "postroom_sms_due"}


@dataclass(frozen=True)
class Accepted:
    id: int
    duplicate: bool


# An enum value looked up once (an enum attribute costs a descriptor call each time).
_PENDING = SendStatus.PENDING.value

# --- the plain path's rows ---------------------------------------------------------------

Rec = TypeVar("Rec", MailSendRecord, SmsSendRecord)


def _record(model: type[Rec], req: MailRequest | SmsRequest, trace_id: str, **own: Any) -> Rec:
    """A Pending record of ``model`` with what every channel's request gives, and ``own``."""
    return model(
        tenant_id=req.tenant_id,
        scope=req.scope.value,
        status=SendStatus.PENDING.value,
        version=0,
        retry_count=0,
        trace_id=trace_id,
        business_key=req.business_key,
        request_hash=req.request_hash,
        template_code=req.template_code,
        variables=req.variables,
        expires_at=req.expires_at,
        stream=req.stream or Stream.TRANSACTIONAL.value,
        request_metadata=req.metadata,
        **own,
    )


def _mail_record(req: MailRequest, trace_id: str) -> MailSendRecord:
    return _record(
        MailSendRecord,
        req,
        trace_id,
        to_addrs=req.to,
        cc_addrs=req.cc or None,
        bcc_addrs=req.bcc or None,
        reply_to=req.reply_to,
        subject=req.subject,
        html_body=req.html,
        text_body=req.text,
        template_id=req.template_id,
        server_id=req.server_id,
        priority=req.priority,
        attachments=req.attachments,
    )


def _mail_recipients(record: MailSendRecord, req: MailRequest) -> list[MailSendRecipient]:
    return [
        MailSendRecipient(record_id=record.id, tenant_id=req.tenant_id, address=address, kind=kind)
        for address, kind in _recipient_rows(req)
    ]


def _sms_record(req: SmsRequest, trace_id: str) -> SmsSendRecord:
    return _record(
        SmsSendRecord,
        req,
        trace_id,
        phone_number=req.phone_number,
        country_code=req.country_code,
        content=req.content,
    )


# --- writing ----------------------------------------------------------------------------

Req = TypeVar("Req", MailRequest, SmsRequest)


def _existing(
    session: Session, model: type[Rec], tenant_id: int, keys: Sequence[str]
) -> dict[str, tuple[int, str | None]]:
    if not keys:
        return {}
    rows = session.execute(
        select(model.business_key, model.id, model.request_hash).where(
            model.tenant_id == tenant_id, model.business_key.in_(keys)
        )
    )
    return {key: (rid, digest) for key, rid, digest in rows if key is not None}


def _existing_by_key(
    session: Session, model: type[Rec], requests: Iterable[MailRequest | SmsRequest]
) -> dict[tuple[int, str], tuple[int, str | None]]:
    by_tenant: dict[int, list[str]] = {}
    for req in requests:
        if req.business_key is not None:
            by_tenant.setdefault(req.tenant_id, []).append(req.business_key)
    found: dict[tuple[int, str], tuple[int, str | None]] = {}
    for tenant_id, keys in by_tenant.items():
        for key, value in _existing(session, model, tenant_id, keys).items():
            found[(tenant_id, key)] = value
    return found


def _conflict(index: int, batch: bool) -> AcceptanceError:
    error = BusinessKeyConflict(
        "conflict", "businessKey", "this businessKey was already used for a different request"
    )
    return error.at(index) if batch else error


def _write(
    session: Session, kind: ChannelAcceptance[Req, Rec], requests: Sequence[Req]
) -> list[Accepted]:
    """Insert the records not already there by business key; ids come back in input order.

    PostgreSQL takes the fast path (one statement for the records and their recipients);
    other databases (the embedded SQLite default) the plain ORM path. Either way a new record
    asks for a NOTIFY once the caller commits.
    """
    trace_id = current_trace_id() or new_trace_id()
    if session.get_bind().dialect.name == "postgresql":
        results = _write_pg(session, kind.model, requests, trace_id, kind.channel)
    else:
        results = _write_orm(session, kind.model, requests, kind.record, kind.recipients, trace_id)
    if any(not r.duplicate for r in results):
        _notify_after_commit(session, kind.channel)
    return results


def _write_orm(
    session: Session,
    model: type[Rec],
    requests: Sequence[Req],
    build: Callable[[Req, str], Rec],
    extra_rows: Callable[[Rec, Req], list[Any]] | None,
    trace_id: str,
) -> list[Accepted]:
    """The plain path: ORM objects, flushed in a savepoint when business keys are given.

    When a concurrent caller commits the same business key first, the unique index refuses
    ours, only the savepoint rolls back, and we return the winner's record. The caller's
    transaction is never aborted.
    """
    for _attempt in range(3):
        results: list[Accepted | None] = [None] * len(requests)
        found = _existing_by_key(session, model, requests)
        new: list[tuple[int, Req, Rec]] = []
        for i, req in enumerate(requests):
            hit = found.get((req.tenant_id, req.business_key)) if req.business_key else None
            if hit is not None:
                record_id, digest = hit
                if digest != req.request_hash:
                    raise _conflict(i, len(requests) > 1)
                results[i] = Accepted(record_id, duplicate=True)
            else:
                new.append((i, req, build(req, trace_id)))
        if not new:
            return [r for r in results if r is not None]
        keyed = any(req.business_key is not None for _, req, _ in new)
        try:
            # Only a business key can collide with a concurrent caller; without one there
            # is nothing to roll back to, and the savepoint would cost two round trips.
            with session.begin_nested() if keyed else contextlib.nullcontext():
                session.add_all([record for _, _, record in new])
                session.flush()
                if extra_rows is not None:
                    rows = [row for _, req, rec in new for row in extra_rows(rec, req)]
                    session.add_all(rows)
                    session.flush()
        except IntegrityError:
            if not keyed:
                raise
            # Someone committed one of our business keys meanwhile: look again.
            for _, _, record in new:
                if record in session:
                    session.expunge(record)
            continue
        for i, _req, record in new:
            results[i] = Accepted(record.id, duplicate=False)
        return [r for r in results if r is not None]
    raise AcceptanceError(
        "conflict", "businessKey", "business keys kept colliding with concurrent requests"
    )


# The PostgreSQL path. Every call is one statement, whatever the batch size: the requests
# travel as one JSON document (a row per request, only the fields it gives), which the
# server unpacks with json_to_recordset; so the statement text is fixed per channel and
# psycopg prepares it on the server after a few uses. Ids are drawn in a materialised CTE,
# so each item's id is known by its ordinal and its recipients go in with it. ON CONFLICT DO
# NOTHING on the business key replaces the savepoint: a concurrent caller that committed the
# same key first makes our row a no-op (PostgreSQL waits for its commit, as the unique index
# did), nothing is aborted, and the item is resolved afterwards against the winner's row.

# (column, type in the document): JSON columns keep their nested JSON as it is.
_COMMON_COLUMNS = [
    ("tenant_id", "bigint"),
    ("scope", "text"),
    ("status", "text"),
    ("trace_id", "text"),
    ("business_key", "text"),
    ("request_hash", "text"),
    ("template_code", "text"),
    ("variables", "json"),
    ("expires_at", "timestamptz"),
    ("stream", "text"),
    ("metadata", "json"),
]
_PG_COLUMNS = {
    "mail": [
        *_COMMON_COLUMNS,
        ("to_addrs", "json"),
        ("cc_addrs", "json"),
        ("bcc_addrs", "json"),
        ("reply_to", "text"),
        ("subject", "text"),
        ("html_body", "text"),
        ("text_body", "text"),
        ("template_id", "bigint"),
        ("server_id", "bigint"),
        ("priority", "integer"),
        ("attachments", "json"),
    ],
    "sms": [
        *_COMMON_COLUMNS,
        ("phone_number", "text"),
        ("country_code", "text"),
        ("content", "text"),
    ],
}
_PG_TABLE = {"mail": "mail_send_record", "sms": "sms_send_record"}
_PG_KEY = {"mail": "uq_mail_send_business_key", "sms": "uq_sms_send_business_key"}


def _pg_insert_sql(channel: str) -> str:
    table, columns = _PG_TABLE[channel], _PG_COLUMNS[channel]
    names = ", ".join(name for name, _ in columns)
    shape = ", ".join(f"{name} {kind}" for name, kind in columns)
    sql = (
        f"WITH d AS MATERIALIZED (SELECT nextval('{table}_id_seq') AS id, u.* "
        f"FROM json_to_recordset(%s::json) AS u(ord integer, rcpt json, {shape})), "
        # Rows go in by (tenant, business key), not input order: two batches holding the same
        # keys in different orders then take the key locks in one order and cannot deadlock.
        f"ins AS (INSERT INTO {table} (id, {names}) SELECT id, {names} FROM d "
        "ORDER BY tenant_id, business_key NULLS LAST, ord "
        f"ON CONFLICT ON CONSTRAINT {_PG_KEY[channel]} DO NOTHING RETURNING id)"
    )
    if channel == "mail":
        sql += (
            ", rcp AS (INSERT INTO mail_send_recipient (record_id, tenant_id, address, kind) "
            "SELECT d.id, d.tenant_id, e->>0, e->>1 FROM d JOIN ins ON ins.id = d.id "
            "CROSS JOIN LATERAL json_array_elements(d.rcpt) AS e)"
        )
    return (
        sql
        + " SELECT d.id, ins.id IS NOT NULL FROM d LEFT JOIN ins ON ins.id = d.id ORDER BY d.ord"
    )


_PG_SQL = {channel: _pg_insert_sql(channel) for channel in _PG_TABLE}


def _recipient_rows(req: MailRequest) -> list[tuple[str, str]]:
    """(address, kind): each address lower-cased, once per kind, for search by recipient."""
    rows = []
    for kind, addresses in (("to", req.to), ("cc", req.cc), ("bcc", req.bcc)):
        for address in dict.fromkeys(a.lower() for a in addresses):
            rows.append((address, kind))
    return rows


def _pg_row(req: MailRequest | SmsRequest, ord_: int, trace_id: str) -> dict[str, Any]:
    row: dict[str, Any] = {
        "ord": ord_,
        "tenant_id": req.tenant_id,
        "scope": str(req.scope),
        "status": _PENDING,
        "trace_id": trace_id,
        "request_hash": req.request_hash,
        "stream": req.stream or Stream.TRANSACTIONAL.value,
    }
    optional: dict[str, Any] = {
        "business_key": req.business_key,
        "template_code": req.template_code,
        "variables": req.variables,
        "expires_at": req.expires_at.isoformat() if req.expires_at else None,
        "metadata": req.metadata,
    }
    if isinstance(req, MailRequest):
        row["to_addrs"] = req.to
        row["rcpt"] = _recipient_rows(req)
        optional |= {
            "cc_addrs": req.cc or None,
            "bcc_addrs": req.bcc or None,
            "reply_to": req.reply_to,
            "subject": req.subject,
            "html_body": req.html,
            "text_body": req.text,
            "template_id": req.template_id,
            "server_id": req.server_id,
            "priority": req.priority,
            "attachments": req.attachments,
        }
    else:
        row["phone_number"] = req.phone_number
        optional |= {"country_code": req.country_code, "content": req.content}
    row.update((k, v) for k, v in optional.items() if v is not None)
    return row


def _insert_pg(
    session: Session,
    channel: str,
    requests: Sequence[MailRequest | SmsRequest],
    trace_id: str,
) -> list[tuple[int, bool]]:
    """Insert ``requests`` in one statement: (id, inserted) per request, in input order;
    inserted is False where a committed row already holds the item's business key."""
    document = json.dumps([_pg_row(req, i, trace_id) for i, req in enumerate(requests)])
    sql = _PG_SQL[channel]
    # Straight to the driver, on the session's connection and in its transaction: this is the
    # hot path of the API, and SQLAlchemy's execution context would cost more than the insert.
    if session.new or session.dirty or session.deleted:
        session.flush()  # what the caller added first must be seen (and conflict) first
    connection = session.connection()
    raw = connection.connection.dbapi_connection
    assert isinstance(raw, psycopg.Connection)
    try:
        with raw.cursor() as cursor:
            cursor.execute(sql, (document,))
            rows = cursor.fetchall()
    except psycopg.Error as exc:
        if raw.broken:
            connection.invalidate(exc)
        raise DBAPIError.instance(sql, None, exc, psycopg.Error) from exc
    return [(int(row[0]), bool(row[1])) for row in rows]


def _write_pg(
    session: Session,
    model: type[Rec],
    requests: Sequence[Req],
    trace_id: str,
    channel: str,
) -> list[Accepted]:
    """The fast path. A batch looks its business keys up first (one SELECT, only when it has
    any), so that a conflict is found before anything is written; a single send just inserts
    and, when its key was taken, reads the winner's row."""
    batch = len(requests) > 1
    for _attempt in range(3):
        results: list[Accepted | None] = [None] * len(requests)
        found = _existing_by_key(session, model, requests) if batch else {}
        todo: list[int] = []
        for i, req in enumerate(requests):
            hit = found.get((req.tenant_id, req.business_key)) if req.business_key else None
            if hit is None:
                todo.append(i)
                continue
            record_id, digest = hit
            if digest != req.request_hash:
                raise _conflict(i, batch)
            results[i] = Accepted(record_id, duplicate=True)
        if todo:
            written = _insert_pg(session, channel, [requests[i] for i in todo], trace_id)
            lost: list[int] = []
            for i, (record_id, inserted) in zip(todo, written, strict=True):
                if inserted:
                    results[i] = Accepted(record_id, duplicate=False)
                else:
                    lost.append(i)
            if lost and not _resolve_lost(session, model, requests, lost, results, batch):
                continue  # a winner's row vanished again meanwhile: start over
        return [r for r in results if r is not None]
    raise AcceptanceError(
        "conflict", "businessKey", "business keys kept colliding with concurrent requests"
    )


def _resolve_lost(
    session: Session,
    model: type[Rec],
    requests: Sequence[Req],
    lost: list[int],
    results: list[Accepted | None],
    batch: bool,
) -> bool:
    """Items whose business key a concurrent caller committed between our look-up and our
    insert: theirs decide. The same request is a duplicate; another one is a conflict, and
    then nothing of ours may stay. False: a winner's row is gone again (ours undone too)."""
    winners = _existing_by_key(session, model, [requests[i] for i in lost])
    for i in lost:
        req = requests[i]
        hit = winners.get((req.tenant_id, req.business_key or ""))
        if hit is not None and hit[1] == req.request_hash:
            results[i] = Accepted(hit[0], duplicate=True)
            continue
        mine = [r.id for r in results if r is not None and not r.duplicate]
        if mine:
            session.execute(
                delete(model).where(model.id.in_(mine)),
                execution_options={"synchronize_session": False},
            )
        if hit is None:
            return False
        raise _conflict(i, batch)
    return True


# --- writes in doubt --------------------------------------------------------------------
#
# A connection lost while a write that commits was on its way (a COMMIT, or a single send's
# statement in autocommit) leaves its outcome unknown: the record may have been written. Lost
# before that, nothing was, and the request may be tried again; the API does so once, watching
# for this.

_WRITE_SENT: ContextVar[bool] = ContextVar("postroom_write_sent", default=False)


@contextlib.contextmanager
def watching_writes() -> Iterator[Callable[[], bool]]:
    """Watch one attempt at accepting: the function it gives says whether a write that commits
    has gone to the database since the attempt began (then a lost connection leaves it in
    doubt, and trying again could write the record twice)."""
    token = _WRITE_SENT.set(False)
    try:
        yield _WRITE_SENT.get
    finally:
        _WRITE_SENT.reset(token)


@event.listens_for(Engine, "commit")
def _committing(_connection: Connection) -> None:
    """A COMMIT is about to be sent (every engine, every session): see ``watching_writes``."""
    _WRITE_SENT.set(True)


# --- wake-ups ---------------------------------------------------------------------------

NOTIFY_INTERVAL_S = 0.01
"""At most one NOTIFY per channel per process in this interval; the workers' poll is the
fallback, so a NOTIFY is a hint and never the only way work is found."""

_PENDING_NOTIFY = "postroom.notify"


def _notify_after_commit(session: Session, channel: str) -> None:
    """Ask for a NOTIFY on ``channel`` once the caller commits (never if it rolls back)."""
    bind = session.get_bind()
    if bind.dialect.name != "postgresql":
        return
    engine = bind if isinstance(bind, Engine) else bind.engine
    session.info.setdefault(_PENDING_NOTIFY, set()).add((engine, channel))


@event.listens_for(Session, "after_commit")
def _committed(session: Session) -> None:
    if session.in_nested_transaction():
        return  # a savepoint released: the work is not visible until the outer commit
    pending = session.info.pop(_PENDING_NOTIFY, None)
    if pending:
        NOTIFIER.request(pending)


@event.listens_for(Session, "after_transaction_end")
def _ended(session: Session, transaction: SessionTransaction) -> None:
    if transaction.parent is None:  # rolled back or closed without a commit: no wake-up
        session.info.pop(_PENDING_NOTIFY, None)


class Notifier:
    """Sends the wake-up NOTIFYs from a thread of its own, after the commit, folded.

    A commit only marks its channel; the thread sends one NOTIFY per marked channel, then
    waits ``interval_s`` before it sends again, so a burst of commits costs the database a
    few NOTIFYs a second per process and the requests none at all. A NOTIFY that fails is
    logged and dropped: the workers poll.
    """

    def __init__(self, interval_s: float = NOTIFY_INTERVAL_S):
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._due: set[tuple[Engine, str]] = set()
        self._thread = ProcessThread("notify", self._send)
        self.sent = 0  # NOTIFY statements sent by this process (for tests and benchmarks)

    def request(self, pending: Iterable[tuple[Engine, str]]) -> None:
        with self._lock:
            self._due.update(pending)
            self._thread.wake()

    def _send(self) -> None:
        """In the thread: one NOTIFY per marked channel, then the pause."""
        with self._lock:
            due, self._due = self._due, set()
        by_engine: dict[Engine, list[str]] = {}
        for engine, channel in due:
            by_engine.setdefault(engine, []).append(channel)
        for engine, channels in by_engine.items():
            try:
                notify = ", ".join(
                    f"pg_notify('{NOTIFY_CHANNEL[channel]}', '')" for channel in sorted(channels)
                )
                _autocommit(engine, f"SELECT {notify}")
                self.sent += len(channels)
            except Exception as exc:  # a hint only: the poll finds the work
                log.warning("NOTIFY failed (%s); the workers' poll will find the work", exc)
        time.sleep(self.interval_s)


NOTIFIER = Notifier()


def _autocommit(engine: Engine, sql: str) -> None:
    """Run one statement in autocommit on a pooled connection (one round trip)."""
    pooled = engine.raw_connection()
    try:
        raw = pooled.driver_connection
        assert isinstance(raw, psycopg.Connection)
        raw.autocommit = True
        try:
            raw.execute(sql)
        finally:
            raw.autocommit = False
    except psycopg.Error as exc:
        pooled.invalidate(exc)
        raise
    finally:
        pooled.close()


def _settings_of(session: Session, settings: Settings | None) -> Settings:
    if settings is not None:
        return settings
    return _default_settings()


_DEFAULT: list[Settings] = []


def _default_settings() -> Settings:
    if not _DEFAULT:
        _DEFAULT.append(Settings.from_env())
    return _DEFAULT[0]


@dataclass(frozen=True)
class ChannelAcceptance(Generic[Req, Rec]):
    """How one channel's messages are accepted, its differences declared once (``MAIL``,
    ``SMS``): its request, the rows the plain path writes, and for mail the server a request
    may name. Its entry points are these methods (``send_mail`` is ``MAIL.send``)."""

    channel: str  # "mail" | "sms": its wake-up and its statement on the PostgreSQL path
    model: type[Rec]
    template: type[MailTemplate] | type[SmsTemplate]
    validate: Callable[[Mapping[str, Any], Settings, int | None], Req]
    record: Callable[[Req, str], Rec]  # the plain path's record
    recipients: Callable[[Rec, Req], list[Any]] | None  # and the rows written beside it

    def send(
        self, session: Session, request: Mapping[str, Any], *, settings: Settings | None = None
    ) -> Accepted:
        """Accept one message for the current tenant; writes a Pending record, never commits."""
        return self.batch(session, [request], settings=settings, _single=True)[0]

    def batch(
        self,
        session: Session,
        items: Sequence[Mapping[str, Any]],
        *,
        settings: Settings | None = None,
        _single: bool = False,
    ) -> list[Accepted]:
        """Accept 1..500 messages atomically: one invalid item rejects the batch, naming its
        index."""
        cfg = _settings_of(session, settings)
        tenant_id = current_tenant_id()
        items = list(items) if _single else check_batch(items)
        requests = []
        fetcher = fetcher_of(session)
        for i, item in enumerate(items):
            try:
                req = self.validate(item, cfg, tenant_id)
                _check(fetcher, req)
            except AcceptanceError as error:
                raise (error if _single else error.at(i)) from None
            requests.append(req)
        unique_keys(requests)
        resolve_streams(session, self.template, requests)
        return _write(session, self, requests)

    def committed(
        self, session: Session, request: Mapping[str, Any], *, settings: Settings | None = None
    ) -> Accepted:
        """Accept one message and commit it, for a caller with no transaction of its own (the
        API).

        On PostgreSQL, with no transaction open on ``session``, the record (and a mail's
        recipients) is written by one statement in autocommit on a connection of the session's
        engine (one round trip: no BEGIN, no COMMIT; the statement is atomic). Elsewhere:
        ``send`` and ``session.commit()``. Rejections raise ``AcceptanceError`` with nothing
        written either way.
        """
        cfg = _settings_of(session, settings)
        req = self.validate(request, cfg, current_tenant_id())
        engine = _autocommit_engine(session)
        if engine is not None:
            return _accept_now(engine, self.channel, req)
        _check(fetcher_of(session), req)
        (result,) = _write(session, self, [req])
        session.commit()
        return result


def _check(fetcher: Callable[[], template_checks.Fetch], req: MailRequest | SmsRequest) -> None:
    """What the request names, checked against its tier (``references``)."""
    check_server(fetcher, req)
    check_template(fetcher, req)


MAIL = ChannelAcceptance(
    "mail", MailSendRecord, MailTemplate, validate_mail, _mail_record, _mail_recipients
)
SMS = ChannelAcceptance("sms", SmsSendRecord, SmsTemplate, validate_sms, _sms_record, None)

# --- accept, as the API, the portal and the tests call it -------------------------------
send_mail, send_mail_batch, send_mail_committed = MAIL.send, MAIL.batch, MAIL.committed
send_sms, send_sms_batch, send_sms_committed = SMS.send, SMS.batch, SMS.committed


def _autocommit_engine(session: Session | scoped_session[Session]) -> Engine | None:
    """The session's PostgreSQL engine when the session holds no transaction (else None)."""
    own = session() if isinstance(session, scoped_session) else session
    bind = own.get_bind()
    if bind.dialect.name != "postgresql" or own.in_transaction():
        return None
    return bind if isinstance(bind, Engine) else None


_KEY_SQL = {
    channel: f"SELECT id, request_hash FROM {table} WHERE tenant_id = %s AND business_key = %s"
    for channel, table in _PG_TABLE.items()
}


def _accept_now(engine: Engine, channel: str, req: MailRequest | SmsRequest) -> Accepted:
    trace_id = current_trace_id() or new_trace_id()
    pooled = engine.raw_connection()
    raw = pooled.driver_connection
    assert isinstance(raw, psycopg.Connection)
    try:
        raw.autocommit = True
        try:
            result = _accept_on(raw, channel, req, trace_id)
        finally:
            if not raw.closed:  # closed: setting it would hide the error that closed it
                raw.autocommit = False
    except psycopg.Error as exc:
        if raw.broken or raw.closed:
            pooled.invalidate(exc)
        raise DBAPIError.instance(_PG_SQL[channel], None, exc, psycopg.Error) from exc
    finally:
        pooled.close()
    if not result.duplicate:
        NOTIFIER.request([(engine, channel)])
    return result


def _accept_on(
    raw: psycopg.Connection[Any], channel: str, req: MailRequest | SmsRequest, trace_id: str
) -> Accepted:
    with raw.cursor() as cursor:

        def fetch(sql: str, params: tuple[Any, ...]) -> tuple[Any, ...] | None:
            row = cursor.execute(sql, params).fetchone()
            return None if row is None else tuple(row)

        _check(lambda: fetch, req)
        document = json.dumps([_pg_row(req, 0, trace_id)])
        _WRITE_SENT.set(True)  # in autocommit, the insert commits itself
        for _attempt in range(3):
            row = cursor.execute(_PG_SQL[channel], (document,)).fetchone()
            assert row is not None
            if row[1]:
                return Accepted(int(row[0]), duplicate=False)
            # The business key is taken (PostgreSQL waited for its owner to commit): theirs.
            winner = cursor.execute(_KEY_SQL[channel], (req.tenant_id, req.business_key)).fetchone()
            if winner is None:
                continue  # gone again meanwhile: try once more
            if winner[1] != req.request_hash:
                raise _conflict(0, batch=False)
            return Accepted(int(winner[0]), duplicate=True)
    raise AcceptanceError(
        "conflict", "businessKey", "business keys kept colliding with concurrent requests"
    )
