"""A mail server's or SMS provider's health: what its recent sends say.

One answer for every place that shows it (the servers and providers pages, the dashboard's
banner, the operators' view, the inbox notices, ``server_up``, a record's diagnosis, which
calls a retry through a failing or paused one SERVER_DOWN), read from the attempt rows
(``send_attempt``, whose ``unavailable`` says what each attempt told about the server itself,
as ``classify.unavailable`` decided it for the breaker) and the breaker's mirror
(``breaker_state``):

- **Paused by the breaker**: its breaker is open; records wait for it.
- **Failing since 10:42 (4 records, last: connection refused)**: attempts could not reach it
  since it last answered, and the last of them is recent; before the breaker opens too. A
  recipient's own refusal (a 550 at RCPT, an invalid number) is an answer: the server is up.
- **Up**: it answered recently (a send, or a refusal of a record for the record's own reasons).
- **No recent sends**: nothing went through it recently.

"Recently" is ``HEALTH_WINDOW_S`` (the setting ``health_window_s``). An incident starts at the
first failure after the server's last answer and lasts until it answers again, however long:
``State.since`` is the same for its whole life, so a notice keyed on it is written once.

Cheap: one statement for every config shown, each config read backwards along
``idx_send_attempt_config`` (migration 0030) from its newest attempt to its last answer (a
server that answers stops the walk at once; one that fails has few attempts since, the breaker
holding its records back after ``BREAKER_FAILURES``).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any

from sqlalchemy import Select, and_, bindparam, distinct, func, or_, select, text
from sqlalchemy.orm import Session, aliased, scoped_session

from portal.models import (
    AttemptOutcome,
    BreakerState,
    Channel,
    MailSendServerConfig,
    SendAttempt,
    SmsProviderConfig,
)
from portal.models.by_channel import PARTS

# How far back "recent" looks: the default of the setting ``health_window_s``.
HEALTH_WINDOW_S = 1800.0


class Health(StrEnum):
    UP = "up"
    QUIET = "quiet"  # no recent sends
    FAILING = "failing"
    PAUSED = "paused"  # its breaker is open


@dataclass(frozen=True)
class State:
    """One server's or provider's health, as every page shows it."""

    health: Health
    since: datetime | None = None  # FAILING/PAUSED: the incident's first failure
    records: int = 0  # distinct records that could not reach it in the incident
    last_error: str = ""
    next_check: datetime | None = None  # PAUSED: the breaker's next probe

    @property
    def failing(self) -> bool:
        """Whether its sends fail now (failing, or paused by the breaker)."""
        return self.health in (Health.FAILING, Health.PAUSED)

    @property
    def label(self) -> str:
        """The pill: "Up", "No recent sends", "Failing", "Paused by the breaker"."""
        return _LABELS[self.health]

    @property
    def detail(self) -> str:
        """What follows the pill: "since 10:42 UTC (4 records, last: connection refused)"."""
        if not self.failing:
            return ""
        parts = [f"{self.records} record{'s' if self.records != 1 else ''}"] if self.records else []
        if self.last_error:
            parts.append(f"last: {self.last_error}")
        since = f"since {_clock(self.since)}" if self.since else ""
        if self.health is Health.PAUSED:
            since = f"failing {since}" if since else ""
            if self.next_check is not None:
                parts.append(f"next check {_clock(self.next_check)}")
        inner = f" ({', '.join(parts)})" if parts else ""
        return f"{since}{inner}".strip()

    @property
    def text(self) -> str:
        """The whole state in one line: "Failing since 10:42 UTC (4 records, last: ...)"."""
        return f"{self.label} {self.detail}".strip()


_LABELS = {
    Health.UP: "Up",
    Health.QUIET: "No recent sends",
    Health.FAILING: "Failing",
    Health.PAUSED: "Paused by the breaker",
}
QUIET = State(Health.QUIET)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)  # "since ever", when it never answered


def _clock(moment: datetime | None) -> str:
    """10:42 UTC today; 2026-12-03 10:42 UTC on another day."""
    if moment is None:
        return ""
    moment = moment.astimezone(UTC)
    if moment.date() == datetime.now(UTC).date():
        return f"{moment:%H:%M} UTC"
    return f"{moment:%Y-%m-%d %H:%M} UTC"


_STAGE = re.compile(r"^(connect|ehlo|starttls|auth|mail|rcpt|data|request):\s*", re.I)
_ERRNO = re.compile(r"^\[Errno -?\d+\]\s*")


def short_error(code: str | None, message: str | None) -> str:
    """An attempt's error as the state quotes it: "connection refused", "421 try later"."""
    text = _ERRNO.sub("", _STAGE.sub("", (message or "").strip())).strip()
    if not text:
        return (code or "").strip()
    text = text[:1].lower() + text[1:]
    if code and code[:1].isdigit() and not text.startswith(code):
        text = f"{code} {text}"
    return text[:120]


