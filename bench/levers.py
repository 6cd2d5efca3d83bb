"""Three levers of the mail throughput work, each side measured in turns within one run (the
machine is shared: only same-run ratios hold).

pipelining  SMTP PIPELINING off and on (``SmtpConnectionPool.pipelining``) against one sink
            process offering it (scripts/smtp_sink.py's SinkHandler, its EHLO reply with
            PIPELINING added; ``--rtt-ms``: behind a relay that delays each direction by half
            that, as a link would). First the transport alone, no database: one thread sending
            the same mail over one connection, blocks in turns (off, on, on, off); wall time,
            its CPU and the sink's per mail. Then end to end, ours as bench/smtp.py runs it
            (``run_ours``: accepted records, a DeliveryService of W mail workers in this
            process until all are Sent), 1 and 5 workers (5: 4 SMTP sessions at once), runs
            in turns off, on, on, off of about --seconds each, the worker's and the sink's CPU
            per mail in each; then one more run of each side under bench/budget.py's meter.
triggers    the status-callback triggers of migration 0015 when the tenant has no endpoint
            (another tenant has one): the product's Sent write (``record_sent`` as a worker
            outside a pool writes it, with its attempt's row) timed write by write, in blocks
            in turns with the triggers on, on with the function's body emptied (the trigger
            still fires: its machinery alone) and off (ALTER TABLE ... DISABLE TRIGGER); the
            PostgreSQL backends' CPU per write; callback rows written.
processes   DELIVERY_PROCESSES 1, 2, 3: the mail workers in P processes (started and warm
            before the clock, as bench/sms.py runs them), scripts/smtp_sink.py's sink in its
            own process (as bench/smtp.py), equal SMTP sessions at once (--sessions, 6: 7
            workers, 4 + 4, 3 + 3 + 3, since a process keeps pool size - 1 workers in flight
            to one server; or --workers N shared out as DELIVERY_PROCESSES shares them);
            mail/s over the middle 80 % of the Sent times (database clock); runs in turns
            1, 2, 3, 3, 2, 1.
"""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import _common as c  # first: puts the repository root on sys.path
import budget
import claim as cl
import psycopg
import smtp as sm

from portal.extensions import db
from portal.messaging.sending.transports.smtp import SmtpConnectionPool
from portal.models import Channel

DB_NAME = "postroom_bench_levers"
TRIGGERS = ("callback_change", "callback_insert")


# --- a sink offering PIPELINING -------------------------------------------------------------


def serve_sink(host: str, port: int, directory: Path, rtt_ms: float = 0.0) -> int:
    """scripts/smtp_sink.py's sink (keeps each mail as a file) with PIPELINING in its EHLO
    reply: aiosmtpd reads pipelined commands line by line as they come; it only does not say
    so. ``rtt_ms``: clients reach it through a relay that holds every chunk rtt_ms / 2 in each
    direction, as a link with that round trip would (the loopback's is some 50 µs)."""
    from aiosmtpd.controller import Controller
    from aiosmtpd.smtp import SMTP, Envelope, Session

    sys.path.insert(0, str(c.ROOT / "scripts"))
    from smtp_sink import SinkHandler  # type: ignore[import-not-found]

    class Handler(SinkHandler):  # type: ignore[misc]
        async def handle_EHLO(
            self,
            server: SMTP,
            session: Session,
            envelope: Envelope,
            hostname: str,
            responses: list[str],
        ) -> list[str]:
            session.host_name = hostname
            responses.insert(-1, "250-PIPELINING")
            return responses

    directory.mkdir(parents=True, exist_ok=True)
    inner = c.free_port() if rtt_ms else port
    controller = Controller(
        Handler(directory), hostname=host, port=inner, server_hostname="smtp-sink.local"
    )
    controller.start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    if rtt_ms:
        threading.Thread(
            target=asyncio.run, args=(relay(host, port, inner, rtt_ms / 2000),), daemon=True
        ).start()
    stop.wait()
    controller.stop()
    return 0


