"""End-to-end SMS: accepted records sent through the `http_json` adapter to a local provider in
its own process, ours vs a bare psycopg + httpx loop doing the same work, same provider, same
table, same run.

provider  tests/support/sms_provider.py's FakeSmsProvider (the JSON gateway: checks the HMAC
          signature, records the idempotency key, answers 200 {"id"}), in a process of its
          own; HTTP/1.1 keep-alive, one thread per connection, TCP_NODELAY (without it each
          answer waits 40 ms for a delayed ACK).
ours      N Pending SMS records accepted (portal.messaging.records.acceptance, not timed), then
          portal.delivery.service.DeliveryService with W SMS workers (the product's engine,
          LISTEN/NOTIFY, logging as worker.py sets it, mail pool off) in P child processes of
          W/P workers each (as P `python worker.py` would run), until all N are Sent: claim,
          suppression check, preparation (provider choice, rendering, quota charge, write-back),
          the signed POST, the versioned Sent with the next claim.
bare      W threads in this process, each one autocommit psycopg connection and one httpx
          client, on the same table (sms_send_record, with its indexes) and records accepted
          the same way: the one-statement claim (UPDATE ... WHERE id IN (SELECT ... FOR UPDATE
          SKIP LOCKED) RETURNING), the same signed POST (the adapter's body and headers), the
          versioned Sent write. 2 statements per SMS; no suppression, rendering or quota.

The clock is the database's: the middle 80 % of the run's Sent times (sent_at, 10th to 90th
percentile), so the start-up of P worker processes (started, then told to go, but each still
opening its pools and planning its first statements) and the tail are outside it. Each run is
sized to last about --seconds (from the previous run of the same configuration). Runs
alternate bare, ours, ours, bare per worker count.

In flight: a pool keeps at most pool size - 1 workers in flight to one provider (the
per-route cap of the fair claim), per process: 10 workers in 1 process send at most 9 at once;
in 2 processes of 5, 8; in 5 of 2, 5; in 10 of 1, 10 (a pool of 1 keeps its one).

Goals: ours >= 0.7 x bare at 1 and 10 workers; ours at 10 workers >= 3 x ours at 1.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import _common as c  # first: puts the repository root on sys.path
import budget
import httpx
import psycopg

from portal.delivery.process import shares as share_out

DB_NAME = "postroom_bench_sms"
RATIO_GOAL = 0.7
SCALE_GOAL = 3.0
PHONE = "+447400123456"
CONTENT = "Your code is 123456. It expires in 10 minutes. Do not share it with anyone."
SENDER_ID = "+15005550006"
CLK_TCK = os.sysconf("SC_CLK_TCK")

BARE_CLAIM = (
    "UPDATE sms_send_record SET status = 'Sending', version = version + 1, "
    "updated_time = statement_timestamp(), "
    "first_claimed_at = coalesce(first_claimed_at, statement_timestamp()) "
    "WHERE id IN (SELECT id FROM sms_send_record WHERE status = 'Pending' "
    "ORDER BY updated_time LIMIT 1 FOR UPDATE SKIP LOCKED) "
    "RETURNING id, version, phone_number, content"
)
BARE_SENT = (
    "UPDATE sms_send_record SET status = 'Sent', version = version + 1, "
    "sent_at = statement_timestamp(), updated_time = statement_timestamp(), "
    "next_retry_at = NULL, provider_message_id = %s, error_code = NULL, error_message = NULL "
    "WHERE id = %s AND version = %s"
)


# --- the provider, in its own process -------------------------------------------------------


def provider_main() -> int:
    """Serve the fake gateway until SIGTERM; print its URL; forget answered requests (the
    fake keeps each for tests to read: here that would only grow)."""
    sys.path.insert(0, str(c.ROOT))
    from tests.support.sms_provider import FakeSmsProvider

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with FakeSmsProvider() as server:
        # TCP_NODELAY on its connections: the handler writes the headers and the body in two
        # sends, and with Nagle the body waits for the client's delayed ACK, 40 ms a request
        # (measured: 48 ms per POST, 6-8 ms with this), which made every client look alike.
        server._server.RequestHandlerClass.disable_nagle_algorithm = True
        print(server.gateway_url, flush=True)
        while not stop.wait(1.0):
            with server._lock:  # the fake's own lock: its request list
                server.requests.clear()
    return 0


@dataclass
class Provider:
    process: subprocess.Popen[str] | None = None
    url: str = ""

    def start(self) -> Provider:
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--provider"],
            cwd=c.ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        self.url = self.process.stdout.readline().strip()
        if not self.url.startswith("http"):
            raise RuntimeError("the fake SMS provider did not start")
        return self

    def cpu_s(self) -> float:
        return cpu_of(self.process.pid) if self.process else 0.0

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()  # our own child, by its pid
            self.process.wait(10)
            self.process = None


def cpu_of(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


# --- ours: DeliveryService in child processes -----------------------------------------------


def child_main(url: str, threads: int, log: str, metered: bool) -> int:
    """One worker process: a DeliveryService with ``threads`` SMS workers; "ready" on stdout,
    start on a line from stdin, first stage of shutdown on SIGTERM (as worker.py). ``metered``:
    with bench/budget.py's hook, whose counts since the start a "report" line on stdin asks
    for."""
    from portal import create_app
    from portal.delivery.service import DeliveryService
    from portal.extensions import db

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    if metered:
        budget.HOOKS.install()
    settings = c.bench_settings(url, mail_send_concurrency=0, sms_send_concurrency=threads)
    app = create_app(settings)
    c.worker_logging(log)
    with app.app_context():
        engine = db.engine
    service = DeliveryService(engine, settings)
    print("ready", flush=True)
    sys.stdin.readline()
    budget.HOOKS.reset()
    service.start()
    if metered:

        def answer() -> None:
            for line in sys.stdin:
                if line.strip() == "report":
                    print(budget.child_report_line(budget.HOOKS.report()), flush=True)

        threading.Thread(target=answer, daemon=True).start()
    stop.wait()
    service.stop()
    service.wait(10)
    return 0


class Children:
    """P worker processes of W/P SMS workers each (the remainder spread over the first)."""

    def __init__(self, url: str, workers: int, procs: int, log: str, metered: bool) -> None:
        shares = share_out(workers, procs)  # as DELIVERY_PROCESSES shares them
        env = dict(os.environ, BENCH_DB_PREFIX=c.DB_PREFIX, BENCH_REDIS_URL=c.REDIS_URL)
        metering = ["--budget"] if metered else []
        self.processes = [
            subprocess.Popen(
                [sys.executable, __file__, "--child", url, str(share), "--log", log, *metering],
                cwd=c.ROOT,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=env,
            )
            for share in shares
        ]
        for p in self.processes:
            assert p.stdout is not None
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("a worker process did not start")

    def go(self) -> None:
        for p in self.processes:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()

    def cpu_s(self) -> float:
        return sum(cpu_of(p.pid) for p in self.processes)

    def reports(self) -> list[dict[str, Any]]:
        """Each metered child's hook counts since it was told to go."""
        out = []
        for p in self.processes:
            assert p.stdin is not None
            assert p.stdout is not None
            p.stdin.write("report\n")
            p.stdin.flush()
            for line in p.stdout:
                if (report := budget.read_report(line)) is not None:
                    out.append(report)
                    break
        return out

    def stop(self) -> None:
        for p in self.processes:
            p.terminate()  # our own children, by their pids
        for p in self.processes:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