@functools.cache
def _states_statement(channel: Channel) -> Select[Any]:
    """The statement ``states`` runs for ``channel``, built once: building it took longer than
    running it (about 9 ms of Python a call, every dashboard view)."""
    model = PARTS[channel].config
    # Aliases, each correlated to the config row only (never to one another).
    answer, fail = aliased(SendAttempt), aliased(SendAttempt)
    last_answer = (
        select(answer.finished_at)
        .where(
            answer.channel == channel.value,
            answer.config_id == model.id,
            or_(answer.outcome == AttemptOutcome.SENT.value, answer.unavailable.is_(False)),
        )
        .order_by(answer.finished_at.desc())
        .limit(1)
        .correlate(model)
        .scalar_subquery()
    )
    # The incident: every attempt that could not reach it since its last answer.
    failed = and_(
        fail.channel == channel.value,
        fail.config_id == model.id,
        fail.finished_at > func.coalesce(last_answer, _EPOCH),
        fail.unavailable.is_(True),
    )

    def of_incident(*columns: Any, newest: bool = False) -> Any:
        query = select(*columns).where(failed).correlate(model)
        if newest:
            query = query.order_by(fail.finished_at.desc()).limit(1)
        return query.scalar_subquery()

    def of_breaker(column: Any) -> Any:
        return (
            select(column)
            .where(BreakerState.channel == channel.value, BreakerState.config_id == model.id)
            .correlate(model)
            .scalar_subquery()
        )

    statement = select(
        model.id,
        last_answer,
        of_breaker(BreakerState.down_since),
        of_breaker(BreakerState.next_probe_at),
        of_breaker(BreakerState.last_error),
        of_incident(func.min(fail.finished_at)),
        of_incident(func.max(fail.finished_at)),
        of_incident(func.count(distinct(fail.record_id))),
        of_incident(fail.code, newest=True),
        of_incident(fail.message, newest=True),
    ).where(model.id.in_(bindparam("wanted", expanding=True)))
    return statement


def states(
    session: Session | scoped_session[Any],
    channel: Channel,
    ids: Iterable[int],
    *,
    window_s: float = HEALTH_WINDOW_S,
    now: datetime | None = None,
) -> dict[int, State]:
    """The health of each of ``ids`` (configs of ``channel``), in one statement. The caller
    chooses the ids (those of the viewer's tier: this reads no names and no tenants)."""
    wanted = sorted(set(ids))
    if not wanted:
        return {}
    start = (now or datetime.now(UTC)) - timedelta(seconds=window_s)
    statement = _states_statement(channel)
    if session.get_bind().dialect.name == "postgresql":
        # Its walks are estimated dear (a third of a config's attempts after its last answer),
        # past jit_above_cost: compiling them took 1.4 s for a 1 ms query. As the dashboard.
        session.execute(text("SET LOCAL jit = off"))
    found: dict[int, State] = {}
    for row in session.execute(statement, {"wanted": wanted}):
        config_id, answered_at, down_since, next_probe, breaker_error = row[:5]
        since, last_failed, records = row[5:8]
        error = short_error(row[8], row[9])
        if down_since is not None:
            error = error or short_error(None, breaker_error)
            found[config_id] = State(
                Health.PAUSED, since or down_since, int(records or 0), error, next_probe
            )
        elif last_failed is not None and last_failed >= start:
            found[config_id] = State(Health.FAILING, since, int(records or 0), error)
        elif answered_at is not None and answered_at >= start:
            found[config_id] = State(Health.UP)
        else:
            found[config_id] = QUIET
    return found


def failing(
    session: Session | scoped_session[Any],
    tiers: Iterable[int] | None,
    *,
    window_s: float = HEALTH_WINDOW_S,
) -> list[tuple[Channel, MailSendServerConfig | SmsProviderConfig, State]]:
    """The failing or paused servers and providers of ``tiers`` (None: of every tier), mail
    first, by tier and name: the dashboard's banner, the operators' view, the notices."""
    out: list[tuple[Channel, MailSendServerConfig | SmsProviderConfig, State]] = []
    models: tuple[tuple[Channel, type[MailSendServerConfig] | type[SmsProviderConfig]], ...] = (
        (Channel.MAIL, MailSendServerConfig),
        (Channel.SMS, SmsProviderConfig),
    )
    for channel, model in models:
        query = select(model).order_by(model.tenant_id, model.name)
        if tiers is not None:
            query = query.where(model.tenant_id.in_(list(tiers)))
        configs: list[MailSendServerConfig | SmsProviderConfig] = list(session.scalars(query))
        found = states(session, channel, [c.id for c in configs], window_s=window_s)
        out += [(channel, c, found[c.id]) for c in configs if found[c.id].failing]
    return out
