"""Claim throughput: records/s claimed and completed with a no-op sender, 1 and 8 threads, on
PostgreSQL with 1,000,000 history rows (mostly Sent) and a backlog of Pending records to drain.

ours       what a busy pool worker runs for a record, minus the send, inside direct.holding
           (one connection while there is work): messaging.sending.sent_write.record_sent with a
           Claimed(...) inside claim.claiming_next, which writes the record Sent, its attempt's
           row and claims the next one (fair order; detached MailSendRecord
           objects) in one statement;
           claim.claim_due (k=1) only when that found nothing. The engine is the product's
           (create_app, engine_options), logging as worker.py sets it (JSON lines at INFO,
           into /dev/null here).
raw1       the baseline: bare psycopg, one statement per record on our own table:
           the Sent write and the next claim (oldest Pending first) as data-modifying CTEs.
raw1-fair  raw1 with the product's fair pick SQL (claim.fair_pick_sql): what the fair order
           (streams, tenants in turn, Retry merged) costs in SQL alone.
raw1-oldest raw1 with the pick before fair claiming: the oldest due record, Pending or Retry, of
           any tenant or stream (two index probes merged by due time). raw1-fair/raw1-oldest
           is what fairness costs (its budget: 5 %).
raw        the two-statement bare loop of the earlier figures: claim, then the versioned
           completion (bench/_common.py RAW_*); 2 commits per record, so it flatters us.

The machine is shared, so the contenders take turns in short time slices (ABBA order, again
and again) on the same backlog; each side's rate = its records / its own time. The backlog is
refilled and the table VACUUM ANALYZEd between rounds when it runs low (the shared server runs
with autovacuum off), never inside a slice.
Goal: ours >= 0.8 of raw1 at 8 threads. When missed (or with --profile) a
breakdown follows: round trips per record, a cProfile of ours, SQLAlchemy Core running the
raw statements, and the variants (ours-separate: claim_due then record_sent).
"""

from __future__ import annotations

import cProfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import _common as c
import budget
import psycopg
from sqlalchemy import Engine, event, text

from portal.extensions import db
from portal.messaging.sending import claim
from portal.messaging.sending.claim import claim_due, claiming_next
from portal.messaging.sending.outcomes import Attempt, Claimed
from portal.messaging.sending.sent_write import record_sent
from portal.models import Channel, MailSendRecord
from portal.models.direct import holding

DB_NAME = "postroom_bench_claim"
GOAL = 0.8  # ours >= 0.8 x the one-statement bare loop on our own table
CONTENDERS = ("raw1", "ours", "raw1-fair", "raw1-oldest", "raw")
ORDER = CONTENDERS + tuple(reversed(CONTENDERS))  # ABBA: each sees the same drift


@dataclass
class Run:
    done: int = 0
    empty_claims: int = 0
    lost_writes: int = 0
    finished: int = 0  # done when every worker has stopped (the deadline's count is ``done``)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, ok: bool) -> None:
        with self.lock:
            self.done += 1
            self.lost_writes += 0 if ok else 1

    def empty(self) -> None:
        with self.lock:
            self.empty_claims += 1


Body = Callable[[Run, threading.Event], None]


def drive(threads: int, seconds: float, body: Body) -> tuple[float, Run]:
    """``threads`` workers run ``body`` for ``seconds``: (seconds, counts at the deadline).

    A worker finishes the record in hand after the deadline; that one is not counted.
    """
    run = Run()
    stop = threading.Event()
    start = threading.Barrier(threads + 1)

    def worker() -> None:
        start.wait()
        body(run, stop)

    pool = [threading.Thread(target=worker, daemon=True) for _ in range(threads)]
    for t in pool:
        t.start()
    start.wait()
    began = time.perf_counter()
    time.sleep(seconds)
    with run.lock:
        counted = Run(done=run.done, empty_claims=run.empty_claims, lost_writes=run.lost_writes)
    elapsed = time.perf_counter() - began
    stop.set()
    for t in pool:
        t.join()
    counted.finished = run.done
    return elapsed, counted


# --- the contenders ----------------------------------------------------------------------------


