"""Table shape: the bare one-statement loop (claim.py's raw1) on today's record table against a
narrow queue table that holds the claim bookkeeping, before building either ("measure
the bare loop on a new shape before building it"). Nothing here changes the product: the other
shapes are tables this script creates beside the migrated ones, on its own database.

Every contender is bare psycopg, one statement per record: the Sent write of the record in
hand and the claim of the next (oldest Pending first, as raw1), as data-modifying CTEs, the
claim reading the Sent write's result (so it runs after it).

raw1        claim.py's raw1, exactly (its statement is imported): today's mail_send_record (11
            indexes, 7 of them full; status and updated_time are indexed, so every status
            change is a non-HOT update that inserts an entry into every full index).
today-full  raw1 + what the product's statement adds on the same table: the attempt row
            (INSERT INTO send_attempt from the Sent write, as outcomes._attempt_insert writes
            it, attempt_count bumped) and the claimed record returned whole (all columns,
            converted by psycopg), as scan.claim_statement returns it.
queue-hot   the narrow-queue shape: mail_queue_q (id, tenant_id, stream, status, due,
            version; partial indexes on the due Pending / Retry / Sending rows as the fair
            indexes are) holds the claim bookkeeping; the record table (a copy of today's
            with its history, fillfactor 75) keeps only the indexes that name no column a
            status change writes (pk, created_time, (tenant_id, id), business key): the
            record's status, version, updated_time, ... are written in the same statement
            (the record stays the truth), as HOT updates. The Sent write deletes the queue row.
queue-hot-full  queue-hot + the attempt row + the claimed record returned whole (vs today-full).
queue-keep  a milder shape: the claim writes only the queue row (the record reads Pending
            until its outcome; Sending is the queue's), the record keeps today's indexes but
            the three claim ones (pending_fair, retry_due, retry_fair, now the queue's); its
            one write per record (Sent) stays non-HOT. The claim reads the record row (a
            worker needs it to send).

The machine is shared: contenders take turns in short time slices, ABBA, on their own
backlogs (refilled and VACUUM ANALYZEd between rounds, never inside a slice); only ratios in
one run mean anything. The HOT share of each contender's record table is read from
pg_stat_user_tables around its slices (each worker flushes its counters before it closes).
A HOT update needs room on the record's page, which on-access pruning makes; pruning skips
rows deleted after the oldest snapshot xmin of the whole server (a snapshot's xmin counts
every database's running xids), so a long transaction anywhere on a shared server (another
bench restoring 10M rows) holds the HOT share down: the oldest snapshot's age is printed.
"""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime
from typing import Any

import _common as c
import psycopg
from claim import RAW1_PICK, Body, Run, drive, raw1_statement

from portal.extensions import db

DB_NAME = "postroom_bench_shape"
GOAL = 0.8  # ours >= 0.8 x raw1

TODAY = "mail_send_record"
HOT_RECORD, HOT_QUEUE = "mail_send_record_q", "mail_queue_q"
KEEP_RECORD, KEEP_QUEUE = "mail_send_record_k", "mail_queue_k"
HOT_FILLFACTOR = 75  # room on the page for the new version of a HOT update

# The record table's indexes each shape keeps (the rest move to the queue table or go).
HOT_KEEPS = (
    "pk_mail_send_record",
    "idx_mail_send_created",
    "idx_mail_send_tenant_created",
    "uq_mail_send_business_key",
)
CLAIM_INDEXES = (
    "idx_mail_send_pending_fair",
    "idx_mail_send_retry_due",
    "idx_mail_send_retry_fair",
)

CONTENDERS = ("raw1", "today-full", "queue-hot", "queue-hot-full", "queue-keep")
ORDER = CONTENDERS + tuple(reversed(CONTENDERS))
RECORD_TABLE = {
    "raw1": TODAY,
    "today-full": TODAY,
    "queue-hot": HOT_RECORD,
    "queue-hot-full": HOT_RECORD,
    "queue-keep": KEEP_RECORD,
}
QUEUE_TABLE = {"queue-hot": HOT_QUEUE, "queue-hot-full": HOT_QUEUE, "queue-keep": KEEP_QUEUE}

# --- the statements ----------------------------------------------------------------------------

