"""End-to-end mail: accepted records delivered over SMTP to a local aiosmtpd sink
(scripts/smtp_sink.py's SinkHandler), ours vs a bare smtplib loop, same sink, same run.

ours  N Pending records accepted (portal.messaging.records.acceptance, not timed), then
      portal.delivery.service.DeliveryService with T mail workers (the product's engine, a poll
      interval of 0.5 s, LISTEN/NOTIFY, logging as worker.py sets it) until all N are Sent:
      claim, preparation (server choice, quota charge, write-back), SMTP over a reused
      connection per worker, the versioned Sent.
raw   T threads, each one smtplib connection reused for all its messages, sending equivalent
      messages (the same headers, a text body of the same size, built per message with
      email.message.EmailMessage) to the same sink.

Runs alternate (raw, ours, ours, raw) per thread count, each sized to last about --seconds
(6 s; from the previous run of the same side). The sink runs both as its own process (as a
real server would: the comparison we report) and on a thread of this process (sharing the GIL
with whichever side is sending), to show which is fair; --sink-port uses one already running
(the peers' sink, so ours and post_office send to the same one).

Connections: a pool keeps at most pool size - 1 workers in flight to one server (the per-server
cap), so ours with 4 workers holds 3 SMTP sessions at once against smtplib's 4 threads;
--equal-connections gives ours one worker more (above 1) so both use as many at once.
Goals: ours >= 0.75 x the bare loop at 1 worker, >= 0.85 x at equal connections.
"""

from __future__ import annotations

import contextlib
import json
import os
import smtplib
import threading
import time
from datetime import UTC, datetime
from email import policy
from email.message import EmailMessage
from email.utils import format_datetime
from typing import Any

import _common as c  # first: puts the repository root on sys.path
import budget
import psycopg

from portal.delivery.service import DeliveryService
from portal.extensions import db
from portal.messaging.records import acceptance
from portal.messaging.sending import sent_write
from portal.models import Channel
from portal.tenancy import tenant_context

DB_NAME = "postroom_bench_smtp"
# Ours >= 0.75 x bare smtplib at 1 worker, >= 0.85 x with as many connections above.
GOAL_ONE = 0.75
GOAL_MANY = 0.85
ORDER = ("raw", "ours", "ours", "raw")
BODY = ("Hello Ann,\n\nThis is a benchmark message from postroom. " * 20)[:1000]
SUBJECT = "Your benchmark message"
RCPT = "ann@example.com"
SENDER = "sender@bench.test"


def accept(app: Any, tenant_id: int, n: int, body: str = BODY) -> tuple[int, int]:
    """``n`` Pending mail records through acceptance (batches of 500); the id range."""
    settings = app.config["SETTINGS"]
    ids: list[int] = []
    with app.app_context(), tenant_context(tenant_id):
        for start in range(0, n, 500):
            items = [
                {"to": [RCPT], "subject": SUBJECT, "text": body} for _ in range(min(500, n - start))
            ]
            ids += [a.id for a in acceptance.send_mail_batch(db.session, items, settings=settings)]
            db.session.commit()
        db.session.remove()
    return min(ids), max(ids)


def run_ours(
    app: Any,
    dsn: str,
    tenant_id: int,
    threads: int,
    n: int,
    meter: budget.Meter | None = None,
    body: str = BODY,
) -> dict[str, float]:
    """``n`` accepted records sent by a DeliveryService of ``threads`` mail workers; with a
    ``meter``, its window is the sending (the pool's connections stay open and warm, so
    ``meter.finish`` waits for their statistics)."""
    lo, hi = accept(app, tenant_id, n, body)
    settings = app.config["SETTINGS"].replace(mail_send_concurrency=threads, sms_send_concurrency=0)
    with app.app_context():
        engine = db.engine
    service = DeliveryService(engine, settings)
    writes = sent_write._committer(engine, Channel.MAIL)
    batches, written = writes.batches, writes.written
    count_sql = (
        "SELECT count(*) FILTER (WHERE status = 'Sent'), "
        "count(*) FILTER (WHERE status NOT IN ('Sent', 'Pending', 'Sending')) "
        "FROM mail_send_record WHERE id BETWEEN %s AND %s"
    )
    if meter is not None:
        meter.start()
    watching = meter.not_counted if meter is not None else contextlib.nullcontext
    with watching():
        conn = psycopg.connect(dsn, autocommit=True, application_name=budget.WATCH_APP)
    with conn:
        cpu = time.process_time()
        began = time.perf_counter()
        service.start()
        sent = failed = 0
        deadline = began + 600
        while time.perf_counter() < deadline:
            with watching():
                row = conn.execute(count_sql, (lo, hi)).fetchone()
            assert row is not None
            sent, failed = row
            if sent + failed >= n:
                break
            time.sleep(0.02)
        elapsed = time.perf_counter() - began
        cpu = time.process_time() - cpu
        if meter is not None:
            meter.mark_end()
    service.stop()
    service.wait(10)
    batches, written = writes.batches - batches, writes.written - written
    print(f"  ours, {threads} workers: {written} Sent writes in {batches} statements")
    return {"n": sent, "s": elapsed, "cpu": cpu, "failed": failed}


