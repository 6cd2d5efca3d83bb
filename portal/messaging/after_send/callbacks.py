"""Status callbacks: who is told what, how it is signed, where it may go,
and the queue of deliveries (claim, attempt, outcome).

The ``callback_delivery`` rows are written by database triggers (migration 0015) in the
statement that changes a record's status, so no write site of the delivery loop knows about
callbacks. This module reads them like the send records are read: claimed by a pool
(``portal.delivery.callback_pool``), at most ``PER_ENDPOINT`` in flight per endpoint, endpoints
taken in turn, retried on a fixed schedule until the retry window ends, then ``dead``.

Safety: ``messaging.sending.outbound``'s policy, as for every connection a tier's configuration
causes: a URL's host is resolved once per attempt, every address is checked against the refused
ranges (unless ``CALLBACK_ALLOW_PRIVATE``), and the connection goes to the address that was
checked (no second lookup; TLS still checks the host name).
"""

from __future__ import annotations

import base64
import json
import logging
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx
from sqlalchemy import Engine, select, text, update
from sqlalchemy.orm import Session
from standardwebhooks import Webhook

from portal.config import Settings
from portal.messaging.sending import outbound
from portal.models import CallbackDelivery, CallbackEndpoint, DeliveryStatus, db_now, db_now_plus

log = logging.getLogger("portal.callbacks")

STATUS_EVENTS = ("queued", "sent", "failed", "dead_letter", "uncertain", "suppressed", "cancelled")
DELIVERY_EVENTS = ("delivered", "bounced", "complained")
EVENT_TYPES: tuple[str, ...] = (
    *(f"mail.{e}" for e in (*STATUS_EVENTS, *DELIVERY_EVENTS, "read")),
    *(f"sms.{e}" for e in (*STATUS_EVENTS, *DELIVERY_EVENTS)),
)
TEST_EVENT = "test"

PER_ENDPOINT = 2  # deliveries in flight to one endpoint at once
PAUSE_AFTER = 20  # consecutive failures that pause an endpoint
PAUSE_S = 300.0
ROTATION_S = 86400.0  # the old secret signs too this long after a rotation
RESPONSE_MAX_BYTES = 1024
TIMEOUT_S = 10.0
LEASE_S = 60.0  # a claimed delivery whose worker vanished is due again after this
MAX_URL_CHARS = 2000
MAX_ERROR_CHARS = 500
# Retry delays in units of CALLBACK_BACKOFF_BASE_S (5 s): 5 s, 30 s, 2 min, 10 min, 30 min,
# then hourly until the retry window (CALLBACK_GIVE_UP_S, 24 h) ends.
STEPS = (1, 6, 24, 120, 360)
HOURLY = 720


# The policy is every outbound connection's (portal.messaging.sending.outbound); these names stay
# here for the callers that speak of callbacks.
Refused = outbound.Refused
Resolver = outbound.Resolver
Target = outbound.Target
system_resolver = outbound.system_resolver
forbidden = outbound.forbidden
url_problem = outbound.url_problem


def resolve(url: str, *, allow_private: bool, resolver: Resolver = system_resolver) -> Target:
    """Check ``url`` and its addresses; the Target to connect to. Raises Refused."""
    return outbound.resolve(url, allow_private=allow_private, resolver=resolver)


def check_at_save(url: str, settings: Settings, resolver: Resolver = system_resolver) -> str | None:
    """Why ``url`` cannot be saved, or None. A name that does not resolve now is accepted (DNS
    may be late); every attempt checks it again."""
    return outbound.url_problem_at_save(
        url, allow_private=settings.callback_allow_private, resolver=resolver
    )


# --- secrets and signing --------------------------------------------------------------------


def new_secret() -> str:
    """A signing secret the Standard Webhooks libraries accept: ``whsec_`` + base64."""
    return "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode("ascii")


def rotate_secret(endpoint: CallbackEndpoint, now: datetime) -> str:
    """A new secret for ``endpoint``; the old one keeps signing for 24 hours."""
    from datetime import timedelta

    fresh = new_secret()
    endpoint.previous_secret_encrypted = endpoint.secret_encrypted
    endpoint.previous_secret_until = now + timedelta(seconds=ROTATION_S)
    endpoint.secret = fresh
    return fresh


def signing_secrets(endpoint: CallbackEndpoint, now: datetime) -> list[str]:
    keys = [endpoint.secret]
    previous = endpoint.previous_secret
    until = endpoint.previous_secret_until
    if previous and until is not None and until > now:
        keys.append(previous)
    return keys


def webhook_id(delivery_id: int) -> str:
    """The same on every attempt of one delivery: receivers deduplicate by it."""
    return f"msg_{delivery_id}"


