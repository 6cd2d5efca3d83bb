"""Scheduled chores on rq-scheduler: declared as data with fixed job ids (as Redash does).

``ensure_schedules`` removes our schedules that are stale and adds the missing ones, so
starting any number of workers, any number of times, never duplicates a schedule; workers
call it at start and again every so often, because Redis may have restarted empty.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import redis
from rq.exceptions import InvalidJobOperation, NoSuchJobError
from rq.worker import SimpleWorker
from rq_scheduler import Scheduler

from portal.config import Settings

log = logging.getLogger("portal.chores")

QUEUE = "postroom-chores"
PREFIX = "postroom-"  # rq job ids allow letters, digits, "_" and "-" only
FETCH_MAIL_INTERVAL_S = 60
MATCH_EVENTS_INTERVAL_S = 300
NOTICES_INTERVAL_S = 60


@dataclass(frozen=True)
class Schedule:
    id: str
    func: str
    interval_s: int
    description: str


def schedules(settings: Settings) -> list[Schedule]:
    """Every periodic chore, as data."""
    return [
        Schedule(
            id=f"{PREFIX}sweep-stuck-sends",
            func="portal.delivery.chores.sweep_job",
            interval_s=max(1, round(settings.sweep_interval_s)),
            description="Put sends stuck in Sending back to retry",
        ),
        Schedule(
            id=f"{PREFIX}fetch-mail",
            func="portal.delivery.chores.fetch_mail_job",
            interval_s=FETCH_MAIL_INTERVAL_S,
            description="Read the bounce mailboxes: DSN bounces and read receipts",
        ),
        Schedule(
            id=f"{PREFIX}retention",
            func="portal.delivery.chores.retention_job",
            interval_s=max(1, round(settings.retention_interval_s)),
            description="Delete records past their tenant's retention, in small batches",
        ),
        Schedule(
            id=f"{PREFIX}notices",
            func="portal.delivery.chores.notices_job",
            interval_s=NOTICES_INTERVAL_S,
            description="Write inbox notices: quotas, outages, dead letters, decisions, mailboxes",
        ),
        Schedule(
            id=f"{PREFIX}match-events",
            func="portal.delivery.chores.match_events_job",
            interval_s=MATCH_EVENTS_INTERVAL_S,
            description="Apply delivery events whose record got its provider id unseen",
        ),
    ]


def ensure_schedules(connection: redis.Redis, settings: Settings) -> dict[str, str]:
    """Remove stale schedules of ours, add missing ones; returns what was done per id."""
    scheduler = Scheduler(queue_name=QUEUE, connection=connection)
    wanted = {s.id: s for s in schedules(settings)}
    done: dict[str, str] = {}
    present: set[str] = set()
    for job in scheduler.get_jobs():
        if not job.id.startswith(PREFIX):
            continue
        spec = wanted.get(job.id)
        if (
            spec is None
            or job.meta.get("interval") != spec.interval_s
            or job.func_name != spec.func
        ):
            scheduler.cancel(job)
            # Another worker may have removed it between our read and here: gone is gone.
            with contextlib.suppress(InvalidJobOperation, NoSuchJobError):
                job.delete()
            done[job.id] = "removed"
        else:
            present.add(job.id)
    for spec in wanted.values():
        if spec.id in present:
            continue
        # The same id from two workers at once lands on one sorted-set member: no duplicate.
        scheduler.schedule(
            scheduled_time=datetime.now(UTC),
            func=spec.func,
            interval=spec.interval_s,
            repeat=None,
            id=spec.id,
            queue_name=QUEUE,
            description=spec.description,
            meta={"interval": spec.interval_s},
            result_ttl=spec.interval_s * 10,
            timeout=max(60, spec.interval_s * 5),
        )
        done[spec.id] = "added" if done.get(spec.id) is None else "replaced"
    return done


class ChoreWorker(SimpleWorker):
    """The rq worker of the chores child: rq's SimpleWorker (jobs in its own process, one app
    per process), whose command channel's thread wakes every second instead of every minute.

    rq stops that thread at shutdown after unsubscribing, and with redis-py 8 the thread can
    read the unsubscribe reply first, find itself unsubscribed and wait its whole sleep for a
    subscription that never comes: a stopped chore child then took up to 60 s to exit (and
    lingered that long after its worker was killed). Its sleep bounds that wait."""

    COMMAND_WAKE_S = 1.0

    def subscribe(self) -> None:
        self.pubsub = self.connection.pubsub()
        self.pubsub.subscribe(**{self.pubsub_channel_name: self.handle_payload})
        self.pubsub_thread = self.pubsub.run_in_thread(  # type: ignore[assignment]
            sleep_time=self.COMMAND_WAKE_S,
            daemon=True,
            exception_handler=self._pubsub_exception_handler,
        )


# --- jobs (run by the rq worker child, a ChoreWorker: one app per process) ----------------

_app: list[Any] = []


def _engine_and_settings() -> tuple[Any, Settings]:
    from portal import create_app
    from portal.extensions import db

    if not _app:
        from portal.logs import configure_logging

        # The rq child's own log lines are JSON too, with record, tenant and trace ids.
        configure_logging()
        _app.append(create_app(web=False))
    app = _app[0]
    with app.app_context():
        return db.engine, app.config["SETTINGS"]


def sweep_job() -> dict[str, Any]:
    """The stuck-send sweep, as an rq job."""
    from portal.messaging.sending.sweeper import sweep_stuck_sends

    engine, settings = _engine_and_settings()
    report = sweep_stuck_sends(engine, settings)
    if report.total:
        log.info(
            "sweep done",
            extra={"recovered": report.recovered, "exhausted": report.exhausted},
        )
    return {"recovered": report.recovered, "exhausted": report.exhausted}


def fetch_mail_job() -> dict[str, Any]:
    """Read every enabled bounce mailbox once, as an rq job (at most 100 messages a mailbox)."""
    from portal.messaging.after_send.receiving.fetch import fetch_all

    engine, _settings = _engine_and_settings()
    report = fetch_all(engine)
    summary = report.as_dict()
    if report.total("stored") or any(run.error for run in report.mailboxes):
        log.info(
            "mail fetch done",
            extra={k: v for k, v in summary.items() if k != "mailboxes"},
        )
    return summary


def match_events_job() -> dict[str, Any]:
    """Apply waiting delivery events whose record now has their provider id, as an rq job."""
    from portal.messaging.after_send.events import match_waiting

    engine, _settings = _engine_and_settings()
    report = match_waiting(engine)
    return {"looked": report.looked, "applied": report.applied}


def retention_job() -> dict[str, int]:
    """The retention chore, as an rq job."""
    from portal.messaging.records.retention import purge

    engine, settings = _engine_and_settings()
    return purge(engine, settings).as_dict()


def notices_job() -> int:
    """The inbox scan, as an rq job: the number of new notices."""
    from portal.messaging.after_send.inbox import scan

    engine, settings = _engine_and_settings()
    return scan(engine, settings.health_window_s)