async def relay(host: str, port: int, inner: int, one_way_s: float) -> None:
    """Forward connections on ``port`` to ``inner``, each chunk ``one_way_s`` late, in order."""

    async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, chunk = await queue.get()
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                if not chunk:
                    writer.close()
                    return
                writer.write(chunk)

        task = asyncio.create_task(deliver())
        while True:
            chunk = await reader.read(65536)
            await queue.put((time.monotonic() + one_way_s, chunk))
            if not chunk:
                break
        await task

    async def connected(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(host, inner)
        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))

    server = await asyncio.start_server(connected, host, port)
    async with server:
        await server.serve_forever()


class PipeliningSink(c.Sink):
    """bench/_common's subprocess sink, offering PIPELINING (``rtt_ms``: behind a relay)."""

    rtt_ms: float = 0.0

    def start(self) -> PipeliningSink:
        self.port = c.free_port()
        self._process = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--serve-sink",
                str(self.port),
                self._dir.name,
                str(self.rtt_ms),
            ],
            cwd=c.ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        c.wait_port(self.host, self.port, timeout_s=60)  # a loaded machine starts slowly
        return self


def cpu_s(pid: int | None) -> float:
    value = budget.cpu_ns(pid) if pid else None
    return (value or 0) / 1e9


# --- lever 1: pipelining --------------------------------------------------------------------


def bench_pipelining(app: Any, dsn: str, args: Any) -> list[list[Any]]:
    sink = PipeliningSink("subprocess")
    sink.rtt_ms = args.rtt_ms
    rows: list[list[Any]] = []
    try:
        sink.start()
        slug = f"pipelining-{args.rtt_ms:g}ms"
        tenant_id = c.tenant_with_mail_server(app, sink.host, sink.port, slug=slug)
        for workers in (1, 5):
            rows.append(pipelining_at(app, dsn, sink, tenant_id, workers, args))
    finally:
        sink.stop()
        SmtpConnectionPool.pipelining = True
    return rows


def transport_alone(args: Any) -> list[list[Any]]:
    """The transport without the database: one SmtpConnectionPool sending the same mail over
    and over to the sink offering PIPELINING, off and on in blocks in turns (off, on, on,
    off); wall time, this thread's CPU and the sink's CPU per mail."""
    from portal.messaging.sending.transports.mail_message import OutgoingMail
    from portal.messaging.sending.transports.smtp import Security, SmtpServer

    sink = PipeliningSink("subprocess")
    sink.rtt_ms = args.rtt_ms
    block = 100 if args.quick else (100 if args.rtt_ms else 1_000)
    totals = {side: {"n": 0.0, "s": 0.0, "cpu": 0.0, "sink": 0.0} for side in ("off", "on")}
    try:
        sink.start()
        server = SmtpServer(
            key="alone@v1",
            host=sink.host,
            port=sink.port,
            security=Security.PLAIN,
            username=None,
            password=None,
            connect_timeout_s=10.0,
            read_timeout_s=30.0,
        )
        for r in range(2 if args.quick else 2 * args.rounds + 1):
            for side in ("off", "on", "on", "off"):
                with SmtpConnectionPool(pipelining=side == "on") as pool:
                    pool.send(server, _alone_mail(OutgoingMail, 0))  # the session opens
                    sink.clear()
                    sink0, cpu0, t0 = cpu_s(sink.pid), time.thread_time(), time.perf_counter()
                    for i in range(block):
                        pool.send(server, _alone_mail(OutgoingMail, i))
                    elapsed, cpu = time.perf_counter() - t0, time.thread_time() - cpu0
                    spent = cpu_s(sink.pid) - sink0
                if r == 0:
                    continue  # warm-up
                for key, value in (("n", block), ("s", elapsed), ("cpu", cpu), ("sink", spent)):
                    totals[side][key] += value
    finally:
        sink.stop()
    per = {side: {k: v / t["n"] * 1e6 for k, v in t.items()} for side, t in totals.items()}
    return [
        [name, per["off"][key], per["on"][key], f"{per['on'][key] / per['off'][key]:.3f}"]
        for name, key in (
            ("wall us/mail", "s"),
            ("sending thread's CPU us/mail", "cpu"),
            ("sink CPU us/mail", "sink"),
        )
    ]


