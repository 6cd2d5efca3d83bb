"""The due scan walks its status indexes, whatever the size of the history (seed 000, "How a
scan reads"; DESIGN.md, "The send record is the queue").

A database of its own (``<test database>_plans``, created and dropped here) gets 100,000 history
rows per send-record table plus a few hundred Pending and Retry rows, then ANALYZE. The exact
statements ``scan_due`` issues are captured as they reach the driver and run as server-side
prepared statements under ``plan_cache_mode = force_generic_plan``, as a long-lived pooled
connection would end up running them, with every planner switch at its default. Each must be an
index scan bounded by its index condition: no Seq Scan, no Filter over the history. The old
single OR query, under the same generic plan, walks the history: that is why the scan is two
queries.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pytest
from psycopg import sql as pgsql
from sqlalchemy import Engine, and_, create_engine, event, make_url, or_, select, text
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import Session

from portal.extensions import db
from portal.messaging.sending.claim import _CLAIMS, scan_due
from portal.models import MailSendRecord, SendStatus, SmsSendRecord, db_now
from tests.conftest import TEST_DATABASE_URL, make_app

ADMIN_URL = os.environ.get(
    "TEST_PG_ADMIN_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)
HISTORY = 100_000
PENDING = 300
RETRY = 300  # half due, half not yet
SCAN_N = 4
SMALL = 10  # rows a bounded plan may discard; the history is 10,000 times that

pytestmark = pytest.mark.timeout(120)

# One INSERT ... SELECT per table: history first (one row a minute over ~70 days: mostly Sent,
# some Failed and DeadLetter), then the work, newest: Pending, and Retry due or not yet due.
_HISTORY_STATUS = (
    "CASE WHEN g % 50 = 0 THEN 'Failed' WHEN g % 97 = 0 THEN 'DeadLetter' ELSE 'Sent' END"
)
_HISTORY_AGE = f"make_interval(mins => {HISTORY} - g)"
_WORK_STATUS = f"CASE WHEN g <= {PENDING} THEN 'Pending' ELSE 'Retry' END"
_WORK_RETRY_AT = (
    f"CASE WHEN g <= {PENDING} THEN NULL "
    "WHEN g % 2 = 0 THEN now() - make_interval(secs => g) "  # due
    "ELSE now() + make_interval(secs => 3600 + g) END"  # not yet due
)
_CHANNEL_COLUMNS = {
    "mail_send_record": ("to_addrs, subject, text_body", "'[\"ann@example.com\"]', 'Hello', 'Hi'"),
    "sms_send_record": ("phone_number, country_code, content", "'+447911123456', 'GB', 'Hi'"),
}


def _fill(engine: Engine, table: str) -> None:
    columns, values = _CHANNEL_COLUMNS[table]
    common = "tenant_id, scope, status, version, retry_count, created_time, updated_time"
    with engine.begin() as conn:
        conn.execute(
            text(
                f"INSERT INTO {table} ({common}, sent_at, {columns}) "
                f"SELECT 1 + g % 50, 'TENANT', {_HISTORY_STATUS}, 3, 0, "
                f"now() - {_HISTORY_AGE}, now() - {_HISTORY_AGE} + interval '2 seconds', "
                f"now() - {_HISTORY_AGE} + interval '2 seconds', {values} "
                f"FROM generate_series(1, {HISTORY}) g"
            )
        )
        conn.execute(
            text(
                f"INSERT INTO {table} ({common}, next_retry_at, {columns}) "
                f"SELECT 1 + g % 50, 'TENANT', {_WORK_STATUS}, 2, "
                f"CASE WHEN g <= {PENDING} THEN 0 ELSE 1 END, "
                f"now() - make_interval(secs => g), now() - make_interval(secs => g), "
                f"{_WORK_RETRY_AT}, {values} "
                f"FROM generate_series(1, {PENDING + RETRY}) g"
            )
        )
        conn.execute(text(f"ANALYZE {table}"))


@pytest.fixture(scope="module")
def plans_engine() -> Iterator[Engine]:
    """A fresh database migrated to head and filled; dropped afterwards."""
    name = f"{make_url(TEST_DATABASE_URL).database}_plans"
    url = make_url(TEST_DATABASE_URL).set(database=name).render_as_string(hide_password=False)
    admin = create_engine(ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        app = make_app(url)
        with app.app_context():
            engine = db.engine
        try:
            for table in _CHANNEL_COLUMNS:
                _fill(engine, table)
            yield engine
        finally:
            engine.dispose()
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


# --- running a statement as a generic prepared statement -------------------------------------


@dataclass(frozen=True)
class Captured:
    sql: str  # as handed to the driver: %(name)s placeholders
    params: dict[str, Any]


def captured_scan(engine: Engine, model: type[Any]) -> list[Captured]:
    """The statements ``scan_due`` sends to the database, exactly as sent."""
    seen: list[Captured] = []

    def capture(
        _conn: Any, _cursor: Any, statement: str, parameters: Any, _ctx: Any, _many: bool
    ) -> None:
        seen.append(Captured(statement, dict(parameters or {})))

    event.listen(engine, "before_cursor_execute", capture)
    try:
        with Session(engine) as session:
            found = scan_due(session, model, SCAN_N)
    finally:
        event.remove(engine, "before_cursor_execute", capture)
    assert len(found) == SCAN_N
    return seen


def compiled(statement: Any) -> Captured:
    """A Core statement compiled as the psycopg dialect would send it."""
    result = statement.compile(dialect=postgresql.psycopg.dialect())
    return Captured(str(result), dict(result.params))


@dataclass(frozen=True)
class Plan:
    root: dict[str, Any]
    execution_ms: float

    def nodes(self) -> Iterator[dict[str, Any]]:
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reversed(node.get("Plans", [])))

    def summary(self) -> str:
        parts = []
        for node in self.nodes():
            what = node["Node Type"]
            if "Index Name" in node:
                what += f" on {node['Index Name']}"
            elif "Relation Name" in node:
                what += f" on {node['Relation Name']}"
            what += f" (rows {node['Actual Rows']}"
            if node.get("Rows Removed by Filter"):
                what += f", removed by filter {node['Rows Removed by Filter']}"
            what += ")"
            parts.append(what)
        blocks = self.root.get("Shared Hit Blocks", 0) + self.root.get("Shared Read Blocks", 0)
        return f"{' > '.join(parts)}; {blocks} buffers; execution {self.execution_ms:.3f} ms"


def explain_generic(engine: Engine, statement: Captured, name: str) -> Plan:
    """PREPARE the statement with $n parameters and EXPLAIN ANALYZE a forced generic plan."""
    order: list[str] = []

    def placeholder(match: re.Match[str]) -> str:
        if match.group(1) not in order:
            order.append(match.group(1))
        return f"${order.index(match.group(1)) + 1}"

    sql = re.sub(r"%\((\w+)\)s", placeholder, statement.sql)
    assert "%" not in sql, sql
    with engine.connect() as conn:
        pg = conn.connection.driver_connection
        assert pg is not None
        args = pgsql.SQL(", ").join(pgsql.Literal(statement.params[p]) for p in order)
        with pg.cursor() as cur:
            cur.execute("SET plan_cache_mode = force_generic_plan")
            cur.execute(f"PREPARE {name} AS {sql}")
            given = f"({args.as_string(pg)})" if order else ""
            cur.execute(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE {name}{given}")
            row = cur.fetchone()
            cur.execute(f"DEALLOCATE {name}")
        conn.rollback()
    assert row is not None
    (document,) = row[0] if isinstance(row[0], list) else json.loads(row[0])
    return Plan(document["Plan"], float(document["Execution Time"]))


def assert_index_bounded(plan: Plan, index: str, rows: int) -> None:
    nodes = list(plan.nodes())
    scans = [n for n in nodes if n["Node Type"] in ("Index Scan", "Index Only Scan")]
    assert [n.get("Index Name") for n in scans] == [index], plan.summary()
    (scan,) = scans
    # A generic plan: the parameters are still symbols in the condition, not inlined values.
    assert "$1" in scan.get("Index Cond", ""), scan.get("Index Cond")
    assert scan["Actual Rows"] == rows, plan.summary()
    for node in nodes:
        assert node["Node Type"] not in ("Seq Scan", "Sort"), plan.summary()
        assert "Filter" not in node, (node["Filter"], plan.summary())
        assert node.get("Rows Removed by Filter", 0) <= SMALL, plan.summary()
        assert node.get("Rows Removed by Index Recheck", 0) <= SMALL, plan.summary()


# --- tests -----------------------------------------------------------------------------------

CHANNELS = {
    "mail": (MailSendRecord, "idx_mail_send_status_updated", "idx_mail_send_status_retry"),
    "sms": (SmsSendRecord, "idx_sms_send_status_updated", "idx_sms_send_status_retry"),
}


def test_every_planner_switch_is_at_its_default(plans_engine: Engine) -> None:
    with plans_engine.connect() as conn:
        changed = conn.execute(
            text(
                "SELECT name, setting FROM pg_settings "
                "WHERE (name LIKE 'enable%' OR name = 'plan_cache_mode') AND setting <> boot_val"
            )
        ).all()
        counts = conn.execute(
            text("SELECT status, count(*) FROM mail_send_record GROUP BY status ORDER BY status")
        ).all()
    assert changed == []
    print(f"\nmail_send_record: {dict(counts)}")
    assert sum(n for _, n in counts) == HISTORY + PENDING + RETRY


@pytest.mark.parametrize("channel", list(CHANNELS))
def test_the_two_scan_queries_walk_their_status_indexes(plans_engine: Engine, channel: str) -> None:
    model, pending_index, retry_index = CHANNELS[channel]
    statements = captured_scan(plans_engine, model)
    statuses = {SendStatus.PENDING.value, SendStatus.RETRY.value}
    by_status = {v: s for s in statements for v in s.params.values() if v in statuses}
    assert set(by_status) == statuses, statements
    assert len(statements) == 2, statements  # two queries, never one OR query

    print()
    for status, index in ((SendStatus.PENDING, pending_index), (SendStatus.RETRY, retry_index)):
        statement = by_status[status.value]
        plan = explain_generic(plans_engine, statement, f"scan_{channel}_{status.value.lower()}")
        print(f"[{channel} {status.value}] {plan.summary()}")
        assert_index_bounded(plan, index, rows=SCAN_N)


@pytest.mark.parametrize("channel", list(CHANNELS))
def test_one_or_query_would_walk_the_history_under_a_generic_plan(
    plans_engine: Engine, channel: str
) -> None:
    """Why the scan is two queries: the seed's single query, generic plan, same data."""
    model = CHANNELS[channel][0]
    old = (
        select(model.id)
        .where(
            or_(
                model.status == SendStatus.PENDING.value,
                and_(model.status == SendStatus.RETRY.value, model.next_retry_at <= db_now()),
            )
        )
        .order_by(model.id)
        .limit(SCAN_N)
    )
    plan = explain_generic(plans_engine, compiled(old), f"or_scan_{channel}")
    print(f"\n[{channel} single OR query] {plan.summary()}")
    assert plan.root["Actual Rows"] == SCAN_N
    removed = sum(n.get("Rows Removed by Filter", 0) for n in plan.nodes())
    seq = [n for n in plan.nodes() if n["Node Type"] == "Seq Scan"]
    # Not index-bounded: it reads (nearly) the whole history to find four due rows.
    assert removed >= HISTORY * 0.9 or seq, plan.summary()