# As outcomes._attempt_insert writes the attempt's row, from the Sent write's result.
ATTEMPT = (
    "attempt AS (INSERT INTO send_attempt (tenant_id, channel, record_id, number, started_at, "
    "duration_ms, worker, config_id, config_name, outcome, ambiguous, code, message, "
    "provider_message_id) SELECT s.tenant_id, 'mail', s.id, s.attempt_count, $4, $5, $6, $7, "
    "$8, 'sent', $9, $10, $11, s.provider_message_id FROM sent s)"
)
SENT_SET = (
    "status = 'Sent', version = m.version + 1, sent_at = statement_timestamp(), "
    "updated_time = statement_timestamp(), next_retry_at = NULL, provider_message_id = $1, "
    "error_code = NULL, error_message = NULL"
)
CLAIM_SET = (
    "status = 'Sending', version = m.version + 1, updated_time = statement_timestamp(), "
    "first_claimed_at = coalesce(m.first_claimed_at, statement_timestamp())"
)
RESULT = (
    "SELECT (SELECT count(*) FROM sent) AS written, {cols} FROM (SELECT 1) one "
    "LEFT JOIN claimed ON true"
)
WHOLE, ID_VERSION = "claimed.*", "claimed.id, claimed.version"


def raw1_sql() -> str:
    """claim.py's raw1, with PostgreSQL's own placeholders as claim.py runs it."""
    sql = raw1_statement(RAW1_PICK)
    for n in (1, 2, 3):
        sql = sql.replace("%s", f"${n}", 1)
    return sql


def today_full_sql() -> str:
    sent = (
        f"sent AS (UPDATE {TODAY} m SET {SENT_SET}, attempt_count = m.attempt_count + 1 "
        "WHERE m.id = $2 AND m.version = $3 "
        "RETURNING m.id, m.tenant_id, m.attempt_count, m.provider_message_id)"
    )
    claimed = (
        f"claimed AS (UPDATE {TODAY} m SET {CLAIM_SET} FROM pick WHERE m.id = pick.id "
        "RETURNING m.*)"
    )
    return f"WITH {sent}, {ATTEMPT}, pick AS ({RAW1_PICK}), {claimed} " + RESULT.format(cols=WHOLE)


def _queue_pick(queue: str) -> str:
    return (
        f"pick AS (SELECT q.id FROM {queue} q WHERE q.status = 'Pending' "
        "AND (SELECT count(*) FROM sent) >= 0 ORDER BY q.due LIMIT 1 FOR UPDATE SKIP LOCKED), "
        f"lease AS (UPDATE {queue} q SET status = 'Sending', version = q.version + 1, "
        "due = statement_timestamp() + interval '5 minutes' FROM pick WHERE q.id = pick.id "
        "RETURNING q.id, q.version)"
    )


def queue_hot_sql(full: bool) -> str:
    """Sent on the record (HOT), its queue row deleted; the next claim: the queue row leased,
    the record written Sending (HOT)."""
    returned = "m.id, m.tenant_id" + (", m.attempt_count, m.provider_message_id" if full else "")
    bump = ", attempt_count = m.attempt_count + 1" if full else ""
    sent = (
        f"sent AS (UPDATE {HOT_RECORD} m SET {SENT_SET}{bump} WHERE m.id = $2 AND m.version = $3 "
        f"RETURNING {returned})"
    )
    done = f"done AS (DELETE FROM {HOT_QUEUE} q USING sent s WHERE q.id = s.id)"
    claimed = (
        f"claimed AS (UPDATE {HOT_RECORD} m SET {CLAIM_SET} FROM lease WHERE m.id = lease.id "
        f"RETURNING {'m.*' if full else 'm.id, m.version'})"
    )
    ctes = [sent, done, ATTEMPT, _queue_pick(HOT_QUEUE), claimed]
    if not full:
        ctes.remove(ATTEMPT)
    return "WITH " + ", ".join(ctes) + " " + RESULT.format(cols=WHOLE if full else ID_VERSION)