def _alone_mail(kind: Any, i: int) -> Any:
    return kind(
        message_id=f"<alone-{i}@bench.test>",
        from_addr=sm.SENDER,
        from_name="Bench",
        to=[sm.RCPT],
        subject=sm.SUBJECT,
        text=sm.BODY,
    )


def pipelining_at(
    app: Any, dsn: str, sink: c.Sink, tenant_id: int, workers: int, args: Any
) -> list[Any]:
    sides = {"off": False, "on": True}
    totals = {name: {"n": 0.0, "s": 0.0, "cpu": 0.0, "sink": 0.0} for name in sides}

    def run(name: str, n: int, meter: budget.Meter | None = None) -> dict[str, float]:
        SmtpConnectionPool.pipelining = sides[name]
        sink.clear()
        sink0 = cpu_s(sink.pid)
        result = sm.run_ours(app, dsn, tenant_id, workers, n, meter=meter)
        result["sink"] = cpu_s(sink.pid) - sink0
        if result["failed"] or (sink.kept() or 0) < result["n"]:
            c.say(f"    {name}: failed {result['failed']:.0f}, sink kept {sink.kept()}")
        return result

    last = {name: sm._rate(run(name, 300)) for name in sides}  # sizes for the timed runs
    c.say(f"\npipelining, {workers} worker(s), runs of about {args.seconds:.0f} s:")
    for r in range(args.rounds):
        line = []
        for name in ("off", "on", "on", "off"):
            n = sm.sized(last[name], args.seconds, args.quick)
            load = os.getloadavg()[0]
            result = run(name, n)
            last[name] = sm._rate(result)
            for key in totals[name]:
                totals[name][key] += result[key]
            line.append(
                f"{name} {last[name]:,.0f} (cpu {result['cpu'] / result['n'] * 1e6:,.0f} us, "
                f"sink {result['sink'] / result['n'] * 1e6:,.0f} us, load {load:.1f})"
            )
        c.say(f"  round {r + 1}/{args.rounds} (mail/s): " + "; ".join(line))
    if args.budget:
        spent = []
        with budget.Meter(dsn, sink_pid=sink.pid) as meter:
            for name in sides:

                def side(n: int, name: str = name) -> budget.Budget:
                    result = run(name, n, meter)
                    return meter.finish(f"pipelining {name}, {workers} w", int(result["n"]))

                n = sm.sized(totals[name]["n"] / totals[name]["s"], 6.0, args.quick)
                spent.append(budget.long_enough(side, n, args.quick))
        budget.print_budgets(f"Budget per mail, {workers} worker(s), PIPELINING off / on", spent)
    rate = {k: v["n"] / v["s"] for k, v in totals.items()}
    per = {k: v["cpu"] / v["n"] * 1e6 for k, v in totals.items()}
    sink_per = {k: v["sink"] / v["n"] * 1e6 for k, v in totals.items()}
    return [
        workers,
        rate["off"],
        rate["on"],
        f"{rate['on'] / rate['off']:.3f}",
        per["off"],
        per["on"],
        sink_per["off"],
        sink_per["on"],
    ]


# --- lever 2: the callback triggers with no endpoint ----------------------------------------

BACKENDS_SQL = (
    "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
    "AND backend_type = 'client backend' AND application_name NOT LIKE 'bench-%'"
)


# The function's body emptied (scratch database only): the trigger still fires and calls it,
# so "empty" against "off" is the trigger machinery, "on" against "empty" the body's look-up.
EMPTY_BODY = (
    "CREATE OR REPLACE FUNCTION callback_enqueue_change() RETURNS trigger LANGUAGE plpgsql "
    "AS $$ BEGIN RETURN NULL; END $$"
)
STATES = ("on", "empty", "off")