def ours_body(engine: Engine, separate: bool = False) -> Body:
    """As portal.delivery.pool runs a busy worker: the next claim rides on the Sent write
    (``separate``: claim_due and record_sent, two statements, as before that)."""

    def body(run: Run, stop: threading.Event) -> None:
        with holding(engine):  # as a pool worker does while it has work
            work(run, stop)

    def work(run: Run, stop: threading.Event) -> None:
        record: MailSendRecord | None = None
        while not stop.is_set():
            if record is None:
                records = claim_due(engine, MailSendRecord, 1)
                if not records:
                    run.empty()
                    continue
                record = records[0]  # type: ignore[assignment]
            assert record is not None
            claimed = Claimed(
                channel=Channel.MAIL,
                id=record.id,
                version=record.version,
                tenant_id=record.tenant_id,
                retry_count=record.retry_count,
            )
            # As the pool writes it: the attempt's row rides on the Sent write.
            attempt = Attempt(datetime.now(UTC), 0.0, None, "bench", "250", "2.0.0 Ok")
            with claiming_next(MailSendRecord, lambda: not separate and not stop.is_set()) as nxt:
                run.count(
                    record_sent(engine, claimed, f"<bench-{record.id}@bench.test>", attempt=attempt)
                )
            record = nxt.records[0] if nxt.records else None  # type: ignore[assignment]

    return body


# The baseline: one statement per record on our own table, bare psycopg: the Sent
# write of the record in hand and the claim of the next (oldest Pending first), as data-
# modifying CTEs; the claim reads the Sent write's result, so it runs after it.
RAW1_SENT = (
    "UPDATE mail_send_record SET status = 'Sent', version = version + 1, "
    "sent_at = statement_timestamp(), updated_time = statement_timestamp(), "
    "next_retry_at = NULL, provider_message_id = %s, error_code = NULL, error_message = NULL "
    "WHERE id = %s AND version = %s RETURNING tenant_id"
)
RAW1_PICK = (
    "SELECT id FROM mail_send_record WHERE status = 'Pending' "
    "AND (SELECT count(*) FROM sent) >= 0 "
    "ORDER BY updated_time LIMIT 1 FOR UPDATE SKIP LOCKED"
)


def raw1_statement(pick: str) -> str:
    return (
        f"WITH sent AS ({RAW1_SENT}), pick AS ({pick}), claimed AS ("
        "UPDATE mail_send_record m SET status = 'Sending', version = m.version + 1, "
        "updated_time = statement_timestamp(), "
        "first_claimed_at = coalesce(m.first_claimed_at, statement_timestamp()) "
        "FROM pick WHERE m.id = pick.id RETURNING m.id, m.version) "
        "SELECT (SELECT count(*) FROM sent), claimed.id, claimed.version "
        "FROM (SELECT 1) one LEFT JOIN claimed ON true"
    )


def raw1_body(dsn: str, pick: str = RAW1_PICK) -> Body:
    """One statement per record: Sent for the one in hand plus the next claim (``pick``:
    oldest first, or the product's fair pick SQL)."""
    # PostgreSQL's own $n placeholders on a RawCursor, as ours runs it: psycopg would parse
    # %s out of a statement over 4 KB (the fair one) at every execution, a client cost that
    # is not the SQL's.
    statement = raw1_statement(pick).replace("%s", "$1", 1).replace("%s", "$2", 1)
    statement = statement.replace("%s", "$3", 1)

    def body(run: Run, stop: threading.Event) -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            cursor = psycopg.RawCursor(conn)
            row: tuple[Any, ...] | None = None
            while not stop.is_set():
                if row is None:
                    row = conn.execute(c.RAW_CLAIM).fetchone()
                    if row is None:
                        run.empty()
                        continue
                record_id, version = row
                got = cursor.execute(
                    statement,
                    (f"<bench-{record_id}@bench.test>", record_id, version),
                    prepare=True,
                ).fetchone()
                assert got is not None
                run.count(got[0] == 1)
                row = None if got[1] is None else (got[1], got[2])

    return body


