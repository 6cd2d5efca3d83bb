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

Data: 10 tenants, tenant 1 holding 60 % of the records; mostly Sent, 2 % Failed, 1 % DeadLetter,
a small backlog (Pending, Retry) at the newest end; one record every ~8 s over 90 days; 50,000
distinct addresses and numbers (about 20 records each).
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlencode

import _common as c
import psycopg
from flask import Flask
from flask.testing import FlaskClient

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


def seed(app: Flask, dsn: str, n: int) -> dict[str, Any]:
    """Tenants, users, n mail + n SMS records with recipients, a backlog and dead letters.

    The records go in by COPY with the tables' secondary indexes dropped and foreign keys not
    checked (session_replication_role = replica), then the indexes are built again from their
    own definitions: at 10M rows, maintaining nine indexes row by row is what takes the time.
    The rows are made by the server (generate_series) and streamed from ``COPY (SELECT ...)
    TO STDOUT`` on one connection into ``COPY ... FROM STDIN`` on another.
    """
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
    step = SPREAD_S / n
    created = f"now() - make_interval(secs => ({n} - g) * {step})"
    chunk = 1_000_000
    with psycopg.connect(dsn) as source, psycopg.connect(dsn) as conn:
        conn.execute("SET session_replication_role = replica")  # no FK triggers while loading
        indexes = drop_secondary_indexes(conn)
        mail_columns = (
            "tenant_id, scope, status, version, retry_count, error_code, error_message, "
            "to_addrs, subject, rendered_subject, text_body, rendered_text, rendered_html, "
            "template_code, created_time, updated_time, prepared_at, sent_at, trace_id, "
            "business_key, message_id_header"
        )
        sms_columns = (
            "tenant_id, scope, status, version, retry_count, error_code, error_message, "
            "phone_number, country_code, content, rendered_content, template_code, "
            "created_time, updated_time, prepared_at, sent_at"
        )
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
                f"{created}, {created}, {created}, {created}, md5(g::text), "
                f"'order-' || g, '<mail-' || g || '@example.com>' FROM {series}",
                f"mail_send_record ({mail_columns})",
            )
            copy_rows(
                source,
                conn,
                f"SELECT {TENANT_OF}, 'TENANT', {STATUS_OF}, 3, 0, {ERROR_OF}, {ERROR_OF}, "
                "'+447911' || lpad((g % 50000)::text, 6, '0'), 'GB', NULL, "
                "'Your code is ' || (g % 10000), 'otp', "
                f"{created}, {created}, {created}, {created} FROM {series}",
                f"sms_send_record ({sms_columns})",
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
                "send_attempt (tenant_id, channel, record_id, number, started_at, finished_at, "
                "outcome, ambiguous, provider_message_id)",
            )
            conn.commit()
            c.say(f"  {start + size:,} of {n:,} rows each ({time.strftime('%H:%M:%S')})")
        # The backlog at the newest end, and dead letters for the operators' pages.
        for table in ("mail_send_record", "sms_send_record"):
            columns = (
                "to_addrs, subject" if table == "mail_send_record" else "phone_number, content"
            )
            values = (
                "'[\"late@example.com\"]', 'Late'"
                if table == "mail_send_record"
                else "'+447911000001', 'Late'"
            )
            conn.execute(
                f"INSERT INTO {table} (tenant_id, scope, status, version, retry_count, "
                f"next_retry_at, created_time, updated_time, {columns}) "
                "SELECT 1, 'TENANT', CASE WHEN g % 3 = 0 THEN 'Retry' ELSE 'Pending' END, "
                "1, 0, now() - make_interval(secs => g), now() - make_interval(secs => g), "
                f"now() - make_interval(secs => g), {values} FROM generate_series(1, 300) g"
            )
        conn.execute(
            "INSERT INTO dead_letter_message (tenant_id, source, event_id, channel, provider, "
            "error_code, reason, attempts, payload, status, created_time) "
            f"SELECT 1 + g % {TENANTS}, 'SendExhausted', (g * 97)::text, 'mail', 'smtp', "
            "'451 4.3.0', 'mailbox busy', 6, json_build_object('recordId', g * 97), "
            "CASE WHEN g % 4 = 0 THEN 'Pending' ELSE 'Resolved' END, "
            f"now() - make_interval(secs => g * 60) FROM generate_series(1, 10000) g"
        )
        conn.commit()
        c.say(f"  rows in; building {len(indexes)} indexes ({time.strftime('%H:%M:%S')})")
        conn.execute("SET maintenance_work_mem = '512MB'")
        for ddl in indexes:
            conn.execute(ddl)
            conn.commit()
    vacuum(dsn)
    with psycopg.connect(dsn) as conn:
        facts = conn.execute(
            "SELECT (SELECT max(id) FROM mail_send_record WHERE tenant_id = 1), "
            "(SELECT max(id) FROM sms_send_record WHERE tenant_id = 1)"
        ).fetchone()
    assert facts is not None
    return {"mail_id": facts[0] - 500, "sms_id": facts[1] - 500}


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