def queue_keep_sql() -> str:
    """The claim leases the queue row only (and reads the record); Sent, by the lease's
    version, deletes the queue row and writes the record Sent (non-HOT: status is indexed)."""
    done = f"done AS (DELETE FROM {KEEP_QUEUE} q WHERE q.id = $2 AND q.version = $3 RETURNING q.id)"
    sent = (
        f"sent AS (UPDATE {KEEP_RECORD} m SET {SENT_SET} FROM done WHERE m.id = done.id "
        "RETURNING m.id, m.tenant_id)"
    )
    claimed = (
        f"claimed AS (SELECT m.id, lease.version FROM lease JOIN {KEEP_RECORD} m "
        "ON m.id = lease.id)"
    )
    ctes = [done, sent, _queue_pick(KEEP_QUEUE), claimed]
    return "WITH " + ", ".join(ctes) + " " + RESULT.format(cols=ID_VERSION)


def statement_of(name: str) -> tuple[str, bool]:
    """(SQL, whether it writes the attempt row and returns the whole record)."""
    return {
        "raw1": (raw1_sql(), False),
        "today-full": (today_full_sql(), True),
        "queue-hot": (queue_hot_sql(False), False),
        "queue-hot-full": (queue_hot_sql(True), True),
        "queue-keep": (queue_keep_sql(), False),
    }[name]


def loop_body(dsn: str, sql: str, full: bool) -> Body:
    """One statement per record: Sent for the one in hand and the next claim. The first claim
    of a worker is the same statement with no record in hand (its Sent write matches none)."""

    def body(run: Run, stop: threading.Event) -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            cursor = psycopg.RawCursor(conn)
            at: tuple[int, int] | None = None  # where id and version are in the result
            held: tuple[int, int] | None = None
            while not stop.is_set():
                rid, ver = held if held is not None else (-1, -1)
                params: tuple[Any, ...] = (f"<bench-{rid}@bench.test>", rid, ver)
                if full:
                    started = datetime.now(UTC)
                    params += (started, 3, "bench-worker", None, None, False, "250", "2.0.0 Ok")
                got = cursor.execute(sql, params, prepare=True).fetchone()
                assert got is not None
                if at is None:
                    names = [d.name for d in cursor.description or ()]
                    at = (names.index("id"), names.index("version"))
                if held is not None:
                    run.count(got[0] == 1)
                if got[at[0]] is None:
                    held = None
                    run.empty()
                else:
                    held = (got[at[0]], got[at[1]])
            # Flush this backend's table counters now (before ReadyForQuery), so the
            # pg_stat_user_tables read after the slice sees them.
            conn.execute("SELECT pg_stat_force_next_flush()")

    return body


# --- the shapes' tables ------------------------------------------------------------------------


def index_defs(conn: psycopg.Connection[Any], table: str) -> dict[str, str]:
    rows = conn.execute(
        "SELECT indexrelid::regclass::text, pg_get_indexdef(indexrelid) FROM pg_index "
        "WHERE indrelid = %s::regclass",
        (table,),
    ).fetchall()
    return {name: sql for name, sql in rows}


def copy_record_table(
    conn: psycopg.Connection[Any], table: str, keep: tuple[str, ...], fillfactor: int
) -> list[str]:
    """``table``: today's record table's columns and history, with only the indexes ``keep``
    and the status-change callback trigger; returns the indexes it has."""
    conn.execute(
        f"CREATE TABLE {table} (LIKE {TODAY} INCLUDING DEFAULTS INCLUDING CONSTRAINTS "
        f"INCLUDING STORAGE) WITH (fillfactor = {fillfactor})"
    )
    conn.execute(f"INSERT INTO {table} SELECT * FROM {TODAY}")
    made = []
    for name, sql in index_defs(conn, TODAY).items():
        if name not in keep:
            continue
        new = name.replace("mail_send_record", table).replace("mail_send_", f"{table}_")
        conn.execute(
            sql.replace(f"INDEX {name} ON", f"INDEX {new} ON").replace(
                f"ON public.{TODAY} ", f"ON public.{table} "
            )
        )
        made.append(new)
    row = conn.execute(
        "SELECT pg_get_triggerdef(oid) FROM pg_trigger WHERE tgrelid = %s::regclass "
        "AND tgname = 'mail_send_record_callback_change'",
        (TODAY,),
    ).fetchone()
    assert row is not None, "the status-change callback trigger is gone: update this bench"
    conn.execute(
        row[0]
        .replace("TRIGGER mail_send_record_callback_change", f"TRIGGER {table}_callback_change")
        .replace(f"ON public.{TODAY} ", f"ON public.{table} ")
    )
    conn.commit()
    return made


