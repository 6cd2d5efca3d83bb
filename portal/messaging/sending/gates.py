"""The gates between a claimed record and its send, as an attempt meets them (``pipeline``): a
place among the pool's workers in flight to the server or provider (``claim.enter_route``), its
breaker (``breaker``), its rate-limit windows (``ratelimit``); and what a send tells them after.
"""

from __future__ import annotations

import logging
from typing import Protocol

from sqlalchemy import Engine

from portal.config import Settings
from portal.messaging.sending import breaker, claim, outcomes, ratelimit
from portal.messaging.sending.backoff import BackoffPolicy
from portal.messaging.sending.breaker import Breaker, ServerDown, Verdict
from portal.messaging.sending.classify import MarkerCode
from portal.messaging.sending.outcomes import Claimed
from portal.messaging.sending.preparation import Gate
from portal.messaging.sending.ratelimit import LimitedConfig, RateLimiter, RateLimitUnavailable
from portal.models import Channel

log = logging.getLogger("portal.delivery")


class Worker(Protocol):
    """What a send worker keeps between records that the gates use (``pipeline.MailContext``,
    ``pipeline.SmsContext``)."""

    engine: Engine
    settings: Settings
    policy: BackoffPolicy
    limiter: RateLimiter | None
    breaker: Breaker | None  # None: the process-wide one


def limiter_of(settings: Settings, limiter: RateLimiter | None) -> RateLimiter:
    """The given limiter, else the process-wide one on ``settings.redis_url``."""
    return limiter or ratelimit.shared(settings.redis_url, settings.rate_limit_timeout_s)


def breaker_of(ctx: Worker) -> Breaker:
    return ctx.breaker or breaker.shared(ctx.engine, ctx.settings)


class RouteBusy(ServerDown):
    """All but one of the pool's workers are in flight to this server or provider, and stayed
    so for ROUTE_WAIT_S (``Settings.route_wait_s``, claim.enter_route): it is slow or hanging,
    so the record waits and the worker is free for other servers' records. Or its last send
    timed out and its slow share of the workers (``SLOW_SERVER_MAX_SHARE``) is in flight
    (``slow``)."""

    def __init__(self, check: breaker.Check, config_id: int, name: str, *, slow: bool) -> None:
        super().__init__(check, config_id, name)
        self.slow = slow


# A healthy server frees a place within milliseconds; one that holds every other worker
# ROUTE_WAIT_S is slow, and its records wait ROUTE_BUSY_DELAY_S (plus jitter) instead.
ROUTE_BUSY_DELAY_S = 5.0


def gate(ctx: Worker, channel: Channel, record_id: int) -> Gate:
    """The checks run once the server or provider is known (before the quota charge on a
    first attempt): a place among the pool's workers in flight to it (at most pool size - 1),
    then its breaker; raises ServerDown when the record must wait."""

    def check(config_id: int, name: str) -> None:
        route = (channel.value, config_id)
        settings = ctx.settings
        if not claim.enter_route(route, settings.route_wait_s, settings.slow_server_max_share):
            busy = breaker.Check(Verdict.DEFER, wait_s=ROUTE_BUSY_DELAY_S, interval_s=2.0)
            raise RouteBusy(busy, config_id, name, slow=claim.route_is_slow(route))
        found = breaker_of(ctx).check(channel, config_id, record_id)
        if found.verdict is Verdict.DEFER:
            raise ServerDown(found, config_id, name)

    return check


def observed(
    ctx: Worker,
    claimed: Claimed,
    config_id: int,
    *,
    answered: bool,
    down: str | None = None,
    timed_out: bool = False,
) -> None:
    """Tell the breaker how the attempt went: ``down`` (the error) for a failure of the server
    itself, ``answered`` when the server replied (a send or the record's own refusal); neither
    when no answer came mid-way (a timeout after MAIL FROM says nothing about the server).
    And the pool's route gate: a send that ``timed_out``, at any stage, holds the server to
    the slow share of the workers (``SLOW_SERVER_MAX_SHARE``); an answer gives it all back."""
    channel = claimed.channel
    if timed_out or answered:
        claim.route_settled((channel.value, config_id), timed_out=timed_out)
    if down is not None:
        breaker_of(ctx).failed(channel, config_id, claimed.id, down)
    elif answered and breaker_of(ctx).answered(channel, config_id):
        try:
            released = breaker.release(ctx.engine, channel, config_id)
        except Exception:  # every process's check of the waiting records releases them
            log.exception("releasing the records waiting for a closed breaker failed")
            return
        log.info("breaker closed: %s waiting records due now", released)


def unavailable(connection: bool, answered: bool) -> bool | None:
    """What a failed attempt says about the server, for its row (``health``): True it could
    not be reached (``classify.unavailable``, as the breaker counts it), False it answered,
    None neither (no answer after the request was written)."""
    return True if connection else False if answered else None


def admit(
    engine: Engine,
    claimed: Claimed,
    config: LimitedConfig,
    limiter: RateLimiter,
    policy: BackoffPolicy,
) -> bool:
    """Check the config's rate-limit windows before a send; False when the record was deferred.

    A full window defers the record to when it resets (QUOTA_EXCEEDED, never sooner than the
    QUOTA floor); an unreachable Redis defers it as TRANSIENT. Neither uses up a retry: no
    send failed.
    """
    if not ratelimit.has_limit(config):
        return True
    try:
        admission = limiter.admit(claimed.channel, config)
    except RateLimitUnavailable as exc:
        outcomes.handle_failure(
            engine,
            claimed,
            MarkerCode.RATE_LIMIT_UNAVAILABLE.value,
            f"the rate-limit store could not be asked, so the send waits: {exc}",
            policy=policy,
            consume_retry=False,
        )
        return False
    if admission.allowed:
        return True
    which = "daily" if admission.window == "daily" else "per-minute"
    limit = config.daily_send_limit if admission.window == "daily" else config.rate_limit_per_minute
    outcomes.handle_failure(
        engine,
        claimed,
        MarkerCode.QUOTA_EXCEEDED.value,
        f"rate limit: the {which} window of {claimed.provider!r} is full ({limit} sends); "
        f"it resets in {admission.wait_s:.1f} s",
        policy=policy,
        retry_after_s=admission.wait_s,
        consume_retry=False,
    )
    return False