# --- set-up ---------------------------------------------------------------------------------


def tenant_with_provider(app: Any, url: str) -> int:
    """A tenant whose default SMS provider is the fake gateway; returns the tenant id."""
    sys.path.insert(0, str(c.ROOT))
    from portal.extensions import db
    from portal.models import SmsProviderConfig, Tenant
    from tests.support.sms_provider import GATEWAY_SECRET

    with app.app_context():
        tenant = Tenant(slug="sms-bench", name="SMS bench")
        db.session.add(tenant)
        db.session.flush()
        config = SmsProviderConfig(
            tenant_id=tenant.id,
            name="gateway",
            provider="http_json",
            sender_id=SENDER_ID,
            base_url=url,
            is_default=True,
        )
        config.secret = GATEWAY_SECRET
        db.session.add(config)
        db.session.commit()
        return int(tenant.id)


def accept(app: Any, tenant_id: int, n: int) -> tuple[int, int]:
    """``n`` Pending SMS records through acceptance (batches of 500); the id range."""
    from portal.extensions import db
    from portal.messaging.records import acceptance
    from portal.tenancy import tenant_context

    settings = app.config["SETTINGS"]
    ids: list[int] = []
    with app.app_context(), tenant_context(tenant_id):
        for start in range(0, n, 500):
            items = [{"phoneNumber": PHONE, "content": CONTENT} for _ in range(min(500, n - start))]
            ids += [a.id for a in acceptance.send_sms_batch(db.session, items, settings=settings)]
            db.session.commit()
        db.session.remove()
    return min(ids), max(ids)


