"""Budget per mail, ours beside django-post_office: the same mails to the same SMTP sink, each
side measured by bench/budget.py's meter (CPU of the worker, of PostgreSQL's backends and of the
sink; statements, round trips, rows, index entries and WAL per mail).

ours         N records accepted (not measured), then DeliveryService with W mail workers
             (default 5: the per-server cap keeps 4 SMTP sessions at once) until all are Sent,
             as bench/smtp.py runs it, with post_office's message body (1.9 KB).
post_office  the peers' own ../shared/peers/bench_po.py (send_queued_mail_until_done, Django's
             SMTP backend, --po-threads threads, default 4), run by the peers' venv
             (~/.cache/peers/venv: ../shared/peers/run.sh makes it) with bench/budget.py's
             psycopg hook installed and its window wrapped around send_queued_mail_until_done
             (setup, migrate and queueing are outside). Its database is renamed
             <db-prefix>_peer_po so that it never meets a run.sh of the peers. Its own
             connections are closed at both ends of the window (post_office opens a new one
             for every batch of 100 anyway) so that the backends' CPU and statistics are read
             whole. post_office commits 100 mails at a time and locks no row: a crash resends
             up to 100.

floor        the least a sender with our guarantees can do per mail, on our own table: bare
             psycopg and smtplib, --po-threads threads, one statement and one commit a mail
             (shape.py's today-full: claim.py's raw1, i.e. the Sent write by version and the
             next claim, oldest Pending first, FOR UPDATE SKIP LOCKED, plus the attempt's row
             and the claimed record returned whole), a message written as one f-string. It
             keeps what ours keeps across a crash (the record locked and versioned, Sent and
             the attempt durable before the next send: at most the one mail in flight resent)
             and nothing else: no preparation, quota, fairness,
             breaker, suppression, delivery events or logging. Ours over the floor is what
             those cost; the floor over post_office is what a durable write per mail costs.

The sink is scripts/smtp_sink.py's SinkHandler in its own process (it parses each mail and
keeps it as a file), the same for all three. Runs alternate ours, post_office, floor, floor,
post_office, ours (--rounds of them), each sized to last about --seconds (at least 5 s).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import budget  # the standard library and psycopg only: the peers' venv imports it too
import psycopg

HERE = Path(__file__).resolve().parent
PEERS_DIR = HERE.parent.parent / "shared" / "peers"
VENV_PYTHON = Path(os.environ.get("PEERS_DIR", "~/.cache/peers")).expanduser() / "venv/bin/python"
DB_NAME = "postroom_bench_budget"
# bench_po.py's message: its body, as it builds it for mail i.
PO_BODY = ("Hello {i}, this is a benchmark message body. " * 40)[:1900]
ORDER = ("ours", "post_office", "floor", "floor", "post_office", "ours")


# --- in the peers' venv: bench_po.py with the meter's hook and window --------------------------


def po_child(peers_dir: str, prefix: str, argv: list[str]) -> int:
    """bench_po.py's main, its database named ``prefix`` + "po", with the hook installed and a
    window around send_queued_mail_until_done: "budget-ready" on stdout, then a line on stdin
    starts it; at the end the hook's report on stdout, then a line on stdin lets it go on."""
    sys.path.insert(0, peers_dir)
    import bench_po  # type: ignore[import-not-found]
    import django  # type: ignore[import-not-found]
    import peers_pg  # type: ignore[import-not-found]

    peers_pg.PREFIX = prefix
    budget.HOOKS.install()
    setup = django.setup

    def setup_then_wrap(*args: Any, **kwargs: Any) -> None:
        setup(*args, **kwargs)
        from post_office import mail  # type: ignore[import-not-found]

        mail.send_queued_mail_until_done = windowed(mail.send_queued_mail_until_done)

    def windowed(send: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            from django.db import connections  # type: ignore[import-not-found]

            connections.close_all()  # the queueing's connection: its statistics land now
            print("budget-ready", flush=True)
            sys.stdin.readline()
            budget.HOOKS.reset()
            try:
                return send(*args, **kwargs)
            finally:
                connections.close_all()  # the last check for more mail: read as it closes
                print(budget.child_report_line(budget.HOOKS.report()), flush=True)
                sys.stdin.readline()

        return run

    django.setup = setup_then_wrap
    sys.argv = ["bench_po.py", *argv]
    bench_po.main()
    return 0


# --- here: the two sides in turns --------------------------------------------------------------


def run_po(
    c: Any, sink: Any, n: int, threads: int, peers: Path, python: Path, log: Any
) -> budget.Budget:
    """One run of bench_po.py under the meter: its budget."""
    from psycopg.conninfo import make_conninfo

    prefix = f"{c.DB_PREFIX}_peer_"
    admin = c.conninfo(c.ADMIN_URL)
    process = subprocess.Popen(
        [
            str(python),
            __file__,
            "--po-child",
            str(peers),
            prefix,
            str(n),
            "--backend",
            "smtp",
            "--smtp-port",
            str(sink.port),
            "--threads",
            str(threads),
        ],
        cwd=peers,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env=dict(os.environ, PEERS_PG=admin),
    )
    assert process.stdin is not None
    assert process.stdout is not None
    meter: budget.Meter | None = None
    spent: budget.Budget | None = None
    result: dict[str, Any] = {}
    try:
        for line in process.stdout:
            if line.startswith("budget-ready"):
                meter = budget.Meter(
                    make_conninfo(admin, dbname=prefix + "po"),
                    own=False,
                    processes=[process.pid],
                    sink_pid=sink.pid,
                )
                meter.start()
                process.stdin.write("go\n")
                process.stdin.flush()
            elif (report := budget.read_report(line)) is not None:
                assert meter is not None
                meter.mark_end()
                # Before bench_po.py goes on: it drops its database when it ends.
                spent = meter.finish(f"post_office, {threads} threads", n, remote=[report])
                meter.close()
                process.stdin.write("go on\n")
                process.stdin.flush()
            elif line.startswith("{"):
                result = json.loads(line)
    finally:
        process.stdin.close()  # a child still waiting for a line goes on, and drops its database
        try:
            process.wait(120)
        except subprocess.TimeoutExpired:
            process.terminate()  # our own child, by its pid
            process.wait(30)
    if process.returncode != 0 or spent is None:
        raise RuntimeError(f"bench_po.py failed (exit {process.returncode}); see {log.name}")
    if result.get("sent") != n or not result.get("ok"):
        spent.notes.append(f"post_office sent {result.get('sent')} of {n}")
    return spent


# --- the floor: our guarantees and nothing else ---------------------------------------------


def floor_message(record_id: int, to: list[str], subject: str, text: str) -> bytes:
    """The mail as one f-string: the headers ours sends for a plain-text mail; the body
    quoted-printable, as ours encodes a body with lines over 78 characters."""
    from email import quoprimime
    from email.utils import format_datetime

    from smtp import SENDER

    body = "\r\n".join(quoprimime.body_encode(text, 76).splitlines())
    return (
        f"Message-ID: <floor-{record_id}@bench.test>\r\n"
        f"Date: {format_datetime(datetime.now(UTC))}\r\n"
        f"From: Bench <{SENDER}>\r\nTo: {', '.join(to)}\r\nSubject: {subject}\r\n"
        'Content-Type: text/plain; charset="utf-8"\r\n'
        "Content-Transfer-Encoding: quoted-printable\r\n"
        f"MIME-Version: 1.0\r\n\r\n{body}\r\n"
    ).encode()


def run_floor(dsn: str, sink: Any, threads: int, n: int, meter: budget.Meter) -> int:
    """``n`` accepted records sent by ``threads`` floor loops; the count sent."""
    import smtplib

    from shape import today_full_sql
    from smtp import SENDER

    sql = today_full_sql()
    # The attempt row's worker, server, ambiguity and reply, as shape.py's today-full binds them.
    attempt = ("bench-floor", None, None, False, "250", "2.0.0 Ok")
    sent = [0] * threads
    errors: list[BaseException] = []
    ready = threading.Barrier(threads + 1)  # connected: the meter starts
    go = threading.Event()  # the meter started: the loops start

    def loop(k: int) -> None:
        try:
            with (
                psycopg.connect(dsn, autocommit=True) as conn,
                smtplib.SMTP(sink.host, sink.port) as server,
            ):
                cursor = psycopg.RawCursor(conn)
                ready.wait()
                go.wait()
                # The first claim: the same statement, with a Sent write that matches no row.
                params: tuple[Any, ...] = (None, -1, -1, datetime.now(UTC), 0)
                row = cursor.execute(sql, params + attempt, prepare=True).fetchone()
                names = [d.name for d in cursor.description or ()]
                at = [names.index(n) for n in ("id", "version", "to_addrs", "subject", "text_body")]
                while row is not None and row[at[0]] is not None:
                    record_id, version, to, subject, text = (row[i] for i in at)
                    started = datetime.now(UTC)
                    server.sendmail(SENDER, to, floor_message(record_id, to, subject, text))
                    took = int((datetime.now(UTC) - started).total_seconds() * 1000)
                    params = (f"<floor-{record_id}@bench.test>", record_id, version, started, took)
                    row = cursor.execute(sql, params + attempt, prepare=True).fetchone()
                    assert row is not None
                    assert row[0] == 1, "a Sent write by version missed"
                    sent[k] += 1
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)
            ready.abort()

    workers = [threading.Thread(target=loop, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    with contextlib.suppress(threading.BrokenBarrierError):
        ready.wait()
        meter.start()
    go.set()
    for w in workers:
        w.join()
    meter.mark_end()
    if errors:
        raise errors[0]
    return sum(sent)


def main() -> int:
    if sys.argv[1:2] == ["--po-child"]:
        return po_child(sys.argv[2], sys.argv[3], sys.argv[4:])

    import _common as c
    import smtp

    args = c.parse_args(
        __doc__,
        lambda p: (
            p.add_argument("--workers", type=int, default=5, help="our mail workers (5)"),
            p.add_argument("--po-threads", type=int, default=4, help="post_office threads (4)"),
            p.add_argument("--seconds", type=float, default=6.0, help="length of a run (6)"),
            p.add_argument("--rounds", type=int, default=1, help="ABBA rounds (1)"),
            p.add_argument("--peers-dir", default=str(PEERS_DIR), help="bench_po.py's folder"),
            p.add_argument("--peers-python", default=str(VENV_PYTHON), help="the peers' venv"),
            p.add_argument("--json", action="store_true", help="also one JSON line per side"),
            p.add_argument(
                "--sides",
                default="ours,post_office,floor",
                help="the sides to run, in the turns' order (default: all three)",
            ),
            p.add_argument(
                "--shape",
                action="append",
                default=[],
                help="SQL run on our database after the migrations, as budget.py's --shape (a "
                "lever to size before it is built: a function's body, a trigger); repeatable",
            ),
        ),
    )
    python, peers = Path(args.peers_python), Path(args.peers_dir)
    wanted = [side.strip() for side in args.sides.split(",") if side.strip()]
    unknown = set(wanted) - set(ORDER)
    if unknown or not wanted:
        c.say(f"--sides: choose among {', '.join(dict.fromkeys(ORDER))}")
        return 1
    if "post_office" in wanted and not python.exists():
        c.say(f"{python} is missing: run {peers / 'run.sh'} once (it makes the peers' venv)")
        return 1
    seconds = max(args.seconds, 5.0)
    order = [side for side in (ORDER[:3] if args.quick else ORDER * args.rounds) if side in wanted]
    c.print_header(
        "bench/peers_budget.py: per mail, ours, django-post_office and the floor", args.quick
    )
    labels = {
        "ours": f"ours, {args.workers} workers",
        "post_office": f"post_office, {args.po_threads} threads",
        "floor": f"floor, {args.po_threads} threads",
    }
    runs: dict[str, list[budget.Budget]] = {"ours": [], "post_office": [], "floor": []}
    rates: dict[str, list[float]] = {"ours": [], "post_office": [], "floor": []}
    log_file = tempfile.NamedTemporaryFile(  # noqa: SIM115 (kept for reading after a failure)
        "w", prefix="peers-budget-", suffix=".log", delete=False
    )
    with c.bench_database(DB_NAME) as url, log_file as log:
        app = c.make_app(url)
        c.worker_logging("info")
        dsn = c.conninfo(url)
        with psycopg.connect(dsn, autocommit=True) as conn:
            for sql in args.shape:
                conn.execute(sql)
        sink = c.Sink("subprocess").start()
        try:
            tenant_id = c.tenant_with_mail_server(app, sink.host, sink.port, slug="budget")
            # A warm-up of ours (imports, plans, connections): not measured.
            smtp.run_ours(app, dsn, tenant_id, args.workers, 200, body=PO_BODY.format(i=0))

            def ours(n: int) -> budget.Budget:
                sink.clear()
                with budget.Meter(dsn, sink_pid=sink.pid) as meter:
                    body = PO_BODY.format(i=n)
                    result = smtp.run_ours(
                        app, dsn, tenant_id, args.workers, n, meter=meter, body=body
                    )
                    return meter.finish(labels["ours"], int(result["n"]))

            def post_office(n: int) -> budget.Budget:
                sink.clear()
                return run_po(c, sink, n, args.po_threads, peers, python, log)

            def floor(n: int) -> budget.Budget:
                smtp.accept(app, tenant_id, n, body=PO_BODY.format(i=n))
                sink.clear()
                with budget.Meter(dsn, sink_pid=sink.pid) as meter:
                    done = run_floor(dsn, sink, args.po_threads, n, meter)
                    return meter.finish(labels["floor"], done)

            sides = {"ours": ours, "post_office": post_office, "floor": floor}

            for side in order:
                last = rates[side][-1] if rates[side] else None
                # The first run of each side: post_office queues 100 a batch, so 3,000 are 30
                # batches; later ones sized from the side's last rate.
                n = 300 if args.quick else int(last * seconds) if last else 3_000
                load = os.getloadavg()[0]
                spent = budget.long_enough(sides[side], n, args.quick)
                kept = sink.kept()
                rate = spent.units / spent.seconds
                runs[side].append(spent)
                rates[side].append(rate)
                c.say(
                    f"  {side}: {spent.units:,} mails in {spent.seconds:.1f} s, {rate:,.0f} mail/s "
                    f"(load {load:.1f}; the sink kept {kept})"
                )
        finally:
            sink.stop()
            with app.app_context():
                from portal.extensions import db

                db.engine.dispose()
    ran = [side for side in labels if runs[side]]
    combined = [budget.combine(labels[side], runs[side]) for side in ran]
    c.say(
        "\nmail/s in the windows: "
        + "; ".join(f"{side} " + ", ".join(f"{r:,.0f}" for r in rates[side]) for side in ran)
    )
    budget.print_budgets(
        "Budget per mail (bench/budget.py), the same sink process; totals over the runs",
        combined,
    )
    if args.json:
        for side, spent in zip(ran, combined, strict=True):
            print(
                json.dumps(
                    {
                        "bench": f"budget {side}",
                        "config": spent.label,
                        "rates": {"mail/s": round(spent.units / spent.seconds, 1)},
                        "budget": spent.as_json(),
                    }
                ),
                flush=True,
            )
    c.say(f"\nload average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