SLOW_S = 1.0  # a page slower than this is timed SLOW_RUNS times (at 10M some take 30 s)
SLOW_RUNS = 3


def timed(fn: Callable[[], Any], runs: int) -> Timing:
    t0 = time.perf_counter()
    fn()  # warm: the plan cache, the buffer cache, Jinja's template cache
    if time.perf_counter() - t0 > SLOW_S:
        runs = min(runs, SLOW_RUNS)
    else:
        fn()
        fn()
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1000)
    return Timing(c.median(samples), c.percentile(samples, 95))


def page(client: FlaskClient, url: str, headers: dict[str, str] | None = None) -> Callable[[], Any]:
    def get() -> None:
        response = client.get(url, headers=headers or {})
        assert response.status_code == 200, (url, response.status_code)

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
    # The dashboard reads its chart's earlier hours at most once a minute: True times the
    # request that reads them (the first after a minute), not the refreshes between.
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


def recipient_tokens(app: Flask, dsn: str) -> dict[str, str]:
    """Tokens of a mail address and a number of tenant 1 (about 12 records each at 1M), and
    one SMS's provider message id, for the search cases."""
    from portal.web.records.recipients import token_for

    wanted = {"mail": "user4242@example.com", "sms": "+447911004242"}
    with app.app_context():
        tokens = {channel: token_for(1, channel, address) for channel, address in wanted.items()}
    with psycopg.connect(dsn) as conn:
        for channel, address in wanted.items():
            conn.execute(
                "INSERT INTO recipient_token (token, tenant_id, channel, address) "
                "VALUES (%s, 1, %s, %s) ON CONFLICT DO NOTHING",
                (tokens[channel], channel, address),
            )
        row = conn.execute(
            "SELECT provider_message_id FROM send_attempt WHERE tenant_id = 1 "
            "ORDER BY id DESC LIMIT 1 OFFSET 500"
        ).fetchone()
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


def prepared(url: str, seeded: bool, n: int) -> tuple[Flask, str, dict[str, Any]]:
    """The app on a bench database of ``n`` rows (seeded now unless it was), its DSN and the
    ids the cases use."""
    app = c.make_app(url)
    dsn = c.conninfo(url)
    if not seeded:
        c.say(f"\nseeding {n:,} mail and {n:,} SMS records ...")
        t0 = time.perf_counter()
        ids = seed(app, dsn, n)
        c.say(f"  seeded in {time.perf_counter() - t0:.1f} s")
        with psycopg.connect(dsn) as conn:
            conn.execute(
                "CREATE TABLE bench_pages_seed (rows bigint, mail_id bigint, sms_id bigint)"
            )
            conn.execute(
                "INSERT INTO bench_pages_seed VALUES (%s, %s, %s)",
                (n, ids["mail_id"], ids["sms_id"]),
            )
    else:
        with psycopg.connect(dsn) as conn:
            row = conn.execute("SELECT mail_id, sms_id FROM bench_pages_seed").fetchone()
        assert row is not None
        ids = {"mail_id": row[0], "sms_id": row[1]}
    ids |= recipient_tokens(app, dsn)  # idempotent: on a kept database too
    return app, dsn, ids


