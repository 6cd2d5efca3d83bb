"""What each mail costs, and where: one meter for ours and for the peers, so both are measured
the same way.

A ``Meter`` watches one database over one window (``start`` ... ``mark_end``) and ``finish``
divides what it saw by the mails (SMS, records) done in it:

worker CPU     the sending process: this process's own CPU (``time.process_time``: every
               thread) less the time of code run under ``Meter.not_counted`` (the bench's own
               watching), or other processes' CPU clocks (``clock_gettime`` on the pid's
               process clock: the same counter, in ns, threads included).
backend CPU    the PostgreSQL backends connected to the database (application names starting
               ``bench-`` left out: the bench's own watcher and this meter), each from its CPU
               clock: one alive at the start from its reading then, a new one from zero (its
               start-up counts); one that closes during the window from a reading the client
               takes just before closing it (the psycopg hook below, in every process that
               talks to the database), the others from their reading at the end. Not counted:
               a backend's own exit after its client said goodbye, the postmaster's fork, the
               WAL writer and checkpointer (they serve every database on the server).
sink CPU       the SMTP sink's or SMS provider's process, from its CPU clock.
statements     what the clients executed (the hook on psycopg's cursors: SQLAlchemy, our direct
               driver path and Django alike); ``executemany`` counts once.
round trips    statements + the BEGINs psycopg sends before a transaction's first statement +
               COMMITs and ROLLBACKs of open transactions + connections opened (one each).
transactions   the server's count (pg_stat_database xact_commit + xact_rollback), less the
               bench's own; beside it the COMMIT records in the WAL: transactions that wrote.
rows written   pg_stat_user_tables n_tup_ins + n_tup_upd + n_tup_del (HOT updates among them).
index entries  approx.: (inserts + non-HOT updates) x the table's indexes, as PostgreSQL adds
               one entry to every index for those (a partial index whose predicate the row
               misses gets none, so this is an upper bound); beside it the count from the WAL:
               B-tree leaf inserts (splits' new items included) and other index methods'
               insert records.
WAL bytes      the database's share of the WAL written in the window (pg_walinspect: records
               that touch its relations and the commit records of their transactions), and
               the whole server's ``pg_wal_lsn_diff`` beside it (other databases' writers too).
               A temporary replication slot keeps the window's WAL until it has been read.

pg_stat_statements would count statements on the server; it needs shared_preload_libraries
(a server restart), so the meter says whether it is there and counts on the client.

Table and transaction counters reach the shared statistics when a backend goes idle at most
once a second, else 10 s later, or when it exits: ``start`` and ``finish`` wait until every
backend of the database has exited or been idle 10.5 s, so close the clients' connections
before ``finish`` (disposing the engine) to keep it short.

Only the standard library and psycopg: the peers' venv imports this module too
(bench/peers_budget.py runs django-post_office under it with this hook installed).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo

EXCLUDED_APPS = "bench-"  # application_name prefix of the bench's own connections
METER_APP = "bench-budget"
WATCH_APP = "bench-monitor"  # give a bench's own watching connection this application_name
STATS_IDLE_S = 10.5  # PostgreSQL 15 flushes an idle backend's pending statistics after 10 s
COUNTS = ("statements", "autocommit", "begins", "commits", "rollbacks")
Mark = tuple[dict[tuple[str, str], dict[str, int]], int]  # the hook's counts, closes so far


# --- CPU of a process --------------------------------------------------------------------------


def cpu_ns(pid: int) -> int | None:
    """User + system CPU of process ``pid`` so far, every thread, in ns (its process CPU clock,
    ``clock_getcpuclockid``'s value); None when it is gone."""
    try:
        return time.clock_gettime_ns(((~pid) << 3) | 2)
    except OSError:
        return None


def started(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot): a pid and this name one process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


# --- the client-side hook ----------------------------------------------------------------------


@dataclass
class Closed:
    """A backend's CPU read just before its client closed the connection."""

    pid: int
    start: int | None
    cpu: int | None
    db: str
    app: str


class Hooks:
    """Counts what psycopg sends, per (database, application name), and reads a backend's CPU
    just before its connection is closed. Installed on psycopg's classes, so every client in
    the process is seen; costs about a microsecond a statement (in the worker's CPU, ours and
    the peers' alike)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: dict[tuple[str, str], dict[str, int]] = {}
        self.closed: list[Closed] = []
        self._saved: list[tuple[Any, str, Any]] = []

    def install(self) -> bool:
        """Put the hook in place; False if it already was."""
        if self._saved:
            return False
        hooks = self

        def key(conn: Any) -> tuple[str, str]:
            try:
                return conn._budget_key  # type: ignore[no-any-return]
            except AttributeError:
                k = (conn.info.dbname, conn.info.parameter_status("application_name") or "")
                conn._budget_key = k
                return k

        def bump(conn: Any, name: str, also: str | None = None) -> None:
            k = key(conn)
            with hooks.lock:
                row = hooks.counts.get(k)
                if row is None:
                    row = hooks.counts[k] = dict.fromkeys(COUNTS, 0)
                row[name] += 1
                if also is not None:
                    row[also] += 1

        idle = psycopg.pq.TransactionStatus.IDLE

        def statement(original: Any) -> Any:
            def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
                conn = self.connection
                if conn.autocommit:
                    bump(conn, "statements", "autocommit")
                elif conn.info.transaction_status == idle:
                    bump(conn, "statements", "begins")  # psycopg sends BEGIN first
                else:
                    bump(conn, "statements")
                return original(self, *args, **kwargs)

            return counted

        def ending(original: Any, name: str) -> Any:
            def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
                if not self.closed and self.info.transaction_status != idle:
                    bump(self, name)
                return original(self, *args, **kwargs)

            return counted

        def close(original: Any) -> Any:
            def reading(self: Any, *args: Any, **kwargs: Any) -> Any:
                if not self.closed:
                    with contextlib.suppress(psycopg.Error):
                        pid = self.info.backend_pid
                        db, app = key(self)
                        done = Closed(pid, started(pid), cpu_ns(pid), db, app)
                        with hooks.lock:
                            hooks.closed.append(done)
                return original(self, *args, **kwargs)

            return reading

        patches = [
            (psycopg.Cursor, "execute", statement),
            (psycopg.Cursor, "executemany", statement),
            (psycopg.Cursor, "stream", statement),
            (psycopg.ServerCursor, "execute", statement),
            (psycopg.Connection, "commit", lambda f: ending(f, "commits")),
            (psycopg.Connection, "rollback", lambda f: ending(f, "rollbacks")),
            (psycopg.Connection, "close", close),
        ]
        for owner, name, wrap in patches:
            original = owner.__dict__[name]
            self._saved.append((owner, name, original))
            setattr(owner, name, wrap(original))
        return True

    def uninstall(self) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()

    def reset(self) -> None:
        with self.lock:
            self.counts.clear()
            self.closed.clear()

    def mark(self) -> Mark:
        with self.lock:
            return {k: dict(v) for k, v in self.counts.items()}, len(self.closed)

    def between(self, mark: Mark, end: Mark | None = None) -> dict[str, Any]:
        """What was counted from ``mark`` to ``end`` (or now), as ``report`` gives it."""
        counts, closed = mark
        now, upto = end if end is not None else self.mark()
        with self.lock:
            gone = list(self.closed[closed:upto])
        rows = []
        for k, row in now.items():
            before = counts.get(k, {})
            rows.append([*k, {n: row[n] - before.get(n, 0) for n in COUNTS}])
        return {"counts": rows, "closed": [asdict(c) for c in gone]}

    def report(self) -> dict[str, Any]:
        """Everything since the last ``reset``, JSON-able (a child process prints it)."""
        return self.between(({}, 0))


HOOKS = Hooks()


# --- the result --------------------------------------------------------------------------------


@dataclass
class Budget:
    """One side's window: totals, and per unit on demand."""

    label: str
    units: int
    seconds: float
    load: tuple[float, float]  # 1-minute load average at the start and at the end
    worker_ns: int
    backend_ns: int
    sink_ns: int | None
    statements: int
    round_trips: int
    connections: int
    transactions: int | None
    wal_commits: int | None
    inserted: int
    updated: int
    hot: int
    deleted: int
    row_locks: int | None
    index_approx: int
    index_wal: int | None
    wal_db: int | None
    wal_fpi: int | None
    wal_server: int
    tables: dict[str, dict[str, int]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def per(self, total: float | None) -> float | None:
        return None if total is None or not self.units else total / self.units

    def per_unit(self) -> dict[str, float | None]:
        us = 1e-3
        worker = self.worker_ns * us
        backend = self.backend_ns * us
        sink = None if self.sink_ns is None else self.sink_ns * us
        return {
            "worker_cpu_us": self.per(worker),
            "backend_cpu_us": self.per(backend),
            "sink_cpu_us": self.per(sink),
            "total_cpu_us": self.per(worker + backend + (sink or 0.0)),
            "statements": self.per(self.statements),
            "round_trips": self.per(self.round_trips),
            "connections": self.per(self.connections),
            "transactions": self.per(self.transactions),
            "wal_commits": self.per(self.wal_commits),
            "rows_written": self.per(self.inserted + self.updated + self.deleted),
            "inserted": self.per(self.inserted),
            "updated": self.per(self.updated),
            "hot_updated": self.per(self.hot),
            "deleted": self.per(self.deleted),
            "row_locks": self.per(self.row_locks),
            "index_entries_approx": self.per(self.index_approx),
            "index_entries_wal": self.per(self.index_wal),
            "wal_bytes": self.per(self.wal_db),
            "wal_fpi_bytes": self.per(self.wal_fpi),
            "wal_bytes_server": self.per(self.wal_server),
        }

    def as_json(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "units": self.units,
            "seconds": round(self.seconds, 3),
            "load": [round(x, 2) for x in self.load],
            "per_unit": {k: None if v is None else round(v, 3) for k, v in self.per_unit().items()},
            "tables": self.tables,
            "notes": self.notes,
        }


SUMMED = (
    "worker_ns",
    "backend_ns",
    "sink_ns",
    "statements",
    "round_trips",
    "connections",
    "transactions",
    "wal_commits",
    "inserted",
    "updated",
    "hot",
    "deleted",
    "row_locks",
    "index_approx",
    "index_wal",
    "wal_db",
    "wal_fpi",
    "wal_server",
)


def combine(label: str, runs: Sequence[Budget]) -> Budget:
    """Several windows of one side as one (totals added, loads the lowest and the highest)."""
    if len(runs) == 1:
        one = runs[0]
        return Budget(**{**one.__dict__, "label": label})

    def total(name: str) -> Any:
        values = [getattr(r, name) for r in runs]
        return None if any(v is None for v in values) else sum(values)

    tables: dict[str, dict[str, int]] = {}
    for r in runs:
        for table, row in r.tables.items():
            into = tables.setdefault(table, dict.fromkeys(row, 0))
            for k, v in row.items():
                into[k] = v if k == "indexes" else into.get(k, 0) + v
    loads = [x for r in runs for x in r.load]
    return Budget(
        label=label,
        units=total("units"),
        seconds=total("seconds"),
        load=(min(loads), max(loads)),
        **{name: total(name) for name in SUMMED},
        tables=tables,
        notes=sorted({n for r in runs for n in r.notes}),
    )


ROWS = (
    ("worker CPU µs", "worker_cpu_us"),
    ("PostgreSQL backends CPU µs", "backend_cpu_us"),
    ("sink CPU µs", "sink_cpu_us"),
    ("total CPU µs", "total_cpu_us"),
    ("statements", "statements"),
    ("round trips (statements + BEGIN/COMMIT + connects)", "round_trips"),
    ("connections opened", "connections"),
    ("transactions (server; each statement psycopg prepares adds one)", "transactions"),
    ("commits that wrote (WAL)", "wal_commits"),
    ("rows written", "rows_written"),
    ("  inserted", "inserted"),
    ("  updated", "updated"),
    ("  of which HOT", "hot_updated"),
    ("  deleted", "deleted"),
    ("tuple locks (WAL: FOR UPDATE, and updates leaving their page)", "row_locks"),
    ("index entries, approx. (ins + non-HOT upd) x indexes", "index_entries_approx"),
    ("index entries, counted in the WAL", "index_entries_wal"),
    ("WAL bytes, this database", "wal_bytes"),
    ("  of which full-page images", "wal_fpi_bytes"),
    ("WAL bytes, whole server (all databases)", "wal_bytes_server"),
)


def print_budgets(title: str, budgets: Sequence[Budget], unit: str = "mail") -> None:
    """The sides in columns, one line item a row, per ``unit``; then the rows by table."""
    if not budgets:
        return
    per = [b.per_unit() for b in budgets]
    print(f"\n{title}", flush=True)
    _print_rows(
        [f"per {unit}", *(b.label for b in budgets)],
        [
            [f"{unit}s measured", *(f"{b.units:,}" for b in budgets)],
            ["window s", *(f"{b.seconds:.1f}" for b in budgets)],
            ["load at start / end", *(f"{b.load[0]:.1f} / {b.load[1]:.1f}" for b in budgets)],
            *([text, *(_fmt(p[key]) for p in per)] for text, key in ROWS),
        ],
        left=1,
    )
    for note in sorted({n for b in budgets for n in b.notes}):
        print(f"  note: {note}", flush=True)
    kinds = ("ins", "upd", "hot", "del")
    lines = [
        [b.label, table, *(_fmt(row[k] / b.units) for k in kinds), str(row["indexes"])]
        for b in budgets
        if b.units
        for table, row in sorted(b.tables.items())
    ]
    if lines:
        print(f"\n  rows written per {unit}, by table (pg_stat_user_tables):", flush=True)
        _print_rows(
            ["", "table", "inserted", "updated", "HOT", "deleted", "indexes"], lines, left=2
        )


def _print_rows(head: list[str], rows: list[list[str]], left: int) -> None:
    """A table: the first ``left`` columns flush left, the others right."""
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
    for n, row in enumerate([head, *rows]):
        cells = [
            cell.ljust(w) if i < left else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ]
        print("  " + "  ".join(cells), flush=True)
        if n == 0:
            print("  " + "  ".join("-" * w for w in widths), flush=True)


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    if abs(value) >= 1 or value == 0:
        return f"{value:.2f}"
    return f"{value:.3f}"


# --- the meter ---------------------------------------------------------------------------------


@dataclass
class _Mark:
    at: float
    load: float
    own: int
    processes: dict[int, int | None]
    sink: int | None
    backends: dict[tuple[int, int | None], tuple[int, str]]
    lsn: str
    hooks: Mark


class Meter:
    """One database, one window. ``dsn``: the database the sides write to (libpq conninfo).

    ``own``: count this process's CPU as the worker's (ours in-process); ``processes``: other
    worker processes (ours as child processes, a peer); ``sink_pid``: the sink's or provider's
    process. Install ``HOOKS`` in every process that talks to the database (this one: done
    here) and pass their reports to ``finish``.
    """

    def __init__(
        self,
        dsn: str,
        *,
        own: bool = True,
        processes: Sequence[int] = (),
        sink_pid: int | None = None,
    ) -> None:
        self._hooked = HOOKS.install()  # taken out again by close, if this put it in
        self.own = own
        self.processes = list(processes)
        self.sink_pid = sink_pid
        # Cluster-wide readings go through the admin database, so this meter's own transactions
        # stay out of the bench database's counters; the bench database's connection reads
        # only its tables' counters (before and after the window) and the WAL.
        self.admin = psycopg.connect(
            make_conninfo(dsn, dbname="postgres"), autocommit=True, application_name=METER_APP
        )
        self.conn = psycopg.connect(dsn, autocommit=True, application_name=METER_APP)
        self.db = self.conn.info.dbname
        self.notes: list[str] = []
        self.walinspect = True
        try:
            self.conn.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
        except psycopg.Error as exc:
            self.walinspect = False
            self.notes.append(f"no pg_walinspect ({exc}): WAL of the whole server only")
        row = self.admin.execute(
            "SELECT oid, current_setting('shared_preload_libraries') FROM pg_database "
            "WHERE datname = %s",
            (self.db,),
        ).fetchone()
        assert row is not None
        self.oid = int(row[0])
        if "pg_stat_statements" not in row[1]:
            self.notes.append(
                "pg_stat_statements is not in shared_preload_libraries: statements counted "
                "on the client"
            )
        self._slot = f"bench_budget_{os.getpid()}_{self.admin.info.backend_pid}"
        self.reports: list[dict[str, Any]] = []  # other processes' hook reports, this window
        self._excluded_ns = 0
        self._start: _Mark | None = None
        self._end: _Mark | None = None

    def close(self) -> None:
        self.conn.close()
        self.admin.close()
        if self._hooked:
            HOOKS.uninstall()

    def __enter__(self) -> Meter:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    @contextlib.contextmanager
    def not_counted(self) -> Iterator[None]:
        """This thread's CPU in the block is the bench's, not the worker's."""
        t0 = time.thread_time_ns()
        try:
            yield
        finally:
            self._excluded_ns += time.thread_time_ns() - t0

    # The window --------------------------------------------------------------------------------

    def start(self) -> None:
        """Wait for earlier work's statistics to land, then read everything."""
        self._settle()
        self._hold_wal()
        self._stats0 = self._stats()
        self._excluded_ns = 0
        self.reports = []
        self._start = self._mark(clocks_last=True)

    def mark_end(self) -> None:
        """The work is done: read the clocks now (``finish`` may wait for statistics)."""
        self._end = self._mark()

    def finish(self, label: str, units: int, remote: Sequence[dict[str, Any]] = ()) -> Budget:
        """The window's budget; ``remote`` (and ``reports``): the hook reports of other
        processes (``HOOKS.report()`` there), whose counts cover the same window."""
        a, b = self._start, self._end
        assert a is not None, "start first"
        assert b is not None, "mark_end first"
        notes = list(self.notes)
        if not self._settle():
            notes.append("a backend stayed busy: its last table statistics may be missing")
        stats1 = self._stats()
        reports = [HOOKS.between(a.hooks, b.hooks), *self.reports, *remote]
        counts = dict.fromkeys(COUNTS, 0)
        own_xacts = 0
        closed: list[Closed] = []
        for report in reports:
            for db, app, row in report["counts"]:
                if db != self.db:
                    continue
                if app.startswith(EXCLUDED_APPS):
                    own_xacts += row["autocommit"] + row["commits"] + row["rollbacks"]
                    continue
                for k in COUNTS:
                    counts[k] += row[k]
            closed += [Closed(**c) for c in report["closed"]]
        # Backends: the last reading of each, less its reading at the start (0 if new).
        final = {key: cpu for key, (cpu, _) in b.backends.items()}
        for c in closed:
            if c.db == self.db and not c.app.startswith(EXCLUDED_APPS) and c.cpu is not None:
                key = (c.pid, c.start)
                final[key] = max(final.get(key, 0), c.cpu)
        backend_ns = sum(cpu - a.backends.get(key, (0, ""))[0] for key, cpu in final.items())
        lost = [key for key in a.backends if key not in final]
        if lost:
            notes.append(f"{len(lost)} backend(s) ended unseen: their last CPU is not counted")
        connections = sum(1 for key in final if key not in a.backends)
        worker_ns = 0
        if self.own:
            worker_ns += b.own - a.own - self._excluded_ns
        for pid in self.processes:
            p0, p1 = a.processes.get(pid), b.processes.get(pid)
            if p0 is None or p1 is None:
                notes.append(f"worker process {pid} was not readable at both ends")
            else:
                worker_ns += p1 - p0
        sink_ns = None if a.sink is None or b.sink is None else b.sink - a.sink
        tables = {}
        for name, row1 in stats1["tables"].items():
            row0 = self._stats0["tables"].get(name, dict.fromkeys(row1, 0))
            delta = {k: row1[k] - row0.get(k, 0) for k in ("ins", "upd", "hot", "del")}
            if any(delta.values()):
                tables[name] = {**delta, "indexes": row1["indexes"]}
        xacts = stats1["xacts"] - self._stats0["xacts"] - own_xacts
        wal = None
        if self.walinspect:
            try:
                wal = self._wal(a.lsn, b.lsn)
            except psycopg.Error as exc:
                notes.append(f"the window's WAL could not be read: {exc}")
            finally:
                self._release_wal()
        server = self.admin.execute("SELECT pg_wal_lsn_diff(%s, %s)", (b.lsn, a.lsn)).fetchone()
        assert server is not None
        return Budget(
            label=label,
            units=units,
            seconds=b.at - a.at,
            load=(a.load, b.load),
            worker_ns=worker_ns,
            backend_ns=backend_ns,
            sink_ns=sink_ns,
            statements=counts["statements"],
            round_trips=counts["statements"]
            + counts["begins"]
            + counts["commits"]
            + counts["rollbacks"]
            + connections,
            connections=connections,
            transactions=xacts,
            wal_commits=None if wal is None else wal["commits"],
            inserted=sum(t["ins"] for t in tables.values()),
            updated=sum(t["upd"] for t in tables.values()),
            hot=sum(t["hot"] for t in tables.values()),
            deleted=sum(t["del"] for t in tables.values()),
            row_locks=None if wal is None else wal["locks"],
            index_approx=sum(
                (t["ins"] + t["upd"] - t["hot"]) * t["indexes"] for t in tables.values()
            ),
            index_wal=None if wal is None else wal["index"],
            wal_db=None if wal is None else wal["bytes"],
            wal_fpi=None if wal is None else wal["fpi"],
            wal_server=int(server[0]),
            tables=tables,
            notes=notes,
        )

    # Readings ----------------------------------------------------------------------------------

    def _mark(self, clocks_last: bool = False) -> _Mark:
        """Every reading; the process clocks after the database's at the start of a window and
        before them at its end, so the meter's own reads stay out of it."""
        if clocks_last:
            backends, lsn = self._backends(), self._lsn()
        own = time.process_time_ns()
        processes = {pid: cpu_ns(pid) for pid in self.processes}
        sink = None if self.sink_pid is None else cpu_ns(self.sink_pid)
        at = time.perf_counter()
        if not clocks_last:
            backends, lsn = self._backends(), self._lsn()
        return _Mark(
            at=at,
            load=os.getloadavg()[0],
            own=own,
            processes=processes,
            sink=sink,
            backends=backends,
            lsn=lsn,
            hooks=HOOKS.mark(),
        )

    def _hold_wal(self) -> None:
        """Keep the window's WAL on disk until ``finish`` has read it: other databases' writers
        make checkpoints that recycle segments within seconds. A temporary physical slot of
        this meter's session (gone with it, whatever happens)."""
        if not self.walinspect:
            return
        self._release_wal()
        try:
            self.admin.execute(
                "SELECT pg_create_physical_replication_slot(%s, true, true)", (self._slot,)
            )
        except psycopg.Error as exc:
            self.notes.append(f"no replication slot to keep the WAL ({exc})")

    def _release_wal(self) -> None:
        self.admin.execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
            "WHERE slot_name = %s",
            (self._slot,),
        )

    def _lsn(self) -> str:
        row = self.admin.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()
        assert row is not None
        return str(row[0])

    def _backends(self) -> dict[tuple[int, int | None], tuple[int, str]]:
        rows = self.admin.execute(
            "SELECT pid, application_name FROM pg_stat_activity "
            "WHERE datname = %s AND application_name NOT LIKE %s",
            (self.db, EXCLUDED_APPS + "%"),
        ).fetchall()
        seen = {}
        for pid, app in rows:
            cpu = cpu_ns(pid)
            if cpu is not None:
                seen[(pid, started(pid))] = (cpu, app)
        return seen

    def _stats(self) -> dict[str, Any]:
        # The transactions first: this meter's own reads on the database come after them.
        row = self.admin.execute(
            "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s",
            (self.db,),
        ).fetchone()
        assert row is not None
        tables = {
            name: {"ins": ins, "upd": upd, "hot": hot, "del": dele, "indexes": indexes}
            for name, ins, upd, hot, dele, indexes in self.conn.execute(
                "SELECT relname, n_tup_ins, n_tup_upd, n_tup_hot_upd, n_tup_del, "
                "(SELECT count(*) FROM pg_index i WHERE i.indrelid = s.relid) "
                "FROM pg_stat_user_tables s"
            )
        }
        return {"tables": tables, "xacts": int(row[0])}

    def _settle(self, limit_s: float = 15.0) -> bool:
        """Wait until no backend of the database has statistics pending: each has exited, or
        been idle longer than PostgreSQL waits before reporting an idle backend's (the bench's
        own watching connections too: their transactions are taken off the server's count)."""
        deadline = time.monotonic() + limit_s
        while True:
            row = self.admin.execute(
                "SELECT count(*), count(*) FILTER (WHERE state <> 'idle' "
                "OR state_change > clock_timestamp() - make_interval(secs => %s)) "
                "FROM pg_stat_activity WHERE datname = %s AND pid <> %s",
                (STATS_IDLE_S, self.db, self.conn.info.backend_pid),
            ).fetchone()
            assert row is not None
            if row[1] == 0:
                if row[0] == 0:
                    time.sleep(0.05)  # an exiting backend reports as it leaves
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)

    def _wal(self, lsn0: str, lsn1: str) -> dict[str, int]:
        """The database's records between two LSNs (and their transactions' commits)."""
        deadline = time.monotonic() + 2
        while True:  # pg_walinspect reads only flushed WAL, and from before the flush point
            row = self.admin.execute(
                "SELECT f >= %(end)s, least(f, %(end)s)::text, %(start)s >= least(f, %(end)s) "
                "FROM (SELECT pg_current_wal_flush_lsn() f) flushed",
                {"start": lsn0, "end": lsn1},
            ).fetchone()
            assert row is not None
            if row[0] or time.monotonic() > deadline:  # an idle server's flush stops short
                break
            time.sleep(0.05)
        if row[2]:  # no record in the window
            return {"bytes": 0, "fpi": 0, "commits": 0, "locks": 0, "index": 0}
        lsn1 = row[1]
        sql = f"""
            WITH r AS MATERIALIZED (
                SELECT xid, resource_manager AS rm, record_type AS kind,
                       record_length AS len, fpi_length AS fpi, description AS d,
                       block_ref ~ ' rel [0-9]+/{self.oid}/' AS ours
                FROM pg_get_wal_records_info(%s, %s)),
            x AS (SELECT DISTINCT xid FROM r WHERE ours AND xid <> 0)
            SELECT rm, kind, count(*), sum(len), sum(fpi),
                   sum(coalesce(substring(d FROM '([0-9]+) tuples')::int, 0)),
                   count(*) FILTER (WHERE d LIKE 'level 0,%%')
            FROM r
            WHERE ours OR (rm = 'Transaction' AND xid IN (SELECT xid FROM x))
            GROUP BY rm, kind"""
        out = {"bytes": 0, "fpi": 0, "commits": 0, "locks": 0, "index": 0}
        for rm, kind, n, size, fpi, tuples, level0 in self.conn.execute(sql, (lsn0, lsn1)):
            out["bytes"] += int(size)
            out["fpi"] += int(fpi)
            kind = kind.split("+")[0]
            if rm == "Transaction" and kind.startswith("COMMIT"):
                out["commits"] += n
            elif rm in ("Heap", "Heap2") and kind in ("LOCK", "LOCK_UPDATED"):
                out["locks"] += n
            elif rm == "Btree" and kind in ("INSERT_LEAF", "INSERT_POST"):
                out["index"] += n
            elif rm == "Btree" and kind in ("SPLIT_L", "SPLIT_R"):
                out["index"] += level0
            elif rm in ("Gin", "Gist", "SPGist", "Hash") and kind.startswith("INSERT"):
                out["index"] += max(n, tuples)
        return out