class TriggerStates:
    """Puts the database in one of ``STATES``, restoring the migration's function for "on"."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        with psycopg.connect(dsn, autocommit=True) as conn:
            row = conn.execute(
                "SELECT pg_get_functiondef('callback_enqueue_change'::regproc)"
            ).fetchone()
        assert row is not None
        self.original = row[0]

    def set(self, state: str) -> None:
        verb = "DISABLE" if state == "off" else "ENABLE"
        with psycopg.connect(self.dsn, autocommit=True, application_name="bench-toggle") as conn:
            conn.execute(EMPTY_BODY if state == "empty" else self.original)
            for table in ("mail_send_record", "sms_send_record"):
                for suffix in TRIGGERS:
                    conn.execute(f"ALTER TABLE {table} {verb} TRIGGER {table}_{suffix}")


def to_sending(dsn: str, n: int) -> list[Any]:
    """``n`` Pending records of tenant 1 claimed (Sending, version + 1) by a plain UPDATE."""
    with psycopg.connect(dsn, autocommit=True, application_name="bench-claim") as conn:
        rows = conn.execute(
            "UPDATE mail_send_record SET status = 'Sending', version = version + 1, "
            "first_claimed_at = statement_timestamp(), updated_time = statement_timestamp() "
            "WHERE id IN (SELECT id FROM mail_send_record WHERE status = 'Pending' "
            "AND tenant_id = 1 ORDER BY id LIMIT %s) RETURNING id, version, retry_count",
            (n,),
        ).fetchall()
    return sorted(rows)


def bench_triggers(app: Any, dsn: str, args: Any) -> list[list[Any]]:
    """The Sent write, triggers on and off, in blocks in turns: latency of each write and the
    database backends' CPU over each block."""
    from portal.messaging.after_send import callbacks
    from portal.models import CallbackEndpoint, Tenant

    block = 200 if args.quick else 600
    warm = 50  # each block's first writes: the plans made again after the ALTER TABLE
    rounds = 2 if args.quick else max(3, args.rounds * 2)
    with app.app_context():
        engine = db.engine
        # Tenant 1 owns the records and has no endpoint; another tenant has one, so the
        # trigger's look-up is an index probe that finds nothing, as on a shared platform.
        for tid, slug in ((1, "bench-1"), (2, "bench-2")):
            db.session.add(Tenant(id=tid, slug=slug, name=slug))
        db.session.flush()
        endpoint = CallbackEndpoint(tenant_id=2, name="other", url="https://hooks.example/x")
        endpoint.event_list = list(callbacks.EVENT_TYPES)
        endpoint.secret = callbacks.new_secret()
        db.session.add(endpoint)
        db.session.commit()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT setval(pg_get_serial_sequence('tenant', 'id'), 10)")
        c.add_pending(conn, (block + warm) * (2 * len(STATES) * rounds + 1) + 500)
        conn.execute("VACUUM ANALYZE mail_send_record")
        before = conn.execute(
            "SELECT n_tup_ins FROM pg_stat_user_tables WHERE relname = 'callback_delivery'"
        ).fetchone()
    states = TriggerStates(dsn)
    lat: dict[str, list[float]] = {state: [] for state in STATES}
    cpu: dict[str, list[float]] = {state: [] for state in STATES}

    def run_block(state: str) -> None:
        states.set(state)
        records = to_sending(dsn, block + warm)
        with (
            cl.holding(engine),
            psycopg.connect(dsn, autocommit=True, application_name="bench-cpu") as watch,
        ):
            for i, (rid, version, retries) in enumerate(records):
                if i == warm:
                    pids = [row[0] for row in watch.execute(BACKENDS_SQL)]
                    cpu0 = sum(budget.cpu_ns(p) or 0 for p in pids)
                claimed = cl.Claimed(
                    channel=Channel.MAIL, id=rid, version=version, tenant_id=1, retry_count=retries
                )
                attempt = cl.Attempt(datetime.now(UTC), 0.0, None, "bench", "250", "2.0.0 Ok")
                t0 = time.perf_counter()
                ok = cl.record_sent(engine, claimed, f"<bench-{rid}@bench.test>", attempt=attempt)
                elapsed = time.perf_counter() - t0
                assert ok, "a Sent write did not match its record"
                if i >= warm:
                    lat[state].append(elapsed)
            cpu1 = sum(budget.cpu_ns(p) or 0 for p in pids)
        cpu[state].append((cpu1 - cpu0) / block / 1e3)

    run_block("on")  # warm-up, not counted
    lat["on"].clear()
    cpu["on"].clear()
    order = STATES + tuple(reversed(STATES))
    for r in range(rounds):
        load = os.getloadavg()[0]
        for state in order:
            run_block(state)
        c.say(
            f"  triggers round {r + 1}/{rounds} (load {load:.1f}), median Sent write / "
            "backends' CPU a write: "
            + ", ".join(
                f"{s} {statistics.median(lat[s][-2 * block :]) * 1e6:,.0f} / "
                f"{sum(cpu[s][-2:]) / 2:,.0f} us"
                for s in STATES
            )
        )
    states.set("on")
    time.sleep(1.1)  # the backends report their table counters when idle
    with psycopg.connect(dsn, autocommit=True) as conn:
        kept = conn.execute("SELECT count(*) FROM callback_delivery").fetchone()
        after = conn.execute(
            "SELECT n_tup_ins FROM pg_stat_user_tables WHERE relname = 'callback_delivery'"
        ).fetchone()
    assert kept is not None
    assert before is not None
    assert after is not None
    med = {s: statistics.median(v) * 1e6 for s, v in lat.items()}
    mean = {s: statistics.fmean(v) * 1e6 for s, v in lat.items()}
    back = {s: statistics.fmean(v) for s, v in cpu.items()}
    c.say(f"  callback_delivery rows: {kept[0]} (inserted in the run: {after[0] - before[0]})")
    return [
        [
            name,
            v["on"],
            v["empty"],
            v["off"],
            f"{v['on'] - v['off']:+.0f}",
            f"{v['empty'] - v['off']:+.0f}",
            f"{v['on'] / v['off']:.3f}",
        ]
        for name, v in (
            ("Sent write, median us", med),
            ("Sent write, mean us", mean),
            ("backends' CPU us a write", back),
        )
    ] + [["callback rows written", after[0] - before[0], "", "", "", "", ""]]


