"""Shared set-up for the benchmarks: a database of their own, migrated with the real migrations,
history rows made fast with generate_series, the raw SQL each bench compares against, an SMTP
sink, and the printing of figures.

Every bench measures ours and the raw limit in the same run (the machine is shared, so only
ratios hold), prints both, and exits 0 whether or not the goal is met: it reports, it does not
assert.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python bench/NAME.py` puts bench/, not the root, on the path
    sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402
from flask import Flask  # noqa: E402
from sqlalchemy import create_engine, make_url, text  # noqa: E402

from portal import create_app  # noqa: E402
from portal.config import Settings  # noqa: E402

ADMIN_URL = os.environ.get(
    "BENCH_PG_ADMIN_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)
REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/14")
# Every bench database is named "<prefix>_<bench>": several people (or sessions) sharing one
# PostgreSQL server each pass their own prefix, so one run never drops another's database.
DEFAULT_DB_PREFIX = "postroom_bench"
DB_PREFIX = os.environ.get("BENCH_DB_PREFIX", DEFAULT_DB_PREFIX)
SECRET_KEY = "bench-secret-key-not-for-production"

# --- arguments and printing --------------------------------------------------------------------


def say_profile(
    profiler: Any, title: str, sort: str, *restrictions: Any, lines: int | None = None
) -> None:
    """A cProfile's stats under ``title``, sorted by ``sort`` ("tottime", "cumulative"),
    limited by ``restrictions`` (a count, a regex: pstats' own), at most ``lines`` lines,
    with site-packages paths shortened."""
    import pstats

    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats(sort).print_stats(*restrictions)
    say(f"  {title}:")
    shown = out.getvalue().splitlines()[7:]
    for line in shown[:lines] if lines is not None else shown:
        if line.strip():
            say("    " + line.replace(str(ROOT) + "/.venv/lib/python3.11/site-packages/", "")[:150])


def parse_args(doc: str | None, extra: Any = None) -> argparse.Namespace:
    # SIGTERM unwinds like Ctrl-C, so the bench database is dropped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run (< 1 min)")
    parser.add_argument(
        "--db-prefix",
        default=DB_PREFIX,
        help="name prefix of the bench databases (default: $BENCH_DB_PREFIX or "
        f"{DEFAULT_DB_PREFIX}); give your own on a shared server",
    )
    parser.add_argument(
        "--redis-url",
        default=REDIS_URL,
        help="Redis of the product under test (default: $BENCH_REDIS_URL or db 14)",
    )
    if extra is not None:
        extra(parser)
    args = parser.parse_args()
    use_names(args.db_prefix, args.redis_url)
    return args


def use_names(db_prefix: str, redis_url: str) -> None:
    """Where this run's databases and Redis keys go (see --db-prefix, --redis-url)."""
    global DB_PREFIX, REDIS_URL
    DB_PREFIX, REDIS_URL = db_prefix, redis_url


def say(message: str) -> None:
    print(message, flush=True)


def machine_facts() -> dict[str, str]:
    cpu = "?"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    try:
        with psycopg.connect(conninfo(ADMIN_URL)) as conn:
            row = conn.execute("SHOW server_version").fetchone()
            pg = row[0] if row else "?"
    except psycopg.Error as exc:
        pg = f"unreachable ({exc})"
    return {
        "code": code_state(),
        "nproc": str(os.cpu_count()),
        "cpu": cpu,
        "postgresql": pg,
        "python": platform.python_version(),
        "load average at start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }


def code_state() -> str:
    """The commit measured, and which product files differ from it (read-only git)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        changed = subprocess.run(
            ["git", "status", "--porcelain", "--", "portal", "app.py", "worker.py", "migrations"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout.split("\n")
    except OSError:
        return "?"
    files = [line[3:] for line in changed if line.strip()]
    return f"{head}" + (f" + uncommitted changes in {', '.join(files)}" if files else "")


def print_header(title: str, quick: bool) -> None:
    say(f"\n=== {title}{' (--quick)' if quick else ''} ===")
    for key, value in machine_facts().items():
        say(f"  {key}: {value}")


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    say(f"\n{title}")
    say("  " + "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)))
    say("  " + "  ".join("-" * w for w in widths))
    for row in cells:
        say("  " + "  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))


def _cell(value: Any) -> str:
    if isinstance(value, float):
        if value >= 100:
            return f"{value:,.0f}"
        if value >= 10:
            return f"{value:.1f}"
        return f"{value:.2f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def verdict(ok: bool) -> str:
    return "MET" if ok else "MISSED"


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(p / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


# --- databases ---------------------------------------------------------------------------------


def conninfo(url: str) -> str:
    """A libpq connection string from a SQLAlchemy URL."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def database_url(name: str, admin_url: str = ADMIN_URL) -> str:
    return make_url(admin_url).set(database=name).render_as_string(hide_password=False)


def db_name(name: str) -> str:
    """``name`` (``postroom_bench_<bench>``) under this run's --db-prefix."""
    if name.startswith(DEFAULT_DB_PREFIX):
        return DB_PREFIX + name[len(DEFAULT_DB_PREFIX) :]
    return f"{DB_PREFIX}_{name}"


@contextlib.contextmanager
def bench_database(name: str, admin_url: str = ADMIN_URL) -> Iterator[str]:
    """A fresh, empty database ``name`` (dropped first if a crashed run left it); dropped after.

    ``name`` is given as ``postroom_bench_<bench>``; --db-prefix replaces that prefix."""
    name = db_name(name)
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        yield database_url(name, admin_url)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def bench_settings(url: str, **overrides: Any) -> Settings:
    """The product's defaults (worker timings as shipped) on the bench database."""
    base = Settings(
        database_url=url,
        redis_url=REDIS_URL,
        secret_key=SECRET_KEY,
        worker_metrics_port=0,
        # The sink and the fake provider listen on loopback, which a tenant's server may not
        # reach by default.
        outbound_tenant_allow_private=True,
    )
    return base.replace(**overrides) if overrides else base


def make_app(url: str, **overrides: Any) -> Flask:
    """An app on ``url``, migrated to head with the real migrations (quietly)."""
    from flask_migrate import upgrade

    app = create_app(bench_settings(url, **overrides))
    with app.app_context(), contextlib.redirect_stderr(io.StringIO()):
        upgrade()
    # env.py's fileConfig put a console handler on the root logger; the product's loggers are
    # configured by worker_logging() below, as worker.py does.
    return app


def worker_logging(level: str) -> None:
    """Log as ``python worker.py`` does (``portal.logs.configure_logging``: JSON lines at
    ``level``), into /dev/null.

    The formatting cost is the product's; the bench output stays readable.
    """
    from portal.logs import configure_logging

    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    configure_logging(level, open(os.devnull, "w"))  # noqa: SIM115 (lives as long as we do)


# --- history rows and backlog ------------------------------------------------------------------

# History: one row a minute into the past, mostly Sent, some Failed and DeadLetter (as the scan
# plan test fills it); the work rows are the newest.
_HISTORY_STATUS = (
    "CASE WHEN g % 50 = 0 THEN 'Failed' WHEN g % 97 = 0 THEN 'DeadLetter' ELSE 'Sent' END"
)
MAIL_COLUMNS = "to_addrs, subject, text_body"
MAIL_VALUES = "'[\"ann@example.com\"]', 'Hello', 'Hi'"


def fill_history(conn: psycopg.Connection[Any], n: int, chunk: int = 250_000) -> None:
    """``n`` mail history rows (Sent, some Failed / DeadLetter), older than anything due."""
    common = "tenant_id, scope, status, version, retry_count, created_time, updated_time"
    done = 0
    while done < n:
        step = min(chunk, n - done)
        age = f"make_interval(mins => {n} - (g + {done}))"
        conn.execute(
            f"INSERT INTO mail_send_record ({common}, sent_at, {MAIL_COLUMNS}) "
            f"SELECT 1 + g % 50, 'TENANT', {_HISTORY_STATUS}, 3, 0, "
            f"now() - interval '1 day' - {age}, "
            f"now() - interval '1 day' - {age} + interval '2 seconds', "
            f"now() - interval '1 day' - {age} + interval '2 seconds', {MAIL_VALUES} "
            f"FROM generate_series(1, {step}) g"
        )
        conn.commit()
        done += step


def add_pending(conn: psycopg.Connection[Any], n: int, tenant_id: int = 1) -> tuple[int, int]:
    """``n`` Pending mail rows, due now (oldest first by updated_time); returns the id range."""
    common = "tenant_id, scope, status, version, retry_count, created_time, updated_time"
    row = conn.execute(
        f"WITH ins AS (INSERT INTO mail_send_record ({common}, {MAIL_COLUMNS}) "
        f"SELECT {tenant_id}, 'TENANT', 'Pending', 0, 0, "
        f"clock_timestamp() - make_interval(secs => ({n} - g) / 1000.0), "
        f"clock_timestamp() - make_interval(secs => ({n} - g) / 1000.0), {MAIL_VALUES} "
        f"FROM generate_series(1, {n}) g RETURNING id) SELECT min(id), max(id) FROM ins"
    ).fetchone()
    conn.commit()
    assert row is not None
    return int(row[0]), int(row[1])


def add_retry(conn: psycopg.Connection[Any], n: int, tenant_id: int = 1) -> None:
    """``n`` Retry mail rows: half due now, half due in an hour."""
    common = "tenant_id, scope, status, version, retry_count, created_time, updated_time"
    conn.execute(
        f"INSERT INTO mail_send_record ({common}, next_retry_at, {MAIL_COLUMNS}) "
        f"SELECT {tenant_id}, 'TENANT', 'Retry', 2, 1, now() - interval '1 hour', "
        f"now() - make_interval(secs => g), "
        f"CASE WHEN g % 2 = 0 THEN now() - make_interval(secs => g) "
        f"ELSE now() + make_interval(secs => 3600 + g) END, {MAIL_VALUES} "
        f"FROM generate_series(1, {n}) g"
    )
    conn.commit()


# --- the raw limit: what the product does, as bare SQL -----------------------------------------

# The same single-statement SKIP LOCKED claim and versioned completion that the product runs,
# writing the same columns (scan.claim and sent_write.record_sent), with none of its Python.
RAW_CLAIM = (
    "UPDATE mail_send_record SET status = 'Sending', version = version + 1, "
    "updated_time = statement_timestamp(), "
    "first_claimed_at = coalesce(first_claimed_at, statement_timestamp()) "
    "WHERE id IN (SELECT id FROM mail_send_record WHERE status = 'Pending' "
    "ORDER BY updated_time LIMIT 1 FOR UPDATE SKIP LOCKED) RETURNING id, version"
)
RAW_CLAIM_RETRY = (
    "UPDATE mail_send_record SET status = 'Sending', version = version + 1, "
    "updated_time = statement_timestamp(), "
    "first_claimed_at = coalesce(first_claimed_at, statement_timestamp()) "
    "WHERE id IN (SELECT id FROM mail_send_record WHERE status = 'Retry' "
    "AND next_retry_at <= statement_timestamp() "
    "ORDER BY next_retry_at LIMIT 1 FOR UPDATE SKIP LOCKED) RETURNING id, version"
)
RAW_COMPLETE = (
    "UPDATE mail_send_record SET status = 'Sent', version = version + 1, "
    "sent_at = statement_timestamp(), updated_time = statement_timestamp(), "
    "next_retry_at = NULL, provider_message_id = %s, error_code = NULL, error_message = NULL "
    "WHERE id = %s AND version = %s"
)
RAW_RETRY = (
    "UPDATE mail_send_record SET status = 'Retry', version = version + 1, "
    "updated_time = statement_timestamp(), error_code = '451 4.3.0', error_message = 'later', "
    "next_retry_at = statement_timestamp() + make_interval(secs => %s), "
    "retry_count = retry_count + 1 WHERE id = %s AND version = %s"
)


# --- a tenant with a mail server ---------------------------------------------------------------


def tenant_with_mail_server(app: Flask, smtp_host: str, smtp_port: int, slug: str = "bench") -> int:
    """A tenant whose default mail server is the sink; returns the tenant id."""
    from portal.extensions import db
    from portal.models import MailSendServerConfig, Tenant

    with app.app_context():
        tenant = Tenant(slug=slug, name=slug.title())
        db.session.add(tenant)
        db.session.flush()
        db.session.add(
            MailSendServerConfig(
                tenant_id=tenant.id,
                name="sink",
                host=smtp_host,
                port=smtp_port,
                security="plain",
                from_address="sender@bench.test",
                from_name="Bench",
                is_default=True,
            )
        )
        db.session.commit()
        return int(tenant.id)


# --- an SMTP sink ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(host: str, port: int, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
            return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout_s} s")


@dataclass
class Sink:
    """scripts/smtp_sink.py's SinkHandler (keeps each mail as a .eml file, prints a line):
    as a subprocess (``mode="subprocess"``: its own process, as a real server would be) or on a
    thread of this process (``mode="inproc"``: sharing our GIL)."""

    mode: str  # "subprocess", "inproc", or "external": one already listening on ``port``
    host: str = "127.0.0.1"
    port: int = 0
    external_pid: int | None = None  # an external sink's process, when known

    def __post_init__(self) -> None:
        self._dir = tempfile.TemporaryDirectory(
            prefix="bench-sink-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None
        )
        self._process: subprocess.Popen[bytes] | None = None
        self._controller: Any = None

    def start(self) -> Sink:
        if self.mode == "external":
            wait_port(self.host, self.port)
            return self
        self.port = free_port()
        if self.mode == "subprocess":
            self._process = subprocess.Popen(
                [
                    sys.executable,
                    str(ROOT / "scripts" / "smtp_sink.py"),
                    "--host",
                    self.host,
                    "--port",
                    str(self.port),
                    "--dir",
                    self._dir.name,
                ],
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        else:
            from aiosmtpd.controller import Controller

            sys.path.insert(0, str(ROOT / "scripts"))
            from smtp_sink import SinkHandler  # type: ignore[import-not-found]

            handler = SinkHandler(Path(self._dir.name))
            self._controller = Controller(
                handler, hostname=self.host, port=self.port, server_hostname="sink.bench"
            )
            with contextlib.redirect_stdout(io.StringIO()):
                self._controller.start()
        wait_port(self.host, self.port)
        return self

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """The in-process sink prints a line a mail: send those to /dev/null meanwhile."""
        if self.mode == "subprocess":
            yield
            return
        with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
            yield

    @property
    def pid(self) -> int | None:
        """The sink's process (None on a thread of ours; an external one's is given)."""
        if self._process is not None:
            return self._process.pid
        return self.external_pid

    def kept(self) -> int | None:
        """Mails the sink kept (None: an external sink, which tells nobody)."""
        if self.mode == "external":
            return None
        return sum(1 for _ in Path(self._dir.name).iterdir())

    def clear(self) -> None:
        for path in Path(self._dir.name).iterdir():
            path.unlink()

    def stop(self) -> None:
        if self._process is not None:
            self._process.terminate()  # our own child, by its pid
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process = None
        if self._controller is not None:
            self._controller.stop()
            self._controller = None
        self._dir.cleanup()
