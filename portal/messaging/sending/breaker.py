"""Circuit breaker per mail server and SMS provider.

Only failures that say the server itself is unavailable count: for mail, before it accepted
MAIL FROM (connect refused or timed out, TLS, a 4xx/5xx greeting, EHLO/STARTTLS); for SMS, of
every provider kind alike, ``classify.unavailable``: no connection, the request not written, an
HTTP 502/503/504 whose provider code names no other cause, or a provider's documented "service
unavailable" code (Twilio 20503, 21730). The transports mark them ``connection``. After
``BREAKER_FAILURES`` distinct records failed so in a row, across every worker and instance, the
breaker opens: due records for it wait without using a retry (``SERVER_UNAVAILABLE``). They
wait on the breaker, not on a time: each is written once, marked with the server it waits for
(``waiting_config_id``) and due only at its own deadline (its expiry or the end of its resend
window, when the claim ends it), so an outage costs one write per record however many probes
it lasts. One record at a time probes, at intervals doubling from ``BREAKER_PROBE_MIN_S`` to
``BREAKER_PROBE_MAX_S``: when a probe is due, a record on its way to the server takes it, or
else the breaker makes one waiting record due (``release(limit=1)``, from the view's refresh,
which an idle pool's poll drives through ``tick``). A probe that fails uses a retry as usual,
and the next probe takes another record. Any answer from the server (a send, a recipient
refused, credentials refused) closes it, and the waiting records become due at once, 1,000 at
a time, with a wake-up for the workers.

State lives in Redis (three keys per config, changed by Lua scripts, so every instance counts one
streak); every change of state is mirrored into ``breaker_state``, which the portal and the
metrics read, and which is the whole state while Redis is away.

The hot path stays cheap: each process keeps a view of the breakers that are open or counting
(one HGETALL at most every ``VIEW_TTL_S``), and a send through a closed breaker touches neither
Redis nor the database. An open breaker adds one script call per refresh (is its probe due?).
"""

from __future__ import annotations

import logging
import random
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from sqlalchemy import Engine, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from portal.config import Settings
from portal.messaging import transitions
from portal.messaging.sending.classify import DeferralCode
from portal.messaging.transitions import Cause
from portal.models import BreakerState, Channel, MailSendRecord, SmsSendRecord, db_now
from portal.models.by_channel import PARTS

log = logging.getLogger("portal.delivery")

SERVER_UNAVAILABLE = DeferralCode.SERVER_UNAVAILABLE.value
VIEW_TTL_S = 0.5  # how stale a process's view of open breakers may be
RECHECK_S = 30.0  # how often a process checks that the records waiting for breakers have one
RELEASE_BATCH = 1000  # deferred records made due per statement when a breaker closes
ACTIVE_KEY = "brk:active"  # field "<channel>:<config id>" -> "open" | "streak"
# A waiting record made due: it stays Retry (no status written), guarded on that status.
_RELEASED = transitions.change(Cause.RELEASED, None)

# KEYS: 1 state hash, 2 streak set, 3 the active hash. ARGV: 1 field, 2 record id, 3 error,
# 4 now (epoch s), 5 threshold, 6 probe min s, 7 probe max s.
# Returns {what, failures, opened_at, next_probe, interval}; what: 0 counting, 1 just opened,
# 2 already open (3: already open and this was the probe, now rescheduled).
FAIL_LUA = """
local now = tonumber(ARGV[4])
if redis.call('HGET', KEYS[1], 'open') == '1' then
  redis.call('HSET', KEYS[1], 'last_error', ARGV[3])
  local h = redis.call('HMGET', KEYS[1], 'probe', 'interval', 'opened_at', 'next_probe')
  if h[1] == ARGV[2] then
    local interval = math.min(tonumber(h[2]) * 2, tonumber(ARGV[7]))
    redis.call('HSET', KEYS[1], 'interval', tostring(interval),
      'next_probe', tostring(now + interval), 'probe', '', 'probe_until', '0')
    return {3, 0, h[3], tostring(now + interval), tostring(interval)}
  end
  return {2, 0, h[3], h[4], h[2]}
end
redis.call('SADD', KEYS[2], ARGV[2])
redis.call('HSET', KEYS[1], 'last_error', ARGV[3])
local n = redis.call('SCARD', KEYS[2])
if n >= tonumber(ARGV[5]) then
  local interval = tonumber(ARGV[6])
  redis.call('HSET', KEYS[1], 'open', '1', 'opened_at', ARGV[4], 'interval', tostring(interval),
    'next_probe', tostring(now + interval), 'probe', '', 'probe_until', '0', 'last_probe', '')
  redis.call('DEL', KEYS[2])
  redis.call('HSET', KEYS[3], ARGV[1], 'open')
  return {1, n, ARGV[4], tostring(now + interval), tostring(interval)}
end
redis.call('HSET', KEYS[3], ARGV[1], 'streak')
return {0, n, '', '', ''}
"""