MIN_WINDOW_S = 5.0


def long_enough(run: Callable[[int], Budget], n: int, quick: bool = False) -> Budget:
    """``run(n)``, and once more with as many units as 6 s take at its rate when its window was
    shorter than ``MIN_WINDOW_S`` (a size guessed from an earlier rate misses under changing
    load); ``quick``: the first run is enough."""
    spent = run(n)
    if not quick and spent.units and spent.seconds < MIN_WINDOW_S:
        spent = run(int(spent.units / spent.seconds * 6.0) + 1)
    return spent


# --- a child process's side of a window --------------------------------------------------------


def child_report_line(report: dict[str, Any]) -> str:
    """The line a child prints with its hook report (``read_report`` parses it)."""
    return "budget " + json.dumps(report)


def read_report(line: str) -> dict[str, Any] | None:
    if not line.startswith("budget "):
        return None
    report: dict[str, Any] = json.loads(line[len("budget ") :])
    return report


# --- the command line: what each of the hot statements costs PostgreSQL -------------------------


def _statements_main() -> int:
    """``python bench/budget.py [--n N] [--rounds R]``: each statement a busy mail worker runs,
    alone, N times in a row on one connection (as ``direct.holding`` keeps it), on a migrated
    database with N x 8 Pending mails: the backend's CPU (its process clock) and the client's
    per statement, so a lever's saving can be told before it is built. In turns (R rounds):

    claim          ``claim.claim_due(engine, MailSendRecord, 1)`` (the poll's, or an idle
                   worker's claim: the fair pick function, the suppression and epoch columns)
    claim, 8       ``claim_due(..., 8)``, per record (the fair pick's SQL walk)
    charge+freeze  preparation's charge and write-back (``_CHARGE_AND_FREEZE``), by version
    sent           ``sent_write.record_sent`` with its attempt row, no next claim
    sent+claim     the same inside ``claim.claiming_next``: Sent and the next claim in one
    sent, claim 8 in every 8th  Sent alone, the next 8 claimed in every 8th: a worker holding 8
    sent, 8        the group commit's statement, 8 Sent writes, no claim
    sent+claim, 8  the group commit's statement (``sent_write._sent_batch``) writing 8 Sent
                   and claiming 8, per record: one worker's batch, were it to hold 8
    nothing        ``SELECT 1``: a round trip and a transaction with no work (the floor)

    The product's imports happen here, not at the top: the peers' venv imports this module."""
    import _common as c  # puts the repository root on sys.path

    args = c.parse_args(
        _statements_main.__doc__,
        lambda p: (
            p.add_argument("--n", type=int, default=2000, help="statements of each kind a turn"),
            p.add_argument("--rounds", type=int, default=2, help="turns of every kind"),
            p.add_argument(
                "--shape",
                action="append",
                default=[],
                help="SQL run once after the migrations (a shape to try: DROP INDEX ..., "
                "CREATE INDEX ...); repeatable",
            ),
        ),
    )
    from datetime import UTC, datetime

    from portal.extensions import db
    from portal.messaging.sending import claim, preparation, sent_write
    from portal.messaging.sending.outcomes import Attempt, Claimed
    from portal.models import Channel, MailSendRecord
    from portal.models.direct import driver_cursor, holding

    n = 200 if args.quick else args.n
    c.print_header("bench/budget.py: each hot statement alone, per statement", args.quick)
    totals: dict[str, list[float]] = {}
    with c.bench_database("postroom_bench_statements") as url:
        app = c.make_app(url)
        with app.app_context():
            engine = db.engine
        settings = c.bench_settings(url)
        dsn = c.conninfo(url)
        tenant = c.tenant_with_mail_server(app, "127.0.0.1", 2525)
        with psycopg.connect(dsn, autocommit=True) as conn:
            for sql in args.shape:
                conn.execute(sql)
        held: list[Any] = []
        frozen = {
            "rendered_subject": "Hello",
            "rendered_html": None,
            "rendered_text": "Hi",
            "final_reply_to": None,
            "final_priority": None,
            "final_attachments": None,
            "server_config_id": None,
            "read_receipt": False,
            "message_id_header": "<bench@bench.test>",
            "template_version": None,
        }

        def claimed_of(record: Any) -> Any:
            return Claimed(Channel.MAIL, record.id, record.version, record.tenant_id, 0)

        def attempt() -> Any:
            return Attempt(datetime.now(UTC), 0.001, None, "bench", "250", "2.0.0 Ok")

        def timed(name: str, body: Callable[[], int]) -> None:
            with holding(engine):
                with driver_cursor(engine) as cur:
                    cur.execute("SELECT pg_backend_pid()")
                    pid = int(cur.fetchone()[0])
                backend0, client0 = cpu_ns(pid) or 0, time.thread_time_ns()
                count = body()
                backend1, client1 = cpu_ns(pid) or 0, time.thread_time_ns()
            total = totals.setdefault(name, [0.0, 0.0, 0.0])
            total[0] += (backend1 - backend0) / 1e3
            total[1] += (client1 - client0) / 1e3
            total[2] += count

        for _round in range(args.rounds):
            with psycopg.connect(dsn) as conn:
                c.add_pending(conn, n * 8, tenant)
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("VACUUM ANALYZE mail_send_record")
            held.clear()

            def claims() -> int:
                for _ in range(n):
                    held.extend(claim.claim_due(engine, MailSendRecord, 1))
                return n

            def claims8() -> int:
                before = len(held)
                for _ in range(n // 8):
                    held.extend(claim.claim_due(engine, MailSendRecord, 8))
                return len(held) - before

            def charges() -> int:
                for i, record in enumerate(held):
                    preparation._charge_and_freeze(
                        engine, MailSendRecord, tenant, claimed_of(record), settings, frozen
                    )
                    held[i] = (record, 1)
                return len(held)

            def sents() -> int:
                for record, bump in held:
                    claimed = claimed_of(record).bumped() if bump else claimed_of(record)
                    sent_write.record_sent(engine, claimed, "<b@b>", attempt=attempt())
                return len(held)

            def sent_and_claims() -> int:
                record = claim.claim_due(engine, MailSendRecord, 1)[0]
                for _ in range(n):
                    with claim.claiming_next(MailSendRecord, lambda: True) as following:
                        sent_write.record_sent(
                            engine, claimed_of(record), "<b@b>", attempt=attempt()
                        )
                    record = following.records[0]
                return n

            def batch_row(record: Any) -> dict[str, Any]:
                row = {"rid": record.id, "ver": record.version, "pmid": "<b@b>"}
                row |= {"has_refused": False, "refused": None}
                for name, value in attempt().params().items():
                    row[name] = value.isoformat() if isinstance(value, datetime) else value
                return row

            def sents8() -> int:
                # 8 Sent writes in one statement, no claim (the group commit's, full).
                statement = sent_write._sent_batch(Channel.MAIL, 0)
                records = claim.claim_due(engine, MailSendRecord, (n // 8) * 8)
                for i in range(0, len(records), 8):
                    statement.run(
                        engine, batch=json.dumps([batch_row(r) for r in records[i : i + 8]])
                    )
                return len(records)

            def sent_and_claims8() -> int:
                # As a pool worker holding records runs it: Sent alone, the next 8 claimed in
                # the Sent write of the last record it holds.
                records = claim.claim_due(engine, MailSendRecord, 8)
                for _ in range(n // 8):
                    for i, record in enumerate(records):
                        last = i == len(records) - 1
                        with claim.claiming_next(MailSendRecord, lambda last=last: 8 * last) as nxt:
                            sent_write.record_sent(
                                engine, claimed_of(record), "<b@b>", attempt=attempt()
                            )
                    records = nxt.records
                return (n // 8) * 8

            def sent8_and_claims8() -> int:
                # One statement writes 8 records Sent (with their attempt rows) and claims
                # the next 8: the group commit's statement, as one worker holding 8 would.
                statement = sent_write._sent_batch(Channel.MAIL, 8)
                loader = claim.loader_for(MailSendRecord)
                records = claim.claim_due(engine, MailSendRecord, 8)
                for _ in range(n // 8):
                    rows = json.dumps([batch_row(r) for r in records])
                    _count, got = statement.run(engine, batch=rows)
                    pk = 3 + loader.pk_index
                    records = [loader.load(row[3:]) for row in got if row[pk] is not None]
                return (n // 8) * 8

            def nothing() -> int:
                for _ in range(n):
                    with driver_cursor(engine) as cur:
                        cur.execute("SELECT 1")
                        cur.fetchall()
                return n

            timed("claim", claims)
            timed("claim, 8 a statement", claims8)
            timed("charge+freeze", charges)
            timed("sent", sents)
            timed("sent+claim", sent_and_claims)
            timed("sent, claim 8 in every 8th", sent_and_claims8)
            timed("sent, 8 a statement", sents8)
            timed("sent+claim, 8 a statement", sent8_and_claims8)
            timed("nothing", nothing)
        engine.dispose()
    rows = [
        [name, f"{backend / count:,.0f}", f"{client / count:,.0f}"]
        for name, (backend, client, count) in totals.items()
        if count
    ]
    c.print_table(
        f"Per statement, {args.rounds} x {n} each (load at the end: {os.getloadavg()[0]:.1f})",
        ["statement", "backend CPU µs", "client CPU µs"],
        rows,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(_statements_main())
