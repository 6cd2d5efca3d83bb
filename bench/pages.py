"""Portal pages on a big database: how long the record pages take to render with --rows mail
and as many SMS records (default 1,000,000; their recipient rows and 10,000 dead letters).

ours  the whole request through Flask's test client, signed in (support staff of the biggest
      tenant, or an operator looking at every tenant): routing, the permission check, the
      queries and the Jinja render, as a browser would wait for it (minus the network).
raw   the main query of the same page as bare SQL over psycopg (what the page cannot beat).

Goals: list, search by recipient and detail under 100 ms median; the dashboards and
"a week two months ago" under 100 ms p95 at 10M rows; the one search box's results
page, each kind of input, under 150 ms p95 and the recipient page under 100 ms p95.
The other pages are measured too, for information. With --index "CREATE INDEX ...", that index
is created on the bench database afterwards and the pages an index could change are measured
again (a new index on a record table costs every status change an index entry: measure that
with bench/claim.py).

The seed time and the database's size are printed. --keep leaves the database in place and a
later run with the same --rows and --keep uses it again (no seeding); drop it by hand after.

--versus N also seeds (or with --keep reuses) a second database of N rows and then times every
page on both in turns, request by request (N, rows, N, rows, ...), and prints each page's p95
and median at both sizes and their ratio (the goal: 1M/100k <= 1.5). On a shared
machine the two sizes measured in separate runs minutes apart see different loads; in turns
they see the same.

--sqlite seeds the same data set into a SQLite file as well (the embedded default that
`make run` uses; migrated with the real migrations, in a temporary directory, or with --keep a
file kept in the system's one and reused), at --rows 100,000 unless given, and times every page
on PostgreSQL and on SQLite in turns as --versus does: each page's p95 and median on both and
SQLite's over PostgreSQL's. A page that fails on either (an error, or anything but 200) is
printed as FAILED, with its error under the table, and the bench goes on.

Data: 10 tenants, tenant 1 holding 60 % of the records; mostly Sent, 2 % Failed, 1 % DeadLetter,
a small backlog (Pending, Retry) at the newest end; one record every ~8 s over 90 days; 50,000
distinct addresses and numbers (about 20 records each).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sqlite3
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import _common as c
import psycopg
from flask import Flask
from flask.testing import FlaskClient
from sqlalchemy import make_url, text

from portal.extensions import db
from portal.models import AppUser, Tenant

DB_NAME = "postroom_bench_pages"
GOAL_MS = 100.0
PASSWORD = "bench-pages-password-1"
SUPPORT = "support@tenant1.bench"
OPERATOR = "operator@platform.bench"
TENANTS = 10
SPREAD_S = 90 * 24 * 3600  # the records' creation times cover 90 days

# tenant 1 gets 6 in 10 records; the other 4 in 10 go round tenants 2..10.
TENANT_OF = f"CASE WHEN g % 10 < 6 THEN 1 ELSE 2 + g % {TENANTS - 1} END"
STATUS_OF = "CASE WHEN g % 50 = 0 THEN 'Failed' WHEN g % 97 = 0 THEN 'DeadLetter' ELSE 'Sent' END"
ERROR_OF = "CASE WHEN g % 50 = 0 THEN '550 5.1.1' WHEN g % 97 = 0 THEN '451 4.3.0' END"
MAIL_COLUMNS = (
    "tenant_id, scope, status, version, retry_count, error_code, error_message, "
    "to_addrs, subject, rendered_subject, text_body, rendered_text, rendered_html, "
    "template_code, created_time, updated_time, prepared_at, sent_at, trace_id, "
    "business_key, message_id_header"
)
SMS_COLUMNS = (
    "tenant_id, scope, status, version, retry_count, error_code, error_message, "
    "phone_number, country_code, content, rendered_content, template_code, "
    "created_time, updated_time, prepared_at, sent_at"
)
ATTEMPT_COLUMNS = (
    "tenant_id, channel, record_id, number, started_at, finished_at, outcome, ambiguous, "
    "provider_message_id"
)
BACKLOG = 300  # Pending and Retry records of tenant 1 at the newest end, per channel
# Each table's own columns in the backlog's rows, and their values.
BACKLOG_OF = {
    "mail_send_record": ("to_addrs, subject", "'[\"late@example.com\"]', 'Late'"),
    "sms_send_record": ("phone_number, content", "'+447911000001', 'Late'"),
}
DEAD_LETTERS = 10_000
# The ids the cases open: a record of tenant 1's, 500 from the newest.
LATEST_IDS = (
    "SELECT (SELECT max(id) FROM mail_send_record WHERE tenant_id = 1) - 500, "
    "(SELECT max(id) FROM sms_send_record WHERE tenant_id = 1) - 500"
)

# The pages an index on the record tables could change (measured again after --index).
INDEXED_PAGES = {
    "dashboard",
    "dashboard, every hour read",
    "dashboard, all tenants",
    "dashboard, all tenants, every hour read",
    "dashboard fragment (htmx)",
    "mail list, status DeadLetter",
    "mail list, template + status",
    "mail list, a week two months ago",
}


# --- seeding -----------------------------------------------------------------------------------


RECORD_TABLES = (
    "mail_send_record",
    "mail_send_recipient",
    "mail_send_subject",
    "sms_send_record",
    "send_attempt",
)


def seed_accounts(app: Flask) -> None:
    """The tenants, the support user of tenant 1 and the operator (through the models)."""
    with app.app_context():
        for i in range(1, TENANTS + 1):
            db.session.add(Tenant(slug=f"tenant{i}", name=f"Tenant {i}"))
        db.session.flush()
        for email, role, tenant_id in [
            (SUPPORT, "support", 1),
            (OPERATOR, "platform_operator", -1),
        ]:
            user = AppUser(email=email, role=role, tenant_id=tenant_id)
            user.set_password(PASSWORD)
            db.session.add(user)
        db.session.commit()


def seed_postgresql(app: Flask, url: str, n: int) -> dict[str, Any]:
    """Tenants, users, n mail + n SMS records with recipients, a backlog and dead letters.

    The records go in by COPY with the tables' secondary indexes dropped and foreign keys not
    checked (session_replication_role = replica), then the indexes are built again from their
    own definitions: at 10M rows, maintaining nine indexes row by row is what takes the time.
    The rows are made by the server (generate_series) and streamed from ``COPY (SELECT ...)
    TO STDOUT`` on one connection into ``COPY ... FROM STDIN`` on another.
    """
    dsn = c.conninfo(url)
    seed_accounts(app)
    step = SPREAD_S / n
    created = f"now() - make_interval(secs => ({n} - g) * {step})"
    sent = f"{created} + make_interval(secs => g % 40)"  # 0-39 s: the dashboard's latency
    chunk = 1_000_000
    with psycopg.connect(dsn) as source, psycopg.connect(dsn) as conn:
        conn.execute("SET session_replication_role = replica")  # no FK triggers while loading
        indexes = drop_secondary_indexes(conn)
        for start in range(0, n, chunk):
            size = min(chunk, n - start)
            series = f"generate_series({start + 1}, {start + size}) g"
            copy_rows(
                source,
                conn,
                f"SELECT {TENANT_OF}, 'TENANT', {STATUS_OF}, 3, 0, {ERROR_OF}, {ERROR_OF}, "
                "json_build_array('user' || (g % 50000) || '@example.com'), "
                "'Order ' || g || ' is on its way', 'Order ' || g || ' is on its way', "
                "'Hello', 'Hello, your order ' || g || ' is on its way.', "
                "'<h1>Order ' || g || '</h1><p>Hello, it is on its way.</p>', "
                "CASE WHEN g % 3 = 0 THEN 'welcome' ELSE 'receipt' END, "
                f"{created}, {created}, {created}, {sent}, md5(g::text), "
                f"'order-' || g, '<mail-' || g || '@example.com>' FROM {series}",
                f"mail_send_record ({MAIL_COLUMNS})",
            )
            copy_rows(
                source,
                conn,
                f"SELECT {TENANT_OF}, 'TENANT', {STATUS_OF}, 3, 0, {ERROR_OF}, {ERROR_OF}, "
                "'+447911' || lpad((g % 50000)::text, 6, '0'), 'GB', NULL, "
                "'Your code is ' || (g % 10000), 'otp', "
                f"{created}, {created}, {created}, {sent} FROM {series}",
                f"sms_send_record ({SMS_COLUMNS})",
            )
            conn.commit()
            source.commit()  # the next chunk's SELECT sees this one's rows
            copy_rows(
                source,
                conn,
                "SELECT id, tenant_id, to_addrs->>0, 'to' FROM mail_send_record "
                f"WHERE id BETWEEN {start + 1} AND {start + size}",
                "mail_send_recipient (record_id, tenant_id, address, kind)",
            )
            # The search side tables: with triggers off (replica) the subject rows are copied
            # as the trigger would write them; every SMS has the attempt that got its
            # provider message id.
            copy_rows(
                source,
                conn,
                "SELECT id, tenant_id, subject FROM mail_send_record "
                f"WHERE id BETWEEN {start + 1} AND {start + size}",
                "mail_send_subject (record_id, tenant_id, subject)",
            )
            copy_rows(
                source,
                conn,
                "SELECT tenant_id, 'sms', id, 1, created_time, created_time, 'sent', false, "
                "'SM' || md5(id::text) FROM sms_send_record "
                f"WHERE id BETWEEN {start + 1} AND {start + size}",
                f"send_attempt ({ATTEMPT_COLUMNS})",
            )
            conn.commit()
            c.say(f"  {start + size:,} of {n:,} rows each ({time.strftime('%H:%M:%S')})")
        # The backlog at the newest end, and dead letters for the operators' pages.
        for table, (columns, values) in BACKLOG_OF.items():
            conn.execute(
                f"INSERT INTO {table} (tenant_id, scope, status, version, retry_count, "
                f"next_retry_at, created_time, updated_time, {columns}) "
                "SELECT 1, 'TENANT', CASE WHEN g % 3 = 0 THEN 'Retry' ELSE 'Pending' END, "
                "1, 0, now() - make_interval(secs => g), now() - make_interval(secs => g), "
                f"now() - make_interval(secs => g), {values} FROM generate_series(1, {BACKLOG}) g"
            )
        conn.execute(
            "INSERT INTO dead_letter_message (tenant_id, source, event_id, channel, provider, "
            "error_code, reason, attempts, payload, status, created_time) "
            f"SELECT 1 + g % {TENANTS}, 'SendExhausted', (g * 97)::text, 'mail', 'smtp', "
            "'451 4.3.0', 'mailbox busy', 6, json_build_object('recordId', g * 97), "
            "CASE WHEN g % 4 = 0 THEN 'Pending' ELSE 'Resolved' END, "
            f"now() - make_interval(secs => g * 60) FROM generate_series(1, {DEAD_LETTERS}) g"
        )
        conn.commit()
        c.say(f"  rows in; building {len(indexes)} indexes ({time.strftime('%H:%M:%S')})")
        conn.execute("SET maintenance_work_mem = '512MB'")
        for ddl in indexes:
            conn.execute(ddl)
            conn.commit()
    vacuum(dsn)
    with psycopg.connect(dsn) as conn:
        facts = conn.execute(LATEST_IDS).fetchone()
    assert facts is not None
    return {"mail_id": facts[0], "sms_id": facts[1]}


def drop_secondary_indexes(conn: psycopg.Connection[Any]) -> list[str]:
    """Drop the record tables' indexes that back no constraint; their CREATE statements."""
    rows = conn.execute(
        "SELECT i.indexrelid::regclass::text, pg_get_indexdef(i.indexrelid) FROM pg_index i "
        "WHERE i.indrelid = ANY(%s::regclass[]) AND NOT EXISTS "
        "(SELECT 1 FROM pg_constraint k WHERE k.conindid = i.indexrelid)",
        (list(RECORD_TABLES),),
    ).fetchall()
    for name, _ in rows:
        conn.execute(f"DROP INDEX {name}")
    conn.commit()
    return [ddl for _, ddl in rows]