def create_queue(conn: psycopg.Connection[Any], queue: str) -> None:
    """The narrow table of the claim bookkeeping: one row per record in flight (Pending,
    Sending, Retry), deleted with its outcome; its partial indexes are the claim's and the
    sweep's (oldest due Pending as raw1 picks, the fair ones, the leases to sweep)."""
    conn.execute(
        f"CREATE TABLE {queue} (id bigint PRIMARY KEY, tenant_id bigint NOT NULL, "
        "stream varchar(16) NOT NULL, status varchar(16) NOT NULL, due timestamptz NOT NULL, "
        "version integer NOT NULL DEFAULT 0)"
    )
    for suffix, definition in (
        ("pending", "(due) WHERE status = 'Pending'"),
        ("pending_fair", "(stream, tenant_id, due) WHERE status = 'Pending'"),
        ("retry_due", "(stream, due) WHERE status = 'Retry'"),
        ("retry_fair", "(stream, tenant_id, due) WHERE status = 'Retry'"),
        ("sending", "(due) WHERE status = 'Sending'"),
    ):
        conn.execute(f"CREATE INDEX idx_{queue}_{suffix} ON {queue} {definition}")
    conn.commit()


def add_pending_queued(conn: psycopg.Connection[Any], table: str, queue: str, n: int) -> None:
    """``n`` Pending records as c.add_pending makes them, each with its queue row."""
    common = "tenant_id, scope, status, version, retry_count, created_time, updated_time"
    conn.execute(
        f"WITH ins AS (INSERT INTO {table} ({common}, {c.MAIL_COLUMNS}) "
        "SELECT 1, 'TENANT', 'Pending', 0, 0, "
        f"clock_timestamp() - make_interval(secs => ({n} - g) / 1000.0), "
        f"clock_timestamp() - make_interval(secs => ({n} - g) / 1000.0), {c.MAIL_VALUES} "
        f"FROM generate_series(1, {n}) g RETURNING id, tenant_id, stream, updated_time) "
        f"INSERT INTO {queue} (id, tenant_id, stream, status, due, version) "
        "SELECT id, tenant_id, stream, 'Pending', updated_time, 0 FROM ins"
    )
    conn.commit()


def pending(dsn: str, table: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(f"SELECT count(*) FROM {table} WHERE status = 'Pending'").fetchone()
    return int(row[0]) if row else 0


def top_up(dsn: str, low: int, n: int) -> None:
    """Each shape's backlog refilled (and its tables VACUUM ANALYZEd) when below ``low``; the
    queue tables are vacuumed every round (small, and churned by every record)."""
    for table, queue in ((TODAY, None), (HOT_RECORD, HOT_QUEUE), (KEEP_RECORD, KEEP_QUEUE)):
        if pending(dsn, queue or table) >= low:
            if queue:
                with psycopg.connect(dsn, autocommit=True) as conn:
                    conn.execute(f"VACUUM (ANALYZE) {queue}")
            continue
        with psycopg.connect(dsn) as conn:
            if queue is None:
                c.add_pending(conn, n)
            else:
                add_pending_queued(conn, table, queue, n)
        with psycopg.connect(dsn, autocommit=True) as conn:
            for name in (table, queue) if queue else (table,):
                conn.execute(f"VACUUM (ANALYZE) {name}")


def table_counts(dsn: str) -> dict[str, tuple[int, int]]:
    """(n_tup_upd, n_tup_hot_upd) of every table a contender writes."""
    names = [TODAY, HOT_RECORD, KEEP_RECORD, HOT_QUEUE, KEEP_QUEUE]
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT relname, n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables "
            "WHERE relname = ANY(%s)",
            (names,),
        ).fetchall()
    return {name: (int(upd), int(hot)) for name, upd, hot in rows}


# --- runs --------------------------------------------------------------------------------------