def body_of(event_type: str, payload: dict[str, Any]) -> str:
    return json.dumps(
        {"type": event_type, "timestamp": payload.get("occurredAt"), "data": payload},
        separators=(",", ":"),
        ensure_ascii=False,
    )


def headers_for(msg_id: str, body: str, keys: Sequence[str], now: datetime) -> dict[str, str]:
    signatures = " ".join(Webhook(key).sign(msg_id, now, body) for key in keys)
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(int(now.timestamp())),
        "webhook-signature": signatures,
        "content-type": "application/json",
        "user-agent": "Postroom-Callbacks/1",
    }


# --- sending ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Result:
    ok: bool
    status_code: int | None
    duration_ms: int
    error: str | None


def post(
    client: httpx.Client,
    url: str,
    body: str,
    headers: dict[str, str],
    *,
    allow_private: bool,
    resolver: Resolver = system_resolver,
) -> Result:
    """One POST of ``body`` to ``url``: checked, to the checked address, at most
    RESPONSE_MAX_BYTES of the answer read, TIMEOUT_S in all. 2xx is delivered."""
    started = time.monotonic()
    try:
        request = outbound.pinned_request(
            client,
            "POST",
            url,
            allow_private=allow_private,
            resolver=resolver,
            headers=headers,
            content=body.encode(),
        )
    except Refused as exc:
        return Result(False, None, 0, f"refused: {exc}"[:MAX_ERROR_CHARS])
    try:
        response = client.send(request, stream=True, follow_redirects=False)
        try:
            read = 0
            for chunk in response.iter_raw():
                read += len(chunk)
                if read >= RESPONSE_MAX_BYTES or time.monotonic() - started > TIMEOUT_S:
                    break
        finally:
            response.close()
    except httpx.HTTPError as exc:
        took = int((time.monotonic() - started) * 1000)
        return Result(False, None, took, f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS])
    took = int((time.monotonic() - started) * 1000)
    code = response.status_code
    if 200 <= code < 300:
        return Result(True, code, took, None)
    return Result(False, code, took, f"HTTP {code}")


def new_client() -> httpx.Client:
    """No proxies or netrc from the environment, no redirects, 10 s per phase (the read loop
    above holds the whole attempt to 10 s)."""
    return outbound.http_client(trust_env=False, follow_redirects=False, timeout=TIMEOUT_S)


# --- the queue ----------------------------------------------------------------------------


def retry_delay(attempts: int, base_s: float) -> float:
    """Seconds before the next attempt after ``attempts`` failed ones."""
    step = STEPS[attempts - 1] if 1 <= attempts <= len(STEPS) else HOURLY
    return step * base_s


@dataclass(frozen=True)
class Claimed:
    id: int
    endpoint_id: int
    attempts: int


_PG_CLAIM = """
WITH busy AS (
  SELECT endpoint_id, count(*) AS n FROM callback_delivery
   WHERE status = 'sending' AND next_attempt_at > statement_timestamp()
   GROUP BY endpoint_id),
c AS (
  SELECT d.id FROM callback_delivery d
    JOIN callback_endpoint e ON e.id = d.endpoint_id
    LEFT JOIN busy b ON b.endpoint_id = d.endpoint_id
   WHERE d.status IN ('pending', 'sending') AND d.next_attempt_at <= statement_timestamp()
     AND e.enabled AND (e.paused_until IS NULL OR e.paused_until <= statement_timestamp())
     AND coalesce(b.n, 0) < CASE WHEN e.consecutive_failures >= :pause_after THEN 1
                                 ELSE :per_endpoint END
   ORDER BY (d.endpoint_id <= :cursor), d.endpoint_id, d.next_attempt_at
   LIMIT 1 FOR UPDATE OF d SKIP LOCKED)
UPDATE callback_delivery d
   SET status = 'sending', attempts = d.attempts + 1, last_attempt_at = statement_timestamp(),
       next_attempt_at = statement_timestamp() + make_interval(secs => :lease)
  FROM c WHERE d.id = c.id
RETURNING d.id, d.endpoint_id, d.attempts
"""

_SQLITE_NOW = "strftime('%Y-%m-%d %H:%M:%f', 'now')"
_SQLITE_CLAIM = f"""
UPDATE callback_delivery
   SET status = 'sending', attempts = attempts + 1, last_attempt_at = {_SQLITE_NOW},
       next_attempt_at = strftime('%Y-%m-%d %H:%M:%f', 'now', printf('%+.6f seconds', :lease))
 WHERE id = (
  SELECT d.id FROM callback_delivery d
    JOIN callback_endpoint e ON e.id = d.endpoint_id
   WHERE d.status IN ('pending', 'sending') AND d.next_attempt_at <= {_SQLITE_NOW}
     AND e.enabled AND (e.paused_until IS NULL OR e.paused_until <= {_SQLITE_NOW})
     AND (SELECT count(*) FROM callback_delivery b WHERE b.endpoint_id = d.endpoint_id
           AND b.status = 'sending' AND b.next_attempt_at > {_SQLITE_NOW})
         < CASE WHEN e.consecutive_failures >= :pause_after THEN 1 ELSE :per_endpoint END
   ORDER BY (d.endpoint_id <= :cursor), d.endpoint_id, d.next_attempt_at
   LIMIT 1)
RETURNING id, endpoint_id, attempts
"""