def copy_rows(
    source: psycopg.Connection[Any], target: psycopg.Connection[Any], query: str, into: str
) -> None:
    """The rows of ``query`` (made by the server) into ``into``, both ways by COPY."""
    with (
        source.cursor().copy(f"COPY ({query}) TO STDOUT") as out,
        target.cursor().copy(f"COPY {into} FROM STDIN") as inp,
    ):
        for data in out:
            inp.write(data)


SQLITE_CHUNK = 100_000


def seed_sqlite(app: Flask, url: str, n: int) -> dict[str, Any]:
    """The data set of ``seed_postgresql`` in the SQLite file of ``url``.

    The rows are made by SQLite itself: per chunk and table one ``WITH RECURSIVE`` counter
    feeding an ``INSERT ... SELECT``, on one connection of the stdlib driver (foreign keys not
    checked: it does not turn them on). The migrations' indexes and triggers stay: the subject
    trigger writes mail_send_subject as acceptance would (PostgreSQL's seed, with its triggers
    off, copies those rows by hand); the callback triggers find no endpoint. No ANALYZE: the
    product never runs one on its SQLite file, so its planner has no statistics either.
    """
    seed_accounts(app)
    step = SPREAD_S / n
    created = sqlite_ago(f"({n} - g) * {step}")
    with contextlib.closing(
        sqlite3.connect(make_url(url).database or "", isolation_level=None)
    ) as conn:
        conn.execute("PRAGMA synchronous = OFF")  # a bench file: a crash only loses the bench
        for start in range(0, n, SQLITE_CHUNK):
            first, last = start + 1, min(start + SQLITE_CHUNK, n)
            counter = sqlite_counter(first, last)
            chunk = f"WHERE id BETWEEN {first} AND {last}"
            conn.execute("BEGIN")
            conn.execute(
                f"{counter} INSERT INTO mail_send_record ({MAIL_COLUMNS}) "
                f"SELECT {TENANT_OF}, 'TENANT', {STATUS_OF}, 3, 0, {ERROR_OF}, {ERROR_OF}, "
                "json_array('user' || (g % 50000) || '@example.com'), "
                "'Order ' || g || ' is on its way', 'Order ' || g || ' is on its way', "
                "'Hello', 'Hello, your order ' || g || ' is on its way.', "
                "'<h1>Order ' || g || '</h1><p>Hello, it is on its way.</p>', "
                "CASE WHEN g % 3 = 0 THEN 'welcome' ELSE 'receipt' END, "
                f"{created}, {created}, {created}, {created}, printf('%032x', g), "
                "'order-' || g, '<mail-' || g || '@example.com>' FROM counter"
            )
            conn.execute(
                f"{counter} INSERT INTO sms_send_record ({SMS_COLUMNS}) "
                f"SELECT {TENANT_OF}, 'TENANT', {STATUS_OF}, 3, 0, {ERROR_OF}, {ERROR_OF}, "
                "'+447911' || printf('%06d', g % 50000), 'GB', NULL, "
                "'Your code is ' || (g % 10000), 'otp', "
                f"{created}, {created}, {created}, {created} FROM counter"
            )
            conn.execute(
                "INSERT INTO mail_send_recipient (record_id, tenant_id, address, kind) "
                f"SELECT id, tenant_id, json_extract(to_addrs, '$[0]'), 'to' "
                f"FROM mail_send_record {chunk}"
            )
            conn.execute(
                f"INSERT INTO send_attempt ({ATTEMPT_COLUMNS}) "
                "SELECT tenant_id, 'sms', id, 1, created_time, created_time, 'sent', 0, "
                f"'SM' || printf('%032x', id) FROM sms_send_record {chunk}"
            )
            conn.execute("COMMIT")
            c.say(f"  {last:,} of {n:,} rows each ({time.strftime('%H:%M:%S')})")
        conn.execute("BEGIN")
        for table, (columns, values) in BACKLOG_OF.items():
            conn.execute(
                f"{sqlite_counter(1, BACKLOG)} INSERT INTO {table} (tenant_id, scope, status, "
                f"version, retry_count, next_retry_at, created_time, updated_time, {columns}) "
                "SELECT 1, 'TENANT', CASE WHEN g % 3 = 0 THEN 'Retry' ELSE 'Pending' END, 1, 0, "
                f"{sqlite_ago('g')}, {sqlite_ago('g')}, {sqlite_ago('g')}, {values} FROM counter"
            )
        conn.execute(
            f"{sqlite_counter(1, DEAD_LETTERS)} INSERT INTO dead_letter_message (tenant_id, "
            "source, event_id, channel, provider, error_code, reason, attempts, payload, status, "
            f"created_time) SELECT 1 + g % {TENANTS}, 'SendExhausted', CAST(g * 97 AS TEXT), "
            "'mail', 'smtp', '451 4.3.0', 'mailbox busy', 6, json_object('recordId', g * 97), "
            "CASE WHEN g % 4 = 0 THEN 'Pending' ELSE 'Resolved' END, "
            f"{sqlite_ago('g * 60')} FROM counter"
        )
        conn.execute("COMMIT")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # the pages read the file, not a long WAL
        mail_id, sms_id = conn.execute(LATEST_IDS).fetchone()
    return {"mail_id": mail_id, "sms_id": sms_id}


