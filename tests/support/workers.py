"""Real ``python worker.py`` processes for tests, and ways to watch them from outside.

Workers are configured only by environment variables, as in production; their stdout and
stderr go to files under the test's ``tmp_path`` and are printed when the test fails. What a
worker did is read from its JSON log lines, from the database, and from /proc (its child
processes), never by touching product code.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO, TypeVar

from flask import Flask
from sqlalchemy import Engine, text

from portal.config import Settings
from portal.delivery.children import die_with_parent
from portal.extensions import db
from portal.messaging.records import acceptance
from portal.messaging.sending.claim import claim
from portal.models import MailSendRecord
from portal.tenancy import tenant_context
from tests.conftest import TEST_DATABASE_URL, TEST_REDIS_URL

ROOT = Path(__file__).resolve().parents[2]
# Every variable portal/config.py reads, so nothing from the caller's shell leaks into a worker.
CONFIG_VARIABLES = {f.name.upper() for f in fields(Settings)} | {
    "PORTAL_ENV",
    "INSTANCE_PATH",
    "LOG_LEVEL",
    "PROMETHEUS_MULTIPROC_DIR",
}

T = TypeVar("T")


# --- waiting ---------------------------------------------------------------------------------


def wait_for(
    predicate: Callable[[], T | None], timeout_s: float, what: str, poll_s: float = 0.1
) -> T:
    """Poll ``predicate`` every ``poll_s`` until it returns something truthy; bounded."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s (last value: {value!r})")
        time.sleep(poll_s)


def free_port() -> int:
    """A port nobody listens on right now (the usual small race is accepted)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# --- processes -------------------------------------------------------------------------------


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of ``pid`` from /proc, or None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
    rest = raw[raw.rindex(")") + 2 :].split()
    return rest[0], int(rest[1])


def alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper counts as gone)."""
    stat = _stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def children_of(pid: int) -> dict[int, str]:
    """Live child processes of ``pid``: pid -> command line."""
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        child = int(entry.name)
        stat = _stat(child)
        if stat is None or stat[1] != pid or stat[0] in ("Z", "X"):
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except OSError:
            continue
        found[child] = cmdline
    return found


def chore_pids(pid: int) -> dict[str, int]:
    """The rq-scheduler and rq worker children of a worker process, by role."""
    roles: dict[str, int] = {}
    for child, cmdline in children_of(pid).items():
        if "/rqscheduler " in cmdline:
            roles["rq-scheduler"] = child
        elif "/rq worker " in cmdline:
            roles["rq-worker"] = child
    return roles


@dataclass
class Worker:
    name: str
    process: subprocess.Popen[bytes]
    stdout: Path
    stderr: Path
    files: list[TextIO] = field(default_factory=list)
    seen_children: set[int] = field(default_factory=set)

    @property
    def pid(self) -> int:
        return self.process.pid

    def stderr_lines(self) -> list[str]:
        return self.stderr.read_text(errors="replace").splitlines()

    def log_lines(self) -> list[dict[str, Any]]:
        """The JSON log lines this worker wrote to stderr (other lines are skipped)."""
        lines = []
        for raw in self.stderr_lines():
            try:
                entry = json.loads(raw)
            except ValueError:
                continue
            if isinstance(entry, dict):
                lines.append(entry)
        return lines

    def logged(self, msg: str) -> list[dict[str, Any]]:
        """Log lines whose message starts with ``msg``."""
        return [e for e in self.log_lines() if str(e.get("msg", "")).startswith(msg)]

    def sent_ids(self) -> list[int]:
        return [e["record_id"] for e in self.log_lines() if e.get("msg") == "sent"]

    def handled_ids(self) -> set[int]:
        """Records this worker wrote an outcome for (sent, failed, retry)."""
        return {e["record_id"] for e in self.log_lines() if "record_id" in e}

    def sent_times(self) -> list[datetime]:
        return [datetime.fromisoformat(e["ts"]) for e in self.log_lines() if e.get("msg") == "sent"]

    def errors(self) -> list[dict[str, Any]]:
        return [e for e in self.log_lines() if e.get("level") in ("ERROR", "CRITICAL")]

    def chores(self) -> dict[str, int]:
        roles = chore_pids(self.pid)
        self.seen_children |= set(roles.values())
        return roles

    def wait_ready(self, timeout_s: float = 60.0) -> dict[str, int]:
        """Until delivery started and both chore children run; returns the children's pids.
        A wait for readiness, not a speed check: a start-up beside three busy test workers on
        2 cores has taken over 20 s, and only a worker that never starts should fail here."""

        def ready() -> dict[str, int] | None:
            assert self.process.poll() is None, f"{self.name} exited with {self.process.poll()}"
            if not self.logged("delivery started"):
                return None
            roles = self.chores()
            return roles if len(roles) == 2 else None

        return wait_for(ready, timeout_s, f"{self.name} ready", poll_s=0.1)

    def signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    def wait_exit(self, timeout_s: float) -> int:
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} still running after {timeout_s} s") from None