def build(i: int) -> EmailMessage:
    msg = EmailMessage(policy=policy.SMTP)
    msg["Message-ID"] = f"<raw-{i}@bench.test>"
    msg["Date"] = format_datetime(datetime.now(UTC))
    msg["From"] = f"Bench <{SENDER}>"
    msg["To"] = RCPT
    msg["Subject"] = SUBJECT
    msg["X-Postroom-Record"] = str(i)
    msg.set_content(BODY)
    return msg


def run_raw(
    sink: c.Sink, threads: int, n: int, meter: budget.Meter | None = None
) -> dict[str, float]:
    shares = [n // threads + (1 if i < n % threads else 0) for i in range(threads)]
    barrier = threading.Barrier(threads + 1)
    done = [0] * threads
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        barrier.wait()
        try:
            with smtplib.SMTP(sink.host, sink.port, local_hostname="bench.local", timeout=30) as s:
                for i in range(shares[k]):
                    msg = build(k * n + i)
                    s.sendmail(SENDER, [RCPT], msg.as_bytes())
                    done[k] += 1
        except BaseException as exc:
            errors.append(exc)

    pool = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    if meter is not None:
        meter.start()
    for t in pool:
        t.start()
    cpu = time.process_time()
    barrier.wait()
    began = time.perf_counter()
    for t in pool:
        t.join()
    elapsed = time.perf_counter() - began
    cpu = time.process_time() - cpu
    if meter is not None:
        meter.mark_end()
    if errors:
        raise errors[0]
    return {"n": sum(done), "s": elapsed, "cpu": cpu, "failed": 0}


def sized(rate: float | None, seconds: float, quick: bool) -> int:
    """Mails for a run of about ``seconds`` at ``rate`` (the last run's of that side)."""
    if quick:
        return 300
    if rate is None or rate != rate:
        return 1_000
    return max(600, min(50_000, int(rate * seconds)))


def compare(
    app: Any,
    dsn: str,
    sink: c.Sink,
    tenant_id: int,
    threads: int,
    workers: int,
    args: Any,
    rounds: int,
) -> dict[str, dict[str, float]]:
    """Rounds of raw (``threads`` smtplib connections) and ours (``workers`` workers)."""
    totals = {name: {"n": 0.0, "s": 0.0, "cpu": 0.0, "failed": 0.0} for name in ("raw", "ours")}
    # One short run of each side first, not counted: the sizes of the timed runs.
    last = {
        "raw": _rate(run_raw(sink, threads, 300)),
        "ours": _rate(run_ours(app, dsn, tenant_id, workers, 300)),
    }
    for r in range(rounds):
        line = []
        for name in ORDER:
            n = sized(last[name], args.seconds, args.quick)
            sink.clear()
            load = os.getloadavg()[0]
            with sink.quiet():
                result = (
                    run_raw(sink, threads, n)
                    if name == "raw"
                    else run_ours(app, dsn, tenant_id, workers, n)
                )
            kept = sink.kept()
            last[name] = _rate(result)
            for key in totals[name]:
                totals[name][key] += result[key]
            line.append(
                f"{name} {last[name]:,.0f} ({result['n']:,.0f} in {result['s']:.1f} s, "
                f"load {load:.1f})"
            )
            if (kept is not None and kept != result["n"]) or result["failed"]:
                line[-1] += f" (sink kept {kept}, failed {result['failed']:.0f})"
        c.say(f"  round {r + 1}/{rounds} (mail/s): " + "; ".join(line))
    return totals


def budgets(
    app: Any,
    dsn: str,
    sink: c.Sink,
    tenant_id: int,
    threads: int,
    workers: int,
    totals: dict[str, dict[str, float]],
    args: Any,
) -> list[budget.Budget]:
    """One more run of each side under bench/budget.py's meter, of at least 5 s (not in the
    rates above): what a mail costs in each process, statements and writes."""
    seconds = max(args.seconds, 6.0)
    out = []
    with budget.Meter(dsn, sink_pid=sink.pid) as meter:

        def ours(n: int) -> budget.Budget:
            sink.clear()
            with sink.quiet():
                result = run_ours(app, dsn, tenant_id, workers, n, meter=meter)
            label = f"ours, {workers} worker{'s' if workers > 1 else ''}"
            return meter.finish(label, int(result["n"]))

        def raw(n: int) -> budget.Budget:
            sink.clear()
            with sink.quiet():
                result = run_raw(sink, threads, n, meter=meter)
            label = f"smtplib, {threads} thread{'s' if threads > 1 else ''}"
            return meter.finish(label, int(result["n"]))

        for name, side in (("ours", ours), ("raw", raw)):
            n = sized(_rate(totals[name]), seconds, args.quick)
            out.append(budget.long_enough(side, n, args.quick))
    return out


def _rate(result: dict[str, float]) -> float:
    return result["n"] / result["s"] if result["s"] > 0 else float("nan")


def breakdown(app: Any, sink: c.Sink, tenant_id: int, n: int) -> None:
    """What one worker does per mail, in this thread: round trips, and a cProfile of this
    thread's CPU time (claim_due + process_mail, as a pool worker runs them)."""
    import cProfile

    from sqlalchemy import event

    from portal.messaging.sending.backoff import BackoffPolicy
    from portal.messaging.sending.claim import claim_due
    from portal.messaging.sending.pipeline import MailContext, process_mail
    from portal.models import MailSendRecord

    accept(app, tenant_id, n)
    settings = app.config["SETTINGS"]
    with app.app_context():
        engine = db.engine
    counts = {"statements": 0, "begin": 0, "commit": 0, "checkout": 0}

    def bump(name: str) -> Any:
        def listener(*_: Any) -> None:
            counts[name] += 1

        return listener

    listeners = [
        (engine, "after_cursor_execute", bump("statements")),
        (engine, "begin", bump("begin")),
        (engine, "commit", bump("commit")),
        (engine.pool, "checkout", bump("checkout")),
    ]
    for target, name, fn in listeners:
        event.listen(target, name, fn)
    ctx = MailContext(
        engine=engine, settings=settings, policy=BackoffPolicy.from_settings(settings)
    )
    done = 0
    profiler = cProfile.Profile(time.thread_time)
    began = time.perf_counter()
    with sink.quiet():
        profiler.enable()
        while done < n:
            claimed = claim_due(engine, MailSendRecord, 1)
            if not claimed:
                break
            process_mail(ctx, claimed[0])
            done += 1
        profiler.disable()
    elapsed = time.perf_counter() - began
    ctx.close()
    for target, name, fn in listeners:
        event.remove(target, name, fn)
    per = {k: v / max(done, 1) for k, v in counts.items()}
    c.say(
        f"\nBreakdown of ours, 1 worker in this thread, {done:,} mails, under cProfile (this "
        f"thread's CPU time): {elapsed / max(done, 1) * 1e6:,.0f} us wall per mail\n"
        f"  database round trips per mail: {per['checkout']:.1f} pool checkouts; "
        f"{per['statements']:.1f} statements through SQLAlchemy (+ {per['begin']:.1f} BEGIN, "
        f"{per['commit']:.1f} COMMIT), the rest one statement each on the driver; raw: none"
    )
    c.say_profile(profiler, "cProfile by own time (top 25)", "tottime", 25)
    c.say_profile(
        profiler,
        "cProfile, cumulative CPU of selected steps (per call: divide by the mail count)",
        "cumulative",
        r"portal/|psycopg/cursor\.py:\d+\(execute\)"
        r"|orm/session\.py:\d+\((commit|execute|scalars|scalar)\)"
        r"|pool/base\.py:\d+\(_checkout\)|smtplib\.py:\d+\((mail|rcpt|data|getreply|send)\)"
        r"|email/message\.py:\d+\((as_bytes|set_content)\)|cache_key\.py:209"
        r"|logging/__init__\.py:\d+\(info\)",
        lines=33,
    )


def _options(p: Any) -> None:
    p.add_argument("--log", default="info", help="worker log level (default: info)")
    p.add_argument("--breakdown", action="store_true", help="only the profile of one worker")
    p.add_argument(
        "--sink",
        choices=("both", "subprocess", "inproc"),
        default="both",
        help="where the sink runs (default: both; the subprocess one is the verdict)",
    )
    p.add_argument(
        "--sink-port",
        type=int,
        default=None,
        help="use a sink already listening on 127.0.0.1:PORT instead (e.g. the peers' "
        "run.sh sink, $PEERS_SMTP_PORT)",
    )
    p.add_argument("--threads", default="1,4", help="smtplib threads = our workers (1,4)")
    p.add_argument(
        "--equal-connections",
        action="store_true",
        help="ours with one worker more than the raw loop's threads (above 1): a pool keeps "
        "at most pool size - 1 workers in flight to one server, so N + 1 workers use N "
        "connections at once, as N smtplib threads (and post_office's N threads) do",
    )
    p.add_argument("--seconds", type=float, default=6.0, help="length of a run (6)")
    p.add_argument("--rounds", type=int, default=2, help="ABBA rounds (2)")
    p.add_argument(
        "--json", action="store_true", help="also one JSON line per config (peers' PEERS_OWN)"
    )
    p.add_argument(
        "--no-budget",
        dest="budget",
        action="store_false",
        help="skip the budget per mail (one more run of each side under bench/budget.py's "
        "meter, with the sink in its own process)",
    )
    p.add_argument(
        "--sink-pid",
        type=int,
        default=int(os.environ.get("PEERS_SINK_PID") or 0) or None,
        help="the process of the --sink-port sink, for its CPU (default: $PEERS_SINK_PID)",
    )


def main() -> int:
    args = c.parse_args(__doc__, _options)
    quick = args.quick
    rounds = 1 if quick else args.rounds
    thread_counts = tuple(int(t) for t in args.threads.split(","))
    if args.sink_port:
        modes: tuple[str, ...] = ("external",)
    else:
        modes = ("subprocess", "inproc") if args.sink == "both" else (args.sink,)
        if quick and args.sink == "both":
            modes = ("subprocess",)
    c.print_header("bench/smtp.py: end-to-end mail to a local SMTP sink", quick)
    rows = []
    measured: dict[str, list[budget.Budget]] = {}
    with c.bench_database(DB_NAME) as url:
        app = c.make_app(url)
        c.worker_logging(args.log)
        dsn = c.conninfo(url)
        for mode in modes:
            sink = c.Sink(mode, port=args.sink_port or 0, external_pid=args.sink_pid).start()
            try:
                tenant_id = c.tenant_with_mail_server(app, sink.host, sink.port, slug=mode)
                if args.breakdown:
                    breakdown(app, sink, tenant_id, 200 if quick else 600)
                    continue
                for threads in thread_counts:
                    workers = threads + 1 if args.equal_connections and threads > 1 else threads
                    c.say(
                        f"\nsink {mode}, {threads} smtplib thread(s), ours {workers} worker(s), "
                        f"runs of about {args.seconds:.0f} s, {ORDER}:"
                    )
                    totals = compare(app, dsn, sink, tenant_id, threads, workers, args, rounds)
                    spent = []
                    if args.budget and mode != "inproc":
                        spent = budgets(app, dsn, sink, tenant_id, threads, workers, totals, args)
                        measured.setdefault(mode, []).extend(spent)
                    ours = totals["ours"]["n"] / totals["ours"]["s"]
                    raw = totals["raw"]["n"] / totals["raw"]["s"]
                    ratio = ours / raw
                    goal = GOAL_ONE if threads == 1 else GOAL_MANY
                    verdict_mode = mode != "inproc"
                    rows.append(
                        [
                            mode,
                            threads,
                            workers,
                            ours,
                            raw,
                            f"{ratio:.2f}",
                            f">= {goal}",
                            c.verdict(ratio >= goal) + ("" if verdict_mode else " (info)"),
                            totals["ours"]["cpu"] / totals["ours"]["n"] * 1e6,
                            totals["raw"]["cpu"] / totals["raw"]["n"] * 1e6,
                        ]
                    )
                    if args.json:
                        print(
                            json.dumps(
                                {
                                    "bench": "ours smtp.py",
                                    "config": f"workers={workers} smtplib threads={threads}",
                                    "rates": {
                                        "mail/s": round(ours, 1),
                                        "raw mail/s": round(raw, 1),
                                    },
                                    "round": int(os.environ.get("PEERS_ROUND", "0")),
                                    "load_at_end": os.getloadavg()[0],
                                    "budget": [b.as_json() for b in spent],
                                }
                            ),
                            flush=True,
                        )
                if mode == "subprocess" and any(
                    r[0] == "subprocess" and r[7].startswith("MISSED") for r in rows
                ):
                    breakdown(app, sink, tenant_id, 200 if quick else 600)
            finally:
                sink.stop()
        with app.app_context():
            db.engine.dispose()
    if not rows:  # --breakdown: the profile is all there is
        return 0
    c.print_table(
        "Mail/s delivered end to end (client CPU: this process; with the in-process sink it "
        "includes the sink)",
        [
            "sink",
            "smtplib threads",
            "our workers",
            "ours mail/s",
            "raw mail/s",
            "ours/raw",
            "goal",
            "",
            "CPU us/mail: ours",
            "raw",
        ],
        rows,
    )
    for mode, spent in measured.items():
        budget.print_budgets(
            f"Budget per mail, sink {mode} (bench/budget.py: one more run of each side, "
            "not in the rates above)",
            spent,
        )
    c.say(f"\nload average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