def sqlite_counter(first: int, last: int) -> str:
    """A ``WITH`` clause naming the table ``counter``: one row for each g in first..last."""
    return (
        f"WITH RECURSIVE counter(g) AS (SELECT {first} UNION ALL "
        f"SELECT g + 1 FROM counter WHERE g < {last})"
    )


def sqlite_ago(seconds: str) -> str:
    """The time ``seconds`` (an SQL expression) ago, as the product's clock writes it on SQLite
    (``db_now``: UTC text to the millisecond)."""
    return f"strftime('%Y-%m-%d %H:%M:%f', 'now', '-' || ({seconds}) || ' seconds')"


def database_size(dsn: str) -> list[list[Any]]:
    """Each record table's heap and index size, and the whole database's."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT relname, pg_size_pretty(pg_table_size(oid)), "
            "pg_size_pretty(pg_indexes_size(oid)) FROM pg_class "
            "WHERE relname = ANY(%s) ORDER BY relname",
            (list(RECORD_TABLES),),
        ).fetchall()
        total = conn.execute("SELECT pg_size_pretty(pg_database_size(current_database()))")
        size = total.fetchone()
    assert size is not None
    return [[*row] for row in rows] + [["whole database", size[0], ""]]


def vacuum(dsn: str) -> None:
    """The shared server runs without autovacuum: statistics and the visibility map, by hand."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for table in (
            "mail_send_record",
            "mail_send_recipient",
            "mail_send_subject",
            "send_attempt",
            "recipient_token",
            "sms_send_record",
            "dead_letter_message",
            "tenant",
        ):
            conn.execute(f"VACUUM (ANALYZE) {table}")