def claim(engine: Engine, cursor: int) -> Claimed | None:
    """Claim one due delivery, the endpoint after ``cursor`` first (endpoints take turns)."""
    # A read first: with nothing due (the usual case) no write transaction, advisory lock or
    # SQLite write lock is taken at every poll of every pool thread. It ends with a COMMIT,
    # not the ROLLBACK closing would send: psycopg drops every statement the connection has
    # prepared at a rollback, and the next claim on this pooled connection would be parsed
    # and planned again (at each idle poll, most of an idle worker's database CPU).
    with engine.connect() as conn:
        due = conn.execute(
            select(CallbackDelivery.id)
            .where(
                CallbackDelivery.status.in_(
                    [DeliveryStatus.PENDING.value, DeliveryStatus.SENDING.value]
                ),
                CallbackDelivery.next_attempt_at <= db_now(),
            )
            .limit(1)
        ).first()
        conn.commit()
    if due is None:
        return None
    params = {
        "pause_after": PAUSE_AFTER,
        "per_endpoint": PER_ENDPOINT,
        "cursor": cursor,
        "lease": LEASE_S,
    }
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            # Claims are serialised, so the in-flight count per endpoint they read is exact.
            conn.execute(text("SELECT pg_advisory_xact_lock(hashtext('postroom-callback-claim'))"))
            row = conn.execute(text(_PG_CLAIM), params).first()
        else:
            row = conn.execute(text(_SQLITE_CLAIM), params).first()
    return Claimed(row[0], row[1], row[2]) if row is not None else None


@dataclass(frozen=True)
class Settled:
    """What an attempt's outcome changed, for the inbox."""

    status: str
    endpoint_paused: bool


def attempt(
    engine: Engine,
    settings: Settings,
    client: httpx.Client,
    claimed: Claimed,
    resolver: Resolver = system_resolver,
) -> Settled | None:
    """Post one claimed delivery and write its outcome (by attempts: a delivery whose lease
    ran out and was claimed again is written by its newer claim only)."""
    now = datetime.now(UTC)
    with Session(engine) as session:
        delivery = session.get(CallbackDelivery, claimed.id)
        endpoint = session.get(CallbackEndpoint, claimed.endpoint_id)
        if delivery is None or endpoint is None:
            return None
        body = body_of(delivery.event_type, delivery.payload)
        headers = headers_for(webhook_id(delivery.id), body, signing_secrets(endpoint, now), now)
        url = endpoint.url
    result = post(
        client,
        url,
        body,
        headers,
        allow_private=settings.callback_allow_private,
        resolver=resolver,
    )
    return settle(engine, settings, claimed, result)


def settle(engine: Engine, settings: Settings, claimed: Claimed, result: Result) -> Settled | None:
    """Write an attempt's outcome: delivered, due again later, or dead past the window."""
    from portal.metrics import CALLBACK_ATTEMPTS

    common: dict[str, Any] = {
        "last_status_code": result.status_code,
        "last_duration_ms": result.duration_ms,
        "last_error": result.error,
    }
    with Session(engine) as session, session.begin():
        delivery = session.get(CallbackDelivery, claimed.id)
        if delivery is None or delivery.attempts != claimed.attempts:
            return None
        if result.ok:
            values = common | {
                "status": DeliveryStatus.DELIVERED.value,
                "delivered_at": db_now(),
                "next_attempt_at": db_now(),
            }
            outcome = DeliveryStatus.DELIVERED.value
        else:
            delay = retry_delay(claimed.attempts, settings.callback_backoff_base_s)
            until = delivery.retry_until or _plus(
                delivery.created_time, settings.callback_give_up_s
            )
            if datetime.now(UTC).timestamp() + delay > until.timestamp():
                values = common | {"status": DeliveryStatus.DEAD.value}
                outcome = DeliveryStatus.DEAD.value
            else:
                values = common | {
                    "status": DeliveryStatus.PENDING.value,
                    "next_attempt_at": db_now_plus(delay),
                }
                outcome = "retry"
        done = session.execute(
            update(CallbackDelivery)
            .where(
                CallbackDelivery.id == claimed.id,
                CallbackDelivery.attempts == claimed.attempts,
                CallbackDelivery.status == DeliveryStatus.SENDING.value,
            )
            .values(**values)
            .execution_options(synchronize_session=False)
        )
        if done.rowcount != 1:  # type: ignore[attr-defined]
            return None
        paused = _endpoint_outcome(session, claimed.endpoint_id, result.ok)
    CALLBACK_ATTEMPTS.labels(outcome=outcome).inc()
    log.log(
        logging.WARNING if outcome == DeliveryStatus.DEAD.value else logging.INFO,
        "callback %s",
        outcome,
        extra={
            "delivery_id": claimed.id,
            "endpoint_id": claimed.endpoint_id,
            "attempts": claimed.attempts,
            "status_code": result.status_code,
            "error": result.error,
        },
    )
    if outcome == DeliveryStatus.DEAD.value or paused:
        from portal.messaging.after_send.inbox import callback_trouble

        callback_trouble(engine, claimed.endpoint_id, claimed.id if not paused else None, paused)
    return Settled(outcome, paused)