FAIR = {
    "mail": ("idx_mail_send_pending_fair", "idx_mail_send_retry_due"),
    "sms": ("idx_sms_send_pending_fair", "idx_sms_send_retry_due"),
}


def _assert_fair_claim_plan(plan: Plan, channel: str) -> None:
    nodes = list(plan.nodes())
    walked = {n.get("Index Name") for n in nodes if "Index" in n["Node Type"]}
    assert set(FAIR[channel]) <= walked, plan.summary()
    for node in nodes:
        assert node["Node Type"] != "Seq Scan", plan.summary()
        assert node.get("Rows Removed by Filter", 0) <= SMALL, plan.summary()
        assert node.get("Actual Rows", 0) <= 10 * SMALL, plan.summary()
    locked = [n for n in nodes if n["Node Type"] == "LockRows"]
    assert locked, plan.summary()  # SKIP LOCKED in the walks
    assert plan.root["Actual Rows"] >= 1, plan.summary()


@pytest.mark.parametrize("channel", list(CHANNELS))
def test_the_one_statement_claim_walks_the_fair_indexes(plans_engine: Engine, channel: str) -> None:
    """What the workers run (``claim_due``): the scan folded into the fair claim (tenants in
    turn, streams in order). Its walks are the partial due indexes (Pending per stream and
    tenant, Retry per stream by due time), locked with SKIP LOCKED; the UPDATE reaches each
    picked row by its key. As prepared (its values inline, so its one plan is the generic
    one), nothing walks or filters the history, and no node handles more than a few rows
    (EXPLAIN ANALYZE of the UPDATE runs in a transaction that is rolled back)."""
    model = CHANNELS[channel][0]
    plan_of = _CLAIMS[model].direct("postgresql", SCAN_N)._plan(plans_engine.dialect)
    assert "%(" not in plan_of.sql  # no parameters: planned once
    plan = explain_generic(plans_engine, Captured(plan_of.sql, {}), f"claim_{channel}")
    print(f"\n[{channel} claim_due] {plan.summary()}")
    _assert_fair_claim_plan(plan, channel)
    assert plan.root["Actual Rows"] == SCAN_N, plan.summary()