# --- measuring -----------------------------------------------------------------------------------


def signed_in(app: Flask, email: str, view_tenant: str | None = None) -> FlaskClient:
    client = app.test_client()
    page = client.get("/auth/login").text
    found = re.search(r'name="csrf_token" value="([^"]+)"', page)
    assert found is not None
    response = client.post(
        "/auth/login",
        data={"email": email, "password": PASSWORD, "csrf_token": found.group(1)},
    )
    assert response.status_code == 302, response.status_code
    if view_tenant is not None:
        with client.session_transaction() as session:
            session["view_tenant"] = view_tenant
    return client


@dataclass
class Timing:
    median_ms: float
    p95_ms: float

    @classmethod
    def of(cls, samples: list[float]) -> Timing:
        return cls(c.median(samples), c.percentile(samples, 95))


SLOW_S = 1.0  # a page slower than this is timed SLOW_RUNS times (at 10M some take 30 s)
SLOW_RUNS = 3

# A side's samples of one page (ms), or why its request failed.
Outcome = list[float] | str


class PageFailed(Exception):
    """A page answered other than 200."""


def timed(fn: Callable[[], Any], runs: int) -> Timing:
    (samples,) = in_turns([fn], runs)
    if isinstance(samples, str):
        raise PageFailed(samples)
    return Timing.of(samples)


def in_turns(fns: list[Callable[[], Any]], runs: int) -> list[Outcome]:
    """Each of ``fns`` timed ``runs`` times in turns, request by request (a, b, a, b, ...),
    so that the machine's load falls on all of them alike, after two warming rounds (plans,
    buffer and page caches, Jinja's template cache). A failed request ends its function's
    timing (its outcome is the error), not the others'."""
    outcomes: list[Outcome] = [[] for _ in fns]

    def round_(keep: bool) -> None:
        for i, fn in enumerate(fns):
            samples = outcomes[i]
            if isinstance(samples, str):
                continue
            t0 = time.perf_counter()
            try:
                fn()
            except Exception as exc:  # reported as FAILED; the bench goes on
                outcomes[i] = failure(exc)
                continue
            if keep:
                samples.append((time.perf_counter() - t0) * 1000)

    t0 = time.perf_counter()
    round_(keep=False)
    if time.perf_counter() - t0 > SLOW_S:
        runs = min(runs, SLOW_RUNS)
    else:
        round_(keep=False)
    for _ in range(runs):
        round_(keep=True)
    return outcomes


def failure(exc: Exception) -> str:
    text = str(exc) if isinstance(exc, PageFailed) else f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())[:300]


