"""Child processes the worker supervises: the rq-scheduler daemon and an rq worker for chores.

Processes, not threads: rq forks and installs signal handlers in its own main thread. A child
that exits is restarted with a growing pause; on shutdown each gets SIGTERM, then SIGKILL
after a few seconds. Children also get SIGTERM if the worker itself dies (PR_SET_PDEATHSIG),
so a SIGKILLed worker leaves no orphan behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("portal.worker")

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In a child, before exec: SIGTERM when the parent dies (Linux; elsewhere nothing)."""
    # Not Linux: no such call; the supervisor's own shutdown still stops them.
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _relay(name: str, process: subprocess.Popen[bytes]) -> None:
    """Pass a child's output on as the worker's own log lines: one JSON object a line.

    Our job code already logs JSON (kept as it is); rq's and rq-scheduler's plain lines
    ("Lock already taken - skipping run") are wrapped with the child's name.
    """
    assert process.stdout is not None
    for raw in process.stdout:
        line = raw.decode(errors="replace").rstrip()
        if not line:
            continue
        if line.startswith("{"):
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
            continue
        level = logging.ERROR if ("Error" in line or "Traceback" in line) else logging.INFO
        log.log(level, "%s: %s", name, line, extra={"child": name})


@dataclass
class Child:
    name: str
    argv: list[str]
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    next_start: float = 0.0
    started_at: float = field(default=0.0)
    # How long a SIGTERMed child may take before SIGKILL (None: the supervisor's default); a
    # delivery child finishes its sends in flight first.
    stop_timeout_s: float | None = None


class Supervisor:
    """Start, watch and stop a fixed set of child processes."""

    def __init__(self, children: list[Child], env: dict[str, str], cwd: Path):
        self.children = children
        self.env = env
        self.cwd = cwd
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="supervisor", daemon=True)

    def start(self) -> None:
        for child in self.children:
            self._spawn(child)
        self.thread.start()

    def _spawn(self, child: Child) -> None:
        try:
            child.process = subprocess.Popen(
                child.argv,
                cwd=self.cwd,
                env=self.env,
                preexec_fn=die_with_parent,
                # Out of the terminal's process group: a Ctrl-C reaches the worker only, and
                # the worker stops its children in order.
                start_new_session=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            threading.Thread(
                target=_relay,
                args=(child.name, child.process),
                name=f"{child.name}-log",
                daemon=True,
            ).start()
            child.started_at = time.monotonic()
            log.info("started %s (pid %s)", child.name, child.process.pid)
        except OSError as exc:
            log.error("cannot start %s: %s", child.name, exc)
            child.process = None

    def _watch(self) -> None:
        while not self.stopping.wait(0.5):
            for child in self.children:
                process = child.process
                if process is not None and process.poll() is None:
                    continue
                now = time.monotonic()
                if process is not None:
                    # Exited: restart after a pause that grows while it keeps failing fast.
                    lived = now - child.started_at
                    child.restarts = 0 if lived > 60 else child.restarts + 1
                    pause = min(30.0, 0.5 * 2 ** min(child.restarts, 6))
                    log.warning(
                        "%s exited with %s; restarting in %.1f s",
                        child.name,
                        process.returncode,
                        pause,
                    )
                    child.process = None
                    child.next_start = now + pause
                if now >= child.next_start and not self.stopping.is_set():
                    self._spawn(child)

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM every child, SIGKILL what is still there after ``timeout_s`` (or the
        child's own ``stop_timeout_s``)."""
        self.stopping.set()
        if self.thread.is_alive():
            self.thread.join(2.0)
        running = [c for c in self.children if c.process and c.process.poll() is None]
        for child in running:
            assert child.process is not None
            child.process.send_signal(signal.SIGTERM)
        start = time.monotonic()
        for child in running:
            assert child.process is not None
            limit = timeout_s if child.stop_timeout_s is None else child.stop_timeout_s
            try:
                child.process.wait(max(0.1, start + limit - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait()


def chore_children(redis_url: str, interval_s: float) -> list[Child]:
    """The rq-scheduler daemon and one rq SimpleWorker for the chores queue."""
    from portal.delivery.chores import QUEUE

    bindir = Path(sys.executable).parent
    return [
        Child(
            "rq-scheduler",
            [
                str(bindir / "rqscheduler"),
                "--url",
                redis_url,
                "--interval",
                f"{min(1.0, interval_s):g}",
                "--quiet",
            ],
        ),
        Child(
            "rq-worker",
            # No --name: rq picks a fresh one per start. A fixed name would clash with the
            # key a SIGKILLed predecessor left in Redis, and the restart would be refused.
            [
                str(bindir / "rq"),
                "worker",
                "--url",
                redis_url,
                "--worker-class",
                "rq.worker.SimpleWorker",
                "--quiet",
                QUEUE,
            ],
        ),
    ]
