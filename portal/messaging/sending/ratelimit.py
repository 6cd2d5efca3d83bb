"""Rate limits (seed 000 "Rate limits"): a daily and a per-minute window per mail server and per
SMS provider, counted in Redis so that every instance shares one budget.

Keys are ``rl:{channel}:{daily|min}:{tenantId}:{configId}:{window}``. ``tenantId`` is the tenant
that owns the config, not the sender's: a platform server shared by many tenants has one
budget, which is what protects the external service. ``window`` is the window's number since
the Unix epoch (UTC days for ``daily``, minutes for ``min``), read from Redis's own clock so
that every instance agrees on where a window starts. A key expires when its window ends.

One Lua script, registered once and run by EVALSHA, checks both windows and increments both
only when both allow, so a per-minute refusal uses none of the day's budget. A config with no
limit (empty or 0) never touches Redis, so sends without limits keep flowing when Redis is down.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import redis
from redis.backoff import NoBackoff
from redis.commands.core import Script
from redis.retry import Retry

from portal.models import Channel

DAY_S = 86_400.0
MINUTE_S = 60.0
WINDOW_NAMES = ("daily", "min")

# Keys are built inside the script from Redis's clock (TIME), so the windows are the same for
# every instance whatever their clocks say. ARGV: 1 "rl:<channel>", 2 "<tenant>:<config>",
# 3 daily limit, 4 per-minute limit (0 = none), 5 day length ms, 6 minute length ms.
# Returns {1, 0, ""} when admitted (both counted), else {0, ms until the refusing window
# resets, its name}; when both refuse, the later reset.
ADMIT_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local names = {'daily', 'min'}
local keys, ttls = {}, {}
local wait, refused = 0, ''
for i = 1, 2 do
  local limit = tonumber(ARGV[2 + i])
  if limit > 0 then
    local length = tonumber(ARGV[4 + i])
    local window = math.floor(now / length)
    local key = ARGV[1] .. ':' .. names[i] .. ':' .. ARGV[2] .. ':' .. string.format('%.0f', window)
    local ttl = (window + 1) * length - now
    local used = tonumber(redis.call('GET', key) or '0')
    if used >= limit and ttl > wait then
      wait, refused = ttl, names[i]
    end
    keys[#keys + 1] = key
    ttls[#ttls + 1] = ttl
  end
end
if wait > 0 then
  return {0, wait, refused}
end
for i = 1, #keys do
  redis.call('INCR', keys[i])
  redis.call('PEXPIRE', keys[i], ttls[i])
end
return {1, 0, ''}
"""


class RateLimitUnavailable(Exception):
    """Redis could not be asked; the send must wait (never go out unchecked)."""


class LimitedConfig(Protocol):
    """What a mail server config and an SMS provider config both have."""

    @property
    def id(self) -> int: ...
    @property
    def tenant_id(self) -> int: ...
    @property
    def daily_send_limit(self) -> int | None: ...
    @property
    def rate_limit_per_minute(self) -> int | None: ...


@dataclass(frozen=True)
class Admission:
    """Whether one send may go now; when not, how long until the full window resets."""

    allowed: bool
    wait_s: float = 0.0
    window: str | None = None  # "daily" or "min": the window that refused


ADMITTED = Admission(allowed=True)


def has_limit(config: LimitedConfig) -> bool:
    """Whether the config has a window at all (else Redis is not asked)."""
    return bool((config.daily_send_limit or 0) > 0 or (config.rate_limit_per_minute or 0) > 0)


def key(channel: Channel, window: str, owner_tenant_id: int, config_id: int, number: int) -> str:
    """The Redis key of one window (as the script builds it)."""
    return f"rl:{channel.value}:{window}:{owner_tenant_id}:{config_id}:{number}"


class RateLimiter:
    """Admits sends against a config's windows; safe to share between threads."""

    def __init__(
        self,
        connect: Callable[[], redis.Redis],
        *,
        day_s: float = DAY_S,
        minute_s: float = MINUTE_S,
    ):
        # Window lengths are parameters so that tests can use short "days"; production uses
        # real days and minutes (the key names say so).
        if day_s <= 0 or minute_s <= 0:
            raise ValueError("window lengths must be positive")
        self._connect = connect
        self.day_ms = round(day_s * 1000)
        self.minute_ms = round(minute_s * 1000)
        self._lock = threading.Lock()
        self._script: Script | None = None

    @classmethod
    def for_url(cls, redis_url: str | None, timeout_s: float, **windows: float) -> RateLimiter:
        """A limiter on ``redis_url`` (None: the embedded Redis); connects on first use."""

        def connect() -> redis.Redis:
            if redis_url is None:
                from portal import redis_store  # the embedded server starts only when needed

                return redis_store.connect(None)
            # Short timeouts and one quick retry (a pooled connection that went stale): a send
            # must not wait long on its limit check, and an unreachable Redis defers the send.
            return redis.Redis.from_url(
                redis_url,
                socket_connect_timeout=timeout_s,
                socket_timeout=timeout_s,
                retry=Retry(NoBackoff(), 1),
                health_check_interval=30,
            )

        return cls(connect, **windows)

    def _admit_script(self) -> Script:
        with self._lock:
            if self._script is None:
                # register_script computes the SHA locally; calls run EVALSHA and load the
                # script only when Redis does not have it yet (NOSCRIPT).
                self._script = self._connect().register_script(ADMIT_LUA)
            return self._script

    def admit(self, channel: Channel, config: LimitedConfig) -> Admission:
        """Count one send against ``config``'s windows, or say how long until one has room.

        Raises RateLimitUnavailable when Redis cannot be asked.
        """
        daily = max(config.daily_send_limit or 0, 0)
        per_minute = max(config.rate_limit_per_minute or 0, 0)
        if not daily and not per_minute:
            return ADMITTED
        try:
            allowed, wait_ms, window = self._admit_script()(
                keys=[],
                args=[
                    f"rl:{channel.value}",
                    f"{config.tenant_id}:{config.id}",
                    daily,
                    per_minute,
                    self.day_ms,
                    self.minute_ms,
                ],
            )
        except redis.RedisError as exc:
            raise RateLimitUnavailable(f"{type(exc).__name__}: {exc}") from exc
        if allowed:
            return ADMITTED
        name = window.decode() if isinstance(window, bytes) else str(window)
        return Admission(allowed=False, wait_s=int(wait_ms) / 1000, window=name)


_shared: dict[tuple[str | None, float], RateLimiter] = {}
_shared_lock = threading.Lock()


def shared(redis_url: str | None, timeout_s: float) -> RateLimiter:
    """The process-wide limiter for ``redis_url`` (one connection pool for every worker)."""
    with _shared_lock:
        limiter = _shared.get((redis_url, timeout_s))
        if limiter is None:
            limiter = _shared[(redis_url, timeout_s)] = RateLimiter.for_url(redis_url, timeout_s)
        return limiter