class ErrorsLogged(logging.Handler):
    """The last exception the app logged: what a page that answered 500 hit (the portal's
    error handler logs it and renders the error page)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.last = ""

    def emit(self, record: logging.LogRecord) -> None:
        exc = record.exc_info[1] if record.exc_info else None
        # A database error's own words, without SQLAlchemy's copy of the statement.
        cause = getattr(exc, "orig", None) or exc
        self.last = f"{type(cause).__name__}: {cause}" if cause else record.getMessage()

    def take(self) -> str:
        last, self.last = self.last, ""
        return last


ERRORS = ErrorsLogged()
logging.getLogger("portal").addHandler(ERRORS)


def page(client: FlaskClient, url: str, headers: dict[str, str] | None = None) -> Callable[[], Any]:
    def get() -> None:
        ERRORS.take()
        response = client.get(url, headers=headers or {})
        if response.status_code != 200:
            logged = ERRORS.take()
            raise PageFailed(f"{response.status_code} on {url}" + (f": {logged}" if logged else ""))

    return get


def case_page(client: FlaskClient, case: Case) -> Callable[[], Any]:
    """The request of ``case`` (the htmx fragment, or read fresh: see Case.fresh)."""
    from portal.web.operations import dashboard

    get = (
        page(client, "/", {"HX-Request": "true"})
        if case.url == "/__hx__"
        else page(client, case.url)
    )
    if not case.fresh:
        return get

    def fresh() -> None:
        dashboard._past_hours.clear()
        dashboard._delivery.clear()  # the tenant's latency and failure rate by route too
        get()

    return fresh


def sql(conn: psycopg.Connection[Any], query: str) -> Callable[[], Any]:
    return lambda: conn.execute(query).fetchall()


@dataclass
class Case:
    name: str
    who: str
    url: str
    raw: str | None = None
    goal: str = ""  # "median" or "p95": under goal_ms is the goal; "": for information
    goal_ms: float = GOAL_MS
    # The dashboard reads its chart's earlier hours, and a tenant's latency and failure rate
    # by route, at most once a minute: True times the request that reads them (the first
    # after a minute), not the refreshes between.
    fresh: bool = False


def weeks_ago(weeks: int) -> str:
    return (datetime.now(UTC) - timedelta(weeks=weeks)).date().isoformat()


def cases(ids: dict[str, Any]) -> list[Case]:
    mail_id, sms_id = ids["mail_id"], ids["sms_id"]
    mid = mail_id // 2
    return [
        Case(
            "mail list",
            "support",
            "/mail-records/",
            "SELECT * FROM mail_send_record WHERE tenant_id = 1 ORDER BY id DESC LIMIT 51",
            "median",
        ),
        Case(
            "mail list, page half-way back",
            "support",
            f"/mail-records/?before={mid}",
            "SELECT * FROM mail_send_record WHERE tenant_id = 1 AND id < "
            f"{mid} ORDER BY id DESC LIMIT 51",
            "median",
        ),
        Case(
            "mail search by recipient",
            "support",
            "/mail-records/?q=User4242@Example.com",
            "SELECT * FROM mail_send_record WHERE id IN (SELECT record_id FROM "
            "mail_send_recipient WHERE tenant_id = 1 AND address = 'user4242@example.com') "
            "ORDER BY id DESC LIMIT 51",
            "median",
        ),
        Case(
            "mail search by recipient, all tenants",
            "operator",
            "/mail-records/?q=user4242@example.com",
            "SELECT * FROM mail_send_record WHERE id IN (SELECT record_id FROM "
            "mail_send_recipient WHERE tenant_id IN (SELECT id FROM tenant) AND address = "
            "'user4242@example.com') ORDER BY id DESC LIMIT 51",
            "median",
        ),
        Case(
            "mail detail",
            "support",
            f"/mail-records/{mail_id}",
            f"SELECT * FROM mail_send_record WHERE id = {mail_id} AND tenant_id = 1",
            "median",
        ),
        Case("mail rendered (iframe)", "support", f"/mail-records/{mail_id}/rendered"),
        Case(
            "sms list",
            "support",
            "/sms-records/",
            "SELECT * FROM sms_send_record WHERE tenant_id = 1 ORDER BY id DESC LIMIT 51",
            "median",
        ),
        Case(
            "sms search by number",
            "support",
            "/sms-records/?q=%2B44+7911+004242",
            "SELECT * FROM sms_send_record WHERE tenant_id = 1 AND phone_number = "
            "'+447911004242' ORDER BY id DESC LIMIT 51",
            "median",
        ),
        Case(
            "sms detail",
            "support",
            f"/sms-records/{sms_id}",
            f"SELECT * FROM sms_send_record WHERE id = {sms_id} AND tenant_id = 1",
            "median",
        ),
        Case("mail list, all tenants", "operator", "/mail-records/"),
        Case("mail subject search", "support", "/mail-records/?q=order+4242+is"),
        Case("mail list, status DeadLetter", "support", "/mail-records/?status=DeadLetter"),
        Case(
            "mail list, template + status",
            "support",
            "/mail-records/?template=welcome&status=Failed",
        ),
        Case(
            "mail list, a week two months ago",
            "support",
            f"/mail-records/?from={weeks_ago(9)}&to={weeks_ago(8)}",
            goal="p95",
        ),
        Case("dashboard", "support", "/", goal="p95"),
        Case("dashboard, every hour read", "support", "/", goal="p95", fresh=True),
        Case("dashboard, all tenants", "operator", "/", goal="p95"),
        Case("dashboard, all tenants, every hour read", "operator", "/", goal="p95", fresh=True),
        Case("dashboard fragment (htmx)", "support", "/__hx__", goal="p95"),
        Case("dead letters", "operator", "/dead-letters/?status=Pending"),
        *search_cases(ids),
    ]


SEARCH_GOAL_MS = 150.0


def search_cases(ids: dict[str, Any]) -> list[Case]:
    """The one search box: each kind of input on the results page, and the
    recipient page of a mail address and of a number (tokens made by ``recipient_tokens``)."""
    mail_id = ids["mail_id"]
    # An order number in a subject ("Order <g> is on its way"): one record of tenant 1 has it
    # at every size. (It was "order 424242 is", a record that exists only from 424,242 rows
    # on: at 100k the search found nothing, so the 1M/100k ratio compared a hit with a miss.)
    order = mail_id // 20 * 10 + 1  # g % 10 < 6: tenant 1's
    kinds = [
        ("full address", "User4242@Example.com"),
        ("partial address", "user4242"),
        ("address prefix", "user4242@"),
        ("domain (every record)", "@example.com"),
        ("subject words, rare", f"order {order} is"),
        ("subject word, in every record", "way"),
        ("national number (GB)", "07911 004242"),
        ("number without +", "447911004242"),
        ("international number", "+44 7911 004242"),
        ("record id", str(mail_id)),
        ("Message-ID", f"<mail-{mail_id}@example.com>"),
        ("provider message id", ids.get("provider_id", "SM-none")),
        ("business key", f"order-{mail_id}"),
    ]
    found = [
        Case(
            f"search: {name}",
            "support",
            "/search/?" + urlencode({"q": q}),
            goal="p95",
            goal_ms=SEARCH_GOAL_MS,
        )
        for name, q in kinds
    ]
    found.append(
        Case(
            "search: full address, all tenants",
            "operator",
            "/search/?q=user4242%40example.com",
            goal="p95",
            goal_ms=SEARCH_GOAL_MS,
        )
    )
    for channel in ("mail", "sms"):
        token = ids.get(f"{channel}_token")
        if token:
            found.append(
                Case(f"recipient page ({channel})", "support", f"/recipients/{token}", goal="p95")
            )
    return found


def recipient_tokens(app: Flask) -> dict[str, str]:
    """Tokens of a mail address and a number of tenant 1 (about 12 records each at 1M), and
    one SMS's provider message id, for the search cases (either dialect)."""
    from portal.web.records.recipients import token_for

    wanted = {"mail": "user4242@example.com", "sms": "+447911004242"}
    with app.app_context():
        tokens = {channel: token_for(1, channel, address) for channel, address in wanted.items()}
        with db.engine.begin() as conn:
            for channel, address in wanted.items():
                conn.execute(
                    text(
                        "INSERT INTO recipient_token (token, tenant_id, channel, address) "
                        "VALUES (:token, 1, :channel, :address) ON CONFLICT DO NOTHING"
                    ),
                    {"token": tokens[channel], "channel": channel, "address": address},
                )
            row = conn.execute(
                text(
                    "SELECT provider_message_id FROM send_attempt WHERE tenant_id = 1 "
                    "ORDER BY id DESC LIMIT 1 OFFSET 500"
                )
            ).first()
    found = {f"{channel}_token": token for channel, token in tokens.items()}
    if row is not None:
        found["provider_id"] = row[0]
    return found