# --- one run --------------------------------------------------------------------------------

# The steady state: the middle 80 % of the run's Sent times (database clock), scaled to the
# whole count. The first and last tenth hold the start-up (each worker process starting its
# pools, connections and first plans, which staggers P processes) and the tail.
SPAN_SQL = (
    "SELECT count(*) FILTER (WHERE status = 'Sent'), "
    "count(*) FILTER (WHERE status NOT IN ('Sent', 'Pending', 'Sending')), "
    "(percentile_cont(0.9) WITHIN GROUP (ORDER BY extract(epoch FROM sent_at)) "
    "- percentile_cont(0.1) WITHIN GROUP (ORDER BY extract(epoch FROM sent_at))) / 0.8 "
    "FROM sms_send_record WHERE id BETWEEN %s AND %s"
)


@dataclass
class Run:
    n: int
    s: float  # database clock: the middle 80 % of the Sent times, over 0.8
    cpu: float  # the client's CPU seconds (our worker processes; the bare loop's process)
    provider_cpu: float
    failed: int

    @property
    def rate(self) -> float:
        return self.n / self.s if self.s > 0 else float("nan")


def run_ours(
    app: Any,
    url: str,
    dsn: str,
    provider: Provider,
    tenant_id: int,
    n: int,
    shape: Shape,
    meter: budget.Meter | None = None,
) -> Run:
    """With a ``meter`` (``own=False``): its window runs from "go" to the last Sent, over the
    child processes; their hook reports land in ``meter.reports``."""
    lo, hi = accept(app, tenant_id, n)
    children = Children(url, shape.workers, shape.procs, shape.log, metered=meter is not None)
    try:
        if meter is not None:
            meter.processes = [p.pid for p in children.processes]
            meter.start()
        cpu0, pcpu0 = children.cpu_s(), provider.cpu_s()
        children.go()
        deadline = time.monotonic() + 600
        with psycopg.connect(dsn, autocommit=True, application_name=budget.WATCH_APP) as conn:
            while time.monotonic() < deadline:
                row = conn.execute(SPAN_SQL, (lo, hi)).fetchone()
                assert row is not None
                if row[0] + row[1] >= n:
                    break
                time.sleep(0.05)
        cpu, pcpu = children.cpu_s() - cpu0, provider.cpu_s() - pcpu0
        if meter is not None:
            meter.mark_end()
            meter.reports = children.reports()
    finally:
        children.stop()
    return Run(int(row[0]), float(row[2] or "nan"), cpu, pcpu, int(row[1]))