# KEYS as above; ARGV: 1 field. Returns 1 when the breaker was open.
ANSWERED_LUA = """
local was = redis.call('HGET', KEYS[1], 'open') == '1'
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('HDEL', KEYS[3], ARGV[1])
if was then return 1 end
return 0
"""

# KEYS: 1 state hash. ARGV: 1 record id, 2 now, 3 probe lease s.
# Returns {'send'} | {'probe'} | {'defer', next_probe, interval, opened_at, last_error}.
GATE_LUA = """
if redis.call('HGET', KEYS[1], 'open') ~= '1' then return {'send'} end
local h = redis.call('HMGET', KEYS[1], 'next_probe', 'interval', 'probe', 'probe_until',
  'last_probe', 'opened_at', 'last_error')
local now = tonumber(ARGV[2])
local free = (not h[3]) or h[3] == '' or now >= tonumber(h[4] or '0')
if now >= tonumber(h[1]) and free and h[5] ~= ARGV[1] then
  redis.call('HSET', KEYS[1], 'probe', ARGV[1], 'probe_until', tostring(now + tonumber(ARGV[3])),
    'last_probe', ARGV[1])
  return {'probe'}
end
return {'defer', h[1], h[2], h[6] or '', h[7] or ''}
"""

# KEYS: 1 state hash. ARGV: 1 now, 2 hold s. An open breaker whose probe is due and not taken
# (no probe in flight, or its lease ran out; no record released for it within the hold) gets a
# record released for it: returns {1, the last probe's record id or ''}; otherwise 0. The
# release holds the slot through ``probe_until`` with no ``probe``, which GATE_LUA reads as
# free: whichever record comes first probes.
PROBE_DUE_LUA = """
local h = redis.call('HMGET', KEYS[1], 'open', 'next_probe', 'probe_until', 'last_probe')
if h[1] ~= '1' then return 0 end
local now = tonumber(ARGV[1])
if now < (tonumber(h[2] or '0') or 0) or now < (tonumber(h[3] or '0') or 0) then return 0 end
redis.call('HSET', KEYS[1], 'probe', '', 'probe_until', tostring(now + tonumber(ARGV[2])))
return {1, h[4] or ''}
"""

# KEYS: 1 state hash, 3 active hash; ARGV: 1 field, 2 opened_at, 3 next_probe, 4 interval,
# 5 last error. Carries a breaker opened in the database (Redis away) over into Redis.
CARRY_LUA = """
if redis.call('HGET', KEYS[1], 'open') == '1' then return 0 end
redis.call('HSET', KEYS[1], 'open', '1', 'opened_at', ARGV[2], 'next_probe', ARGV[3],
  'interval', ARGV[4], 'last_error', ARGV[5], 'probe', '', 'probe_until', '0', 'last_probe', '')
redis.call('HSET', KEYS[2], ARGV[1], 'open')
return 1
"""


class Verdict(StrEnum):
    SEND = "send"  # closed: send as usual
    PROBE = "probe"  # open, and this record tests it
    DEFER = "defer"  # open: wait for the next probe


@dataclass(frozen=True)
class Check:
    """What the breaker says about one record's attempt."""

    verdict: Verdict
    wait_s: float = 0.0  # DEFER: until the next probe could run
    interval_s: float = 0.0
    down_since: datetime | None = None
    last_error: str = ""


SEND = Check(Verdict.SEND)