Results = dict[str, tuple[Timing, Timing | None]]


def measure(
    app: Flask, dsn: str, ids: dict[str, Any], runs: int, only: set[str] | None = None
) -> Results:
    clients = {
        "support": signed_in(app, SUPPORT),
        "operator": signed_in(app, OPERATOR, "all"),
    }
    results: Results = {}
    with psycopg.connect(dsn, autocommit=True) as conn:
        for case in cases(ids):
            if only is not None and case.name not in only:
                continue
            fn = case_page(clients[case.who], case)
            ours = timed(fn, runs)
            raw = timed(sql(conn, case.raw), runs) if case.raw else None
            results[case.name] = (ours, raw)
            c.say(
                f"  {case.name}: {ours.median_ms:,.1f} ms median, p95 {ours.p95_ms:,.1f} "
                f"(load {os.getloadavg()[0]:.1f})"
            )
    return results


def report(title: str, results: Results, ids: dict[str, Any]) -> None:
    rows = []
    goals = {case.name: case.goal for case in cases(ids) if case.goal}
    limits = {case.name: case.goal_ms for case in cases(ids)}
    for name, (ours, raw) in results.items():
        goal_ms = limits.get(name, GOAL_MS)
        met = (ours.p95_ms if goals.get(name) == "p95" else ours.median_ms) < goal_ms
        rows.append(
            [
                name,
                ours.median_ms,
                ours.p95_ms,
                raw.median_ms if raw else "",
                f"{goals[name]} < {goal_ms:.0f}" if name in goals else "",
                c.verdict(met) if name in goals else ("" if met else "slow"),
            ]
        )
    c.print_table(title, ["page", "ours ms", "p95", "raw SQL ms", "goal", ""], rows)


def options(parser: Any) -> None:
    parser.add_argument("--runs", type=int, default=20, help="timed requests per page")
    parser.add_argument(
        "--rows", type=int, default=None, help="mail records, and as many SMS (default 1M)"
    )
    parser.add_argument(
        "--index",
        action="append",
        default=[],
        help="CREATE INDEX statement to try afterwards (repeatable; bench database only)",
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the database; reuse a kept one of this size"
    )
    parser.add_argument(
        "--versus",
        type=int,
        default=None,
        help="also a database of this many rows, every page timed on both in turns (ratios)",
    )
    parser.add_argument(
        "--sqlite",
        action="store_true",
        help="the same data set in a SQLite file too (default --rows 100,000), every page "
        "timed on SQLite and PostgreSQL in turns",
    )