def compare(
    dsn: str, threads: int, slice_s: float, rounds: int, backlog: tuple[int, int]
) -> dict[str, dict[str, float]]:
    bodies = {name: loop_body(dsn, *statement_of(name)) for name in CONTENDERS}
    keys = ("n", "s", "cpu", "empty", "lost", "upd", "hot", "qupd")
    totals = {name: dict.fromkeys(keys, 0.0) for name in CONTENDERS}
    for r in range(rounds):
        top_up(dsn, *backlog)
        line = []
        this_round = {name: [0.0, 0.0] for name in CONTENDERS}
        for name in ORDER:
            before = table_counts(dsn)
            cpu = time.process_time()
            elapsed, run = drive(threads, slice_s, bodies[name])
            used = time.process_time() - cpu
            after = table_counts(dsn)
            t = totals[name]
            t["cpu"] += used
            t["n"] += run.done
            t["s"] += elapsed
            this_round[name][0] += run.done
            this_round[name][1] += elapsed
            t["empty"] += run.empty_claims
            t["lost"] += run.lost_writes
            record = RECORD_TABLE[name]
            t["upd"] += after[record][0] - before[record][0]
            t["hot"] += after[record][1] - before[record][1]
            if name in QUEUE_TABLE:
                queue = QUEUE_TABLE[name]
                t["qupd"] += after[queue][0] - before[queue][0]
            line.append(f"{name} {run.done / elapsed:,.0f}")
        c.say(f"  round {r + 1}/{rounds} (rec/s): " + ", ".join(line))
        # Each round's ratio to raw1 from its own two slices (ABBA: both sides of the round's
        # middle), so a load swing between rounds moves both sides of the ratio.
        base = this_round["raw1"][0] / this_round["raw1"][1]
        for name, (n, s) in this_round.items():
            totals[name][f"r{r}"] = n / s / base
    for table, queue in ((TODAY, None), (HOT_RECORD, HOT_QUEUE), (KEEP_RECORD, KEEP_QUEUE)):
        if pending(dsn, queue or table) == 0:
            c.say(f"  WARNING: {table}'s backlog ran dry; its figures are too low")
    return totals


def hot_probe(dsn: str) -> list[list[Any]]:
    """Does a partial index whose predicate names status (say, only the final states) leave a
    Pending -> Sending update HOT? 1,000 rows, a table with room on every page."""
    rows = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        for label, index in (
            ("(tenant_id, id): names no column the update writes", "(tenant_id, id)"),
            ("(id) WHERE status IN final states", "(id) WHERE status IN ('Sent', 'Failed')"),
            ("(tenant_id, status, id), as today", "(tenant_id, status, id)"),
        ):
            conn.execute("DROP TABLE IF EXISTS shape_hot_probe")
            conn.execute(
                "CREATE TABLE shape_hot_probe (id bigint PRIMARY KEY, tenant_id bigint, "
                "status text, pad text) WITH (fillfactor = 50)"
            )
            conn.execute(f"CREATE INDEX shape_hot_probe_ix ON shape_hot_probe {index}")
            conn.execute(
                "INSERT INTO shape_hot_probe SELECT g, g % 7, 'Pending', repeat('x', 100) "
                "FROM generate_series(1, 1000) g"
            )
            conn.execute("UPDATE shape_hot_probe SET status = 'Sending'")
            conn.execute("SELECT pg_stat_force_next_flush()")
            got = conn.execute(
                "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables "
                "WHERE relname = 'shape_hot_probe'"
            ).fetchone()
            assert got is not None
            rows.append([label, int(got[0]), int(got[1])])
        conn.execute("DROP TABLE shape_hot_probe")
    return rows


def oldest_snapshot() -> str:
    """The oldest snapshot on the server (any database): what stalls on-access pruning."""
    with psycopg.connect(c.conninfo(c.ADMIN_URL), autocommit=True) as conn:
        row = conn.execute(
            "SELECT age(backend_xmin), datname, now() - xact_start FROM pg_stat_activity "
            "WHERE backend_xmin IS NOT NULL AND pid <> pg_backend_pid() "
            "ORDER BY age(backend_xmin) DESC LIMIT 1"
        ).fetchone()
    if row is None:
        return "none"
    return f"{row[0]:,} xids old (database {row[1]}, its transaction open {row[2]})"


