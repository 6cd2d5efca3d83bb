"""Fair claiming: one tenant's backlog, or a broadcast backlog, must not hold
back other mail. End to end through DeliveryService (4 mail workers, NOTIFY on, the product's
engine) to scripts/smtp_sink.py's sink in its own process, on PostgreSQL.

1. B alone: tenant B accepts a mail every 0.2 s (5/s, one acceptance each, committed); its
   accepted-to-sent latency (sent_at - created_time, the database clock) p50 / p99.
2. A alone: tenant A has N due records (Pending, inserted by SQL); A's drain rate (records
   Sent per second) over a fixed window once the service runs.
3. Both: A's N due records and B at 5/s at once, the same window: B's p99 (goal <= 1 s and
   <= 2x its p99 alone) and A's rate (goal >= 0.9 x its rate alone).
4. Streams: N broadcast records due (tenant A), then one transactional mail accepted (tenant
   B): its accepted-to-sent time (goal <= 1 s).

N is 100,000 (--quick: 5,000); runs 1 and 3 are interleaved twice (A alone, both, both, A
alone) so the machine's neighbours weigh on both sides alike. The load average is printed
with the figures.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import _common as c
import psycopg

from portal.delivery.service import DeliveryService
from portal.extensions import db
from portal.messaging.records import acceptance
from portal.tenancy import tenant_context

DB_NAME = "postroom_bench_fairness"
WORKERS = 4
RATE_S = 0.2  # B: one mail every 0.2 s


def insert_due(dsn: str, tenant_id: int, n: int, stream: str) -> None:
    """``n`` Pending records of one tenant and stream, due a minute ago and older."""
    with psycopg.connect(dsn) as conn:
        conn.execute(
            "INSERT INTO mail_send_record (tenant_id, scope, status, version, retry_count, "
            f"stream, created_time, updated_time, {c.MAIL_COLUMNS}) "
            "SELECT %s, 'TENANT', 'Pending', 0, 0, %s, "
            "now() - interval '1 minute' - make_interval(secs => (%s - g) / 1000.0), "
            "now() - interval '1 minute' - make_interval(secs => (%s - g) / 1000.0), "
            f"{c.MAIL_VALUES} FROM generate_series(1, %s) g",
            (tenant_id, stream, n, n, n),
        )
        conn.commit()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE mail_send_record")


def reset(dsn: str, sink: c.Sink) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM mail_send_recipient")
        conn.execute("DELETE FROM mail_send_record")
        conn.execute("VACUUM ANALYZE mail_send_record")
    sink.clear()


def accept_one(app: Any, tenant_id: int, stream: str = "transactional") -> int:
    with app.app_context(), tenant_context(tenant_id):
        accepted = acceptance.send_mail_committed(
            db.session,
            {"to": ["bob@example.com"], "subject": "Hi", "text": "Hello", "stream": stream},
            settings=app.config["SETTINGS"],
        )
        db.session.remove()
    return int(accepted.id)


def latencies(dsn: str, ids: list[int], timeout_s: float = 30.0) -> list[float]:
    """Accepted-to-sent seconds of ``ids`` (waits until all are Sent, up to ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    with psycopg.connect(dsn, autocommit=True) as conn:
        while True:
            rows = conn.execute(
                "SELECT extract(epoch FROM sent_at - created_time) FROM mail_send_record "
                "WHERE id = ANY(%s) AND status = 'Sent'",
                (ids,),
            ).fetchall()
            if len(rows) == len(ids) or time.monotonic() > deadline:
                return [float(r[0]) for r in rows] + [float("inf")] * (len(ids) - len(rows))
            time.sleep(0.05)


def sent_of(dsn: str, tenant_id: int) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM mail_send_record WHERE tenant_id = %s AND status = 'Sent'",
            (tenant_id,),
        ).fetchone()
    assert row is not None
    return int(row[0])


