"""The stuck-send sweep (seed 000 "Stuck sends").

A record left in Sending past ``STUCK_SEND_THRESHOLD_S`` belongs to a worker that died or was
stopped mid-send. The sweep puts it back to Retry, due now, with ``ZOMBIE_RECOVERED``; one whose
retries are already used up becomes a dead letter with ``ZOMBIE_EXHAUSTED`` (and its archive
row). Each transition goes by version in its own transaction and tenant context, so two
sweeps at once, or a sweep racing a late worker, change each record once.

A stuck record that was prepared may have been accepted (seed 002: a lost lease is
uncertain), so its attempt is marked ambiguous, and what happens next is the server's or
provider's ``uncertain_policy``: ``retry`` (at least once, relying on the stable Message-ID or
idempotency key) puts it back to Retry as above; ``hold`` makes it ``Uncertain``, never resent
automatically, for an operator to resolve. A record stuck before preparation sent nothing.

Each sweep writes its end time to ``chore_run``. The sweep is an rq-scheduler job, so it
stops when Redis is away; ``sweep_if_overdue`` lets a delivery worker see that from the
database alone (no run for two intervals) and run the sweep itself: on PostgreSQL one worker at
a time, under a transaction-level advisory lock (so it works behind PgBouncer in transaction
mode); on SQLite it simply runs, since the version check already makes parallel sweeps safe.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any

from sqlalchemy import Engine, exists, func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from portal.config import Settings
from portal.messaging import transitions
from portal.messaging.records import timeline
from portal.messaging.sending.backoff import BackoffPolicy
from portal.messaging.sending.classify import MarkerCode
from portal.messaging.sending.outcomes import (
    Attempt,
    Claimed,
    dead_letter_row,
    write_outcome,
)
from portal.messaging.transitions import Cause
from portal.metrics import MESSAGE_FAILED
from portal.models import (
    AttemptOutcome,
    Channel,
    ChoreRun,
    RecordEventKind,
    SendStatus,
    UncertainPolicy,
    db_now,
    db_now_plus,
)
from portal.models.by_channel import PARTS
from portal.tenancy import tenant_context

log = logging.getLogger("portal.sweeper")

BATCH = 200
SWEEP_CHORE = "sweep-stuck-sends"  # its row in chore_run
# pg_try_advisory_xact_lock's key for "a worker runs the overdue sweep": b"postroom" as a bigint.
SWEEP_LOCK_KEY = int.from_bytes(b"postroom", "big")
# The sweep's transitions: by version, and guarded on their from-status (Sending) as well.
_RECOVERED = transitions.change(Cause.SWEPT, SendStatus.RETRY)
_EXHAUSTED = transitions.change(Cause.SWEPT, SendStatus.DEAD_LETTER)
_HELD = transitions.change(Cause.SWEPT, SendStatus.UNCERTAIN)


@dataclass
class SweepReport:
    recovered: dict[str, int] = field(default_factory=dict)
    exhausted: dict[str, int] = field(default_factory=dict)
    held: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.recovered.values()) + sum(self.exhausted.values()) + sum(self.held.values())


def sweep_stuck_sends(engine: Engine, settings: Settings) -> SweepReport:
    """One sweep over both channels: at most 200 records each, oldest first."""
    report = SweepReport()
    for channel, parts in PARTS.items():
        model = parts.record
        with Session(engine) as session:
            stuck = session.execute(
                select(
                    model.id,
                    model.version,
                    model.tenant_id,
                    model.trace_id,
                    model.retry_count,
                    model.prepared_at.is_not(None),
                    _route(channel),
                    model.updated_time,
                )
                .where(
                    _RECOVERED.where(model.status),
                    model.updated_time < db_now_plus(-settings.stuck_send_threshold_s),
                )
                .order_by(model.updated_time)
                .limit(BATCH)
            ).all()
            holding = _holding_routes(session, channel)
            names = _route_names(session, channel, {row[6] for row in stuck if row[5]})
        for record_id, version, tenant_id, trace_id, retry_count, prepared, route, at in stuck:
            claimed = Claimed(channel, record_id, version, tenant_id, retry_count)
            # A prepared record may have reached its server: its attempt gets a row.
            attempt = Attempt(at, None, route, names.get(route), worker=None) if prepared else None
            with tenant_context(tenant_id, trace_id):
                outcome = _transition(
                    engine,
                    claimed,
                    settings,
                    ambiguous=prepared,
                    hold=prepared and route in holding,
                    attempt=attempt,
                )
            if outcome is not None:
                counts = {
                    "retry": report.recovered,
                    "dead_letter": report.exhausted,
                    "uncertain": report.held,
                }[outcome]
                counts[channel.value] = counts.get(channel.value, 0) + 1
    _record_run(engine)
    return report


def _record_run(engine: Engine) -> None:
    """Write this sweep's end time (database clock) to ``chore_run``."""
    dialect = postgresql if engine.dialect.name == "postgresql" else sqlite
    statement = dialect.insert(ChoreRun).values(name=SWEEP_CHORE, last_run_at=db_now())
    statement = statement.on_conflict_do_update(
        index_elements=[ChoreRun.name], set_={"last_run_at": db_now()}
    )
    try:
        with engine.begin() as connection:
            connection.execute(statement)
    except Exception:
        # The sweep itself is done; a missing mark only lets a worker sweep once more.
        log.exception("the sweep ran, but writing its time failed")


