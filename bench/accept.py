"""Acceptance API throughput under gunicorn: single sends/s (POST /api/v1/mail) and batch
records/s (POST /api/v1/mail/batch, 500 items), against the raw limit in the same run.

ours  gunicorn (a subprocess on a free port, DATABASE_URL = the bench database, 2 workers,
      threads per worker swept: 1 = sync worker, 4, 8 = gthread), loaded by Debian's `wrk` (a
      separate process: 2 threads, 16 connections, keep-alive) for a fixed count: the time is
      taken when that many requests are answered, whichever wrk thread answered them (each
      thread appends a line to a file every 10 answers). The ceiling is timed by the same
      clock. Non-2xx answers are counted and reported, and so is a database that holds fewer
      records than the answers promised.
raw   the same INSERTs (the send record with the same columns, its recipient row) by a bare
      psycopg loop: single = one record + recipient + COMMIT per send on 8 connections;
      batch = executemany of 500 records and 500 recipients + COMMIT on 4 connections. No
      NOTIFY (ours NOTIFYs at every commit).
Runs alternate: raw, each gunicorn config, raw.
Goal: >= 1,000 single sends/s; batches >= 10,000 records/s.
Needs `wrk` (apt-get install wrk). With py-spy on PATH (or BENCH_PYSPY=/path/to/py-spy), a
missed goal (or --profile) is followed by a sampled profile of the gunicorn workers.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import _common as c  # first: puts the repository root on sys.path
import psycopg

from portal.extensions import db
from portal.models import ApiKey, Tenant
from portal.models.tenant import new_api_token

DB_NAME = "postroom_bench_accept"
SINGLE_GOAL = 1_000.0
BATCH_GOAL = 10_000.0
BATCH = 500
THREADS = (1, 4, 8)
WRK_THREADS = 2
WRK_CONNECTIONS = 16
MAIL = {"to": ["ann@example.com"], "subject": "Hello", "text": "Hi Ann, this is a benchmark."}

# Each wrk thread appends a line to the progress file every STEP answers; the bench adds the
# lines up. Ours and the ceiling are timed by this same clock: from wrk's start until N requests
# are answered, whichever thread answered them (a thread that waits on a sync worker does not
# hold the clock, as it did when each thread had to finish its own share).
LUA = """
local counter = 0
local step = tonumber(os.getenv("BENCH_STEP"))
local cap = tonumber(os.getenv("BENCH_CAP"))
local progress = os.getenv("BENCH_PROGRESS_FILE")
wrk.method = "POST"
wrk.body = io.open(os.getenv("BENCH_BODY_FILE")):read("*a")
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer " .. os.getenv("BENCH_TOKEN")
response = function(status, headers, body)
  counter = counter + 1
  if counter % step == 0 then
    local f = io.open(progress, "a")
    f:write("+\\n")
    f:close()
  end
  if counter >= cap then
    wrk.thread:stop()
  end
end
"""
STEP = 10

# The ceiling: a hello-world Flask app under the same gunicorn and wrk, doing only what any
# JSON endpoint does (parse the body, answer 202 with a small JSON object). Nothing of ours,
# no database: what this machine allows a Flask endpoint at all.
HELLO = """
from flask import Flask, jsonify, request

app = Flask(__name__)


@app.post("/api/v1/mail")
def one():
    request.get_json()
    return jsonify({"id": 1, "duplicate": False}), 202


@app.post("/api/v1/mail/batch")
def many():
    items = request.get_json()["items"]
    return jsonify({"items": [{"id": i, "duplicate": False} for i in range(len(items))]}), 202