def run(
    app: Any, dsn: str, a: int | None, b: int | None, window_s: float
) -> tuple[float, list[float]]:
    """The service for ``window_s`` seconds: A's drain rate (if A has due work), B's
    latencies (if B sends)."""
    with app.app_context():
        engine = db.engine
    settings = app.config["SETTINGS"].replace(mail_send_concurrency=WORKERS, sms_send_concurrency=0)
    service = DeliveryService(engine, settings)
    b_ids: list[int] = []
    stop = threading.Event()

    def sender() -> None:
        assert b is not None
        next_at = time.monotonic()
        while not stop.is_set():
            b_ids.append(accept_one(app, b))
            next_at += RATE_S
            stop.wait(max(0.0, next_at - time.monotonic()))

    service.start()
    time.sleep(0.3)  # the listener connects; the backlog's first claims are made
    a_before = sent_of(dsn, a) if a is not None else 0
    began = time.perf_counter()
    thread = threading.Thread(target=sender) if b is not None else None
    if thread is not None:
        thread.start()
    time.sleep(window_s)
    a_rate = ((sent_of(dsn, a) - a_before) / (time.perf_counter() - began)) if a else 0.0
    stop.set()
    if thread is not None:
        thread.join()
    b_lat = latencies(dsn, b_ids) if b_ids else []
    service.stop()
    service.wait(10)
    return a_rate, b_lat


def one_behind_broadcast(app: Any, dsn: str, a: int, b: int, n: int) -> float:
    insert_due(dsn, a, n, "broadcast")
    with app.app_context():
        engine = db.engine
    settings = app.config["SETTINGS"].replace(mail_send_concurrency=WORKERS, sms_send_concurrency=0)
    service = DeliveryService(engine, settings)
    service.start()
    time.sleep(1.0)  # broadcast is flowing
    rid = accept_one(app, b, "transactional")
    (took,) = latencies(dsn, [rid])
    service.stop()
    service.wait(10)
    return took


def main() -> int:
    args = c.parse_args(__doc__)
    quick = args.quick
    n = 5_000 if quick else 100_000
    window_s = 3.0 if quick else 10.0
    c.print_header("bench/fairness.py: one tenant's backlog and other tenants' mail", quick)
    with c.bench_database(DB_NAME) as url:
        app = c.make_app(url)
        c.worker_logging("warning")
        dsn = c.conninfo(url)
        sink = c.Sink("subprocess").start()
        try:
            a = c.tenant_with_mail_server(app, sink.host, sink.port, slug="tenant-a")
            b = c.tenant_with_mail_server(app, sink.host, sink.port, slug="tenant-b")
            c.say(f"\nB alone, 5 mails/s for {window_s:g} s ...")
            _, b_alone = run(app, dsn, None, b, window_s)
            reset(dsn, sink)
            alone_rates: list[float] = []
            both_rates: list[float] = []
            b_both: list[float] = []
            for which in ("alone", "both", "both", "alone"):
                c.say(f"A with {n:,} due records, {which} ...")
                insert_due(dsn, a, n, "transactional")
                rate, lat = run(app, dsn, a, b if which == "both" else None, window_s)
                (both_rates if which == "both" else alone_rates).append(rate)
                b_both += lat
                reset(dsn, sink)
            c.say(f"{n:,} broadcast due, then one transactional mail ...")
            behind = one_behind_broadcast(app, dsn, a, b, n)
            reset(dsn, sink)
        finally:
            sink.stop()
        load = " ".join(f"{x:.2f}" for x in c.os.getloadavg())
        p99_alone = c.percentile(b_alone, 99)
        p99_both = c.percentile(b_both, 99)
        a_alone = c.median(alone_rates)
        a_both = c.median(both_rates)
        rows = [
            [
                "B accepted-to-sent p50 / p99, alone",
                f"{c.percentile(b_alone, 50) * 1000:.0f} / {p99_alone * 1000:.0f} ms",
                "",
                "",
            ],
            [
                f"B p50 / p99 with A's {n:,} due",
                f"{c.percentile(b_both, 50) * 1000:.0f} / {p99_both * 1000:.0f} ms",
                f"p99 <= 1 s and <= 2x alone ({p99_both / p99_alone:.2f}x)" if p99_alone else "",
                c.verdict(p99_both <= 1.0 and p99_both <= 2 * p99_alone),
            ],
            [
                "A drain rate: alone / with B",
                f"{a_alone:,.0f} / {a_both:,.0f} rec/s",
                f">= 0.9 ({a_both / a_alone:.2f})" if a_alone else "",
                c.verdict(a_alone > 0 and a_both / a_alone >= 0.9),
            ],
            [
                f"one transactional behind {n:,} broadcast",
                f"{behind * 1000:.0f} ms",
                "<= 1 s",
                c.verdict(behind <= 1.0),
            ],
        ]
        c.print_table(
            f"Fairness ({WORKERS} mail workers, B at 5 mails/s, {window_s:g} s windows)",
            ["figure", "measured", "goal", ""],
            rows,
        )
        c.say(f"\nload average at the end: {load}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