def run_bare(
    app: Any,
    dsn: str,
    provider: Provider,
    tenant_id: int,
    n: int,
    shape: Shape,
    meter: budget.Meter | None = None,
) -> Run:
    from portal.messaging.sending.transports.sms import http_json
    from portal.messaging.sending.transports.sms.result import idempotency_key
    from tests.support.sms_provider import GATEWAY_SECRET

    lo, hi = accept(app, tenant_id, n)
    barrier = threading.Barrier(shape.workers + 1)
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            with (
                psycopg.connect(dsn, autocommit=True) as conn,
                httpx.Client(timeout=30) as client,
            ):
                barrier.wait()
                while True:
                    row = conn.execute(BARE_CLAIM).fetchone()
                    if row is None:
                        return
                    record_id, version, phone, content = row
                    key = idempotency_key(record_id)
                    body = json.dumps(
                        {
                            "to": phone,
                            "from": SENDER_ID,
                            "content": content,
                            "externalTemplateId": None,
                            "signature": None,
                            "variables": {},
                            "reference": key,
                        },
                        ensure_ascii=False,
                        separators=(",", ":"),
                    ).encode()
                    answer = client.post(
                        provider.url,
                        content=body,
                        headers={
                            "Content-Type": "application/json",
                            "Accept": "application/json",
                            http_json.IDEMPOTENCY_HEADER: key,
                            http_json.SIGNATURE_HEADER: http_json.sign(body, GATEWAY_SECRET),
                        },
                    )
                    answer.raise_for_status()
                    conn.execute(BARE_SENT, (str(answer.json()["id"]), record_id, version))
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()  # the others (and the main thread) stop waiting

    pool = [threading.Thread(target=worker) for _ in range(shape.workers)]
    for t in pool:
        t.start()
    if meter is not None:
        meter.start()
    with contextlib.suppress(threading.BrokenBarrierError):
        barrier.wait()
    cpu0, pcpu0 = time.process_time(), provider.cpu_s()
    for t in pool:
        t.join()
    cpu, pcpu = time.process_time() - cpu0, provider.cpu_s() - pcpu0
    if meter is not None:
        meter.mark_end()
    if errors:
        raise errors[0]
    with psycopg.connect(dsn, autocommit=True, application_name=budget.WATCH_APP) as conn:
        row = conn.execute(SPAN_SQL, (lo, hi)).fetchone()
    assert row is not None
    return Run(int(row[0]), float(row[2] or "nan"), cpu, pcpu, int(row[1]))


# --- what ours does per SMS ------------------------------------------------------------------