def worker_env(instance: Path, secret_key: str, **overrides: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CONFIG_VARIABLES}
    env.update(
        DATABASE_URL=TEST_DATABASE_URL,
        REDIS_URL=TEST_REDIS_URL,
        SECRET_KEY=secret_key,  # the worker decrypts stored SMTP passwords with it
        # Every test server listens on 127.0.0.1, which a tenant's configuration may not reach
        # by default; tests of that policy run it in the test process with their own settings.
        OUTBOUND_TENANT_ALLOW_PRIVATE="true",
        MAIL_SEND_CONCURRENCY="10",
        # NOTIFY wakes a worker for new records; the poll finds retries that fall due (their
        # backoff is 0.1 s and more in these tests). Each poll costs a claim in every pool:
        # at 0.05 s an idle worker process and its database sessions took a sixth of a core.
        POLL_INTERVAL_S="0.2",
        WORKER_METRICS_PORT="0",
        SHUTDOWN_GRACE_S="10",
        INSTANCE_PATH=str(instance),
        LOG_LEVEL="INFO",
        PYTHONUNBUFFERED="1",
    )
    env.update(overrides)
    return env


def dump(workers: list[Worker]) -> None:
    """Print what each worker wrote (delivery 'sent' lines left out: there can be thousands)."""
    for w in workers:
        for label, path in (("stdout", w.stdout), ("stderr", w.stderr)):
            content = path.read_text(errors="replace") if path.exists() else ""
            lines = content.splitlines()
            interesting = [ln for ln in lines if '"msg": "sent"' not in ln]
            print(
                f"----- {w.name} {label} (pid {w.process.pid}, rc {w.process.returncode}): "
                f"{len(lines)} lines, {len(lines) - len(interesting)} 'sent' lines omitted -----"
            )
            print("\n".join(interesting[-200:]))


class WorkerGroup:
    """Workers started one by one during a test; all stopped (killed) at the end."""

    def __init__(self, tmp_path: Path, secret_key: str, **env: str):
        self.tmp_path = tmp_path
        self.instance = tmp_path / "instance"
        self.instance.mkdir(exist_ok=True)
        self.env = worker_env(self.instance, secret_key, **env)
        self.workers: list[Worker] = []

    def start(self, **env: str) -> Worker:
        name = f"worker-{len(self.workers)}"
        out, err = self.tmp_path / f"{name}.stdout", self.tmp_path / f"{name}.stderr"
        out_file, err_file = out.open("w"), err.open("w")
        process = subprocess.Popen(
            [sys.executable, "worker.py"],
            cwd=ROOT,
            env=self.env | env,
            stdout=out_file,
            stderr=err_file,
            stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent,  # a killed test run takes its workers with it
        )
        worker = Worker(name, process, out, err, [out_file, err_file])
        self.workers.append(worker)
        return worker

    def close(self) -> None:
        for w in self.workers:
            children = w.seen_children | set(children_of(w.pid))
            if w.process.poll() is None:
                w.process.kill()
                w.process.wait(10)
            for f in w.files:
                f.close()
            for child in children:  # PR_SET_PDEATHSIG should have done it; never leak one
                if alive(child):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(child, signal.SIGKILL)


@contextmanager
def worker_group(tmp_path: Path, secret_key: str, **env: str) -> Iterator[WorkerGroup]:
    """Start workers with ``group.start()``; their output is printed if the block fails."""
    group = WorkerGroup(tmp_path, secret_key, **env)
    try:
        yield group
    except BaseException:
        dump(group.workers)
        raise
    finally:
        group.close()


@contextmanager
def worker_processes(
    tmp_path: Path, secret_key: str, n: int = 2, **env: str
) -> Iterator[list[Worker]]:
    """Start ``n`` worker processes; print their output if the block fails; never leak one."""
    with worker_group(tmp_path, secret_key, **env) as group:
        for _ in range(n):
            group.start()
        yield group.workers