"""


# --- gunicorn ------------------------------------------------------------------------------


class Gunicorn:
    def __init__(
        self,
        url: str,
        workers: int,
        threads: int,
        app: str = "app:app",
        cwd: Path = c.ROOT,
    ):
        """``cwd`` is the checkout served (its ``portal`` comes first on the path)."""
        self.port = c.free_port()
        self.workers, self.threads = workers, threads
        env = dict(os.environ)
        env.update(
            DATABASE_URL=url,
            SECRET_KEY=c.SECRET_KEY,
            REDIS_URL=c.REDIS_URL,
            PYTHONUNBUFFERED="1",
            PYTHONPATH=str(cwd),
        )
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 (closed in stop())
        self.process = subprocess.Popen(
            [
                str(c.ROOT / ".venv" / "bin" / "gunicorn"),
                "--workers",
                str(workers),
                "--threads",
                str(threads),
                "--bind",
                f"127.0.0.1:{self.port}",
                "--log-level",
                "warning",
                app,
            ],
            cwd=cwd,
            env=env,
            stdout=self._log,
            stderr=self._log,
        )
        self.base = f"http://127.0.0.1:{self.port}"

    def config(self) -> str:
        kind = "sync" if self.threads == 1 else "gthread"
        return f"{self.workers} workers x {self.threads} threads ({kind})"

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 90  # a loaded, shared machine starts slowly
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.base}/health", timeout=1) as r:
                    if r.status == 200:
                        # Every worker up: a few requests more, so each has imported the app.
                        for _ in range(self.workers * 4):
                            urllib.request.urlopen(f"{self.base}/health", timeout=5).read()
                        return
            except OSError:
                time.sleep(0.2)
        self._log.seek(0)
        raise RuntimeError("gunicorn did not start:\n" + self._log.read().decode()[-2000:])

    def worker_pids(self) -> list[int]:
        out = subprocess.run(
            ["ps", "-o", "pid=", "--ppid", str(self.process.pid)],
            capture_output=True,
            text=True,
            check=False,
        ).stdout
        return [int(p) for p in out.split()]

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)  # our own child, by its pid
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()


# --- load ----------------------------------------------------------------------------------


def max_id(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT coalesce(max(id), 0) FROM mail_send_record").fetchone()
    return int(row[0]) if row else 0


def wrk_run(
    base: str, path: str, body: Any, token: str, requests: int, records: int, dsn: str | None
) -> dict[str, Any]:
    """Send requests until ``requests`` are answered (by any wrk thread); the seconds that took.

    ``records``: what the database should hold more by then (``dsn`` None, for the ceiling:
    nothing is written). Non-2xx answers count as answered and are reported.
    """
    work = Path(tempfile.mkdtemp(prefix="bench-wrk-"))
    try:
        (work / "body.json").write_text(json.dumps(body))
        (work / "load.lua").write_text(LUA)
        progress = work / "progress"
        progress.touch()
        env = dict(os.environ)
        env.update(
            BENCH_STEP=str(STEP),
            BENCH_CAP=str(requests),  # a thread stops after all of them: a safety net only
            BENCH_PROGRESS_FILE=str(progress),
            BENCH_BODY_FILE=str(work / "body.json"),
            BENCH_TOKEN=token,
        )
        start_id = max_id(dsn) if dsn is not None else 0
        began = time.perf_counter()
        process = subprocess.Popen(
            _wrk_command(base, path, work),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        elapsed = float("nan")
        seen, moved = 0, began
        while process.poll() is None:
            answered = progress.stat().st_size // 2 * STEP  # a "+" line per STEP answers
            now = time.perf_counter()
            if answered >= requests:
                elapsed = now - began
                break
            if answered != seen:
                seen, moved = answered, now
            elif now - moved > 10:  # stalled: report what was answered
                break
            time.sleep(0.005)
        process.send_signal(signal.SIGINT)  # wrk prints its summary and exits
        out, _ = process.communicate(timeout=30)
        got = max_id(dsn) - start_id if dsn is not None else 0
        answered = re.search(r"(\d+) requests in", out)
        result = {"s": elapsed, "records": got if dsn is not None else requests}
        result["answered"] = int(answered.group(1)) if answered else 0
        if dsn is not None and got < records:
            result["short"] = f"database holds {got:,} of {records:,} records"
        return result | _wrk_summary(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _wrk_command(base: str, path: str, work: Path) -> list[str]:
    return [
        "wrk",
        "-t",
        str(WRK_THREADS),
        "-c",
        str(WRK_CONNECTIONS),
        "-d",
        "600s",
        "--timeout",
        "60s",
        "--latency",
        "-s",
        str(work / "load.lua"),
        base + path,
    ]


def _wrk_summary(out: str) -> dict[str, Any]:
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = re.search(r"Socket errors: (.*)", out)
    p50 = re.search(r"\s50%\s+(\S+)", out)
    p99 = re.search(r"\s99%\s+(\S+)", out)
    return {
        "non2xx": int(non2xx.group(1)) if non2xx else 0,
        "errors": errors.group(1) if errors else "",
        "p50": p50.group(1) if p50 else "?",
        "p99": p99.group(1) if p99 else "?",
    }


# --- the raw limit -------------------------------------------------------------------------

RAW_RECORD = (
    "INSERT INTO mail_send_record (tenant_id, scope, status, version, retry_count, trace_id, "
    "request_hash, to_addrs, subject, text_body) "
    "VALUES (%s, 'TENANT', 'Pending', 0, 0, %s, %s, %s, %s, %s) RETURNING id"
)
RAW_RECIPIENT = (
    "INSERT INTO mail_send_recipient (record_id, tenant_id, address, kind) "
    "VALUES (%s, %s, %s, 'to')"
)


def raw_single(
    dsn: str, tenant_id: int, n: int, threads: int = 8, notify: bool = False
) -> dict[str, float]:
    shares = [n // threads + (1 if i < n % threads else 0) for i in range(threads)]
    barrier = threading.Barrier(threads + 1)
    to = json.dumps(MAIL["to"])

    def worker(k: int) -> None:
        with psycopg.connect(dsn) as conn:
            barrier.wait()
            for _ in range(shares[k]):
                row = conn.execute(
                    RAW_RECORD,
                    (tenant_id, "0" * 32, "f" * 64, to, MAIL["subject"], MAIL["text"]),
                ).fetchone()
                assert row is not None
                conn.execute(RAW_RECIPIENT, (row[0], tenant_id, MAIL["to"][0]))
                if notify:
                    conn.execute("NOTIFY postroom_mail_due")
                conn.commit()

    return _timed(worker, threads, barrier, n)


def raw_batch(
    dsn: str, tenant_id: int, batches: int, threads: int = 4, notify: bool = False
) -> dict[str, float]:
    shares = [batches // threads + (1 if i < batches % threads else 0) for i in range(threads)]
    barrier = threading.Barrier(threads + 1)
    to = json.dumps(MAIL["to"])
    rows = [(tenant_id, "0" * 32, "f" * 64, to, MAIL["subject"], MAIL["text"])] * BATCH

    def worker(k: int) -> None:
        with psycopg.connect(dsn) as conn:
            barrier.wait()
            for _ in range(shares[k]):
                with conn.cursor() as cur:
                    cur.executemany(RAW_RECORD, rows, returning=True)
                    ids = []
                    while True:
                        ids.append(cur.fetchone()[0])  # type: ignore[index]
                        if not cur.nextset():
                            break
                    cur.executemany(RAW_RECIPIENT, [(i, tenant_id, MAIL["to"][0]) for i in ids])
                    if notify:
                        cur.execute("NOTIFY postroom_mail_due")
                conn.commit()

    return _timed(worker, threads, barrier, batches * BATCH)


def _timed(worker: Any, threads: int, barrier: threading.Barrier, records: int) -> dict[str, float]:
    pool = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    for t in pool:
        t.start()
    barrier.wait()
    began = time.perf_counter()
    for t in pool:
        t.join()
    return {"s": time.perf_counter() - began, "records": records}


# --- profile -------------------------------------------------------------------------------


def pyspy() -> str | None:
    return os.environ.get("BENCH_PYSPY") or shutil.which("py-spy")


def profile(url: str, token: str, dsn: str, threads: int, kind: str, requests: int) -> None:
    """py-spy samples both gunicorn workers during a single-send run; top frames by self time,
    and the share of samples under chosen frames."""
    spy = pyspy()
    if spy is None:
        c.say("\n(no py-spy: set BENCH_PYSPY or put py-spy on PATH for a profile of the workers)")
        return
    server = Gunicorn(url, 2, threads)
    try:
        server.wait_ready()
        work = Path(tempfile.mkdtemp(prefix="bench-spy-"))
        spies = [
            subprocess.Popen(
                [
                    spy,
                    "record",
                    "--pid",
                    str(pid),
                    "--format",
                    "raw",
                    "--rate",
                    "250",
                    "--duration",
                    "600",
                    "--nonblocking",
                    "--threads",
                    "-o",
                    str(work / f"{pid}.txt"),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for pid in server.worker_pids()
        ]
        time.sleep(1.0)
        if kind == "single":
            result = wrk_run(server.base, "/api/v1/mail", MAIL, token, requests, requests, dsn)
        else:
            body = {"items": [MAIL] * BATCH}
            result = wrk_run(
                server.base, "/api/v1/mail/batch", body, token, requests, requests * BATCH, dsn
            )
        for spy_process in spies:
            spy_process.send_signal(signal.SIGINT)  # our own child: writes its file and exits
            spy_process.wait(timeout=30)
        stacks: collections.Counter[str] = collections.Counter()
        for path in work.glob("*.txt"):
            for line in path.read_text().splitlines():
                stack, _, count = line.rpartition(" ")
                if stack and count.isdigit():
                    stacks[stack] += int(count)
        shutil.rmtree(work, ignore_errors=True)
    finally:
        server.stop()
    # Only request-handling threads: stacks that pass through the WSGI app.
    handling = {s: n for s, n in stacks.items() if "wsgi_app" in s or "handle_request" in s}
    total = sum(handling.values()) or 1
    c.say(
        f"\nProfile of the gunicorn workers (py-spy, {sum(stacks.values()):,} samples, "
        f"{total:,} in request handling; {requests:,} {kind} requests at "
        f"{requests / result['s']:,.1f}/s under the profiler):"
    )
    own: collections.Counter[str] = collections.Counter()
    for stack, n in handling.items():
        own[_frame(stack.split(";")[-1])] += n
    c.say("  by own time (leaf frame), share of request-handling samples:")
    for frame, n in own.most_common(15):
        c.say(f"    {n / total:6.1%}  {frame}")
    marks = [
        ("api_key_required (the whole request under it)", ["api_key_required"]),
        (
            "  the API key lookup (SELECT)",
            ["api_key_required", "execute (sqlalchemy/orm/session"],
            ["send_mail_batch"],
        ),
        ("acceptance.send_mail_batch (validate + write)", ["send_mail_batch"]),
        ("  validate_mail", ["validate_mail"]),
        ("    email_validator.validate_email", ["validate_email"]),
        ("  _write: flush (INSERT record + recipients, savepoint)", ["_write", "flush"]),
        ("  _notify (the NOTIFY statement)", ["_notify"]),
        ("db.session.commit (view)", ["commit (sqlalchemy/orm/session"]),
        ("  of which waiting on the server", ["commit (sqlalchemy/orm/session", "wait (psycopg"]),
        ("psycopg waiting on the server (all)", ["wait (psycopg"]),
        ("SQLAlchemy ORM flush machinery", ["flush (sqlalchemy/orm/session"]),
        ("jsonify / response", ["jsonify"]),
    ]
    c.say("  inclusive share of request-handling samples:")
    for label, needles, *without in marks:
        excluded = without[0] if without else []
        n = sum(
            v
            for stack, v in handling.items()
            if all(x in stack for x in needles) and not any(x in stack for x in excluded)
        )
        c.say(f"    {n / total:6.1%}  {label}")


def _frame(frame: str) -> str:
    return frame.replace(str(c.ROOT) + "/.venv/lib/python3.11/site-packages/", "")[:110]


# --- main ----------------------------------------------------------------------------------


def setup(url: str) -> tuple[int, str]:
    app = c.make_app(url)
    with app.app_context():
        tenant = Tenant(slug="bench", name="Bench")
        db.session.add(tenant)
        db.session.flush()
        token = new_api_token()
        key = ApiKey(tenant_id=tenant.id, name="bench")
        key.set_token(token)
        db.session.add(key)
        db.session.commit()
        tenant_id = int(tenant.id)
        db.engine.dispose()
    return tenant_id, token


def _options(parser: Any) -> None:
    parser.add_argument("--profile", action="store_true", help="always profile")
    parser.add_argument(
        "--only", choices=("single", "batch"), help="measure one kind only (a quicker loop)"
    )
    parser.add_argument(
        "--threads",
        help="gunicorn threads per worker to sweep, comma-separated (default 1,4,8; quick 1,4)",
    )
    parser.add_argument("--workers", type=int, default=2, help="gunicorn workers (default 2)")
    parser.add_argument(
        "--compare",
        metavar="CHECKOUT",
        help="single sends only: ours against another checkout (e.g. a `git worktree` of an "
        "older commit), in ABBA turns per config and --rounds times, same database and key",
    )
    parser.add_argument("--rounds", type=int, default=2, help="ABBA rounds with --compare")


def run_server(
    kind: str,
    workers: int,
    threads: int,
    url: str,
    token: str,
    dsn: str,
    n: int,
    ceiling: bool,
    checkout: Path = c.ROOT,
) -> dict[str, Any]:
    """One wrk run against a fresh gunicorn: ours (``app:app`` of ``checkout``) or the
    hello-world ceiling."""
    hello_dir: Path | None = None
    if ceiling:
        hello_dir = Path(tempfile.mkdtemp(prefix="bench-hello-"))
        (hello_dir / "hello_bench.py").write_text(HELLO)
        server = Gunicorn(url, workers, threads, app="hello_bench:app", cwd=hello_dir)
    else:
        server = Gunicorn(url, workers, threads, cwd=checkout)
    try:
        server.wait_ready() if not ceiling else _wait_port(server)
        target = None if ceiling else dsn
        if kind == "single":
            r = wrk_run(server.base, "/api/v1/mail", MAIL, token, n, n, target)
        else:
            body = {"items": [MAIL] * BATCH}
            r = wrk_run(server.base, "/api/v1/mail/batch", body, token, n, n * BATCH, target)
    finally:
        server.stop()
        if hello_dir is not None:
            shutil.rmtree(hello_dir, ignore_errors=True)
    r["config"] = server.config()
    return r


def _wait_port(server: Gunicorn) -> None:
    """The hello-world app has no /health: wait until it answers at all."""
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(server.base + "/", timeout=1).read()
        except urllib.error.HTTPError:
            for _ in range(server.workers * 4):  # 404s: every worker up and imported
                with contextlib.suppress(urllib.error.HTTPError):
                    urllib.request.urlopen(server.base + "/", timeout=5).read()
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError("the hello-world gunicorn did not start")


def compare(args: Any, thread_counts: tuple[int, ...], singles: int) -> int:
    """Single sends/s of this checkout against another one, in ABBA turns on each config:
    a change's cost measured on the same machine, database and key in one run."""
    other = Path(args.compare).resolve()
    c.print_header(f"bench/accept.py --compare {other}: single sends, this checkout vs that", False)
    rows = []
    with c.bench_database(DB_NAME) as url:
        _tenant_id, token = setup(url)
        dsn = c.conninfo(url)
        for threads in thread_counts:
            rates: dict[str, list[float]] = {"this": [], "that": []}
            for _ in range(args.rounds):
                for who in ("this", "that", "that", "this"):
                    checkout = c.ROOT if who == "this" else other
                    r = run_server(
                        "single", args.workers, threads, url, token, dsn, singles, False, checkout
                    )
                    rates[who].append(singles / r["s"])
                    c.say(
                        f"  {who} {r['config']}: {singles / r['s']:,.0f} sends/s; p50 {r['p50']}"
                        f", p99 {r['p99']}; non-2xx {r['non2xx']}"
                    )
            this = sum(rates["this"]) / len(rates["this"])
            that = sum(rates["that"]) / len(rates["that"])
            rows.append(
                [
                    f"{args.workers} x {threads}",
                    this,
                    that,
                    f"{this / that:.3f}",
                    " ".join(f"{x:,.0f}" for x in rates["this"]),
                    " ".join(f"{x:,.0f}" for x in rates["that"]),
                ]
            )
    c.print_table(
        f"Single sends/s, this checkout vs {other} (mean of {2 * args.rounds} runs each, ABBA)",
        ["gunicorn", "this", "that", "this/that", "this runs", "that runs"],
        rows,
    )
    return 0


