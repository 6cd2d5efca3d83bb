"""What the status-callback triggers (migration 0015) cost on the delivery hot path.

Three states of the same database, taken in turns (ABC CBA ...) within one run:

none   the callback triggers disabled (ALTER TABLE ... DISABLE TRIGGER): no status
       callbacks;
0 ep   the triggers on, no endpoint anywhere: every Sent write evaluates the trigger's WHEN
       and calls the function, which finds no endpoint (one index probe);
1 ep   the triggers on, one enabled endpoint of the records' tenant subscribed to every event:
       every Sent write also inserts a callback_delivery row (the callback pool is off, so
       nothing is posted).

claim  bench/claim.py's ``ours`` body (record_sent + the next claim in one statement, no-op
       sender) on PostgreSQL with history rows, 1 and 8 threads, in time slices.
sql    the trigger alone: a plpgsql loop of single-row status writes (each an event) inside
       the server, no client: microseconds per write in each state.
smtp   bench/smtp.py's ``ours`` (DeliveryService over a local SMTP sink in its own process),
       1 and 4 threads, whole runs of N mails.

Figures are ratios against ``none`` in the same run (the machine is shared).
"""

from __future__ import annotations

import time
from typing import Any

import _common as c  # first: puts the repository root on sys.path
import claim as cl
import psycopg
import smtp as sm

from portal.extensions import db
from portal.messaging.after_send import callbacks
from portal.models import CallbackEndpoint

DB_NAME = "postroom_bench_callbacks"
STATES = ("none", "0 ep", "1 ep")
ORDER = STATES + tuple(reversed(STATES))
TRIGGERS = ("callback_change", "callback_insert")


def tenant_one(dsn: str) -> None:
    """History and backlog rows of bench/_common belong to tenant 1: make sure it exists."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO tenant (id, slug, name) VALUES (1, 'bench-1', 'Bench 1') "
            "ON CONFLICT DO NOTHING"
        )


def set_state(app: Any, dsn: str, state: str, tenant_ids: list[int]) -> None:
    verb = "DISABLE" if state == "none" else "ENABLE"
    with psycopg.connect(dsn, autocommit=True) as conn:
        for table in ("mail_send_record", "sms_send_record"):
            for suffix in TRIGGERS:
                conn.execute(f"ALTER TABLE {table} {verb} TRIGGER {table}_{suffix}")
        conn.execute("DELETE FROM callback_delivery")
        conn.execute("DELETE FROM callback_endpoint")
    if state == "1 ep":
        with app.app_context():
            for tenant_id in tenant_ids:
                row = CallbackEndpoint(
                    tenant_id=tenant_id, name="bench", url="https://hooks.example/bench"
                )
                row.event_list = list(callbacks.EVENT_TYPES)
                row.secret = callbacks.new_secret()
                db.session.add(row)
            db.session.commit()


def bench_claim(app: Any, dsn: str, quick: bool) -> list[list[Any]]:
    history = 100_000 if quick else 1_000_000
    slice_s = 0.5 if quick else 2.0
    rounds = 2 if quick else 4
    backlog = (6_000, 10_000) if quick else (40_000, 60_000)
    with app.app_context():
        engine = db.engine
    tenant_one(dsn)
    c.say(f"\nclaim: filling {history:,} history rows ...")
    with psycopg.connect(dsn) as conn:
        c.fill_history(conn, history)
    rows = []
    for threads in (1, 8):
        totals = {s: [0.0, 0.0] for s in STATES}
        for r in range(rounds):
            cl.top_up(dsn, *backlog)
            line = []
            for state in ORDER:
                set_state(app, dsn, state, [1])
                elapsed, run = cl.drive(threads, slice_s, cl.ours_body(engine))
                totals[state][0] += run.done
                totals[state][1] += elapsed
                line.append(f"{state} {run.done / elapsed:,.0f}")
            c.say(f"  claim {threads} thread(s) round {r + 1}/{rounds} (rec/s): " + ", ".join(line))
        rate = {s: n / t for s, (n, t) in totals.items()}
        rows.append(
            [
                "claim",
                threads,
                rate["none"],
                rate["0 ep"],
                rate["1 ep"],
                f"{rate['0 ep'] / rate['none']:.3f}",
                f"{rate['1 ep'] / rate['none']:.3f}",
            ]
        )
    return rows


def bench_smtp(app: Any, dsn: str, quick: bool) -> list[list[Any]]:
    n = 300 if quick else 600
    rounds = 1 if quick else 2
    sink = c.Sink("subprocess").start()
    rows = []
    try:
        tenant_id = c.tenant_with_mail_server(app, sink.host, sink.port, slug="cb-smtp")
        for threads in (1, 4):
            totals = {s: [0.0, 0.0] for s in STATES}
            for r in range(rounds):
                line = []
                for state in ORDER:
                    set_state(app, dsn, state, [tenant_id])
                    sink.clear()
                    with sink.quiet():
                        result = sm.run_ours(app, dsn, tenant_id, threads, n)
                    totals[state][0] += result["n"]
                    totals[state][1] += result["s"]
                    line.append(f"{state} {result['n'] / result['s']:,.0f}")
                c.say(
                    f"  smtp {threads} thread(s) round {r + 1}/{rounds} (mail/s): "
                    + ", ".join(line)
                )
            rate = {s: n_ / t for s, (n_, t) in totals.items()}
            rows.append(
                [
                    "smtp",
                    threads,
                    rate["none"],
                    rate["0 ep"],
                    rate["1 ep"],
                    f"{rate['0 ep'] / rate['none']:.3f}",
                    f"{rate['1 ep'] / rate['none']:.3f}",
                ]
            )
    finally:
        sink.stop()
    return rows


SQL_LOOP = """
DO $$
DECLARE t0 timestamptz := clock_timestamp();
BEGIN
  FOR i IN 1..{n} LOOP
    UPDATE mail_send_record
       SET status = CASE WHEN status = 'Sent' THEN 'Failed' ELSE 'Sent' END,
           version = version + 1, updated_time = statement_timestamp()
     WHERE id = {lo} + (i % {rows});
  END LOOP;
  RAISE NOTICE '%', extract(epoch FROM clock_timestamp() - t0);
