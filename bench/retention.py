"""Retention must not slow sending: the chore purges N old records (1,000,000; --quick 100,000)
while bench/claim.py's ``ours`` loop (record_sent + the next claim, no-op sender) runs, and the
claim rate during the purge is reported as a ratio of the rate without it (goal >= 0.8).

Phases, on one database:
  before   claim slices, no purge (the reference rate)
  during   slices alternating (ABBA) between the purge running and paused: the purge
           (portal.messaging.records.retention.purge in another thread: batches of 1,000 under SKIP
           LOCKED, one short transaction each, resting as long as each batch took) may start
           a batch only in the "running" slices; the ratio is running / paused
  after    the same slices once the purge is done, before any VACUUM: the dead rows are still
           in the heap and in the indexes the claim walks
  vacuumed the same slices after VACUUM (ANALYZE) of the record table

History rows belong to 50 tenants with a retention of 2 days; the Pending backlog the claim
loop drains belongs to tenant 1 too (Pending is never purged; what the loop sends is recent).
The shared bench server runs with autovacuum off, so the bench reports the dead tuples left
and how long the VACUUM that autovacuum would run takes, instead of waiting for it.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import _common as c  # first: puts the repository root on sys.path
import claim as cl
import psycopg

from portal.extensions import db
from portal.messaging.records import retention

DB_NAME = "postroom_bench_retention"
GOAL = 0.8


def slices(engine: Any, threads: int, slice_s: float, n: int) -> tuple[float, list[float]]:
    rates = []
    for _ in range(n):
        elapsed, run = cl.drive(threads, slice_s, cl.ours_body(engine))
        rates.append(run.done / elapsed)
    return sum(rates) / len(rates), rates


def dead_tuples(dsn: str) -> tuple[int, int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT n_live_tup, n_dead_tup FROM pg_stat_user_tables "
            "WHERE relname = 'mail_send_record'"
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def main() -> int:
    args = c.parse_args(
        __doc__,
        lambda p: (
            p.add_argument("--threads", type=int, default=4, help="claim threads (default 4)"),
            p.add_argument("--log", default="warning", help="worker log level"),
        ),
    )
    quick = args.quick
    history = 100_000 if quick else 1_000_000
    slice_s = 0.5 if quick else 2.0
    reference = 3 if quick else 6
    c.print_header("bench/retention.py: purging old records while claims run", quick)
    with c.bench_database(DB_NAME) as url:
        app = c.make_app(url)
        with app.app_context():
            engine = db.engine
        settings = app.config["SETTINGS"]
        c.worker_logging(args.log)
        dsn = c.conninfo(url)
        c.say(f"\nfilling {history:,} history rows (50 tenants, retention 2 days) ...")
        with psycopg.connect(dsn) as conn:
            c.fill_history(conn, history)
            conn.execute(
                "INSERT INTO tenant (id, slug, name, mail_retention_days) "
                "SELECT g, 'bench-' || g, 'Bench ' || g, 2 FROM generate_series(1, 50) g"
            )
            conn.commit()
            c.add_pending(conn, 200_000 if not quick else 40_000)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("VACUUM (ANALYZE) mail_send_record")
        c.say(f"\nclaim loop: {args.threads} thread(s), {slice_s:g} s slices")
        slices(engine, args.threads, slice_s, 1)  # warm-up: connections, plans, caches
        before, before_rates = slices(engine, args.threads, slice_s, reference)
        c.say("  before: " + ", ".join(f"{r:,.0f}" for r in before_rates) + " rec/s")

        # The purge runs in its own thread, batch after batch, resting between batches as the
        # chore does (retention.duty_cycle); it may start a batch only while ``running`` is
        # set. Slices alternate purge on / purge off (ABBA), so both see the same drift.
        report: list[retention.Report] = []
        purge_s: list[float] = []
        running = threading.Event()
        rest = retention.duty_cycle()

        def between(batch_s: float) -> None:
            rest(batch_s)
            running.wait()

        def purge() -> None:
            running.wait()
            started = time.perf_counter()
            report.append(retention.purge(engine, settings, between=between))
            purge_s.append(time.perf_counter() - started)

        purger = threading.Thread(target=purge, daemon=True)
        purger.start()
        on_rates: list[float] = []
        off_rates: list[float] = []
        order = (True, False, False, True)
        turn = 0
        while purger.is_alive():
            on = order[turn % len(order)]
            turn += 1
            if on:
                running.set()
            else:
                running.clear()
            elapsed, run = cl.drive(args.threads, slice_s, cl.ours_body(engine))
            if purger.is_alive():  # a slice that ended after the purge counts for neither
                (on_rates if on else off_rates).append(run.done / elapsed)
        running.set()
        purger.join()
        during = sum(on_rates) / max(1, len(on_rates))
        beside = sum(off_rates) / max(1, len(off_rates))
        deleted = report[0].deleted.get("mail_records", 0)
        purging_s = purge_s[0] * len(on_rates) / max(1, len(on_rates) + len(off_rates))
        c.say(
            f"  during ({len(on_rates)} slices with the purge, {len(off_rates)} without): "
            f"{during:,.0f} / {beside:,.0f} rec/s; purge of {deleted:,} records in about "
            f"{purging_s:.0f} s of purging ({deleted / max(purging_s, 1e-9):,.0f} records/s)"
        )
        live, dead = dead_tuples(dsn)
        after, after_rates = slices(engine, args.threads, slice_s, reference)
        c.say("  after, not vacuumed: " + ", ".join(f"{r:,.0f}" for r in after_rates) + " rec/s")
        t0 = time.perf_counter()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("VACUUM (ANALYZE) mail_send_record")
        vacuum_s = time.perf_counter() - t0
        vacuumed, vacuumed_rates = slices(engine, args.threads, slice_s, reference)
        c.say("  after VACUUM: " + ", ".join(f"{r:,.0f}" for r in vacuumed_rates) + " rec/s")
        engine.dispose()
    ratio = during / beside
    c.print_table(
        f"Claim rate while the retention chore purges {history:,} records",
        ["phase", "rec/s", "ratio to purge paused", "goal", ""],
        [
            ["before", before, f"{before / beside:.2f}", "", ""],
            ["purge paused (ABBA)", beside, "1.00", "", ""],
            [
                "purge running (ABBA)",
                during,
                f"{ratio:.2f}",
                f">= {GOAL}",
                c.verdict(ratio >= GOAL),
            ],
            ["after, dead rows left", after, f"{after / beside:.2f}", "", ""],
            ["after VACUUM", vacuumed, f"{vacuumed / beside:.2f}", "", ""],
        ],
    )
    c.say(
        f"purge: {deleted:,} records; then {live:,} live and {dead:,} dead "
        f"tuples in mail_send_record; VACUUM (ANALYZE) took {vacuum_s:.1f} s. The scan tables "
        "vacuum after 5,000 dead tuples whatever their size (migration 0004's storage "
        "parameters), so with autovacuum on a purge of this size is vacuumed in the runs that "
        "follow its batches, not at the end."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