# The pick before fair claiming (oldest due first, Pending or Retry, no streams or tenants' turn),
# reading the Sent write's result as raw1's does.
RAW1_OLDEST_PICK = (
    "WITH pend AS (SELECT r.id, r.updated_time AS due FROM mail_send_record r "
    "WHERE r.status = 'Pending' AND (SELECT count(*) FROM sent) >= 0 "
    "ORDER BY r.updated_time LIMIT 1 FOR UPDATE SKIP LOCKED), "
    "ret AS (SELECT r.id, r.next_retry_at AS due FROM mail_send_record r "
    "WHERE r.status = 'Retry' AND r.next_retry_at <= now() AND (SELECT count(*) FROM sent) >= 0 "
    "ORDER BY r.next_retry_at LIMIT 1 FOR UPDATE SKIP LOCKED) "
    "SELECT id FROM (SELECT id, due FROM pend UNION ALL SELECT id, due FROM ret) u "
    "ORDER BY due LIMIT 1"
)


def raw1_fair_body(dsn: str) -> Body:
    """``raw1`` with the product's fair pick (tenants in turn, streams, Retry merged):
    what fairness costs in SQL alone."""
    pick = claim.fair_pick_sql("mail_send_record", 1, claim.ALL_STREAMS, after_sent=True)
    return raw1_body(dsn, pick)


def raw_body(dsn: str) -> Body:
    def body(run: Run, stop: threading.Event) -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            while not stop.is_set():
                row = conn.execute(c.RAW_CLAIM).fetchone()
                if row is None:
                    run.empty()
                    continue
                record_id, version = row
                done = conn.execute(
                    c.RAW_COMPLETE, (f"<bench-{record_id}@bench.test>", record_id, version)
                )
                run.count(done.rowcount == 1)

    return body


# Diagnostics: where the gap comes from.


def core_autocommit_body(engine: Engine) -> Body:
    """The raw statements, each its own transaction, through SQLAlchemy Core and the product's
    pool: what SQLAlchemy's execution and result objects cost (ours skips them)."""
    claim_sql = text(c.RAW_CLAIM)
    complete_sql = text(
        c.RAW_COMPLETE.replace("%s", ":pmid", 1).replace("%s", ":id", 1).replace("%s", ":v", 1)
    )

    def body(run: Run, stop: threading.Event) -> None:
        while not stop.is_set():
            with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                row = conn.execute(claim_sql).first()
            if row is None:
                run.empty()
                continue
            params = {"pmid": f"<bench-{row.id}@bench.test>", "id": row.id, "v": row.version}
            with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                result = conn.execute(complete_sql, params)
            run.count(result.rowcount == 1)

    return body


# --- runs --------------------------------------------------------------------------------------


