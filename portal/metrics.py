"""Prometheus metrics shared by the portal and the worker.

Counters live in each process (multiprocess mode under gunicorn, when
PROMETHEUS_MULTIPROC_DIR is set); the backlog is read from the database at scrape time along
the status indexes, so every process reports the same truth.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session

log = logging.getLogger(__name__)

MESSAGE_SENT = Counter(
    "message_sent", "Sends the server or provider accepted", ["channel", "provider"]
)
MESSAGE_FAILED = Counter(
    "message_failed",
    "Failed attempts, preparation failures included, by what happened next",
    ["channel", "provider", "outcome"],
)
MESSAGE_ACCEPTED = Counter(
    "message_accepted", "Records written by acceptance (duplicates excluded)", ["channel"]
)
SEND_DURATION = Histogram(
    "message_send_duration_seconds",
    "Time talking to the server or provider per attempt",
    ["channel"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
SENT_BATCH_SIZE = Histogram(
    "sent_write_batch_size",
    "Sent writes per statement: the workers' writes that came at once go together",
    ["channel"],
    buckets=(1, 2, 4, 8, 16),
)

CALLBACK_ATTEMPTS = Counter(
    "callback_attempts",
    "Status callback attempts, by outcome (delivered, retry, dead)",
    ["outcome"],
)

RETENTION_DELETED = Counter(
    "retention_deleted",
    "Rows the retention chore deleted, by kind (mail_records, events, callbacks, ...)",
    ["kind"],
)

BACKLOG_STATUSES = ("Pending", "Retry", "Sending", "Uncertain")


class BacklogCollector(Collector):
    """Records waiting, by channel and status, and how long the oldest due one has waited."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def collect(self) -> Iterator[GaugeMetricFamily]:
        from portal.models import MailSendRecord, SmsSendRecord, db_now

        backlog = GaugeMetricFamily(
            "message_backlog", "Records not yet settled, by status", labels=["channel", "status"]
        )
        oldest = GaugeMetricFamily(
            "message_oldest_due_age_seconds",
            "How long the longest-due record has been waiting to be claimed",
            labels=["channel"],
        )
        try:
            with Session(self.engine) as session:
                for channel, model in (("mail", MailSendRecord), ("sms", SmsSendRecord)):
                    counts = dict(
                        session.execute(
                            select(model.status, func.count())
                            .where(model.status.in_(BACKLOG_STATUSES))
                            .group_by(model.status)
                        ).all()
                    )
                    for status in BACKLOG_STATUSES:
                        backlog.add_metric([channel, status], counts.get(status, 0))
                    pending = session.scalar(
                        select(func.min(model.updated_time)).where(model.status == "Pending")
                    )
                    retry = session.scalar(
                        select(func.min(model.next_retry_at)).where(
                            model.status == "Retry", model.next_retry_at <= db_now()
                        )
                    )
                    now = session.scalar(select(db_now()))
                    due = [t for t in (pending, retry) if t is not None]
                    age = (now - min(due)).total_seconds() if due and now else 0.0
                    oldest.add_metric([channel], max(0.0, age))
        except Exception as exc:  # a scrape must not fail because the database is away
            log.warning("backlog metrics unavailable: %s", exc)
            return
        yield backlog
        yield oldest


class ServerUpCollector(Collector):
    """``server_up{channel,config}``: 0 while a server's or provider's sends fail (failing or
    paused by its breaker, as ``health`` reads it for the pages), 1 otherwise."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def collect(self) -> Iterator[GaugeMetricFamily]:
        from portal.messaging.sending import health
        from portal.models import Channel, MailSendServerConfig, SmsProviderConfig

        up = GaugeMetricFamily(
            "server_up",
            "1 unless the mail server's or SMS provider's recent sends could not reach it "
            "(failing, or its circuit breaker open)",
            labels=["channel", "config"],
        )
        try:
            with Session(self.engine) as session:
                for channel, model in (
                    (Channel.MAIL, MailSendServerConfig),
                    (Channel.SMS, SmsProviderConfig),
                ):
                    rows = session.execute(
                        select(model.id, model.name).where(model.enabled.is_(True))
                    ).all()
                    states = health.states(session, channel, [i for i, _name in rows])
                    names = [name for _id, name in rows]
                    for config_id, name in rows:
                        # Names are unique per tier only: a clash gets the id.
                        label = name if names.count(name) == 1 else f"{name}#{config_id}"
                        failing = states[config_id].failing
                        up.add_metric([channel.value, label], 0 if failing else 1)
        except Exception as exc:  # a scrape must not fail because the database is away
            log.warning("server_up unavailable: %s", exc)
            return
        yield up


class OperationsCollector(Collector):
    """What the alert rules of deploy/ watch besides the backlog: how long
    ago each chore last ran (``chore_last_run_age_seconds{chore}``, from chore_run) and the
    status callbacks still owed (``callback_backlog``, ``callback_oldest_due_age_seconds``,
    along the partial index of due deliveries)."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def collect(self) -> Iterator[GaugeMetricFamily]:
        from portal.models import CallbackDelivery, ChoreRun, db_now

        chores = GaugeMetricFamily(
            "chore_last_run_age_seconds",
            "Seconds since each periodic chore (the stuck-send sweep) last ran",
            labels=["chore"],
        )
        backlog = GaugeMetricFamily(
            "callback_backlog", "Status callback deliveries not yet delivered nor dead"
        )
        oldest = GaugeMetricFamily(
            "callback_oldest_due_age_seconds",
            "How long the longest-due status callback delivery has been due",
        )
        try:
            with Session(self.engine) as session:
                now = session.scalar(select(db_now()))
                assert now is not None
                for name, last in session.execute(select(ChoreRun.name, ChoreRun.last_run_at)):
                    chores.add_metric([name], max(0.0, (now - last).total_seconds()))
                due = CallbackDelivery.status.in_(["pending", "sending"])
                backlog.add_metric([], session.scalar(select(func.count()).where(due)) or 0)
                first = session.scalar(
                    select(func.min(CallbackDelivery.next_attempt_at)).where(
                        due, CallbackDelivery.next_attempt_at <= db_now()
                    )
                )
                oldest.add_metric([], max(0.0, (now - first).total_seconds()) if first else 0.0)
        except Exception as exc:  # a scrape must not fail because the database is away
            log.warning("operations metrics unavailable: %s", exc)
            return
        yield chores
        yield backlog
        yield oldest


def registry_for(engine: Engine) -> CollectorRegistry:
    """The registry to expose: this process's (or all gunicorn workers') metrics + backlog."""
    from prometheus_client import REGISTRY, multiprocess

    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    else:
        registry = CollectorRegistry()
        for collector in list(REGISTRY._collector_to_names):  # the default process metrics
            registry.register(collector)
    registry.register(BacklogCollector(engine))
    registry.register(ServerUpCollector(engine))
    registry.register(OperationsCollector(engine))
    return registry


def start_worker_metrics(port: int, engine: Engine) -> None:
    """Serve /metrics for the worker on 127.0.0.1:``port``."""
    from prometheus_client import start_http_server

    start_http_server(port, addr="127.0.0.1", registry=registry_for(engine))