def breakdown(app: Any, dsn: str, tenant_id: int, n: int) -> None:
    """One worker in this thread (claim_due + process_sms, as a pool worker runs them):
    round trips per SMS by kind of statement, and a cProfile of this thread's CPU time."""
    import cProfile
    from collections import Counter

    from sqlalchemy import event

    from portal.extensions import db
    from portal.messaging.sending.backoff import BackoffPolicy
    from portal.messaging.sending.claim import claim_due
    from portal.messaging.sending.pipeline import SmsContext, process_sms
    from portal.models import SmsSendRecord

    accept(app, tenant_id, n)
    settings = app.config["SETTINGS"]
    with app.app_context():
        engine = db.engine
    kinds: Counter[str] = Counter()
    counts = {"begin": 0, "commit": 0, "checkout": 0}

    # Every statement, whether through SQLAlchemy or straight on the driver (models/direct).
    original = psycopg.Cursor.execute

    def counted(self: Any, query: Any, *a: Any, **k: Any) -> Any:
        text = (
            query
            if isinstance(query, str)
            else str(getattr(query, "as_string", lambda _: query)(None))
        )
        words = text.split()
        head = " ".join(words[:1]).upper() if words else "?"
        table = next(
            (
                w.strip('"(),')
                for w in words
                if w.strip('"(),').endswith(
                    ("_record", "_config", "suppression", "_quota", "_state", "_usage")
                )
            ),
            "",
        )
        kinds[f"{head} {table}"] += 1
        return original(self, query, *a, **k)

    def bump(name: str) -> Any:
        def listener(*_: Any) -> None:
            counts[name] += 1

        return listener

    listeners = [
        (engine, "begin", bump("begin")),
        (engine, "commit", bump("commit")),
        (engine.pool, "checkout", bump("checkout")),
    ]
    for target, name, fn in listeners:
        event.listen(target, name, fn)
    ctx = SmsContext(engine=engine, settings=settings, policy=BackoffPolicy.from_settings(settings))
    done = 0
    profiler = cProfile.Profile(time.thread_time)
    began = time.perf_counter()
    psycopg.Cursor.execute = counted  # type: ignore[method-assign]
    profiler.enable()
    while done < n:
        claimed = claim_due(engine, SmsSendRecord, 1)
        if not claimed:
            break
        process_sms(ctx, claimed[0])  # type: ignore[arg-type]
        done += 1
    profiler.disable()
    psycopg.Cursor.execute = original  # type: ignore[method-assign]
    elapsed = time.perf_counter() - began
    for target, name, fn in listeners:
        event.remove(target, name, fn)
    per = max(done, 1)
    c.say(
        f"\nBreakdown of ours: 1 worker in this thread, {done:,} SMS, under cProfile: "
        f"{elapsed / per * 1e6:,.0f} us wall per SMS; per SMS: "
        f"{sum(kinds.values()) / per:.1f} statements on the driver (of which SQLAlchemy "
        f"began {counts['begin'] / per:.1f} and committed {counts['commit'] / per:.1f} "
        "transactions), "
        f"{counts['checkout'] / per:.1f} pool checkouts; the bare loop: 2 statements"
    )
    for kind, count in kinds.most_common(12):
        c.say(f"    {count / per:5.2f}  {kind}")
    c.say_profile(profiler, "cProfile by own time (top 25)", "tottime", 25)
    c.say_profile(
        profiler,
        "cProfile, cumulative CPU of selected steps (per SMS: divide by the count)",
        "cumulative",
        r"portal/|psycopg/cursor\.py:\d+\(execute\)|orm/session\.py:\d+\((get|execute|commit)\)"
        r"|httpx/_client\.py:\d+\(post\)|secretbox|cache_key\.py:\d+|logging/__init__\.py:\d+\(info\)",
        lines=38,
    )


# --- the comparison -------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    workers: int
    procs: int  # ours: worker processes (the bare loop is always threads in one process)
    log: str = "info"

    @property
    def label(self) -> str:
        return f"{self.workers} worker{'s' if self.workers > 1 else ''} in {self.procs} proc"


@dataclass
class Totals:
    n: int = 0
    s: float = 0.0
    cpu: float = 0.0
    provider_cpu: float = 0.0
    failed: int = 0
    rates: list[float] | None = None

    def add(self, run: Run) -> None:
        self.n += run.n
        self.s += run.s
        self.cpu += run.cpu
        self.provider_cpu += run.provider_cpu
        self.failed += run.failed
        self.rates = [*(self.rates or []), run.rate]

    @property
    def rate(self) -> float:
        return self.n / self.s if self.s > 0 else float("nan")