def top_up(dsn: str, low: int, n: int) -> None:
    """Refill the backlog (and VACUUM ANALYZE) when fewer than ``low`` records are Pending."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM mail_send_record WHERE status = 'Pending'"
        ).fetchone()
        if row is not None and row[0] >= low:
            return
    with psycopg.connect(dsn) as conn:
        c.add_pending(conn, n)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("VACUUM (ANALYZE) mail_send_record")


def compare(
    dsn: str,
    threads: int,
    slice_s: float,
    rounds: int,
    bodies: dict[str, Body],
    order: tuple[str, ...],
    backlog: tuple[int, int],
) -> dict[str, dict[str, float]]:
    """Interleave the contenders in time slices; totals per contender."""
    totals = {name: {"n": 0.0, "s": 0.0, "cpu": 0.0, "empty": 0.0, "lost": 0.0} for name in bodies}
    for r in range(rounds):
        top_up(dsn, *backlog)
        line = []
        for name in order:
            cpu = time.process_time()
            elapsed, run = drive(threads, slice_s, bodies[name])
            t = totals[name]
            t["cpu"] += time.process_time() - cpu
            t["n"] += run.done
            t["s"] += elapsed
            t["empty"] += run.empty_claims
            t["lost"] += run.lost_writes
            line.append(f"{name} {run.done / elapsed:,.0f}")
        c.say(f"  round {r + 1}/{rounds} (rec/s): " + ", ".join(line))
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM mail_send_record WHERE status = 'Pending'"
        ).fetchone()
    if row is not None and row[0] == 0:
        c.say("  WARNING: the backlog ran dry in the last slice; its figure is too low")
    return totals


def budgets(
    engine: Engine, dsn: str, seconds: float, backlog: tuple[int, int]
) -> list[budget.Budget]:
    """One more slice of ours, raw1 and raw at 1 and 8 threads under bench/budget.py's meter:
    what a record costs in each process, statements and writes (not in the rates above)."""
    bodies = {"raw1": raw1_body(dsn), "ours": ours_body(engine), "raw (2 stmts)": raw_body(dsn)}
    out = []
    with budget.Meter(dsn) as meter:
        for threads in (1, 8):
            for name, body in bodies.items():
                top_up(dsn, *backlog)
                meter.start()
                _, run = drive(threads, seconds, body)
                meter.mark_end()
                label = f"{name}, {threads} thread{'s' if threads > 1 else ''}"
                out.append(meter.finish(label, run.finished))
    return out


# --- where ours spends its time ----------------------------------------------------------------


def breakdown(engine: Engine, dsn: str, n: int) -> None:
    """One thread, in this thread: round trips per record and a cProfile of ours."""
    top_up(dsn, n + 10, n + 10)
    counts = {"statements": 0, "begin": 0, "commit": 0, "checkout": 0, "ping": 0}
    in_db = [0.0]
    marks: dict[int, float] = {}

    def before(_c: Any, cursor: Any, *_: Any) -> None:
        marks[id(cursor)] = time.perf_counter()

    def after(_c: Any, cursor: Any, *_: Any) -> None:
        in_db[0] += time.perf_counter() - marks.pop(id(cursor))
        counts["statements"] += 1

    def bump(name: str) -> Callable[..., None]:
        def listener(*_: Any) -> None:
            counts[name] += 1

        return listener

    listeners = [
        (engine, "before_cursor_execute", before),
        (engine, "after_cursor_execute", after),
        (engine, "begin", bump("begin")),
        (engine, "commit", bump("commit")),
        (engine.pool, "checkout", bump("checkout")),
    ]
    do_ping = engine.dialect.do_ping

    def counted_ping(dbapi_connection: Any) -> bool:
        counts["ping"] += 1
        return do_ping(dbapi_connection)

    engine.dialect.do_ping = counted_ping  # type: ignore[method-assign]
    for target, name, fn in listeners:
        event.listen(target, name, fn)
    run = Run()
    stop = threading.Event()
    original = run.count

    def count(ok: bool) -> None:
        original(ok)
        if run.done >= n:
            stop.set()

    run.count = count  # type: ignore[method-assign]
    # CPU time of this thread, not wall time: where the client burns its processor.
    profiler = cProfile.Profile(time.thread_time)
    began = time.perf_counter()
    profiler.enable()
    ours_body(engine)(run, stop)
    profiler.disable()
    elapsed = time.perf_counter() - began
    for target, name, fn in listeners:
        event.remove(target, name, fn)
    engine.dialect.do_ping = do_ping  # type: ignore[method-assign]
    per = {k: v / run.done for k, v in counts.items()}
    driver = per["checkout"] - per["statements"]  # checkouts that ran a statement on the driver
    c.say(
        f"\nBreakdown of ours, 1 thread, {run.done:,} records, under cProfile (slower than the "
        f"runs above; the profile counts this thread's CPU time):\n"
        f"  per record: {elapsed / run.done * 1e6:,.0f} us wall, of which "
        f"{in_db[0] / run.done * 1e6:,.0f} us inside cursor.execute (statements only)\n"
        f"  pool checkouts per record: {per['checkout']:.1f}, of which {driver:.1f} ran one "
        f"statement on the driver (record_sent claiming the next) and {per['statements']:.1f} "
        f"statements went through SQLAlchemy (with {per['begin']:.1f} BEGIN, "
        f"{per['commit']:.1f} COMMIT); pings of idle connections: {per['ping']:.2f}; "
        "raw makes 2 round trips (each statement its own transaction)"
    )
    c.say_profile(profiler, "cProfile by own time (top 15)", "tottime", 15)
    c.say_profile(
        profiler,
        "cProfile, cumulative time of selected steps",
        "cumulative",
        r"portal/messaging/(scan|outcomes)\.py|portal/models/direct\.py|orm/session\.py:\d+\((commit|execute|scalars)\)"
        r"|pool/base\.py:\d+\(_checkout\)|psycopg/connection\.py:\d+\(wait\)"
        r"|orm/loading\.py:\d+\(instances\)|cache_key\.py:209\(_generate_cache_key\)"
        r"|logging/__init__\.py:\d+\(info\)|prometheus_client/metrics\.py:\d+\(inc\)",
    )


VARIANTS = ("raw", "core-autocommit", "ours-separate", "ours")


def variants(
    engine: Engine, dsn: str, slice_s: float, rounds: int, backlog: tuple[int, int]
) -> None:
    """Each variant against raw, interleaved: what each part of the gap is worth."""
    bodies = {
        "raw": raw_body(dsn),
        "core-autocommit": core_autocommit_body(engine),
        "ours-separate": ours_body(engine, separate=True),
        "ours": ours_body(engine),
    }
    what = {
        "raw": "bare psycopg, 2 round trips",
        "core-autocommit": "raw SQL via SQLAlchemy Core + product pool",
        "ours-separate": "claim_due, then record_sent",
        "ours": "record_sent claiming the next",
    }
    order = VARIANTS + tuple(reversed(VARIANTS))
    for threads in (1, 8):
        c.say(f"\nVariants, {threads} thread(s), {slice_s:g} s slices:")
        totals = compare(dsn, threads, slice_s, rounds, bodies, order, backlog)
        raw_rate = totals["raw"]["n"] / totals["raw"]["s"]
        rows = [
            [
                name,
                what[name],
                t["n"] / t["s"],
                f"{t['n'] / t['s'] / raw_rate:.2f}",
                t["cpu"] / t["n"] * 1e6,
                int(t["empty"]),
            ]
            for name, t in totals.items()
        ]
        c.print_table(
            f"Variants at {threads} thread(s)",
            ["contender", "what", "rec/s", "of raw", "client CPU us/rec", "empty claims"],
            rows,
        )


def through_pgbouncer(
    url: str, engine: Engine, dsn: str, slice_s: float, rounds: int, backlog: tuple[int, int]
) -> None:
    """Ours straight to PostgreSQL against ours through PgBouncer (transaction
    mode, as DATABASE_POOLER=transaction runs it), raw1 beside, in ABBA turns."""
    from portal import create_app
    from tests.support.pgbouncer import pgbouncer

    with pgbouncer(url) as pooled_url:
        pooled = create_app(c.bench_settings(pooled_url, database_pooler="transaction"))
        with pooled.app_context():
            pooled_engine = db.engine
        c.worker_logging("info")
        order = ("raw1", "ours", "ours-pgbouncer", "ours-pgbouncer", "ours", "raw1")
        rows = []
        for threads in (1, 8):
            c.say(f"\n{threads} thread(s), {slice_s:g} s slices, {rounds} rounds of {order}:")
            bodies = {
                "raw1": raw1_body(dsn),
                "ours": ours_body(engine),
                "ours-pgbouncer": ours_body(pooled_engine),
            }
            totals = compare(dsn, threads, slice_s, rounds, bodies, order, backlog)
            rate = {name: t["n"] / t["s"] for name, t in totals.items()}
            rows.append(
                [
                    threads,
                    rate["ours"],
                    rate["ours-pgbouncer"],
                    rate["raw1"],
                    f"{rate['ours-pgbouncer'] / rate['ours']:.2f}",
                    f"{rate['ours'] / rate['raw1']:.2f}",
                    f"{rate['ours-pgbouncer'] / rate['raw1']:.2f}",
                ]
            )
        c.print_table(
            "Records/s claimed and completed, straight vs through PgBouncer (transaction mode)",
            [
                "threads",
                "ours rec/s",
                "via pgbouncer",
                "raw1 rec/s",
                "pgbouncer/straight",
                "ours/raw1",
                "pgbouncer/raw1",
            ],
            rows,
        )
        pooled_engine.dispose()


def main() -> int:
    args = c.parse_args(
        __doc__,
        lambda p: (
            p.add_argument("--profile", action="store_true", help="break ours down even if met"),
            p.add_argument("--log", default="info", help="worker log level (default: info)"),
            p.add_argument(
                "--no-budget",
                dest="budget",
                action="store_false",
                help="skip the budget per record (one more slice of ours, raw1 and raw under "
                "bench/budget.py's meter)",
            ),
            p.add_argument(
                "--pgbouncer",
                action="store_true",
                help="only ours direct against ours through a local PgBouncer in transaction "
                "mode (DATABASE_POOLER=transaction: no prepared statements), raw1 beside",
            ),
        ),
    )
    quick = args.quick
    history = 100_000 if quick else 1_000_000
    slice_s = 0.5 if quick else 2.0
    rounds = 2 if quick else 6
    backlog = (6_000, 10_000) if quick else (40_000, 60_000)
    c.print_header("bench/claim.py: claim + versioned completion, no-op sender", quick)
    with c.bench_database(DB_NAME) as url:
        app = c.make_app(url)
        with app.app_context():
            engine = db.engine
        c.worker_logging(args.log)
        dsn = c.conninfo(url)
        c.say(f"\nfilling {history:,} history rows ...")
        t0 = time.perf_counter()
        with psycopg.connect(dsn) as conn:
            c.fill_history(conn, history)
        c.say(f"  done in {time.perf_counter() - t0:.1f} s")
        if args.pgbouncer:
            through_pgbouncer(url, engine, dsn, slice_s, rounds, backlog)
            engine.dispose()
            return 0
        rows = []
        missed = False
        for threads in (1, 8):
            c.say(f"\n{threads} thread(s), {slice_s:g} s slices, {rounds} rounds of {ORDER}:")
            bodies = {
                "raw1": raw1_body(dsn),
                "ours": ours_body(engine),
                "raw1-fair": raw1_fair_body(dsn),
                "raw1-oldest": raw1_body(dsn, RAW1_OLDEST_PICK),
                "raw": raw_body(dsn),
            }
            totals = compare(dsn, threads, slice_s, rounds, bodies, ORDER, backlog)
            rate = {name: t["n"] / t["s"] for name, t in totals.items()}
            ratio = rate["ours"] / rate["raw1"]
            missed |= ratio < GOAL
            rows.append(
                [
                    threads,
                    rate["ours"],
                    rate["raw1"],
                    f"{ratio:.2f}",
                    f">= {GOAL}",
                    c.verdict(ratio >= GOAL),
                    f"{rate['raw1-fair'] / rate['raw1']:.2f}",
                    f"{rate['raw1-fair'] / rate['raw1-oldest']:.2f}",
                    f"{rate['ours'] / rate['raw']:.2f}",
                    totals["ours"]["cpu"] / totals["ours"]["n"] * 1e6,
                    totals["raw1"]["cpu"] / totals["raw1"]["n"] * 1e6,
                    int(totals["ours"]["empty"]),
                    int(sum(t["lost"] for t in totals.values())),
                ]
            )
        c.print_table(
            f"Records/s claimed and completed ({history:,} history rows)",
            [
                "threads",
                "ours rec/s",
                "raw1 rec/s",
                "ours/raw1",
                "goal",
                "",
                "raw1-fair/raw1",
                "raw1-fair/raw1-oldest",
                "ours/raw (2 stmts)",
                "client CPU us/rec: ours",
                "raw1",
                "empty claims: ours",
                "lost writes",
            ],
            rows,
        )
        c.say(
            "raw1: the Sent write + next claim (oldest Pending) in one statement, bare psycopg;"
            "\nraw1-fair: the same with the product's fair pick SQL (what fairness costs in SQL);"
            "\nraw1-oldest: the same with the older pick (oldest due, Pending or Retry);"
            "\nraw: the two-statement loop of earlier figures (claim, then Sent)."
            "\nThe slim-table and procrastinate figures come from ../shared/peers (bench/README)."
        )
        if args.budget:
            budget.print_budgets(
                "Budget per record (bench/budget.py: one more slice of each, not in the rates "
                "above)",
                budgets(engine, dsn, 1.0 if quick else 5.0, backlog),
                unit="record",
            )
        if missed or args.profile:
            breakdown(engine, dsn, 300 if quick else 1_500)
            variants(engine, dsn, slice_s, 1 if quick else 3, backlog)
        c.say(f"\nload average at the end: {' '.join(f'{x:.2f}' for x in c.os.getloadavg())}")
        engine.dispose()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