def _swept_lately(interval_s: float) -> Any:
    """True when the sweep ran within two intervals (database clock)."""
    return select(
        exists().where(
            ChoreRun.name == SWEEP_CHORE,
            ChoreRun.last_run_at >= db_now_plus(-2 * interval_s),
        )
    )


def sweep_if_overdue(engine: Engine, settings: Settings) -> SweepReport | None:
    """Run the sweep here when its last run is older than two ``SWEEP_INTERVAL_S`` (or there
    is none); None when it is not overdue or another worker is running it right now."""
    lately = _swept_lately(settings.sweep_interval_s)
    with engine.connect() as connection:
        if connection.scalar(lately):
            return None
    if engine.dialect.name != "postgresql":
        return sweep_stuck_sends(engine, settings)
    # The lock lives as long as this transaction, whose connection only holds it: the sweep's
    # own writes go through their own short transactions, as the scheduled sweep's do.
    with engine.connect() as connection, connection.begin():
        if not connection.scalar(select(func.pg_try_advisory_xact_lock(SWEEP_LOCK_KEY))):
            return None
        if connection.scalar(lately):
            return None  # another worker swept between our look and the lock
        return sweep_stuck_sends(engine, settings)


def _route(channel: Channel) -> Any:
    return PARTS[channel].route


def _holding_routes(session: Session, channel: Channel) -> set[int]:
    """The ids of the configs of this channel whose uncertain policy is ``hold``."""
    config = PARTS[channel].config
    return set(
        session.scalars(
            select(config.id).where(config.uncertain_policy == UncertainPolicy.HOLD.value)
        )
    )


def _route_names(session: Session, channel: Channel, ids: set[Any]) -> dict[int, str]:
    """The names of these mail servers or SMS providers (for the attempts' rows)."""
    config = PARTS[channel].config
    ids.discard(None)
    if not ids:
        return {}
    return dict(session.execute(select(config.id, config.name).where(config.id.in_(ids))).all())


def _transition(
    engine: Engine,
    claimed: Claimed,
    settings: Settings,
    *,
    ambiguous: bool = False,
    hold: bool = False,
    attempt: Attempt | None = None,
) -> str | None:
    model = PARTS[claimed.channel].record
    exhausted = BackoffPolicy.from_settings(settings).used_up(claimed.retry_count)
    reason = (
        f"stuck in Sending for over {settings.stuck_send_threshold_s:g} s: the worker that "
        "claimed it stopped or crashed mid-send; the server may or may not have accepted it"
    )
    values: dict[str, Any]
    if ambiguous:
        values = {"ambiguous_attempt": True, "ambiguous_at": db_now(), "ambiguous_reason": reason}
    else:
        values = {}
    if hold:
        code = MarkerCode.ZOMBIE_RECOVERED.value
        values |= {**_HELD.values, "next_retry_at": None}
        exhausted = False
    elif exhausted:
        code = MarkerCode.ZOMBIE_EXHAUSTED.value
        values |= {**_EXHAUSTED.values, "next_retry_at": None}
    else:
        code = MarkerCode.ZOMBIE_RECOVERED.value
        values |= {
            **_RECOVERED.values,
            "next_retry_at": db_now(),
            "retry_count": model.retry_count + 1,
        }
    if attempt is not None:
        attempt = replace(attempt, code=code, message=reason)
    values |= {"updated_time": db_now(), "error_code": code, "error_message": reason}
    values["version"] = model.version + 1
    with Session(engine) as session, session.begin():
        written = write_outcome(
            session,
            claimed,
            values,
            attempt,
            AttemptOutcome.SWEPT,
            ambiguous,
            _RECOVERED.where(model.status),
        )
        if not written:
            return None  # the worker finished it, or another sweep got there first
        if attempt is None:  # never prepared: no attempt row tells of it
            timeline.note(
                session,
                claimed.channel,
                claimed.id,
                claimed.tenant_id,
                RecordEventKind.SWEPT,
                code=code,
                message=reason,
            )
        if exhausted:
            session.add(dead_letter_row(claimed, code, reason))
    outcome = "uncertain" if hold else "dead_letter" if exhausted else "retry"
    MESSAGE_FAILED.labels(claimed.channel.value, "sweeper", outcome).inc()
    extra = {
        "record_id": claimed.id,
        "channel": claimed.channel.value,
        "error_code": code,
        "outcome": outcome,
    }
    if hold:
        log.error("stuck send held as Uncertain: it is not resent automatically", extra=extra)
    elif exhausted:
        log.error("stuck send dead-lettered: its retries were used up", extra=extra)
    else:
        log.warning("stuck send put back to retry", extra=extra)
    return outcome


__all__ = ["BATCH", "Channel", "SweepReport", "sweep_if_overdue", "sweep_stuck_sends"]
