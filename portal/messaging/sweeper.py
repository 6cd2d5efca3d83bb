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
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Engine, select, update
from sqlalchemy.orm import Session

from portal.config import Settings
from portal.messaging.classify import MarkerCode
from portal.messaging.outcomes import MODELS, Claimed, dead_letter_row
from portal.metrics import MESSAGE_FAILED
from portal.models import (
    Channel,
    MailSendRecord,
    MailSendServerConfig,
    SendStatus,
    SmsProviderConfig,
    UncertainPolicy,
    db_now,
    db_now_plus,
)
from portal.tenancy import tenant_context

log = logging.getLogger("portal.sweeper")

BATCH = 200


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
    for channel, model in MODELS.items():
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
                )
                .where(
                    model.status == SendStatus.SENDING.value,
                    model.updated_time < db_now_plus(-settings.stuck_send_threshold_s),
                )
                .order_by(model.updated_time)
                .limit(BATCH)
            ).all()
            holding = _holding_routes(session, channel)
        for record_id, version, tenant_id, trace_id, retry_count, prepared, route in stuck:
            claimed = Claimed(channel, record_id, version, tenant_id, retry_count)
            with tenant_context(tenant_id, trace_id):
                outcome = _transition(
                    engine,
                    claimed,
                    settings,
                    ambiguous=prepared,
                    hold=prepared and route in holding,
                )
            if outcome is not None:
                counts = {
                    "retry": report.recovered,
                    "dead_letter": report.exhausted,
                    "uncertain": report.held,
                }[outcome]
                counts[channel.value] = counts.get(channel.value, 0) + 1
    return report


def _route(channel: Channel) -> Any:
    model = MODELS[channel]
    return model.server_config_id if model is MailSendRecord else model.provider_config_id  # type: ignore[union-attr]


def _holding_routes(session: Session, channel: Channel) -> set[int]:
    """The ids of the configs of this channel whose uncertain policy is ``hold``."""
    config = MailSendServerConfig if channel is Channel.MAIL else SmsProviderConfig
    return set(
        session.scalars(
            select(config.id).where(config.uncertain_policy == UncertainPolicy.HOLD.value)
        )
    )


def _transition(
    engine: Engine,
    claimed: Claimed,
    settings: Settings,
    *,
    ambiguous: bool = False,
    hold: bool = False,
) -> str | None:
    model = MODELS[claimed.channel]
    exhausted = claimed.retry_count >= settings.max_retries
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
        values |= {"status": SendStatus.UNCERTAIN.value, "next_retry_at": None}
        exhausted = False
    elif exhausted:
        code = MarkerCode.ZOMBIE_EXHAUSTED.value
        values |= {"status": SendStatus.DEAD_LETTER.value, "next_retry_at": None}
    else:
        code = MarkerCode.ZOMBIE_RECOVERED.value
        values |= {
            "status": SendStatus.RETRY.value,
            "next_retry_at": db_now(),
            "retry_count": model.retry_count + 1,
        }
    with Session(engine) as session, session.begin():
        result = session.execute(
            update(model)
            .where(
                model.id == claimed.id,
                model.version == claimed.version,
                model.status == SendStatus.SENDING.value,
            )
            .values(
                version=model.version + 1,
                updated_time=db_now(),
                error_code=code,
                error_message=reason,
                **values,
            )
            .execution_options(synchronize_session=False)
        )
        if result.rowcount != 1:  # type: ignore[attr-defined]
            return None  # the worker finished it, or another sweep got there first
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


__all__ = ["BATCH", "Channel", "SweepReport", "sweep_stuck_sends"]