def index_summary(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for table in (TODAY, HOT_RECORD, KEEP_RECORD, HOT_QUEUE):
            names = sorted(index_defs(conn, table))
            c.say(f"  {table}: {len(names)} indexes: {', '.join(names)}")


def main() -> int:
    args = c.parse_args(
        __doc__,
        lambda p: p.add_argument(
            "--fillfactor",
            type=int,
            default=HOT_FILLFACTOR,
            help=f"of queue-hot's record table (default {HOT_FILLFACTOR})",
        ),
    )
    quick = args.quick
    history = 100_000 if quick else 1_000_000
    slice_s = 0.5 if quick else 2.0
    rounds = 2 if quick else 4
    backlog = (6_000, 10_000) if quick else (40_000, 60_000)
    load_start = " ".join(f"{x:.2f}" for x in c.os.getloadavg())
    c.print_header(
        "bench/shape.py: the bare one-statement loop on today's and a narrow shape", quick
    )
    with c.bench_database(DB_NAME) as url:
        app = c.make_app(url)
        with app.app_context():
            db.engine.dispose()  # migrated; the contenders are bare psycopg
        dsn = c.conninfo(url)
        c.say(f"\nfilling {history:,} history rows, then the shapes' copies ...")
        t0 = time.perf_counter()
        with psycopg.connect(dsn) as conn:
            c.fill_history(conn, history)
            hot_kept = HOT_KEEPS
            keep_kept = tuple(n for n in index_defs(conn, TODAY) if n not in CLAIM_INDEXES)
            copy_record_table(conn, HOT_RECORD, hot_kept, args.fillfactor)
            copy_record_table(conn, KEEP_RECORD, keep_kept, 100)
            create_queue(conn, HOT_QUEUE)
            create_queue(conn, KEEP_QUEUE)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("VACUUM (ANALYZE)")
        c.say(f"  done in {time.perf_counter() - t0:.1f} s")
        index_summary(dsn)
        rows = []
        for threads in (1, 8):
            c.say(f"\n{threads} thread(s), {slice_s:g} s slices, {rounds} rounds of {ORDER}:")
            c.say(f"  oldest snapshot on the server: {oldest_snapshot()}")
            totals = compare(dsn, threads, slice_s, rounds, backlog)
            c.say(f"  oldest snapshot on the server: {oldest_snapshot()}")
            rate = {name: t["n"] / t["s"] for name, t in totals.items()}
            for name, t in totals.items():
                rows.append(
                    [
                        threads,
                        name,
                        rate[name],
                        f"{rate[name] / rate['raw1']:.2f}",
                        f"{c.median([t[f'r{r}'] for r in range(rounds)]):.2f}",
                        f"{rate[name] / rate['today-full']:.2f}",
                        f"{t['hot']:,.0f} / {t['upd']:,.0f}",
                        f"{t['hot'] / t['upd']:.0%}" if t["upd"] else "-",
                        f"{t['upd'] / t['n']:.2f}" if t["n"] else "-",
                        f"{t['qupd'] / t['n']:.2f}" if name in QUEUE_TABLE and t["n"] else "-",
                        t["cpu"] / t["n"] * 1e6 if t["n"] else float("nan"),
                        int(t["empty"]),
                        int(t["lost"]),
                    ]
                )
        c.print_table(
            f"Records/s, Sent + next claim in one statement, bare psycopg ({history:,} history)",
            [
                "threads",
                "contender",
                "rec/s",
                "of raw1",
                "median of rounds",
                "of today-full",
                "record HOT / updates",
                "HOT share",
                "record upd/rec",
                "queue upd/rec",
                "client CPU us/rec",
                "empty claims",
                "lost writes",
            ],
            rows,
        )
        c.print_table(
            "HOT probe: 1,000 rows updated Pending -> Sending (fillfactor 50), one other index",
            ["the other index", "updates", "HOT"],
            hot_probe(dsn),
        )
        c.say(
            "raw1: claim.py's bare loop on today's table; today-full: + attempt row + the whole"
            " record returned;\nqueue-hot(-full): the claim bookkeeping in a narrow queue"
            " table, the record's status written HOT (no index names a column it changes);"
            "\nqueue-keep: the claim writes the queue only, the record keeps its status indexes"
            " (one non-HOT write a record, at Sent)."
        )
        c.say(f"\nload average at start: {load_start}; at the end: ")
        c.say("  " + " ".join(f"{x:.2f}" for x in c.os.getloadavg()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