class ServerDown(Exception):
    """Raised by the gate in preparation: the chosen server's breaker is open (no charge)."""

    def __init__(self, check: Check, config_id: int, name: str) -> None:
        super().__init__(f"{name} is down")
        self.check = check
        self.config_id = config_id
        self.name = name


def _field(channel: Channel, config_id: int) -> str:
    return f"{channel.value}:{config_id}"


def _keys(channel: Channel, config_id: int) -> list[str]:
    name = _field(channel, config_id)
    return [f"brk:{name}", f"brk:{name}:streak", ACTIVE_KEY]


def _epoch(moment: datetime | None) -> float:
    return moment.timestamp() if moment is not None else 0.0


def _moment(epoch: float | str | bytes | None) -> datetime | None:
    if epoch is None or epoch in ("", b""):
        return None
    value = float(epoch.decode() if isinstance(epoch, bytes) else epoch)
    return datetime.fromtimestamp(value, UTC) if value else None


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value or "")


def defer_message(kind: str, name: str, check: Check) -> str:
    """The waiting record's error message: which server, since when, the last real error."""
    since = check.down_since.strftime("%Y-%m-%d %H:%M:%S UTC") if check.down_since else "now"
    return (
        f"not attempted: the {kind} {name!r} is down since {since} (its connections keep "
        f"failing), so this waits for it without using a retry and goes out as soon as it "
        f"answers again; next check in about {check.wait_s:.0f} s. "
        f"Last error: {check.last_error or '(none recorded)'}"
    )


def defer_delay(check: Check, rng: random.Random | None = None) -> float:
    """The deferred record's wait: to the next probe, plus jitter (records spread out)."""
    jitter = (rng or random).uniform(0.0, min(5.0, max(check.interval_s, 0.2) / 2))
    return max(check.wait_s, 0.0) + jitter


# --- the database: the mirror, and the whole state while Redis is away ---------------------


