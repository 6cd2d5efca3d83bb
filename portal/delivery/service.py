"""The delivery service: one pool per channel, the wake-ups, and the two-stage shutdown."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine

from portal.config import Settings
from portal.delivery.callback_pool import CallbackPool
from portal.delivery.pool import ChannelPool, ChannelSpec
from portal.delivery.wakeups import Listener
from portal.messaging.sending.backoff import BackoffPolicy
from portal.messaging.sending.pipeline import MailContext, SmsContext, process_mail, process_sms
from portal.messaging.sending.sweeper import sweep_if_overdue
from portal.models import Channel, MailSendRecord, SmsSendRecord

log = logging.getLogger("portal.delivery")


# Each channel's table, what a worker keeps between records (mail: its SMTP connections; SMS:
# its HTTP client, made in the worker's own thread) and one attempt.
_CHANNELS: dict[
    Channel,
    tuple[
        type[MailSendRecord] | type[SmsSendRecord],
        type[MailContext] | type[SmsContext],
        Callable[[Any, Any], None],
    ],
] = {
    Channel.MAIL: (MailSendRecord, MailContext, process_mail),
    Channel.SMS: (SmsSendRecord, SmsContext, process_sms),
}


def channel_spec(channel: Channel, engine: Engine, settings: Settings) -> ChannelSpec:
    """A channel's pool: MAIL_SEND_CONCURRENCY or SMS_SEND_CONCURRENCY workers, each with a
    context of its own."""
    model, context, process = _CHANNELS[channel]
    policy = BackoffPolicy.from_settings(settings)

    def make_context() -> MailContext | SmsContext:
        return context(engine=engine, settings=settings, policy=policy)

    return ChannelSpec(
        channel=channel,
        model=model,
        concurrency=(
            settings.mail_send_concurrency
            if channel == Channel.MAIL
            else settings.sms_send_concurrency
        ),
        make_context=make_context,
        process=process,
        broadcast_max_share=settings.broadcast_max_share,
        max_hold_s=settings.stuck_send_threshold_s / 2,
    )


class SweepWatch:
    """Runs the stuck-send sweep in this worker when the scheduled one is overdue.

    The sweep is an rq-scheduler job, and rq lives in Redis: while Redis is away nothing would
    sweep. Every ``SWEEP_INTERVAL_S`` this thread asks the database when the sweep last ran;
    past two intervals it runs it here (``sweeper.sweep_if_overdue``: one worker at a time).
    The first look waits two intervals, so the scheduler's first run at start comes first.
    """

    def __init__(self, engine: Engine, settings: Settings):
        self.engine = engine
        self.settings = settings
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="sweep-watch", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()

    def _run(self) -> None:
        interval = self.settings.sweep_interval_s
        wait = 2 * interval
        while not self.stopping.wait(wait):
            wait = interval
            try:
                report = sweep_if_overdue(self.engine, self.settings)
            except Exception as exc:  # the database is away: the claims say so already
                log.warning("could not check whether the sweep is overdue: %s", exc)
                continue
            if report is not None:
                log.warning(
                    "stuck-send sweep overdue (the scheduler did not run it: is Redis down?); "
                    "this worker ran it",
                    extra={
                        "recovered": report.recovered,
                        "exhausted": report.exhausted,
                        "held": report.held,
                    },
                )


@dataclass
class DeliveryService:
    engine: Engine
    settings: Settings

    def __post_init__(self) -> None:
        specs = [channel_spec(c, self.engine, self.settings) for c in _CHANNELS]
        self.pools = {
            spec.channel: ChannelPool(self.engine, spec, self.settings.poll_interval_s)
            for spec in specs
            if spec.concurrency > 0
        }
        self.listener: Listener | None = None
        if self.engine.dialect.name == "postgresql":
            self.listener = Listener(
                self.engine,
                {c.value: pool.wake for c, pool in self.pools.items()},
                self.settings.database_direct_url,
            )
        self.sweep_watch = SweepWatch(self.engine, self.settings)
        self.callbacks = CallbackPool(self.engine, self.settings)

    def _parts(self) -> list[ChannelPool | Listener | SweepWatch | CallbackPool]:
        """What the service runs, in the order it starts and stops them: the pools, the LISTEN
        thread (PostgreSQL), the sweep watch and the status-callback pool."""
        listener = [] if self.listener is None else [self.listener]
        return [*self.pools.values(), *listener, self.sweep_watch, self.callbacks]

    def start(self) -> None:
        for part in self._parts():
            part.start()
        log.info(
            "delivery started",
            extra={"pools": {c.value: p.spec.concurrency for c, p in self.pools.items()}},
        )

    def stop(self) -> None:
        """First stage: claim nothing more."""
        for part in self._parts():
            part.stop()

    def wait(self, grace_s: float) -> bool:
        """Wait at most ``grace_s`` for sends in flight; True when all finished."""
        deadline = time.monotonic() + grace_s
        done = all(pool.join(deadline) for pool in self.pools.values())
        done = self.callbacks.join(deadline) and done
        if not done:
            left = sum(pool.in_flight for pool in self.pools.values())
            log.warning(
                "shutdown grace ran out; %d send(s) left in Sending for the stuck-send sweep",
                left,
            )
        return done