def _plus(when: datetime, seconds: float) -> datetime:
    from datetime import timedelta

    return when + timedelta(seconds=seconds)


def _endpoint_outcome(session: Session, endpoint_id: int, ok: bool) -> bool:
    """Count the endpoint's failures in a row; True when this failure paused it."""
    if ok:
        session.execute(
            update(CallbackEndpoint)
            .where(CallbackEndpoint.id == endpoint_id, CallbackEndpoint.consecutive_failures > 0)
            .values(consecutive_failures=0, paused_until=None)
            .execution_options(synchronize_session=False)
        )
        return False
    failures = session.execute(
        update(CallbackEndpoint)
        .where(CallbackEndpoint.id == endpoint_id)
        .values(consecutive_failures=CallbackEndpoint.consecutive_failures + 1)
        .returning(CallbackEndpoint.consecutive_failures)
        .execution_options(synchronize_session=False)
    ).scalar()
    if failures is None or failures < PAUSE_AFTER:
        return False
    session.execute(
        update(CallbackEndpoint)
        .where(CallbackEndpoint.id == endpoint_id)
        .values(paused_until=db_now_plus(PAUSE_S))
        .execution_options(synchronize_session=False)
    )
    log.warning(
        "callback endpoint paused after %d failures in a row",
        failures,
        extra={"endpoint_id": endpoint_id},
    )
    return failures == PAUSE_AFTER


# --- portal actions -----------------------------------------------------------------------


def test_event(session: Session, endpoint: CallbackEndpoint) -> CallbackDelivery:
    """A ``test`` delivery to ``endpoint`` alone, due now (the caller commits)."""
    now = datetime.now(UTC)
    delivery = CallbackDelivery(
        tenant_id=endpoint.tenant_id,
        endpoint_id=endpoint.id,
        channel=None,
        record_id=None,
        event_type=TEST_EVENT,
        sequence=0,
        payload={
            "id": None,
            "channel": None,
            "status": None,
            "businessKey": None,
            "errorCode": None,
            "errorMessage": None,
            "providerMessageId": None,
            "metadata": {"endpoint": endpoint.name},
            "occurredAt": now.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            "sequence": 0,
        },
        status=DeliveryStatus.PENDING.value,
    )
    session.add(delivery)
    session.flush()
    return delivery


def resend(session: Session, tenant_id: int, delivery_ids: Sequence[int], give_up_s: float) -> int:
    """Make deliveries of ``tenant_id`` due now with a fresh retry window (same webhook-id);
    one in flight is left alone."""
    result = session.execute(
        update(CallbackDelivery)
        .where(
            CallbackDelivery.tenant_id == tenant_id,
            CallbackDelivery.id.in_(list(delivery_ids)),
            CallbackDelivery.status != DeliveryStatus.SENDING.value,
        )
        .values(
            status=DeliveryStatus.PENDING.value,
            next_attempt_at=db_now(),
            retry_until=db_now_plus(give_up_s),
        )
        .execution_options(synchronize_session=False)
    )
    return int(result.rowcount)  # type: ignore[attr-defined]


def replay_since(
    session: Session, tenant_id: int, endpoint_id: int, since: datetime, give_up_s: float
) -> int:
    """Every delivery of one endpoint since ``since`` due again (same webhook-ids)."""
    ids = session.scalars(
        select(CallbackDelivery.id).where(
            CallbackDelivery.tenant_id == tenant_id,
            CallbackDelivery.endpoint_id == endpoint_id,
            CallbackDelivery.created_time >= since,
        )
    ).all()
    return resend(session, tenant_id, ids, give_up_s) if ids else 0


def secret_problem(secret: str) -> str | None:
    """What is wrong with a given signing secret ("must ..."), or None."""
    if not secret.startswith("whsec_"):
        return "must start with whsec_ followed by base64"
    try:
        raw = base64.b64decode(secret[len("whsec_") :], validate=True)
    except ValueError:
        return "must be whsec_ followed by base64"
    if not 24 <= len(raw) <= 64:
        return "must hold 24 to 64 bytes"
    return None