def versus(
    small: tuple[Flask, dict[str, Any]], big: tuple[Flask, dict[str, Any]], runs: int
) -> list[list[Any]]:
    """Every page timed on the small and the big database in turns, request by request."""
    sides = []
    for app, ids in (small, big):
        clients = {
            "support": signed_in(app, SUPPORT),
            "operator": signed_in(app, OPERATOR, "all"),
        }
        sides.append({case.name: (case, clients[case.who]) for case in cases(ids)})
    rows = []
    for name, (case, _) in sides[1].items():
        if name not in sides[0]:
            continue
        fns = [case_page(client, one) for one, client in (side[name] for side in sides)]
        for fn in fns:  # warm both: plans, buffers, templates
            fn()
            fn()
        samples: list[list[float]] = [[], []]
        for _ in range(runs):
            for side_samples, fn in zip(samples, fns, strict=True):
                t0 = time.perf_counter()
                fn()
                side_samples.append((time.perf_counter() - t0) * 1000)
        small_p95, big_p95 = (c.percentile(x, 95) for x in samples)
        small_med, big_med = (c.median(x) for x in samples)
        goal = case.goal_ms if case.goal == "p95" else None
        rows.append(
            [
                name,
                small_p95,
                big_p95,
                big_p95 / small_p95,
                small_med,
                big_med,
                big_med / small_med,
                "" if goal is None else c.verdict(big_p95 < goal),
            ]
        )
        c.say(f"  {name}: p95 {small_p95:,.1f} / {big_p95:,.1f} (load {os.getloadavg()[0]:.1f})")
    return rows


def main() -> int:
    args = c.parse_args(__doc__, options)
    n = args.rows or (50_000 if args.quick else 1_000_000)
    c.print_header("bench/pages.py: portal pages on a big database", args.quick)
    if args.versus:
        return main_versus(args, args.versus, n)
    with pages_database(n, args.keep) as (url, seeded):
        app, dsn, ids = prepared(url, seeded, n)
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
        with app.app_context():
            db.engine.dispose()
    return 0


def main_versus(args: Any, small_n: int, n: int) -> int:
    """--versus: both databases, every page in turns, the ratios."""
    with (
        pages_database(small_n, args.keep, f"{DB_NAME}_{small_n}") as (small_url, small_seeded),
        pages_database(n, args.keep) as (url, seeded),
    ):
        small_app, small_dsn, small_ids = prepared(small_url, small_seeded, small_n)
        app, dsn, ids = prepared(url, seeded, n)
        for size, where in ((small_n, small_dsn), (n, dsn)):
            c.print_table(
                f"Database size, {size:,} rows", ["table", "heap", "indexes"], database_size(where)
            )
        c.say(f"load average before measuring: {load()}")
        rows = versus((small_app, small_ids), (app, ids), args.runs)
        c.print_table(
            f"Every page on {small_n:,} and {n:,} records in turns ({args.runs} each), ms",
            [
                "page",
                f"p95 {small_n:,}",
                f"p95 {n:,}",
                "ratio",
                f"median {small_n:,}",
                f"median {n:,}",
                "ratio",
                f"p95 goal at {n:,}",
            ],
            rows,
        )
        c.say(f"\nload average at the end: {load()}")
        for one in (small_app, app):
            with one.app_context():
                db.engine.dispose()
    return 0


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


if __name__ == "__main__":
    raise SystemExit(main())