# --- lever 3: processes ---------------------------------------------------------------------


def child_main(url: str, workers: int, log: str) -> int:
    """One delivery process: a DeliveryService of ``workers`` mail workers; "ready" on stdout,
    start on a line from stdin, stop on SIGTERM (finishing what is in flight)."""
    from portal import create_app
    from portal.delivery.service import DeliveryService

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    settings = c.bench_settings(url, mail_send_concurrency=workers, sms_send_concurrency=0)
    app = create_app(settings)
    c.worker_logging(log)
    with app.app_context():
        engine = db.engine
    service = DeliveryService(engine, settings)
    print("ready", flush=True)
    sys.stdin.readline()
    service.start()
    stop.wait()
    service.stop()
    service.wait(10)
    return 0


def shape(sessions: int, processes: int) -> list[int]:
    """Each process's workers for ``sessions`` SMTP sessions at once over ``processes``: a
    process of k + 1 workers holds k sessions (one of 1 worker holds 1)."""
    split = [
        sessions // processes + (1 if i < sessions % processes else 0) for i in range(processes)
    ]
    return [k + 1 for k in split]


def shape_of(args: Any, processes: int) -> list[int]:
    """Equal SMTP sessions (``--sessions``), or ``--workers`` shared out as
    DELIVERY_PROCESSES shares MAIL_SEND_CONCURRENCY (worker.delivery_shares)."""
    if args.workers:
        from portal.delivery.process import shares

        return [w for w in shares(args.workers, processes) if w]
    return shape(args.sessions, processes)