def nested_plans(engine: Engine, statement: Captured) -> tuple[Plan, list[Plan]]:
    """EXPLAIN ANALYZE of ``statement`` (rolled back), and the plan of every statement it ran
    inside functions, as auto_explain hands them to the client (generic plans forced)."""
    with engine.connect() as conn:
        pg = conn.connection.driver_connection
        assert pg is not None
        notices: list[str] = []
        pg.add_notice_handler(lambda diag: notices.append(diag.message_primary or ""))
        with pg.cursor() as cur:
            cur.execute("SET plan_cache_mode = force_generic_plan")
            cur.execute("LOAD 'auto_explain'")
            for setting, value in (
                ("log_min_duration", "0"),
                ("log_analyze", "on"),
                ("log_buffers", "on"),
                ("log_nested_statements", "on"),
                ("log_format", "json"),
                ("log_level", "notice"),
            ):
                cur.execute(f"SET auto_explain.{setting} = {value}")
            cur.execute(
                f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {statement.sql}", statement.params
            )
            row = cur.fetchone()
        conn.rollback()
    assert row is not None
    (document,) = row[0] if isinstance(row[0], list) else json.loads(row[0])
    inner = []
    for notice in notices:
        _head, _, body = notice.partition("plan:")
        found = json.loads(body)
        if "postroom_claim_one" not in found["Query Text"]:
            inner.append(Plan(found["Plan"], 0.0))
    return Plan(document["Plan"], float(document["Execution Time"])), inner