def stop(workers: list[Worker]) -> None:
    """SIGTERM each worker (first stage: finish sends in flight) and expect exit code 0."""
    for w in workers:
        if w.process.poll() is None:
            w.process.send_signal(signal.SIGTERM)
    codes: dict[str, int | None] = {}
    for w in workers:
        try:
            codes[w.name] = w.process.wait(30)
        except subprocess.TimeoutExpired:
            codes[w.name] = None
    assert codes == {w.name: 0 for w in workers}, f"worker exit codes after SIGTERM: {codes}"


# --- a status history kept by the database itself ------------------------------------------


class StatusAudit:
    """A trigger on mail_send_record that writes every insert and update to a side table.

    Records move fast (a sweep's Retry is claimed again within milliseconds); polling cannot
    see every step, the database can. Test-owned: created and dropped by the test.
    """

    def __init__(self, engine: Engine):
        self.engine = engine

    def install(self) -> None:
        with self.engine.begin() as conn:
            conn.execute(text("DROP TABLE IF EXISTS test_status_audit"))
            conn.execute(
                text(
                    "CREATE TABLE test_status_audit (seq bigserial PRIMARY KEY, "
                    "record_id bigint, status text, error_code text, retry_count int, "
                    "version int, ambiguous boolean, at timestamptz DEFAULT clock_timestamp())"
                )
            )
            conn.execute(
                text(
                    "CREATE OR REPLACE FUNCTION test_status_audit_fn() RETURNS trigger AS $$ "
                    "BEGIN INSERT INTO test_status_audit "
                    "(record_id, status, error_code, retry_count, version, ambiguous) VALUES "
                    "(NEW.id, NEW.status, NEW.error_code, NEW.retry_count, NEW.version, "
                    "NEW.ambiguous_attempt); RETURN NEW; END $$ LANGUAGE plpgsql"
                )
            )
            conn.execute(
                text(
                    "CREATE TRIGGER test_status_audit_trg AFTER INSERT OR UPDATE "
                    "ON mail_send_record FOR EACH ROW EXECUTE FUNCTION test_status_audit_fn()"
                )
            )

    def remove(self) -> None:
        with self.engine.begin() as conn:
            conn.execute(text("DROP TRIGGER IF EXISTS test_status_audit_trg ON mail_send_record"))
            conn.execute(text("DROP FUNCTION IF EXISTS test_status_audit_fn()"))
            conn.execute(text("DROP TABLE IF EXISTS test_status_audit"))

    def history(self, record_id: int) -> list[tuple[str, str | None, int, int]]:
        """(status, error_code, retry_count, version) after each write, oldest first."""
        with self.engine.connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT status, error_code, retry_count, version FROM test_status_audit "
                    "WHERE record_id = :id ORDER BY seq"
                ),
                {"id": record_id},
            ).all()
        return [(r[0], r[1], r[2], r[3]) for r in rows]

    def statuses(self, record_id: int) -> list[str]:
        """The record's statuses in order, repeats collapsed."""
        out: list[str] = []
        for status, *_ in self.history(record_id):
            if not out or out[-1] != status:
                out.append(status)
        return out

    def codes(self, status: str) -> dict[int, set[str | None]]:
        """Error codes each record had whenever it entered ``status``."""
        with self.engine.connect() as conn:
            rows = conn.execute(
                text("SELECT record_id, error_code FROM test_status_audit WHERE status = :s"),
                {"s": status},
            ).all()
        found: dict[int, set[str | None]] = {}
        for record_id, code in rows:
            found.setdefault(record_id, set()).add(code)
        return found


# --- records ---------------------------------------------------------------------------------


def accept_abandoned(app: Flask, tenant_id: int, **body: Any) -> int:
    """Accept a mail and claim it in the same transaction, then leave it: a record in Sending
    by a real claim that no running worker can have taken first (as if its worker died)."""
    request = {"to": ["stuck@example.com"], "subject": "Stuck", "text": "Hi"} | body
    with tenant_context(tenant_id):
        accepted = acceptance.send_mail(db.session, request, settings=app.config["SETTINGS"])
    claimed = claim(db.session, MailSendRecord, [accepted.id], 1)
    assert [(r.id, r.status) for r in claimed] == [(accepted.id, "Sending")]
    db.session.commit()
    return int(accepted.id)
