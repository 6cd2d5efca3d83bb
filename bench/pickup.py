"""Pick-up latency: from the commit that makes a record due to the claim that takes it, p50 and
p99, with NOTIFY and with polling only.

One record is accepted at a time (portal.messaging.records.acceptance.send_mail + commit, as the API
does: NOTIFY at commit), the clock read as the commit returns; the record's first_claimed_at
(written by the claim, database clock, same host clock) minus that is the latency. The next
record is accepted once the previous one is Sent and a random pause has passed (up to 50 ms
with NOTIFY, up to 500 ms when polling, so arrivals fall anywhere in the poll cycle).

ours  portal.delivery.service.DeliveryService, 4 mail workers (the product's defaults), the
      SMTP sink of scripts/smtp_sink.py in its own process:
        notify   LISTEN/NOTIFY on, POLL_INTERVAL_S = 30 (so only a NOTIFY can be the wake-up)
        polling  the listener off, POLL_INTERVAL_S = 0.5
raw   a bare psycopg loop running the single-statement SKIP LOCKED claim (and completion):
        notify   woken by its own LISTEN connection
        polling  every 0.5 s
Blocks alternate (ours, raw, ours, raw) per mode, so a neighbour's load hits both.
Goal: p99 <= 50 ms with NOTIFY, <= 550 ms polling.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import _common as c  # first: puts the repository root on sys.path
import psycopg
from sqlalchemy.orm import Session

from portal import create_app
from portal.delivery.service import DeliveryService
from portal.extensions import db
from portal.messaging.records import acceptance
from portal.messaging.records.acceptance import NOTIFY_CHANNEL
from portal.tenancy import tenant_context

DB_NAME = "postroom_bench_pickup"
GOALS = {"notify": 50.0, "polling": 550.0}
PAUSE = {"notify": 0.05, "polling": 0.5}
POLL = {"notify": 30.0, "polling": 0.5}


class RawConsumer:
    """The raw limit: claim on NOTIFY (own LISTEN connection) or every 0.5 s."""

    def __init__(self, dsn: str, mode: str):
        self.dsn = dsn
        self.mode = mode
        self.stop = threading.Event()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self.thread.start()
        self.ready.wait(10)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)

    def _drain(self, conn: psycopg.Connection[Any]) -> None:
        while True:
            row = conn.execute(c.RAW_CLAIM).fetchone()
            if row is None:
                return
            conn.execute(c.RAW_COMPLETE, ("<raw@bench.test>", row[0], row[1]))

    def _run(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as work:
            if self.mode == "polling":
                self.ready.set()
                while not self.stop.wait(0.5):
                    self._drain(work)
                return
            with psycopg.connect(self.dsn, autocommit=True) as listen:
                listen.execute(f"LISTEN {NOTIFY_CHANNEL['mail']}")
                self.ready.set()
                while not self.stop.is_set():
                    for _note in listen.notifies(timeout=0.5, stop_after=1):
                        self._drain(work)


def samples(app: Any, dsn: str, tenant_id: int, mode: str, n: int) -> list[tuple[float, float]]:
    """Accept ``n`` records one at a time: (ms from commit, ms from created_time) to claim."""
    settings = app.config["SETTINGS"]
    out: list[tuple[float, float]] = []
    rng = random.Random()
    with app.app_context(), psycopg.connect(dsn, autocommit=True) as probe:
        engine = db.engine
        for _ in range(n):
            with Session(engine) as session, tenant_context(tenant_id):
                accepted = acceptance.send_mail(
                    session,
                    {"to": ["ann@example.com"], "subject": "Hi", "text": "Hi"},
                    settings=settings,
                )
                session.commit()
                committed = time.time()
            deadline = time.monotonic() + 10
            row: Any = None
            while time.monotonic() < deadline:
                row = probe.execute(
                    "SELECT status, extract(epoch FROM first_claimed_at), "
                    "extract(epoch FROM first_claimed_at - created_time) "
                    "FROM mail_send_record WHERE id = %s",
                    (accepted.id,),
                ).fetchone()
                if row is not None and row[0] == "Sent":
                    break
                time.sleep(0.005)
            if row is None or row[1] is None:
                out.append((float("inf"), float("inf")))
            else:
                out.append(((float(row[1]) - committed) * 1000, float(row[2]) * 1000))
            time.sleep(rng.uniform(0, PAUSE[mode]))
    return out


def block(
    app: Any, dsn: str, tenant_id: int, mode: str, who: str, n: int
) -> list[tuple[float, float]]:
    if who == "raw":
        consumer = RawConsumer(dsn, mode)
        consumer.start()
        try:
            return samples(app, dsn, tenant_id, mode, n)
        finally:
            consumer.close()
    settings = app.config["SETTINGS"].replace(
        mail_send_concurrency=4, sms_send_concurrency=0, poll_interval_s=POLL[mode]
    )
    with app.app_context():
        engine = db.engine
    if who == "pgbouncer":
        # The worker's statements through PgBouncer in transaction mode (no
        # prepared statements), its one LISTEN connection straight to the server.
        pooled = create_app(
            settings.replace(
                database_url=POOLED[0],
                database_pooler="transaction",
                database_direct_url=settings.database_url,
            )
        )
        settings = pooled.config["SETTINGS"]
        with pooled.app_context():
            engine = db.engine
    service = DeliveryService(engine, settings)
    if mode == "polling":
        service.listener = None  # polling only
    service.start()
    time.sleep(1.0)  # the listener connects (and wakes everyone once)
    try:
        return samples(app, dsn, tenant_id, mode, n)
    finally:
        service.stop()
        service.wait(10)


POOLED: list[str] = []  # the PgBouncer URL, with --pgbouncer


def main() -> int:
    args = c.parse_args(
        __doc__,
        lambda p: (
            p.add_argument("--log", default="info", help="worker log level"),
            p.add_argument(
                "--pgbouncer",
                action="store_true",
                help="NOTIFY only: ours straight against ours through a local PgBouncer "
                "(transaction mode; LISTEN on DATABASE_DIRECT_URL), raw beside",
            ),
        ),
    )
    if args.pgbouncer:
        from tests.support.pgbouncer import pgbouncer

        with c.bench_database(DB_NAME) as url, pgbouncer(url) as pooled_url:
            POOLED.append(pooled_url)
            return run(args, url, ("ours", "pgbouncer", "raw", "raw", "pgbouncer", "ours"))
    with c.bench_database(DB_NAME) as url:
        return run(args, url, ("ours", "raw", "ours", "raw"))


def run(args: Any, url: str, order: tuple[str, ...]) -> int:
    quick = args.quick
    counts = {"notify": 30, "polling": 16} if quick else {"notify": 200, "polling": 120}
    c.print_header("bench/pickup.py: due-to-claimed latency", quick)
    rows = []
    modes = ("notify",) if POOLED else ("notify", "polling")
    app = c.make_app(url)
    c.worker_logging(args.log)
    dsn = c.conninfo(url)
    sink = c.Sink("subprocess").start()
    try:
        tenant_id = c.tenant_with_mail_server(app, sink.host, sink.port)
        for mode in modes:
            got: dict[str, list[tuple[float, float]]] = {who: [] for who in order}
            half = counts[mode] // 2
            for who in order:
                began = time.perf_counter()
                got[who] += block(app, dsn, tenant_id, mode, who, half)
                took = time.perf_counter() - began
                c.say(f"  {mode:<8} {who:<4} {half} samples in {took:.0f} s")
            for who in dict.fromkeys(order):
                commit_ms = [a for a, _ in got[who]]
                created_ms = [b for _, b in got[who]]
                p99 = c.percentile(commit_ms, 99)
                rows.append(
                    [
                        mode,
                        who,
                        len(commit_ms),
                        c.percentile(commit_ms, 50),
                        c.percentile(commit_ms, 90),
                        p99,
                        max(commit_ms),
                        c.percentile(created_ms, 50),
                        c.percentile(created_ms, 99),
                        f"<= {GOALS[mode]:.0f}",
                        c.verdict(p99 <= GOALS[mode]) if who != "raw" else "",
                    ]
                )
    finally:
        sink.stop()
        with app.app_context():
            db.engine.dispose()
    c.print_table(
        "Due-to-claimed latency, ms (from commit returned; and from created_time, the INSERT's "
        "statement time)",
        [
            "mode",
            "who",
            "n",
            "p50",
            "p90",
            "p99",
            "max",
            "p50 (created)",
            "p99 (created)",
            "goal p99",
            "",
        ],
        rows,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
