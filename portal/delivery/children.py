"""Child processes the worker supervises: the rq-scheduler daemon and an rq worker for chores,
and the delivery children (``DELIVERY_PROCESSES``).

Processes, not threads: rq forks and installs signal handlers in its own main thread. A child
that exits is restarted with a growing pause; on shutdown each gets SIGTERM, then SIGKILL
after a few seconds. Children also get SIGTERM if the worker itself dies (PR_SET_PDEATHSIG),
so a SIGKILLed worker leaves no orphan behind.

PR_SET_PDEATHSIG fires when the *thread* that started the child ends, not the process. So one
thread, the supervisor's, starts every child, restarts them, and at shutdown signals and waits
for them; it ends only after the last one has exited. A child started by a thread that ended
before it would get that SIGTERM early, and the supervisor's own SIGTERM after it would be a
second signal: a delivery child exits at once on a second signal, dropping its sends in flight.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("portal.worker")

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int | None = None) -> None:
    """In a child, before exec: SIGTERM when the thread that started it ends (Linux; elsewhere
    nothing). With ``parent`` (that process's pid), a parent already gone by the time the call
    is made means exiting at once: the signal would never come."""
    # Not Linux: no such call; the supervisor's own shutdown still stops them.
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if parent is not None and os.getppid() != parent:
        os._exit(1)


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
    # The thread passing its output on, joined after it exits so its last lines are written.
    relay: threading.Thread | None = None


class Supervisor:
    """Start, watch and stop a fixed set of child processes, all from the one thread that
    outlives them (see the module's docstring)."""

    def __init__(self, children: list[Child], env: dict[str, str], cwd: Path):
        self.children = children
        self.env = env
        self.cwd = cwd
        self.stopping = threading.Event()
        self.started = threading.Event()
        self.stop_timeout_s = 5.0
        self.thread = threading.Thread(target=self._run, name="supervisor", daemon=True)

    def start(self) -> None:
        """Start the supervisor's thread; return once it has started the children."""
        self.thread.start()
        self.started.wait()

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM every child, SIGKILL what is still there after ``timeout_s`` (or the
        child's own ``stop_timeout_s``); return once all have exited."""
        self.stop_timeout_s = timeout_s
        self.stopping.set()
        if self.thread.is_alive():
            self.thread.join()

    def _run(self) -> None:
        try:
            if not self.stopping.is_set():
                for child in self.children:
                    self._spawn(child)
        finally:
            self.started.set()
        while not self.stopping.wait(0.5):
            try:
                self._restart_exited()
            except Exception:  # this thread must live on: its end would signal the children
                log.exception("supervisor: cannot check the children")
        self._stop_children()

    def _spawn(self, child: Child) -> None:
        try:
            child.process = subprocess.Popen(
                child.argv,
                cwd=self.cwd,
                env=self.env,
                preexec_fn=functools.partial(die_with_parent, os.getpid()),
                # Out of the terminal's process group: a Ctrl-C reaches the worker only, and
                # the worker stops its children in order.
                start_new_session=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            child.relay = threading.Thread(
                target=_relay,
                args=(child.name, child.process),
                name=f"{child.name}-log",
                daemon=True,
            )
            child.relay.start()
            child.started_at = time.monotonic()
            log.info("started %s (pid %s)", child.name, child.process.pid)
        except (OSError, subprocess.SubprocessError) as exc:
            log.error("cannot start %s: %s", child.name, exc)
            child.process = None

    def _restart_exited(self) -> None:
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

    def _stop_children(self) -> None:
        running = [c for c in self.children if c.process and c.process.poll() is None]
        for child in running:
            assert child.process is not None
            child.process.send_signal(signal.SIGTERM)
        start = time.monotonic()
        for child in running:
            assert child.process is not None
            limit = self.stop_timeout_s if child.stop_timeout_s is None else child.stop_timeout_s
            try:
                child.process.wait(max(0.1, start + limit - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait()
        # Their last lines ("delivery process stopped") are still in the pipes.
        deadline = time.monotonic() + 2.0
        for child in self.children:
            if child.relay is not None:
                child.relay.join(max(0.0, deadline - time.monotonic()))


def chore_children(redis_url: str, interval_s: float) -> list[Child]:
    """The rq-scheduler daemon and one rq worker (``chores.ChoreWorker``) for the chores queue."""
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
                "portal.delivery.chores.ChoreWorker",
                "--quiet",
                QUEUE,
            ],
        ),
    ]
