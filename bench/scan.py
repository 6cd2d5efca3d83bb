"""Scan latency: the two queries of messaging.sending.claim.scan_due (Pending by updated_time, due
Retry by next_retry_at; n = 4, a worker's own scan), exactly as SQLAlchemy sends them, run as
server-side prepared statements (psycopg prepare=True) under each plan_cache_mode (auto,
force_custom_plan, force_generic_plan).

Part 1, history size: 10,000 vs 1,000,000 history rows (mostly Sent), each with the same work
set (300 Pending, 300 Retry of which half are due), in two databases measured in turns.
Part 2, churn: 200,000 claims and completions (5 % of them through Retry first) on a fresh
1,000,000-row table with only autovacuum running (no manual VACUUM), against an untouched copy
of the same table, measured in turns right after the churn and again after autovacuum's next
visit. The churn runs the same statements as bench/claim.py's raw loop (the product's columns)
on 4 connections while acceptance inserts Pending in batches of 500.

The shared server runs with autovacuum off (its CI configuration), so when it does, part 2 runs
on a private PostgreSQL cluster this script starts (initdb in a temporary folder, the
installed server's defaults: autovacuum on, naptime 60 s) and stops.

Figures: client latency per scan (what a worker waits, median over many executions), the
server's execution time and buffers (EXPLAIN ANALYZE of the same prepared statement), and the
plan. Goal: 1M / 10k <= 1.5 and after-churn / fresh <= 1.5. When the churn ratio is
missed, the churn is repeated on another copy with per-table settings (ALTER TABLE, as a
migration would set them) to show what fixes it.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import random
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import _common as c
import psycopg
from psycopg import sql as pgsql
from sqlalchemy import create_engine, event, text
from sqlalchemy.orm import Session

from portal.extensions import db
from portal.messaging.sending.claim import scan_due
from portal.models import MailSendRecord

GOAL = 1.5
MODES = ("auto", "force_custom_plan", "force_generic_plan")
WORK_PENDING = 300
WORK_RETRY = 300
SCAN_N = 4
TUNED = {
    # Index vacuuming even when few heap pages have dead items (PG 14+ may skip it: "bypass").
    "vacuum_index_cleanup": "on",
    # Vacuum after a fixed number of dead rows, not a share of a table that only grows.
    "autovacuum_vacuum_scale_factor": "0",
    "autovacuum_vacuum_threshold": "5000",
    "autovacuum_vacuum_insert_scale_factor": "0",
    "autovacuum_vacuum_insert_threshold": "20000",
    "autovacuum_analyze_scale_factor": "0",
    "autovacuum_analyze_threshold": "20000",
    # Do not throttle it: a queue table needs its dead index entries gone quickly.
    "autovacuum_vacuum_cost_delay": "0",
}


# --- the statements scan_due sends -------------------------------------------------------------


@dataclass(frozen=True)
class Statement:
    label: str  # "pending" | "retry"
    sql: str  # %(name)s placeholders, as handed to the driver
    params: dict[str, Any]


def scan_statements(url: str) -> list[Statement]:
    """Capture the two statements ``scan_due`` issues, as SQLAlchemy sends them."""
    app = c.make_app(url)
    with app.app_context():
        engine = db.engine
    seen: list[Statement] = []

    def capture(_c: Any, _cur: Any, statement: str, params: Any, _ctx: Any, _many: bool) -> None:
        values = dict(params or {})
        label = "pending" if "Pending" in values.values() else "retry"
        seen.append(Statement(label, statement, values))

    event.listen(engine, "before_cursor_execute", capture)
    try:
        with Session(engine) as session:
            scan_due(session, MailSendRecord, SCAN_N)
    finally:
        event.remove(engine, "before_cursor_execute", capture)
        engine.dispose()
    assert [s.label for s in seen] == ["pending", "retry"], seen
    return seen


def _dollar(statement: Statement) -> tuple[str, list[Any]]:
    order: list[str] = []

    def placeholder(match: re.Match[str]) -> str:
        if match.group(1) not in order:
            order.append(match.group(1))
        return f"${order.index(match.group(1)) + 1}"

    sql = re.sub(r"%\((\w+)\)s", placeholder, statement.sql)
    return sql, [statement.params[p] for p in order]


# --- measuring ---------------------------------------------------------------------------------


@dataclass
class Figures:
    client_us: dict[str, list[float]]  # per label and "scan" (both queries)
    server_ms: dict[str, list[float]]
    buffers: dict[str, int]
    plan: dict[str, str]


def _summary(plan: dict[str, Any]) -> str:
    parts = []
    stack = [plan]
    while stack:
        node = stack.pop()
        what = node["Node Type"]
        if "Index Name" in node:
            what += f" {node['Index Name']}"
            if "$" in node.get("Index Cond", ""):
                what += " (generic)"
        if node.get("Rows Removed by Filter"):
            what += f" filter-removed {node['Rows Removed by Filter']}"
        parts.append(what)
        stack.extend(reversed(node.get("Plans", [])))
    return " > ".join(parts)


def measure(
    dsns: dict[str, str],
    statements: list[Statement],
    mode: str,
    rounds: int,
    per_round: int,
    explains: int,
) -> dict[str, Figures]:
    """Both databases in turns: client latency of the prepared statements, then EXPLAIN."""
    conns = {name: psycopg.connect(dsn, autocommit=True) for name, dsn in dsns.items()}
    try:
        figures = {
            name: Figures(
                {"pending": [], "retry": [], "scan": []}, {"pending": [], "retry": []}, {}, {}
            )
            for name in dsns
        }
        for conn in conns.values():
            conn.execute(pgsql.SQL("SET plan_cache_mode = {}").format(pgsql.Identifier(mode)))
            for st in statements:  # past psycopg's and the plan cache's thresholds
                for _ in range(8):
                    conn.execute(st.sql, st.params, prepare=True).fetchall()
        names = list(dsns)
        for r in range(rounds):
            for name in names if r % 2 == 0 else reversed(names):
                cur = conns[name].cursor()
                f = figures[name]
                for _ in range(per_round):
                    t0 = time.perf_counter()
                    cur.execute(statements[0].sql, statements[0].params, prepare=True)
                    cur.fetchall()
                    t1 = time.perf_counter()
                    cur.execute(statements[1].sql, statements[1].params, prepare=True)
                    cur.fetchall()
                    t2 = time.perf_counter()
                    f.client_us["pending"].append((t1 - t0) * 1e6)
                    f.client_us["retry"].append((t2 - t1) * 1e6)
                    f.client_us["scan"].append((t2 - t0) * 1e6)
        # The server's side: the same statement PREPAREd by name, EXPLAIN ANALYZE EXECUTE.
        for conn in conns.values():
            for i, st in enumerate(statements):
                sql, args = _dollar(st)
                stmt = f"bench_scan_{i}"
                conn.execute(f"PREPARE {stmt} AS {sql}")
                call = pgsql.SQL("EXECUTE {}({})").format(
                    pgsql.Identifier(stmt), pgsql.SQL(", ").join(pgsql.Literal(a) for a in args)
                )
                for _ in range(6):
                    conn.execute(call).fetchall()
        for _ in range(explains):
            for name, conn in conns.items():
                for i, st in enumerate(statements):
                    call = pgsql.SQL(
                        "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE {}({})"
                    ).format(
                        pgsql.Identifier(f"bench_scan_{i}"),
                        pgsql.SQL(", ").join(pgsql.Literal(a) for a in _dollar(st)[1]),
                    )
                    row = conn.execute(call).fetchone()
                    assert row is not None
                    doc = row[0] if isinstance(row[0], list) else json.loads(row[0])
                    plan = doc[0]["Plan"]
                    f = figures[name]
                    f.server_ms[st.label].append(float(doc[0]["Execution Time"]))
                    f.buffers[st.label] = plan.get("Shared Hit Blocks", 0) + plan.get(
                        "Shared Read Blocks", 0
                    )
                    f.plan[st.label] = _summary(plan)
        return figures
    finally:
        for conn in conns.values():
            conn.close()


def report(
    title: str, base: str, other: str, by_mode: dict[str, dict[str, Figures]]
) -> dict[str, float]:
    """One table: per mode and query, base vs other; returns the scan ratio per mode."""
    rows = []
    ratios: dict[str, float] = {}
    for mode, figures in by_mode.items():
        fb, fo = figures[base], figures[other]
        for label in ("pending", "retry", "scan"):
            b, o = c.median(fb.client_us[label]), c.median(fo.client_us[label])
            ratio = o / b
            if label == "scan":
                ratios[mode] = ratio
                rows.append(
                    [
                        mode,
                        "both (one scan)",
                        b,
                        o,
                        f"{ratio:.2f}",
                        "",
                        "",
                        "",
                        f"<= {GOAL} " + c.verdict(ratio <= GOAL),
                    ]
                )
                continue
            sb, so = c.median(fb.server_ms[label]), c.median(fo.server_ms[label])
            rows.append(
                [
                    mode,
                    label,
                    b,
                    o,
                    f"{ratio:.2f}",
                    f"{sb * 1000:.0f} / {so * 1000:.0f}",
                    f"{so / sb:.2f}" if sb else "-",
                    f"{fb.buffers[label]} / {fo.buffers[label]}",
                    "",
                ]
            )
    c.print_table(
        title,
        [
            "plan_cache_mode",
            "query",
            f"{base} us",
            f"{other} us",
            "ratio",
            "server exec us",
            "ratio",
            "buffers",
            "goal",
        ],
        rows,
    )
    c.say("  plans (" + other + "):")
    for mode, figures in by_mode.items():
        for label in ("pending", "retry"):
            c.say(f"    {mode:<18} {label:<7} {figures[other].plan[label]}")
    return ratios


# --- filling -----------------------------------------------------------------------------------


def prepare_db(url: str, history: int, work: bool = True) -> None:
    app = c.make_app(url)  # the real migrations
    with app.app_context():
        db.engine.dispose()  # no connection left behind (CREATE DATABASE ... TEMPLATE needs none)
    dsn = c.conninfo(url)
    with psycopg.connect(dsn) as conn:
        c.fill_history(conn, history)
        if work:
            add_work(conn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("VACUUM (ANALYZE) mail_send_record")


def add_work(conn: psycopg.Connection[Any]) -> None:
    c.add_pending(conn, WORK_PENDING)
    c.add_retry(conn, WORK_RETRY)


def table_stats(dsn: str) -> dict[str, Any]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT (SELECT reltuples::bigint FROM pg_class WHERE relname = 'mail_send_record'), "
            "n_dead_tup, autovacuum_count, autoanalyze_count, "
            "last_autovacuum, pg_relation_size('mail_send_record'), "
            "pg_relation_size('idx_mail_send_status_updated'), "
            "pg_relation_size('idx_mail_send_status_retry') "
            "FROM pg_stat_user_tables WHERE relname = 'mail_send_record'"
        ).fetchone()
    assert row is not None
    keys = (
        "live",
        "dead",
        "autovacuums",
        "autoanalyzes",
        "last_autovacuum",
        "heap",
        "idx_upd",
        "idx_retry",
    )
    return dict(zip(keys, row, strict=True))


def describe(stats: dict[str, Any]) -> str:
    mb = 1024 * 1024
    return (
        f"live {stats['live']:,}, dead {stats['dead']:,}, autovacuums {stats['autovacuums']}, "
        f"autoanalyzes {stats['autoanalyzes']}, heap {stats['heap'] / mb:.0f} MB, "
        f"idx status_updated {stats['idx_upd'] / mb:.1f} MB, status_retry "
        f"{stats['idx_retry'] / mb:.1f} MB"
    )


# --- churn -------------------------------------------------------------------------------------

CHURN_INSERT = (
    "INSERT INTO mail_send_record (tenant_id, scope, status, version, retry_count, "
    f"created_time, updated_time, {c.MAIL_COLUMNS}) "
    "SELECT 1 + g %% 50, 'TENANT', 'Pending', 0, 0, clock_timestamp(), clock_timestamp(), "
    f"{c.MAIL_VALUES} FROM generate_series(1, %s) g"
)


def churn(dsn: str, claims: int, workers: int = 4, retry_share: float = 0.05) -> float:
    """``claims`` claims and completions with acceptance running alongside; returns seconds."""
    lock = threading.Lock()
    state = {"claims": 0, "accepted": 0, "pending_claims": 0}
    done = threading.Event()
    errors: list[BaseException] = []

    def acceptor() -> None:
        try:
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("SET synchronous_commit = off")  # faster churn, same table state
                while not done.is_set():
                    with lock:
                        backlog = state["accepted"] - state["pending_claims"]
                    if backlog < 2_000:
                        conn.execute(CHURN_INSERT, (500,))
                        with lock:
                            state["accepted"] += 500
                    else:
                        time.sleep(0.005)
        except BaseException as exc:  # report, do not hang the others
            errors.append(exc)
            done.set()

    def worker() -> None:
        rng = random.Random()
        try:
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("SET synchronous_commit = off")
                turn = 0
                while not done.is_set():
                    turn += 1
                    first, second = (
                        (c.RAW_CLAIM_RETRY, c.RAW_CLAIM)
                        if turn % 4 == 0
                        else (c.RAW_CLAIM, c.RAW_CLAIM_RETRY)
                    )
                    row = conn.execute(first).fetchone()
                    source = first
                    if row is None:
                        row = conn.execute(second).fetchone()
                        source = second
                    if row is None:
                        time.sleep(0.002)
                        continue
                    record_id, version = row
                    if source is c.RAW_CLAIM and rng.random() < retry_share:
                        conn.execute(c.RAW_RETRY, (0.5, record_id, version))
                    else:
                        conn.execute(c.RAW_COMPLETE, ("<churn@bench.test>", record_id, version))
                    with lock:
                        state["claims"] += 1
                        state["pending_claims"] += source is c.RAW_CLAIM
                        if state["claims"] >= claims:
                            done.set()
        except BaseException as exc:
            errors.append(exc)
            done.set()

    threads = [threading.Thread(target=acceptor, daemon=True)] + [
        threading.Thread(target=worker, daemon=True) for _ in range(workers)
    ]
    began = time.perf_counter()
    for t in threads:
        t.start()
    step = max(claims // 5, 1)
    next_report = step
    while not done.wait(1.0):
        with lock:
            n = state["claims"]
        if n >= next_report:
            elapsed = time.perf_counter() - began
            c.say(
                f"    {n:,} claims in {elapsed:.0f} s ({n / elapsed:,.0f}/s); "
                + describe(table_stats(dsn))
            )
            next_report += step
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    elapsed = time.perf_counter() - began
    # What is left in flight goes to Sent, so the table holds no work of the churn's.
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "UPDATE mail_send_record SET status = 'Sent', version = version + 1, "
            "sent_at = statement_timestamp(), updated_time = statement_timestamp(), "
            "next_retry_at = NULL WHERE status IN ('Pending', 'Retry', 'Sending')"
        )
    return elapsed


def wait_for_autovacuum(dsn: str, after: Any, timeout_s: float) -> float | None:
    """Seconds until autovacuum has visited the table after ``after`` (None: not in time)."""
    began = time.monotonic()
    while time.monotonic() - began < timeout_s:
        stats = table_stats(dsn)
        if stats["last_autovacuum"] is not None and stats["last_autovacuum"] > after:
            return time.monotonic() - began
        time.sleep(2)
    return None


# --- a private cluster, when the shared one has autovacuum off ---------------------------------


class PrivateCluster:
    """initdb + pg_ctl in a temporary folder, as the postgres user; stopped and removed after."""

    def __init__(self, major: str) -> None:
        candidates = sorted(glob.glob(f"/usr/lib/postgresql/{major}/bin")) or sorted(
            glob.glob("/usr/lib/postgresql/*/bin")
        )
        if not candidates:
            raise RuntimeError("no PostgreSQL server binaries under /usr/lib/postgresql")
        self.bin = candidates[-1]
        self.dir = tempfile.mkdtemp(prefix="postroom-bench-pg-")
        self.data = os.path.join(self.dir, "data")
        self.port = c.free_port()
        self.admin_url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _as_postgres(self, *args: str) -> None:
        prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        subprocess.run([*prefix, *args], check=True, stdout=subprocess.DEVNULL)

    def start(self) -> None:
        if os.geteuid() == 0:
            shutil.chown(self.dir, "postgres", "postgres")
        self._as_postgres(
            f"{self.bin}/initdb",
            "-D",
            self.data,
            "-A",
            "trust",
            "-U",
            "postgres",
            "-E",
            "UTF8",
            "--no-sync",
        )
        options = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={self.dir} "
            "-c max_connections=40"
        )
        self._as_postgres(
            f"{self.bin}/pg_ctl",
            "-D",
            self.data,
            "-o",
            options,
            "-l",
            os.path.join(self.dir, "log"),
            "-w",
            "start",
        )

    def setting(self, name: str) -> str:
        with psycopg.connect(c.conninfo(self.admin_url)) as conn:
            row = conn.execute(pgsql.SQL("SHOW {}").format(pgsql.Identifier(name))).fetchone()
        return str(row[0]) if row else "?"

    def stop(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):
            self._as_postgres(f"{self.bin}/pg_ctl", "-D", self.data, "-m", "fast", "-w", "stop")
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def churn_server() -> Iterator[tuple[str, str, bool]]:
    """(admin URL, description, private?) of a server with autovacuum on."""
    with psycopg.connect(c.conninfo(c.ADMIN_URL)) as conn:
        autovacuum = conn.execute("SHOW autovacuum").fetchone()
        version = conn.execute("SHOW server_version_num").fetchone()
    if autovacuum and autovacuum[0] == "on":
        yield c.ADMIN_URL, "the shared server (autovacuum on)", False
        return
    major = str(int(version[0]) // 10000) if version else "15"
    cluster = PrivateCluster(major)
    cluster.start()
    try:
        yield (
            cluster.admin_url,
            (
                f"a private cluster on port {cluster.port} (the shared server has autovacuum off); "
                f"autovacuum {cluster.setting('autovacuum')}, naptime "
                f"{cluster.setting('autovacuum_naptime')}, scale factor "
                f"{cluster.setting('autovacuum_vacuum_scale_factor')} (the table: 0.01 from the "
                f"migration), cost delay {cluster.setting('autovacuum_vacuum_cost_delay')}, "
                f"shared_buffers {cluster.setting('shared_buffers')}"
            ),
            True,
        )
    finally:
        cluster.stop()


def clone(admin_url: str, template: str, name: str) -> str:
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        conn.execute(text(f'CREATE DATABASE "{name}" TEMPLATE "{template}" STRATEGY FILE_COPY'))
    admin.dispose()
    return c.database_url(name, admin_url)


def drop(admin_url: str, name: str) -> None:
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


# --- main --------------------------------------------------------------------------------------


def part_history(small: int, large: int, rounds: int, per_round: int, explains: int) -> bool:
    c.say(f"\nPart 1: {small:,} vs {large:,} history rows (shared server)")
    names = {"small": "postroom_bench_scan_small", "large": "postroom_bench_scan_large"}
    with (
        c.bench_database(names["small"]) as small_url,
        c.bench_database(names["large"]) as large_url,
    ):
        t0 = time.perf_counter()
        prepare_db(small_url, small)
        prepare_db(large_url, large)
        c.say(f"  filled in {time.perf_counter() - t0:.0f} s")
        statements = scan_statements(large_url)
        for st in statements:
            c.say(f"  {st.label}: {' '.join(st.sql.split())}  {st.params}")
        dsns = {
            f"{small // 1000}k": c.conninfo(small_url),
            f"{large // 1000}k": c.conninfo(large_url),
        }
        by_mode = {m: measure(dsns, statements, m, rounds, per_round, explains) for m in MODES}
        base, other = list(dsns)
        ratios = report(
            f"Scan latency, {other} vs {base} history rows (client median us per execution; "
            f"server: median of {explains} EXPLAIN ANALYZE)",
            base,
            other,
            by_mode,
        )
    return all(r <= GOAL for r in ratios.values())


def churn_variant(
    admin_url: str,
    label: str,
    table_settings: dict[str, str],
    server_settings: dict[str, str],
    claims: int,
    fresh_url: str,
    rounds: int,
    per_round: int,
    explains: int,
    autovacuum_wait_s: float,
) -> dict[str, dict[str, float]]:
    name = f"postroom_bench_scan_{label}"
    url = clone(admin_url, "postroom_bench_scan_base", name)
    dsn, fresh_dsn = c.conninfo(url), c.conninfo(fresh_url)
    try:
        if table_settings:
            with psycopg.connect(dsn, autocommit=True) as conn:
                options = ", ".join(f"{k} = {v}" for k, v in table_settings.items())
                conn.execute(f"ALTER TABLE mail_send_record SET ({options})")
            c.say(f"  ALTER TABLE mail_send_record SET ({options})")
        if server_settings:
            with psycopg.connect(c.conninfo(admin_url), autocommit=True) as conn:
                for key, value in server_settings.items():
                    conn.execute(f"ALTER SYSTEM SET {key} = '{value}'")
                    c.say(f"  ALTER SYSTEM SET {key} = '{value}' (private cluster)")
                conn.execute("SELECT pg_reload_conf()")
        statements = scan_statements(url)
        c.say(f"  churning {claims:,} claims on '{label}' ...")
        seconds = churn(dsn, claims)
        with psycopg.connect(dsn) as conn:
            ended = conn.execute("SELECT now()").fetchone()[0]  # type: ignore[index]
        c.say(f"  churn done in {seconds:.0f} s ({claims / seconds:,.0f} claims/s)")
        # The churned table gets the same work set the fresh one holds (no ANALYZE: autovacuum
        # alone keeps its statistics).
        with psycopg.connect(dsn) as conn:
            add_work(conn)
        c.say(f"  fresh:   {describe(table_stats(fresh_dsn))}")
        c.say(f"  churned: {describe(table_stats(dsn))}")
        results: dict[str, dict[str, float]] = {}
        dsns = {"fresh": fresh_dsn, label: dsn}
        by_mode = {m: measure(dsns, statements, m, rounds, per_round, explains) for m in MODES}
        results["right after the churn"] = report(
            f"Scan latency, '{label}' right after {claims:,} claims vs fresh",
            "fresh",
            label,
            by_mode,
        )
        waited = wait_for_autovacuum(dsn, ended, autovacuum_wait_s)
        if waited is None:
            c.say(f"\n  autovacuum did not visit '{label}' within {autovacuum_wait_s:.0f} s")
        else:
            c.say(f"\n  autovacuum visited '{label}' {waited:.0f} s after the measurement")
            c.say(f"  churned: {describe(table_stats(dsn))}")
            by_mode = {m: measure(dsns, statements, m, rounds, per_round, explains) for m in MODES}
            results["after autovacuum's next visit"] = report(
                f"Scan latency, '{label}' after autovacuum's next visit vs fresh",
                "fresh",
                label,
                by_mode,
            )
        return results
    finally:
        drop(admin_url, name)
        if server_settings:
            with psycopg.connect(c.conninfo(admin_url), autocommit=True) as conn:
                for key in server_settings:
                    conn.execute(f"ALTER SYSTEM RESET {key}")
                conn.execute("SELECT pg_reload_conf()")


def part_churn(
    history: int,
    claims: int,
    rounds: int,
    per_round: int,
    explains: int,
    wait_s: float,
    every_variant: bool = False,
) -> dict[str, dict[str, dict[str, float]]]:
    results: dict[str, dict[str, dict[str, float]]] = {}
    with churn_server() as (admin_url, where, private):
        c.say(f"\nPart 2: {claims:,} claims + completions, autovacuum only, on {where}")
        with c.bench_database("postroom_bench_scan_base", admin_url) as base_url:
            t0 = time.perf_counter()
            # The work set is there when the table is analyzed, in every copy alike.
            prepare_db(base_url, history, work=True)
            c.say(f"  filled {history:,} rows in {time.perf_counter() - t0:.0f} s")
            fresh_url = clone(admin_url, "postroom_bench_scan_base", "postroom_bench_scan_fresh")
            args = (claims, fresh_url, rounds, per_round, explains, wait_s)
            variants: list[tuple[str, str, dict[str, str], dict[str, str]]] = [
                ("as migrated", "churned", {}, {}),
                ("per-table settings", "tuned", TUNED, {}),
            ]
            if private:
                variants.append(
                    (
                        "per-table settings + naptime 10 s",
                        "tuned_nap",
                        TUNED,
                        {"autovacuum_naptime": "10s"},
                    )
                )
            try:
                for title, label, table, server in variants:
                    if (
                        results
                        and not every_variant
                        and not any(
                            r > GOAL
                            for v in list(results.values())[-1].values()
                            for r in v.values()
                        )
                    ):
                        break
                    if results:
                        c.say(f"\n  The same churn again with {title}:")
                    results[title] = churn_variant(admin_url, label, table, server, *args)
            finally:
                drop(admin_url, "postroom_bench_scan_fresh")
    return results


def main() -> int:
    args = c.parse_args(
        __doc__,
        lambda p: (
            p.add_argument("--skip-history", action="store_true", help="only part 2"),
            p.add_argument(
                "--every-variant",
                action="store_true",
                help="churn with the tuned settings too, even when the goal is met",
            ),
        ),
    )
    quick = args.quick
    c.print_header("bench/scan.py: scan_due latency vs history size and churn", quick)
    small, large = (10_000, 100_000) if quick else (10_000, 1_000_000)
    claims = 5_000 if quick else 200_000
    rounds, per_round, explains = (4, 50, 5) if quick else (10, 200, 25)
    wait_s = 0 if quick else 150
    history_ok = None
    if not args.skip_history:
        history_ok = part_history(small, large, rounds, per_round, explains)
    churn_results = part_churn(
        large, claims, rounds, per_round, explains, wait_s, args.every_variant
    )
    rows = []
    if history_ok is not None:
        rows.append(
            [
                f"{large // 1000}k vs {small // 1000}k history",
                "all three modes",
                "",
                c.verdict(history_ok),
            ]
        )
    for variant, moments in churn_results.items():
        for moment, ratios in moments.items():
            worst = max(ratios.values())
            rows.append(
                [
                    f"after {claims // 1000}k claims ({variant}), {moment}",
                    ", ".join(f"{m} {r:.2f}" for m, r in ratios.items()),
                    f"{worst:.2f}",
                    c.verdict(worst <= GOAL),
                ]
            )
    c.print_table(
        f"Summary (goal: every ratio <= {GOAL})",
        ["comparison", "scan ratio by mode", "worst", ""],
        rows,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