END $$
"""


def bench_sql(app: Any, dsn: str, quick: bool) -> list[list[Any]]:
    """The trigger alone, inside the server: N status writes (Sent <-> Failed, each an event)
    in one plpgsql loop, no client round trips; microseconds per write in each state."""
    rows_n = 10_000
    tenant_one(dsn)
    n = 20_000 if quick else 100_000
    rounds = 2 if quick else 4
    with psycopg.connect(dsn) as conn:
        lo, _hi = c.add_pending(conn, rows_n)
    totals = {s: 0.0 for s in STATES}
    for r in range(rounds):
        line = []
        for state in ORDER:
            set_state(app, dsn, state, [1])
            notes: list[str] = []
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.add_notice_handler(lambda d, kept=notes: kept.append(d.message_primary or ""))
                conn.execute(SQL_LOOP.format(n=n, lo=lo, rows=rows_n))
            seconds = float(notes[-1])
            totals[state] += seconds
            line.append(f"{state} {seconds / n * 1e6:.1f} us")
        c.say(f"  sql round {r + 1}/{rounds} (per status write): " + ", ".join(line))
    per = {s: totals[s] / (2 * rounds * n) * 1e6 for s in STATES}
    return [
        [
            "sql (us/write)",
            "-",
            per["none"],
            per["0 ep"],
            per["1 ep"],
            f"+{per['0 ep'] - per['none']:.1f} us",
            f"+{per['1 ep'] - per['none']:.1f} us",
        ]
    ]


def main() -> int:
    args = c.parse_args(
        __doc__,
        lambda p: (
            p.add_argument("--log", default="info", help="worker log level (default: info)"),
            p.add_argument("--only", choices=("claim", "smtp", "sql"), default=None),
        ),
    )
    c.print_header("bench/callbacks.py: the callback triggers on the hot path", args.quick)
    rows: list[list[Any]] = []
    with c.bench_database(DB_NAME) as url:
        # The callback pool stays off: deliveries pile up, nothing is posted.
        app = c.make_app(url, callback_concurrency=0)
        c.worker_logging(args.log)
        dsn = c.conninfo(url)
        started = time.perf_counter()
        if args.only in (None, "sql"):
            rows += bench_sql(app, dsn, args.quick)
        if args.only in (None, "smtp"):
            rows += bench_smtp(app, dsn, args.quick)
        if args.only in (None, "claim"):
            rows += bench_claim(app, dsn, args.quick)
        with app.app_context():
            db.engine.dispose()
    c.print_table(
        "Rate with the callback triggers off (none), on with 0 endpoints, on with 1 endpoint",
        ["bench", "threads", "none /s", "0 ep /s", "1 ep /s", "0 ep / none", "1 ep / none"],
        rows,
    )
    c.say(f"took {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