class SqlStore:
    """The breaker state in ``breaker_state``, each change under the row's lock."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def _row(self, session: Session, channel: Channel, config_id: int) -> BreakerState:
        dialect = postgresql if self.engine.dialect.name == "postgresql" else sqlite
        session.execute(
            dialect.insert(BreakerState)
            .values(channel=channel.value, config_id=config_id, interval_s=0.0, streak=[])
            .on_conflict_do_nothing()
        )
        return session.scalars(
            select(BreakerState)
            .where(BreakerState.channel == channel.value, BreakerState.config_id == config_id)
            .with_for_update()
        ).one()

    def active(self) -> dict[str, str]:
        """Field -> "open" | "streak", as Redis's active hash."""
        with Session(self.engine) as session:
            rows = session.execute(
                select(BreakerState.channel, BreakerState.config_id, BreakerState.down_since)
            ).all()
        return {f"{c}:{i}": "open" if down else "streak" for c, i, down in rows}

    def down(self) -> list[BreakerState]:
        """Every open breaker (detached rows)."""
        with Session(self.engine) as session:
            rows = list(
                session.scalars(select(BreakerState).where(BreakerState.down_since.is_not(None)))
            )
            session.expunge_all()
        return rows

    def failed(
        self,
        channel: Channel,
        config_id: int,
        record_id: int,
        error: str,
        now: float,
        threshold: int,
        probe_min_s: float,
        probe_max_s: float,
    ) -> bool:
        """A connection-level failure; True when the breaker is open after it."""
        with Session(self.engine) as session, session.begin():
            row = self._row(session, channel, config_id)
            row.last_error = error
            row.updated_time = _moment(now)
            if row.down_since is not None:
                if row.probe_record_id == record_id:
                    row.interval_s = min(row.interval_s * 2, probe_max_s)
                    row.next_probe_at = _moment(now + row.interval_s)
                    row.probe_record_id = None
                    row.probe_until = None
                return True
            streak = sorted({*row.streak, record_id})
            if len(streak) < threshold:
                row.streak = streak
                return False
            row.streak = []
            row.down_since = _moment(now)
            row.interval_s = probe_min_s
            row.next_probe_at = _moment(now + probe_min_s)
            row.probe_record_id = row.last_probe_record_id = None
            row.probe_until = None
            return True

    def answered(self, channel: Channel, config_id: int) -> bool:
        """The server answered; True when its breaker was open."""
        with Session(self.engine) as session, session.begin():
            row = session.get(BreakerState, (channel.value, config_id), with_for_update=True)
            if row is None:
                return False
            was_open = row.down_since is not None
            session.delete(row)
        return was_open

    def gate(
        self, channel: Channel, config_id: int, record_id: int, now: float, lease_s: float
    ) -> Check:
        with Session(self.engine) as session, session.begin():
            row = session.get(BreakerState, (channel.value, config_id), with_for_update=True)
            if row is None or row.down_since is None:
                return SEND
            next_probe = _epoch(row.next_probe_at)
            free = row.probe_record_id is None or now >= _epoch(row.probe_until)
            if now >= next_probe and free and row.last_probe_record_id != record_id:
                row.probe_record_id = row.last_probe_record_id = record_id
                row.probe_until = _moment(now + lease_s)
                return Check(Verdict.PROBE)
            return _deferral(next_probe, row.interval_s, now, row.down_since, row.last_error or "")

    def probe_due(self, channel: Channel, config_id: int, now: float, hold_s: float) -> int | None:
        """PROBE_DUE_LUA on the row: None, or the last probe's record id (0: none)."""
        with Session(self.engine) as session, session.begin():
            row = session.get(BreakerState, (channel.value, config_id), with_for_update=True)
            if row is None or row.down_since is None:
                return None
            if now < _epoch(row.next_probe_at) or now < _epoch(row.probe_until):
                return None
            row.probe_record_id = None
            row.probe_until = _moment(now + hold_s)
            return row.last_probe_record_id or 0

    def is_open(self, channel: Channel, config_id: int) -> bool:
        with Session(self.engine) as session:
            down = session.scalar(
                select(BreakerState.down_since).where(
                    BreakerState.channel == channel.value, BreakerState.config_id == config_id
                )
            )
        return down is not None

    def mirror(
        self,
        channel: Channel,
        config_id: int,
        *,
        down_since: datetime | None,
        next_probe_at: datetime | None,
        interval_s: float,
        last_error: str,
    ) -> None:
        """Write a change of state that Redis made (best effort: the pages lag if it fails)."""
        try:
            with Session(self.engine) as session, session.begin():
                row = self._row(session, channel, config_id)
                row.down_since = down_since
                row.next_probe_at = next_probe_at
                row.interval_s = interval_s
                row.last_error = last_error
                row.updated_time = datetime.now(UTC)
        except Exception:
            log.exception("breaker: mirroring the state to the database failed")


def _deferral(
    next_probe: float, interval_s: float, now: float, down_since: datetime | None, error: str
) -> Check:
    # A probe in flight or due: the following one is at least an interval away.
    wait = next_probe - now if next_probe > now else interval_s
    return Check(Verdict.DEFER, wait, interval_s, down_since, error)


# --- the breaker ----------------------------------------------------------------------------