def what(args: Any) -> str:
    if args.workers:
        return f"MAIL_SEND_CONCURRENCY={args.workers} shared out"
    return f"{args.sessions} SMTP sessions at once"


SPAN_SQL = (
    "SELECT count(*) FILTER (WHERE status = 'Sent'), "
    "count(*) FILTER (WHERE status NOT IN ('Sent', 'Pending', 'Sending')), "
    "(percentile_cont(0.9) WITHIN GROUP (ORDER BY extract(epoch FROM sent_at)) "
    "- percentile_cont(0.1) WITHIN GROUP (ORDER BY extract(epoch FROM sent_at))) / 0.8 "
    "FROM mail_send_record WHERE id BETWEEN %s AND %s"
)


def run_processes(
    app: Any, url: str, dsn: str, sink: c.Sink, tenant_id: int, workers: list[int], n: int, log: str
) -> dict[str, float]:
    lo, hi = sm.accept(app, tenant_id, n)
    env = dict(os.environ, BENCH_DB_PREFIX=c.DB_PREFIX, BENCH_REDIS_URL=c.REDIS_URL)
    children = [
        subprocess.Popen(
            [sys.executable, __file__, "--child", url, str(w), "--log", log],
            cwd=c.ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for w in workers
    ]
    try:
        for p in children:
            assert p.stdout is not None
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("a delivery process did not start")
        cpu0 = sum(cpu_s(p.pid) for p in children)
        sink0 = cpu_s(sink.pid)
        for p in children:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        deadline = time.monotonic() + 600
        with psycopg.connect(dsn, autocommit=True, application_name=budget.WATCH_APP) as conn:
            while time.monotonic() < deadline:
                row = conn.execute(SPAN_SQL, (lo, hi)).fetchone()
                assert row is not None
                if row[0] + row[1] >= n:
                    break
                time.sleep(0.05)
        cpu = sum(cpu_s(p.pid) for p in children) - cpu0
        sink_cpu = cpu_s(sink.pid) - sink0
    finally:
        for p in children:
            p.terminate()  # our own children, by their pids
        for p in children:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    return {
        "n": float(row[0]),
        "s": float(row[2] or "nan"),
        "cpu": cpu,
        "sink": sink_cpu,
        "failed": float(row[1]),
    }


def bench_processes(app: Any, url: str, dsn: str, args: Any) -> list[list[Any]]:
    counts = tuple(int(p) for p in args.processes.split(","))
    order = counts + tuple(reversed(counts))
    sink = c.Sink("subprocess")
    totals = {p: {"n": 0.0, "s": 0.0, "cpu": 0.0, "sink": 0.0} for p in counts}
    try:
        sink.start()
        tenant_id = c.tenant_with_mail_server(app, sink.host, sink.port, slug="processes")
        shapes = {p: shape_of(args, p) for p in counts}
        c.say(f"\nprocesses, {what(args)}: workers by process {shapes}")
        last = {
            p: sm._rate(run_processes(app, url, dsn, sink, tenant_id, shapes[p], 600, args.log))
            for p in counts
        }
        for r in range(args.rounds):
            line = []
            for p in order:
                n = sm.sized(last[p], args.seconds, args.quick)
                sink.clear()
                load = os.getloadavg()[0]
                result = run_processes(app, url, dsn, sink, tenant_id, shapes[p], n, args.log)
                last[p] = sm._rate(result)
                for key in totals[p]:
                    totals[p][key] += result[key]
                line.append(f"{p}: {last[p]:,.0f} (load {load:.1f})")
                if result["failed"]:
                    line[-1] += f" failed {result['failed']:.0f}"
            c.say(f"  round {r + 1}/{args.rounds} (mail/s): " + "; ".join(line))
    finally:
        sink.stop()
    base = totals[counts[0]]["n"] / totals[counts[0]]["s"]
    rows = []
    for p in counts:
        t = totals[p]
        rate = t["n"] / t["s"]
        rows.append(
            [
                p,
                "+".join(str(w) for w in shape_of(args, p)),
                rate,
                f"{rate / base:.3f}",
                t["cpu"] / t["n"] * 1e6,
                t["sink"] / t["n"] * 1e6,
            ]
        )
    return rows


# --- main -----------------------------------------------------------------------------------


def _options(p: Any) -> None:
    p.add_argument("--only", choices=("pipelining", "triggers", "processes"), action="append")
    p.add_argument("--log", default="info", help="worker log level (default: info)")
    p.add_argument("--seconds", type=float, default=6.0, help="length of a run (6)")
    p.add_argument("--rounds", type=int, default=2, help="rounds in turns (2)")
    p.add_argument(
        "--rtt-ms",
        type=float,
        default=0.0,
        help="pipelining: a round trip of this many ms to the sink (a delaying relay; 0: none)",
    )
    p.add_argument(
        "--transport-only",
        action="store_true",
        help="pipelining: only the transport alone, not the end-to-end runs",
    )
    p.add_argument("--sessions", type=int, default=6, help="SMTP sessions at once (processes)")
    p.add_argument(
        "--workers",
        type=int,
        default=0,
        help="processes: this many mail workers shared out over the processes, as "
        "DELIVERY_PROCESSES does, instead of equal sessions",
    )
    p.add_argument("--processes", default="1,2,3", help="delivery process counts (1,2,3)")
    p.add_argument(
        "--no-budget", dest="budget", action="store_false", help="pipelining: skip the meter"
    )


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve-sink":
        return serve_sink("127.0.0.1", int(sys.argv[2]), Path(sys.argv[3]), float(sys.argv[4]))
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        c.use_names(os.environ["BENCH_DB_PREFIX"], os.environ["BENCH_REDIS_URL"])
        return child_main(sys.argv[2], int(sys.argv[3]), sys.argv[5])
    args = c.parse_args(__doc__, _options)
    if args.quick:
        args.rounds = 1
    only = set(args.only or ("pipelining", "triggers", "processes"))
    c.print_header("bench/levers.py: pipelining, callback triggers, processes", args.quick)
    c.say(
        f"  SmtpConnectionPool.pipelining (the product's default): {SmtpConnectionPool.pipelining}"
    )
    with c.bench_database(DB_NAME) as url:
        app = c.make_app(url)
        c.worker_logging(args.log)
        dsn = c.conninfo(url)
        if "triggers" in only:
            rows = bench_triggers(app, dsn, args)
            c.print_table(
                "The Sent write with the callback triggers on / on with the function's body "
                "emptied / off (no endpoint for the tenant)",
                ["", "on", "empty body", "off", "on - off", "empty - off", "on / off"],
                rows,
            )
        if "pipelining" in only:
            c.print_table(
                "The transport alone (no database), SMTP PIPELINING off / on, one thread"
                + (f", the sink {args.rtt_ms:g} ms away" if args.rtt_ms else ""),
                ["", "off", "on", "on/off"],
                transport_alone(args),
            )
        if "pipelining" in only and not args.transport_only:
            rows = bench_pipelining(app, dsn, args)
            c.print_table(
                "Ours with SMTP PIPELINING off / on, the same sink offering it"
                + (f", {args.rtt_ms:g} ms away" if args.rtt_ms else ""),
                [
                    "workers",
                    "off mail/s",
                    "on mail/s",
                    "on/off",
                    "worker CPU us/mail: off",
                    "on",
                    "sink CPU us/mail: off",
                    "on",
                ],
                rows,
            )
        if "processes" in only:
            rows = bench_processes(app, url, dsn, args)
            c.print_table(
                f"Mail/s by delivery processes, {what(args)} (middle 80 % of the Sent times)",
                ["processes", "workers", "mail/s", "x 1st", "workers CPU us/mail", "sink"],
                rows,
            )
        with app.app_context():
            db.engine.dispose()
    c.say(f"\nload average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