def main() -> int:
    args = c.parse_args(__doc__, _options)
    quick = args.quick
    if shutil.which("wrk") is None:
        c.say("wrk is not installed (apt-get install wrk); nothing measured")
        return 0
    if args.compare:
        threads = tuple(int(t) for t in (args.threads or "4").split(","))
        return compare(args, threads, 1_000 if quick else 3_000)
    singles = 1_000 if quick else 3_000
    batches = 10 if quick else 40
    if args.threads:
        thread_counts: tuple[int, ...] = tuple(int(t) for t in args.threads.split(","))
    else:
        thread_counts = (1, 4) if quick else THREADS
    workers = args.workers
    kinds = (args.only,) if args.only else ("single", "batch")
    c.print_header("bench/accept.py: acceptance API under gunicorn", quick)
    rows = []
    best: tuple[float, int] = (0.0, 4)
    best_batch = 0.0
    with c.bench_database(DB_NAME) as url:
        tenant_id, token = setup(url)
        dsn = c.conninfo(url)
        for kind in kinds:
            raw_rates: dict[str, list[float]] = {"raw": [], "raw+notify": []}
            ours: dict[int, dict[str, Any]] = {}
            ceiling: dict[int, float] = {}
            order: list[Any] = ["raw", "raw+notify"]
            for threads in thread_counts:
                order += [threads, -threads]  # ours, then the ceiling on the same config
            order += ["raw+notify", "raw"]
            n = singles if kind == "single" else batches
            for who in order:
                if isinstance(who, str):
                    notify = who == "raw+notify"
                    r = (
                        raw_single(dsn, tenant_id, singles, notify=notify)
                        if kind == "single"
                        else raw_batch(dsn, tenant_id, batches, notify=notify)
                    )
                    raw_rates[who].append(r["records"] / r["s"])
                    c.say(f"  {kind:<6} {who}: {r['records']:,} records in {r['s']:.2f} s")
                    continue
                threads, is_ceiling = abs(who), who < 0
                r = run_server(kind, workers, threads, url, token, dsn, n, is_ceiling)
                if is_ceiling:
                    ceiling[threads] = (n if kind == "single" else n * BATCH) / r["s"]
                    c.say(
                        f"  {kind:<6} ceiling (hello-world Flask) {r['config']}: {r['records']:,}"
                        f" requests in {r['s']:.2f} s; latency p50 {r['p50']}, p99 {r['p99']}"
                    )
                    continue
                ours[threads] = r
                c.say(
                    f"  {kind:<6} ours {r['config']}: {n:,} requests answered in "
                    f"{r['s']:.2f} s (database: +{r['records']:,} records); latency p50 "
                    f"{r['p50']}, p99 {r['p99']}; non-2xx "
                    f"{r['non2xx']}{'; socket errors ' + r['errors'] if r['errors'] else ''}"
                    f"{'; ' + r['short'] if 'short' in r else ''}"
                )
            raw = sum(raw_rates["raw"]) / len(raw_rates["raw"])
            raw_notify = sum(raw_rates["raw+notify"]) / len(raw_rates["raw+notify"])
            goal = SINGLE_GOAL if kind == "single" else BATCH_GOAL
            unit = "sends/s" if kind == "single" else "records/s"
            for threads, r in ours.items():
                expected = singles if kind == "single" else batches * BATCH
                rate = expected / r["s"]
                if kind == "single" and rate > best[0]:
                    best = (rate, threads)
                if kind == "batch":
                    best_batch = max(best_batch, rate)
                rows.append(
                    [
                        kind,
                        r["config"],
                        rate,
                        raw,
                        f"{rate / raw:.2f}",
                        raw_notify,
                        f"{rate / raw_notify:.2f}",
                        ceiling[threads],
                        f"{rate / ceiling[threads]:.2f}",
                        f">= {goal:,.0f} {unit}",
                        c.verdict(rate >= goal),
                        r["non2xx"],
                        f"{r['p50']} / {r['p99']}",
                    ]
                )
        c.print_table(
            f"Acceptance throughput (wrk: {WRK_THREADS} threads, {WRK_CONNECTIONS} connections; "
            f"batch = {BATCH} items; raw: mean of the runs before and after; ceiling: a "
            "hello-world Flask endpoint under the same gunicorn, no database)",
            [
                "kind",
                "gunicorn",
                "ours",
                "raw",
                "ours/raw",
                "raw+NOTIFY",
                "ours/that",
                "ceiling",
                "ours/ceil",
                "goal",
                "",
                "non-2xx",
                "latency p50 / p99",
            ],
            rows,
        )
        if "single" in kinds:
            c.say(f"\nbest single-send config: {workers} workers x {best[1]} threads")
        if "single" in kinds and (best[0] < SINGLE_GOAL or args.profile):
            profile(url, token, dsn, best[1], "single", 500 if quick else 2_000)
        if "batch" in kinds and (best_batch < BATCH_GOAL or args.profile):
            profile(url, token, dsn, best[1], "batch", 5 if quick else 20)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