@contextlib.contextmanager
def pages_database(n: int, keep: bool, base: str = DB_NAME) -> Iterator[tuple[str, bool]]:
    """The bench database and whether it is already seeded with ``n`` rows (--keep)."""
    name = c.db_name(base)
    url = c.database_url(name)
    if keep:
        with contextlib.suppress(psycopg.Error), psycopg.connect(c.conninfo(url)) as conn:
            row = conn.execute("SELECT rows FROM bench_pages_seed").fetchone()
            if row is not None and row[0] == n:
                c.say(f"\nreusing the kept database {name} ({n:,} rows)")
                yield url, True
                return
    if not keep:
        with c.bench_database(base) as url:
            yield url, False
        return
    with psycopg.connect(c.conninfo(c.ADMIN_URL), autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.execute(f'CREATE DATABASE "{name}"')
    c.say(f"\nthe database {name} is kept after this run: drop it when done")
    yield url, False


@contextlib.contextmanager
def sqlite_database(n: int, keep: bool) -> Iterator[tuple[str, bool]]:
    """A SQLite file for the bench and whether it is already seeded with ``n`` rows: in a
    temporary directory removed after the run, or (--keep) a file in the system's temporary
    directory that is kept, and reused by a later run with the same --rows."""
    if not keep:
        with tempfile.TemporaryDirectory(prefix="bench-pages-") as where:
            yield f"sqlite:///{where}/postroom.db", False
        return
    path = Path(tempfile.gettempdir()) / f"{c.db_name(DB_NAME)}.db"
    url = f"sqlite:///{path}"
    if seeded_rows(path) == n:
        c.say(f"\nreusing the kept SQLite file {path} ({n:,} rows)")
        yield url, True
        return
    for stale in (path, path.with_name(f"{path.name}-wal"), path.with_name(f"{path.name}-shm")):
        stale.unlink(missing_ok=True)
    c.say(f"\nthe SQLite file {path} is kept after this run: remove it when done")
    yield url, False


def seeded_rows(path: Path) -> int | None:
    """The --rows a kept SQLite file was seeded with (None: none, or not seeded to the end)."""
    if not path.exists():
        return None
    with contextlib.closing(sqlite3.connect(path)) as conn:
        try:
            row = conn.execute("SELECT rows FROM bench_pages_seed").fetchone()
        except sqlite3.Error:
            return None
    return None if row is None else int(row[0])


def sqlite_size(url: str) -> list[list[Any]]:
    """Each record table's and its indexes' size in the SQLite file (dbstat), and the file's."""
    path = make_url(url).database or ""
    with contextlib.closing(sqlite3.connect(path)) as conn:
        rows = conn.execute(
            "SELECT m.tbl_name, sum(CASE WHEN m.type = 'table' THEN s.pgsize END), "
            "sum(CASE WHEN m.type = 'index' THEN s.pgsize END) "
            "FROM dbstat s JOIN sqlite_master m ON m.name = s.name "
            f"WHERE m.tbl_name IN ({', '.join('?' for _ in RECORD_TABLES)}) "
            "GROUP BY m.tbl_name ORDER BY m.tbl_name",
            RECORD_TABLES,
        ).fetchall()
    size = sum(
        Path(f"{path}{suffix}").stat().st_size
        for suffix in ("", "-wal")
        if Path(f"{path}{suffix}").exists()
    )
    return [[table, mb(heap), mb(index)] for table, heap, index in rows] + [
        ["whole file (and its WAL)", mb(size), ""]
    ]


def mb(size: int | None) -> str:
    return f"{(size or 0) / 2**20:,.0f} MB"


SEEDS = {"postgresql": seed_postgresql, "sqlite": seed_sqlite}


def prepared(url: str, seeded: bool, n: int) -> tuple[Flask, dict[str, Any]]:
    """The app on a bench database of ``n`` rows, PostgreSQL or SQLite (seeded now unless it
    was), and the ids the cases use."""
    app = c.make_app(url)
    dialect = make_url(url).get_backend_name()
    if not seeded:
        c.say(f"\nseeding {n:,} mail and {n:,} SMS records ({dialect}) ...")
        t0 = time.perf_counter()
        ids = SEEDS[dialect](app, url, n)
        c.say(f"  seeded in {time.perf_counter() - t0:.1f} s")
        with app.app_context(), db.engine.begin() as conn:
            conn.execute(
                text("CREATE TABLE bench_pages_seed (rows bigint, mail_id bigint, sms_id bigint)")
            )
            conn.execute(
                text("INSERT INTO bench_pages_seed VALUES (:rows, :mail_id, :sms_id)"),
                {"rows": n, **ids},
            )
    else:
        with app.app_context(), db.engine.connect() as conn:
            row = conn.execute(text("SELECT mail_id, sms_id FROM bench_pages_seed")).one()
        ids = {"mail_id": row[0], "sms_id": row[1]}
    ids |= recipient_tokens(app)  # idempotent: on a kept database too
    return app, ids


def compared(
    sides: list[tuple[Flask, dict[str, Any]]], runs: int
) -> Iterator[tuple[Case, list[Outcome]]]:
    """Every page timed on each side (an app and its ids) in turns, request by request."""
    clients = [
        {"support": signed_in(app, SUPPORT), "operator": signed_in(app, OPERATOR, "all")}
        for app, _ in sides
    ]
    by_name = [{case.name: case for case in cases(ids)} for _, ids in sides]
    for name, case in by_name[-1].items():
        if any(name not in side for side in by_name):
            continue
        fns = [
            case_page(side_clients[side[name].who], side[name])
            for side_clients, side in zip(clients, by_name, strict=True)
        ]
        yield case, in_turns(fns, runs)


def side_by_side(
    title: str,
    labels: tuple[str, str],
    sides: list[tuple[Flask, dict[str, Any]]],
    runs: int,
) -> None:
    """Every page on two sides in turns: each side's p95 and median, the second's over the
    first's, and the second's p95 against the page's goal. A page that failed on a side is
    FAILED there, with its error in a table of its own."""
    rows, failed = [], []
    for case, outcomes in compared(sides, runs):
        timings = [Timing.of(o) if isinstance(o, list) else None for o in outcomes]
        p95s = [t.p95_ms if t else "FAILED" for t in timings]
        medians = [t.median_ms if t else "FAILED" for t in timings]
        second = timings[1]
        goal = case.goal_ms if case.goal == "p95" and second is not None else None
        rows.append(
            [
                case.name,
                *p95s,
                ratio(*p95s),
                *medians,
                ratio(*medians),
                "" if goal is None or second is None else c.verdict(second.p95_ms < goal),
            ]
        )
        failed += [
            [case.name, label, outcome]
            for label, outcome in zip(labels, outcomes, strict=True)
            if isinstance(outcome, str)
        ]
        shown = " / ".join(f"{v:,.1f}" if isinstance(v, float) else v for v in p95s)
        c.say(f"  {case.name}: p95 {shown} (load {os.getloadavg()[0]:.1f})")
    first, last = labels
    c.print_table(
        title,
        [
            "page",
            f"p95 {first}",
            f"p95 {last}",
            "ratio",
            f"median {first}",
            f"median {last}",
            "ratio",
            f"p95 goal, {last}",
        ],
        rows,
    )
    if failed:
        c.print_table("FAILED pages", ["page", "on", "error"], failed)


def ratio(first: float | str, second: float | str) -> float | str:
    """second / first, or nothing when either failed."""
    if isinstance(first, float) and isinstance(second, float) and first > 0:
        return second / first
    return ""


def main() -> int:
    args = c.parse_args(__doc__, options)
    if args.sqlite and (args.versus or args.index):
        raise SystemExit("--sqlite compares the two dialects: not with --versus or --index")
    n = args.rows or (50_000 if args.quick else 100_000 if args.sqlite else 1_000_000)
    c.print_header("bench/pages.py: portal pages on a big database", args.quick)
    if args.versus:
        return main_versus(args, args.versus, n)
    if args.sqlite:
        return main_sqlite(args, n)
    with pages_database(n, args.keep) as (url, seeded):
        app, ids = prepared(url, seeded, n)
        dsn = c.conninfo(url)
        c.print_table("Database size", ["table", "heap", "indexes"], database_size(dsn))
        c.say(f"load average before measuring: {load()}")
        results = measure(app, dsn, ids, args.runs)
        report(f"Pages with the migrations' indexes ({n:,} mail + {n:,} SMS records)", results, ids)
        c.say(f"load average after measuring: {load()}")

        columns = [results]
        for ddl in args.index:
            c.say(f"\n{ddl} (bench database only) ...")
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(ddl)
            vacuum(dsn)
            columns.append(measure(app, dsn, ids, args.runs, only=INDEXED_PAGES))
        if args.index:
            c.print_table(
                "The pages an index could change, with each --index added in turn (p95 ms)",
                ["page", "migrations only", *(f"+ index {i + 1}" for i in range(len(args.index)))],
                [
                    [name, *(column[name][0].p95_ms for column in columns)]
                    for name in results
                    if name in INDEXED_PAGES
                ],
            )
        c.say(f"\nload average at the end: {load()}")
        dispose(app)
    return 0


def main_versus(args: Any, small_n: int, n: int) -> int:
    """--versus: both databases, every page in turns, the ratios."""
    with (
        pages_database(small_n, args.keep, f"{DB_NAME}_{small_n}") as (small_url, small_seeded),
        pages_database(n, args.keep) as (url, seeded),
    ):
        small_app, small_ids = prepared(small_url, small_seeded, small_n)
        app, ids = prepared(url, seeded, n)
        for size, where in ((small_n, small_url), (n, url)):
            c.print_table(
                f"Database size, {size:,} rows",
                ["table", "heap", "indexes"],
                database_size(c.conninfo(where)),
            )
        c.say(f"load average before measuring: {load()}")
        side_by_side(
            f"Every page on {small_n:,} and {n:,} records in turns ({args.runs} each), ms",
            (f"{small_n:,}", f"{n:,}"),
            [(small_app, small_ids), (app, ids)],
            args.runs,
        )
        c.say(f"\nload average at the end: {load()}")
        dispose(small_app, app)
    return 0


def main_sqlite(args: Any, n: int) -> int:
    """--sqlite: the same data set in a SQLite file and in PostgreSQL, every page in turns."""
    with (
        sqlite_database(n, args.keep) as (sqlite_url, sqlite_seeded),
        pages_database(n, args.keep) as (url, seeded),
    ):
        sqlite_app, sqlite_ids = prepared(sqlite_url, sqlite_seeded, n)
        app, ids = prepared(url, seeded, n)
        c.print_table(
            f"Database size, PostgreSQL, {n:,} rows",
            ["table", "heap", "indexes"],
            database_size(c.conninfo(url)),
        )
        c.print_table(
            f"Database size, SQLite, {n:,} rows",
            ["table", "heap", "indexes"],
            sqlite_size(sqlite_url),
        )
        c.say(f"load average before measuring: {load()}")
        side_by_side(
            f"Every page on PostgreSQL and SQLite, {n:,} records each, in turns "
            f"({args.runs} each), ms",
            ("PostgreSQL", "SQLite"),
            [(app, ids), (sqlite_app, sqlite_ids)],
            args.runs,
        )
        c.say(f"\nload average at the end: {load()}")
        dispose(app, sqlite_app)
    return 0


def dispose(*apps: Flask) -> None:
    for app in apps:
        with app.app_context():
            db.engine.dispose()


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


if __name__ == "__main__":
    raise SystemExit(main())