@pytest.mark.parametrize("channel", list(CHANNELS))
def test_the_next_claim_in_the_sent_write_walks_the_fair_indexes_too(
    plans_engine: Engine, channel: str
) -> None:
    """The Sent write with the single-record claim it carries (``claim_statement``): the
    claim function (migration 0022) takes the turn from the Sent write's CTE, so PostgreSQL
    cannot lock a candidate before the Sent write has run (a claim that held a lock while
    its Sent write waited could deadlock with another worker). Each statement the function
    runs walks a fair index (Pending per stream and tenant; Retry per stream by due time and
    per tenant), locks with SKIP LOCKED, and reads no history."""
    from portal.messaging.sending import outcomes, sent_write
    from portal.models import Channel

    model = CHANNELS[channel][0]
    with plans_engine.connect() as conn:
        rid, ver = conn.execute(
            select(model.id, model.version)
            .where(model.status == SendStatus.PENDING.value)
            .order_by(model.id)
            .limit(1)
        ).one()
    direct = sent_write._SENT_AND_CLAIM[(Channel(channel), False, True)]  # with the attempt's row
    statement = compiled(direct.statement)
    table = model.__tablename__
    assert f"postroom_claim_one_{table}(coalesce((SELECT max(s.tenant_id) FROM sent s)" in (
        statement.sql
    )
    attempt = outcomes.Attempt(datetime.now(UTC), 0.01, None, "relay", "250", "ok")
    params = {**statement.params, "rid": rid, "ver": ver, "pmid": "<plan@test>"}
    params |= attempt.params()
    plan, inner = nested_plans(plans_engine, Captured(statement.sql, params))
    print(f"\n[{channel} sent + claim_statement] {plan.summary()}")
    for each in inner:
        print(f"  [claim function] {each.summary()}")
    # The record was Pending, so the Sent write matched nothing (version or status do not
    # matter to the plan) and the claim still ran: one row with the claimed record.
    assert plan.root["Actual Rows"] == 1, plan.summary()
    walked = set()
    for each in inner:
        for node in each.nodes():
            assert node["Node Type"] != "Seq Scan", each.summary()
            assert node.get("Rows Removed by Filter", 0) <= SMALL, each.summary()
            assert node.get("Actual Rows", 0) <= SMALL, each.summary()
            if "Index Name" in node:
                walked.add(node["Index Name"])
    prefix = table.removesuffix("_record")
    # The data has 50 tenants with Pending work and due Retry records: every walk ran.
    assert {
        f"idx_{prefix}_pending_fair",
        f"idx_{prefix}_retry_due",
        f"idx_{prefix}_retry_fair",
    } <= walked, walked
    locking = [each for each in inner if any(n["Node Type"] == "LockRows" for n in each.nodes())]
    assert locking, [each.summary() for each in inner]