def sized(rate: float | None, seconds: float, quick: bool) -> int:
    if quick:
        return 300
    if rate is None or rate != rate:
        return 1_000
    return max(500, min(100_000, int(rate * seconds)))


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--provider":
        return provider_main()
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        log = sys.argv[sys.argv.index("--log") + 1] if "--log" in sys.argv else "info"
        c.use_names(
            os.environ.get("BENCH_DB_PREFIX", c.DB_PREFIX),
            os.environ.get("BENCH_REDIS_URL", c.REDIS_URL),
        )
        return child_main(sys.argv[2], int(sys.argv[3]), log, "--budget" in sys.argv)
    args = c.parse_args(
        __doc__,
        lambda p: (
            p.add_argument("--log", default="info", help="worker log level (default: info)"),
            p.add_argument(
                "--workers", default="1,10", help="worker counts, comma-separated (1,10)"
            ),
            p.add_argument(
                "--procs",
                default="1,2,5,10",
                help="ours at the largest worker count: as how many processes (1,2,5,10); "
                "the other counts run as 1 process",
            ),
            p.add_argument("--seconds", type=float, default=6.0, help="length of a run (6)"),
            p.add_argument("--rounds", type=int, default=2, help="ABBA rounds (2)"),
            p.add_argument(
                "--json", action="store_true", help="also JSON lines (peers' PEERS_OWN)"
            ),
            p.add_argument(
                "--breakdown", action="store_true", help="only the profile of one worker"
            ),
            p.add_argument(
                "--no-budget",
                dest="budget",
                action="store_false",
                help="skip the budget per SMS (one more run of each side at each worker count "
                "in one process, under bench/budget.py's meter)",
            ),
        ),
    )
    counts = [int(x) for x in args.workers.split(",")]
    top = max(counts)
    shapes = [Shape(w, 1, args.log) for w in counts]
    shapes += [Shape(top, int(p), args.log) for p in args.procs.split(",") if int(p) not in (0, 1)]
    rounds = 1 if args.quick else args.rounds
    c.print_header("bench/sms.py: end-to-end SMS to a local provider process", args.quick)
    results: dict[tuple[str, Shape], Totals] = {}
    spent: dict[Shape, list[budget.Budget]] = {}
    provider = Provider().start()
    try:
        with c.bench_database(DB_NAME) as url:
            app = c.make_app(url)
            c.worker_logging(args.log)
            dsn = c.conninfo(url)
            tenant_id = tenant_with_provider(app, provider.url)
            if args.breakdown:
                breakdown(app, dsn, tenant_id, 300 if args.quick else 2_000)
                shapes = []
            # A warm-up of each side (imports, plans, the provider's first threads): not counted.
            if shapes:
                run_bare(app, dsn, provider, tenant_id, 200, Shape(1, 1))
                run_ours(app, url, dsn, provider, tenant_id, 200, Shape(1, 1, args.log))
            last: dict[tuple[str, Shape], float] = {}
            for shape in shapes:
                c.say(f"\n{shape.label}(s), runs of about {args.seconds:.0f} s, {ORDER}:")
                bare_shape = Shape(shape.workers, 1, args.log)
                for r in range(rounds):
                    line = []
                    for side in ORDER:
                        if side == "bare" and shape.procs != 1 and (side, bare_shape) in results:
                            continue  # the bare loop at this count was measured already
                        key = (side, shape if side == "ours" else bare_shape)
                        n = sized(last.get(key), args.seconds, args.quick)
                        load = os.getloadavg()[0]
                        run = (
                            run_bare(app, dsn, provider, tenant_id, n, bare_shape)
                            if side == "bare"
                            else run_ours(app, url, dsn, provider, tenant_id, n, shape)
                        )
                        last[key] = run.rate
                        results.setdefault(key, Totals()).add(run)
                        line.append(
                            f"{side} {run.rate:,.0f} ({run.n:,} in {run.s:.1f} s, load {load:.1f})"
                        )
                        if run.failed or run.n < n:
                            line[-1] += f" [sent {run.n} of {n}, failed {run.failed}]"
                    c.say(f"  round {r + 1}/{rounds} (SMS/s): " + "; ".join(line))
            if shapes and args.budget:
                spent = budgets(app, url, dsn, provider, tenant_id, shapes, last, args)
            with app.app_context():
                from portal.extensions import db

                db.engine.dispose()
    finally:
        provider.stop()
    if not shapes:
        return 0
    report(results, shapes, top)
    budget.print_budgets(
        "Budget per SMS (bench/budget.py: one more run of each side, not in the rates above; "
        "provider = the sink)",
        [b for pair in spent.values() for b in pair],
        unit="SMS",
    )
    if args.json:
        for shape in shapes:
            ours = results[("ours", shape)].rate
            bare = results[("bare", Shape(shape.workers, 1, shape.log))].rate
            print(
                json.dumps(
                    {
                        "bench": "ours sms.py",
                        "config": f"workers={shape.workers} procs={shape.procs}",
                        "rates": {"SMS/s": round(ours, 1), "bare SMS/s": round(bare, 1)},
                        "round": int(os.environ.get("PEERS_ROUND", "0")),
                        "load_at_end": os.getloadavg()[0],
                        "budget": [b.as_json() for b in spent.get(shape, [])],
                    }
                ),
                flush=True,
            )
    c.say(f"\nload average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


ORDER = ("bare", "ours", "ours", "bare")


def budgets(
    app: Any,
    url: str,
    dsn: str,
    provider: Provider,
    tenant_id: int,
    shapes: list[Shape],
    last: dict[tuple[str, Shape], float],
    args: Any,
) -> dict[Shape, list[budget.Budget]]:
    """One more run of ours and of the bare loop at each worker count in one process, under
    bench/budget.py's meter (at least 5 s): what an SMS costs in each process, statements and
    writes."""
    seconds = max(args.seconds, 6.0)
    pid = provider.process.pid if provider.process else None
    out: dict[Shape, list[budget.Budget]] = {}
    for shape in (s for s in shapes if s.procs == 1):

        def ours(n: int, shape: Shape = shape) -> budget.Budget:
            with budget.Meter(dsn, own=False, sink_pid=pid) as meter:
                run = run_ours(app, url, dsn, provider, tenant_id, n, shape, meter=meter)
                return meter.finish(f"ours, {shape.label}", run.n)

        def bare(n: int, shape: Shape = shape) -> budget.Budget:
            with budget.Meter(dsn, sink_pid=pid) as meter:
                run = run_bare(app, dsn, provider, tenant_id, n, shape, meter=meter)
                return meter.finish(f"bare, {shape.workers} threads", run.n)

        pair = [
            budget.long_enough(
                side, sized(last.get((name, shape)), seconds, args.quick), args.quick
            )
            for name, side in (("ours", ours), ("bare", bare))
        ]
        out[shape] = pair
    return out


def report(results: dict[tuple[str, Shape], Totals], shapes: list[Shape], top: int) -> None:
    one = results.get(("ours", next((s for s in shapes if s.workers == 1), shapes[0])))
    rows = []
    for shape in shapes:
        ours = results[("ours", shape)]
        bare = results[("bare", Shape(shape.workers, 1, shape.log))]
        ratio = ours.rate / bare.rate
        scale = ours.rate / one.rate if one is not None and shape.workers > 1 else None
        rows.append(
            [
                shape.workers,
                shape.procs,
                ours.rate,
                bare.rate,
                f"{ratio:.2f}",
                c.verdict(ratio >= RATIO_GOAL),
                f"{scale:.2f}" if scale is not None else "",
                c.verdict(scale >= SCALE_GOAL) if scale is not None else "",
                ours.cpu / max(ours.n, 1) * 1e6,
                bare.cpu / max(bare.n, 1) * 1e6,
                ours.provider_cpu / max(ours.n, 1) * 1e6,
                bare.provider_cpu / max(bare.n, 1) * 1e6,
            ]
        )
    c.print_table(
        f"SMS/s end to end (database clock; totals over the runs); goals: ours/bare >= "
        f"{RATIO_GOAL}, ours at {top} workers >= {SCALE_GOAL:.0f} x ours at 1",
        [
            "workers",
            "procs",
            "ours SMS/s",
            "bare SMS/s",
            "ours/bare",
            "",
            "x 1 worker",
            "",
            "client CPU us/SMS: ours",
            "bare",
            "provider CPU us/SMS: ours",
            "bare",
        ],
        rows,
    )


if __name__ == "__main__":
    raise SystemExit(main())