class Breaker:
    """The breakers of every server and provider, as one process sees them; thread-safe."""

    def __init__(
        self,
        engine: Engine,
        settings: Settings,
        connect: Callable[[], redis.Redis] | None,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.sql = SqlStore(engine)
        self.threshold = max(settings.breaker_failures, 1)
        self.probe_min_s = settings.breaker_probe_min_s
        self.probe_max_s = max(settings.breaker_probe_max_s, settings.breaker_probe_min_s)
        timeouts = (
            settings.smtp_connect_timeout_s + settings.smtp_read_timeout_s,
            settings.sms_connect_timeout_s + settings.sms_read_timeout_s,
        )
        self.lease_s = 2 * max(timeouts) + 1  # a probe whose worker died frees the slot
        # A record released for a due probe holds the slot this long; one that never came
        # (cancelled meanwhile, or still behind other work) lets the next release go.
        self.release_hold_s = max(self.probe_min_s, 1.0)
        self.engine = engine
        self._connect = connect
        self._clock = clock
        self._lock = threading.Lock()
        self._client: redis.Redis | None = None
        self._scripts: dict[str, Any] = {}
        self._view: dict[str, str] = {}
        self._view_at = -1e9
        # False at first: the first view read carries over what the database holds.
        self._redis_ok = False
        self._warned_at = -1e9
        _watching.setdefault(engine, weakref.WeakSet()).add(self)
        # How often this process checks that each record waiting for a breaker has one open;
        # the first check comes with the first view.
        self.recheck_s = RECHECK_S
        self._rechecked_at = -1e9

    # -- Redis, or the database when it is away --

    def _redis(self) -> redis.Redis:
        if self._connect is None:
            raise redis.ConnectionError("no Redis configured for the breaker")
        with self._lock:
            if self._client is None:
                self._client = self._connect()
            return self._client

    def _script(self, source: str) -> Any:
        client = self._redis()
        with self._lock:
            script = self._scripts.get(source)
            if script is None:
                script = self._scripts[source] = client.register_script(source)
            return script

    def _redis_failed(self, exc: Exception) -> None:
        now = time.monotonic()
        self._redis_ok = False
        if now - self._warned_at > 30:
            self._warned_at = now
            log.warning("breaker: Redis unavailable, using the database: %s", exc)

    def _run(self, source: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """Run a script; raises redis.RedisError (the caller falls back to the database)."""
        return self._script(source)(keys=list(keys), args=list(args))

    def _current_view(self) -> dict[str, str]:
        now = time.monotonic()
        if now - self._view_at < VIEW_TTL_S:
            return self._view
        with self._lock:
            if now - self._view_at < VIEW_TTL_S:
                return self._view
            self._view_at = now
        was_ok = self._redis_ok
        try:
            raw = self._redis().hgetall(ACTIVE_KEY)
            view = {_text(k): _text(v) for k, v in raw.items()}
            self._redis_ok = True
            if not was_ok:
                self._carry_over(view)
        except redis.RedisError as exc:
            self._redis_failed(exc)
            try:
                view = self.sql.active()
            except Exception:
                log.exception("breaker: reading the state failed; treating every server as up")
                view = {}
        self._view = view
        self._release_for_probes(view)
        if now - self._rechecked_at >= self.recheck_s:
            self._rechecked_at = now
            self._release_orphans(view)
        return view

    def _release_orphans(self, view: dict[str, str]) -> None:
        """Records waiting for a breaker that is not open (Redis came back empty, or lost a
        close) are released: nothing else would make them due before their deadline."""
        for channel, model in ((Channel.MAIL, MailSendRecord), (Channel.SMS, SmsSendRecord)):
            try:
                with Session(self.engine) as session:
                    configs = session.scalars(
                        select(model.waiting_config_id)
                        .where(
                            _RELEASED.where(model.status),
                            model.error_code == SERVER_UNAVAILABLE,
                            model.next_retry_at > db_now(),
                            model.waiting_config_id.is_not(None),
                        )
                        .distinct()
                    ).all()
                for config_id in configs:
                    if config_id is None or view.get(_field(channel, config_id)) == "open":
                        continue
                    if self.is_open(channel, config_id):
                        continue  # opened since the view was read
                    released = release(self.engine, channel, config_id)
                    if released:
                        log.warning(
                            "breaker: %s is not open; released %s records waiting for it",
                            _field(channel, config_id),
                            released,
                        )
            except Exception:
                log.exception("breaker: checking the records waiting for breakers failed")

    def _release_for_probes(self, view: dict[str, str]) -> None:
        """An open breaker whose probe is due while every record for it waits (none comes to
        the gate by itself) gets one of them made due: the probe. One process wins each."""
        for field, status in view.items():
            if status != "open":
                continue
            name, _, config = field.partition(":")
            channel, config_id = Channel(name), int(config)
            try:
                last = self._probe_due(channel, config_id)
                if last is None:
                    continue
                released = release(self.engine, channel, config_id, limit=1, skip=last)
            except Exception:
                log.exception("breaker: releasing a waiting record for %s's probe failed", field)
                continue
            if released:
                log.info("breaker: %s's probe is due; a waiting record is released for it", field)

    def _probe_due(self, channel: Channel, config_id: int) -> int | None:
        now = self._clock()
        try:
            answer = self._run(
                PROBE_DUE_LUA,
                _keys(channel, config_id)[:1],
                [repr(now), repr(self.release_hold_s)],
            )
        except redis.RedisError as exc:
            self._redis_failed(exc)
            return self.sql.probe_due(channel, config_id, now, self.release_hold_s)
        if not answer:
            return None
        last = _text(answer[1])
        return int(last) if last else 0

    def watch(self) -> None:
        """Keep the view fresh (and release records for due probes); for ``tick``."""
        try:
            self._current_view()
        except Exception:
            log.exception("breaker: refreshing the view failed")

    def _carry_over(self, view: dict[str, str]) -> None:
        """Redis is back: breakers opened in the database meanwhile are opened there too."""
        for row in self.sql.down():
            field = f"{row.channel}:{row.config_id}"
            if view.get(field) == "open":
                continue
            keys = _keys(Channel(row.channel), row.config_id)
            self._run(
                CARRY_LUA,
                [keys[0], keys[2]],
                [
                    field,
                    repr(_epoch(row.down_since)),
                    repr(_epoch(row.next_probe_at)),
                    repr(row.interval_s or self.probe_min_s),
                    row.last_error or "",
                ],
            )
            view[field] = "open"

    def _set_view(self, field: str, status: str | None) -> None:
        with self._lock:
            view = dict(self._view)
            if status is None:
                view.pop(field, None)
            else:
                view[field] = status
            self._view = view

    # -- the three calls of the delivery pipeline --

    def check(self, channel: Channel, config_id: int, record_id: int) -> Check:
        """Before a send (after the server is chosen, before the quota is charged)."""
        field = _field(channel, config_id)
        if self._current_view().get(field) != "open":
            return SEND
        now = self._clock()
        try:
            answer = self._run(
                GATE_LUA, _keys(channel, config_id)[:1], [record_id, repr(now), self.lease_s]
            )
        except redis.RedisError as exc:
            self._redis_failed(exc)
            return self.sql.gate(channel, config_id, record_id, now, self.lease_s)
        verdict = _text(answer[0])
        if verdict == "send":
            self._set_view(field, None)
            return SEND
        if verdict == "probe":
            log.info("breaker: probing %s with record %s", field, record_id)
            return Check(Verdict.PROBE)
        return _deferral(
            float(_text(answer[1])),
            float(_text(answer[2])),
            now,
            _moment(_text(answer[3])),
            _text(answer[4]),
        )

    def failed(self, channel: Channel, config_id: int, record_id: int, error: str) -> None:
        """A connection-level failure of ``record_id``'s attempt."""
        field = _field(channel, config_id)
        now = self._clock()
        args = [field, record_id, error[:500], repr(now), self.threshold]
        args += [repr(self.probe_min_s), repr(self.probe_max_s)]
        try:
            what, _n, opened, next_probe, interval = self._run(
                FAIL_LUA, _keys(channel, config_id), args
            )
        except redis.RedisError as exc:
            self._redis_failed(exc)
            is_open = self.sql.failed(
                channel,
                config_id,
                record_id,
                error,
                now,
                self.threshold,
                self.probe_min_s,
                self.probe_max_s,
            )
            self._set_view(field, "open" if is_open else "streak")
            return
        what = int(what)
        self._set_view(field, "streak" if what == 0 else "open")
        if what in (1, 3):  # opened, or a probe failed: the pages show the next probe
            self.sql.mirror(
                channel,
                config_id,
                down_since=_moment(_text(opened)),
                next_probe_at=_moment(_text(next_probe)),
                interval_s=float(_text(interval)),
                last_error=error,
            )
        if what == 1:
            log.error(
                "breaker: %s is down (%s records in a row failed to connect); deferring its "
                "records: %s",
                field,
                self.threshold,
                error,
                extra={"config": field},
            )

    def is_open(self, channel: Channel, config_id: int) -> bool:
        """The breaker's state as it is now (not the process's view, which may lag)."""
        try:
            return _text(self._redis().hget(_keys(channel, config_id)[0], "open")) == "1"
        except redis.RedisError as exc:
            self._redis_failed(exc)
            return self.sql.is_open(channel, config_id)

    def answered(self, channel: Channel, config_id: int) -> bool:
        """The server answered an attempt (sent, or refused it for the record's own reasons);
        True when that closed its breaker (the caller then releases the deferred records)."""
        field = _field(channel, config_id)
        if field not in self._current_view():
            return False  # neither open nor counting: nothing to reset
        try:
            was_open = bool(self._run(ANSWERED_LUA, _keys(channel, config_id), [field]))
        except redis.RedisError as exc:
            self._redis_failed(exc)
            was_open = self.sql.answered(channel, config_id)
        else:
            # The mirror row goes too (the database's own state while Redis was away).
            was_open = self.sql.answered(channel, config_id) or was_open
        self._set_view(field, None)
        if was_open:
            log.warning("breaker: %s answered again; closed", field, extra={"config": field})
        return was_open


def release(
    engine: Engine,
    channel: Channel,
    config_id: int,
    *,
    batch: int = RELEASE_BATCH,
    limit: int | None = None,
    skip: int = 0,
) -> int:
    """Make the records waiting for this breaker due now, ``batch`` at a time (at most
    ``limit``; ``skip``: a record id left waiting), and wake the workers; returns how many.
    ``limit=1`` is the record released for a due probe: the one with the fewest retries used,
    so the probes' retries are spread over the records."""
    model = PARTS[channel].record
    size = batch if limit is None else min(batch, limit)
    waiting = (
        select(model.id)
        .where(
            _RELEASED.where(model.status),
            model.error_code == SERVER_UNAVAILABLE,
            model.waiting_config_id == config_id,
            model.next_retry_at > db_now(),
            model.id != skip,
        )
        .limit(size)
    )
    if limit is not None:
        waiting = waiting.order_by(model.retry_count, model.id)
    if engine.dialect.name == "postgresql":
        waiting = waiting.with_for_update(skip_locked=True)
    total = 0
    for _ in range(10_000):
        with Session(engine) as session, session.begin():
            result = session.execute(
                update(model)
                .where(model.id.in_(waiting.scalar_subquery()))
                .values(next_retry_at=db_now(), updated_time=db_now(), version=model.version + 1)
                .execution_options(synchronize_session=False)
            )
        count = int(result.rowcount)  # type: ignore[attr-defined]
        total += count
        if count < size or (limit is not None and total >= limit):
            break
    if total and engine.dialect.name == "postgresql":
        from portal.messaging.records.acceptance import NOTIFIER  # acceptance's wake-ups

        NOTIFIER.request([(engine, channel.value)])
    return total


# The breakers of each engine in this process, for ``tick``.
_watching: weakref.WeakKeyDictionary[Engine, weakref.WeakSet[Breaker]] = weakref.WeakKeyDictionary()


def tick(engine: Engine) -> None:
    """The breakers' clock when no record comes to them: called by every claim on ``engine``
    (an idle pool's poll among them), it refreshes each breaker's view when stale, which
    releases a waiting record for any probe that is due. Nothing more while the view is fresh."""
    for gate in tuple(_watching.get(engine, ())):
        if time.monotonic() - gate._view_at >= VIEW_TTL_S:
            gate.watch()


_shared: dict[tuple[str, str | None], Breaker] = {}
_shared_lock = threading.Lock()


def shared(engine: Engine, settings: Settings) -> Breaker:
    """The process-wide breaker for this database and Redis (one view per process)."""
    key = (str(engine.url), settings.redis_url)
    with _shared_lock:
        found = _shared.get(key)
        if found is None:
            found = _shared[key] = Breaker(engine, settings, _connector(settings))
        return found


def _connector(settings: Settings) -> Callable[[], redis.Redis]:
    def connect() -> redis.Redis:
        if settings.redis_url is None:
            from portal import redis_store  # the embedded server starts only when needed

            return redis_store.connect(None)
        timeout = settings.rate_limit_timeout_s
        return redis.Redis.from_url(
            settings.redis_url,
            socket_connect_timeout=timeout,
            socket_timeout=timeout,
            retry=Retry(NoBackoff(), 1),
            health_check_interval=30,
        )

    return connect


def down_states(
    engine: Engine, channel: Channel | None = None
) -> dict[tuple[str, int], BreakerState]:
    """The open breakers, from the database mirror (pages, dashboard, metrics)."""
    try:
        rows = SqlStore(engine).down()
    except Exception:
        log.exception("breaker: reading the state failed")
        return {}
    return {
        (r.channel, r.config_id): r for r in rows if channel is None or r.channel == channel.value
    }
