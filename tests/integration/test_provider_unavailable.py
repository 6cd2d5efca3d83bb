"""An SMS provider outage costs records no retries beyond the breaker's first few, on every
provider kind: Twilio, Vonage and the JSON gateway each answer an outage their own way (a 503
with their own code or none, or no connection at all), and ``classify.unavailable`` is the one
definition all of them go through.

Records are claimed and processed in the test thread (the code the pool workers run) against a
real local HTTP server that plays the provider: down first, then answering again.
"""

from __future__ import annotations

import threading
import time
from http.server import ThreadingHTTPServer
from typing import Any

import httpx
import pytest
import redis
from flask import Flask
from sqlalchemy import func, select

from portal.config import Settings
from portal.extensions import db
from portal.messaging.sending import breaker
from portal.messaging.sending.backoff import BackoffPolicy
from portal.messaging.sending.breaker import Breaker
from portal.messaging.sending.claim import claim_due
from portal.messaging.sending.classify import Reach, unavailable
from portal.messaging.sending.pipeline import SmsContext, process_sms
from portal.messaging.sending.transports import sms as sms_transport
from portal.models import BreakerState, MailSendRecord, SendStatus, SmsSendRecord
from tests.support import sms as sms_support
from tests.support.delivery import tenant
from tests.support.sms_provider import FakeSmsProvider, Request, _Reply

N = 24
THRESHOLD = 5
PROBE_MIN_S = 2.0  # the first probe comes after the outage phase below
OUTAGE_PHASE_S = 1.2  # longer than the whole retry schedule at BACKOFF_BASE_S=0.2 (<= 0.9 s)
KINDS = ("twilio", "vonage", "http_json")

# How each provider answers while it is down (HTTP 503 with its own body).
DOWN_REPLIES: dict[str, _Reply] = {
    # Twilio's REST exception for its own outage: its error 20503 "Service unavailable".
    "twilio": _Reply(
        503,
        {
            "code": 20503,
            "message": "Service unavailable",
            "more_info": "https://www.twilio.com/docs/errors/20503",
            "status": 503,
        },
    ),
    # Vonage's front door: an RFC 7807 problem without an SMS API status.
    "vonage": _Reply(503, {"type": "about:blank", "title": "Service Unavailable"}),
    # Our gateway protocol's own code for "the gateway is down".
    "http_json": _Reply(503, {"code": "SERVICE_UNAVAILABLE", "message": "carrier link down"}),
}


class OutageProvider(FakeSmsProvider):
    """The fake provider, down until ``recover()``: answering 503 as ``kind`` does, or (with
    ``refuse``) not listening at all, so that every connection is refused."""

    def __init__(self, kind: str, *, refuse: bool) -> None:
        super().__init__()
        self.kind = kind
        self.refuse = refuse
        self.down = True
        self.port = int(self._server.server_address[1])
        if refuse:
            self._server.server_close()  # the port stays ours to reopen; nothing listens now

    def __enter__(self) -> OutageProvider:
        if not self.refuse:
            self._thread.start()
        return self

    def recover(self) -> None:
        """The provider answers again (listening again on the same port, when it refused)."""
        self.down = False
        if self.refuse:
            server = ThreadingHTTPServer(("127.0.0.1", self.port), self._handler_class())
            server.daemon_threads = True
            self._server = server
            self._thread = threading.Thread(
                target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
            )
            self._thread.start()
            self.refuse = False

    def close(self) -> None:
        if self.refuse:
            return  # never listened
        super().close()

    def _reply(self, request: Request, headers: dict[str, str], body: bytes) -> _Reply | None:
        if self.down:
            request.answer = "down"
            return DOWN_REPLIES[self.kind]
        return super()._reply(request, headers, body)


@pytest.fixture
def clean_redis(redis_client: redis.Redis) -> redis.Redis:
    return redis_client


def _settings(app: Flask) -> Settings:
    base: Settings = app.config["SETTINGS"]
    values: dict[str, Any] = {
        "max_retries": 2,
        "backoff_base_s": 0.2,
        "breaker_failures": THRESHOLD,
        "breaker_probe_min_s": PROBE_MIN_S,
        "breaker_probe_max_s": 30.0,
        "sms_connect_timeout_s": 0.5,
        "sms_read_timeout_s": 2.0,
    }
    return base.replace(**values)


def _process(ctx: SmsContext, record: MailSendRecord | SmsSendRecord) -> None:
    assert isinstance(record, SmsSendRecord)
    process_sms(ctx, record)


def _process_for(ctx: SmsContext, seconds: float, give_up_s: float = 20.0) -> None:
    """Claim and process whatever comes due for ``seconds``, and on until no record is left
    Pending (each has had its first attempt): on a loaded machine the first attempts alone
    can take longer than ``seconds``."""
    started = time.monotonic()
    while time.monotonic() - started < give_up_s:
        claimed = claim_due(db.engine, SmsSendRecord, 1)
        if claimed:
            _process(ctx, claimed[0])
            continue
        if time.monotonic() - started >= seconds:
            with db.engine.connect() as conn:
                pending = conn.scalar(
                    select(func.count()).where(SmsSendRecord.status == SendStatus.PENDING.value)
                )
            if not pending:
                return
        time.sleep(0.02)


def _process_until_all_sent(ctx: SmsContext, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        claimed = claim_due(db.engine, SmsSendRecord, 1)
        if claimed:
            _process(ctx, claimed[0])
            continue
        with db.engine.connect() as conn:
            left = conn.scalar(
                select(func.count()).where(SmsSendRecord.status != SendStatus.SENT.value)
            )
        if left == 0:
            return
        time.sleep(0.02)
    raise AssertionError("the records did not all go out after the provider recovered")


def _rows() -> list[SmsSendRecord]:
    db.session.expire_all()
    return list(db.session.scalars(select(SmsSendRecord).order_by(SmsSendRecord.id)))


@pytest.mark.parametrize("refuse", [False, True], ids=["503", "connection-refused"])
@pytest.mark.parametrize("kind", KINDS)
def test_an_outage_opens_the_breaker_and_costs_no_record_a_second_retry(
    app: Flask, clean_redis: redis.Redis, kind: str, refuse: bool
) -> None:
    settings = _settings(app)
    t = tenant("acme")
    with OutageProvider(kind, refuse=refuse) as server:
        config = sms_support.provider(t.id, kind, server)
        db.session.commit()
        numbers = [f"+4474009{i:05d}" for i in range(N)]
        for number in numbers:
            sms_support.accept_sms(app, t.id, phoneNumber=number)
        ctx = SmsContext(
            engine=db.engine,
            settings=settings,
            policy=BackoffPolicy.from_settings(settings),
            breaker=Breaker(db.engine, settings, breaker._connector(settings)),
        )
        try:
            _process_for(ctx, OUTAGE_PHASE_S)

            # Within the outage: the first THRESHOLD records spent one retry each, every
            # other record waits on the breaker with none spent, and nobody is on a second.
            rows = _rows()
            spent = sorted(r.retry_count for r in rows)
            assert spent == [0] * (N - THRESHOLD) + [1] * THRESHOLD
            assert {r.status for r in rows} == {"Retry"}
            assert {r.error_code for r in rows} == {breaker.SERVER_UNAVAILABLE}
            state = db.session.get(BreakerState, ("sms", config.id))
            assert state is not None
            assert state.down_since is not None
            if not refuse:
                assert len(server.requests) == THRESHOLD  # the waiting ones never went out

            server.recover()
            _process_until_all_sent(ctx)
        finally:
            ctx.close()

        rows = _rows()
        assert {r.status for r in rows} == {"Sent"}
        assert max(r.retry_count for r in rows) <= 1
        accepted = [r.to for r in server.accepted()]
        assert sorted(accepted) == sorted(numbers)  # each exactly once
    db.session.expire_all()
    assert db.session.get(BreakerState, ("sms", config.id)) is None  # closed again


# --- what counts, per provider kind, without a database --------------------------------------

TWILIO = sms_transport.ProviderAccount(
    "twilio", "tw", "https://tw.test", "AC1", "token", "+15005550006"
)
VONAGE = sms_transport.ProviderAccount("vonage", "vo", "https://vo.test", "key", "s", "Acme")
GATEWAY = sms_transport.ProviderAccount("http_json", "gw", "https://gw.test/send", None, "s", None)
OUTGOING = sms_transport.OutgoingSms(1, "+447400123456", "Hello", "postroom-sms-1")


@pytest.fixture(autouse=True)
def _public_addresses(monkeypatch: pytest.MonkeyPatch) -> None:
    # The providers are httpx.MockTransport handlers: their hosts "resolve" to a public address.
    from portal.messaging.sending.transports.sms import _http

    monkeypatch.setattr(_http, "RESOLVER", lambda host, port: ["93.184.216.34"])


def _answer(status: int, body: dict[str, Any] | bytes) -> httpx.Client:
    def handler(request: httpx.Request) -> httpx.Response:
        if isinstance(body, bytes):
            return httpx.Response(status, content=body)
        return httpx.Response(status, json=body)

    return httpx.Client(transport=httpx.MockTransport(handler))


def _vonage_status(status: str, text: str) -> dict[str, Any]:
    return {"message-count": "1", "messages": [{"status": status, "error-text": text}]}


@pytest.mark.parametrize(
    ("account", "status", "body", "counts"),
    [
        # Unavailable: 502/503/504 without a code, or with one that names no other cause.
        (TWILIO, 503, {"code": 20503, "message": "Service unavailable"}, True),
        (TWILIO, 502, b"<html>Bad Gateway</html>", True),
        (TWILIO, 504, {"code": 20500, "message": "Internal Server Error"}, True),
        (TWILIO, 400, {"code": 21730, "message": "System under maintenance"}, True),
        (VONAGE, 503, b"<html>Service Unavailable</html>", True),
        (VONAGE, 504, {"title": "Gateway Timeout"}, True),
        (GATEWAY, 503, b"down", True),
        (GATEWAY, 502, {"code": "PROVIDER_ERROR", "message": "upstream"}, True),
        (GATEWAY, 500, {"code": "SERVICE_UNAVAILABLE", "message": "carrier link down"}, True),
        # Answers about our account or this message: the provider is there to give them.
        (TWILIO, 429, {"code": 20429, "message": "Too Many Requests"}, False),
        (TWILIO, 503, {"code": 20429, "message": "Too Many Requests"}, False),
        (TWILIO, 500, {"code": 20500, "message": "Internal Server Error"}, False),
        (TWILIO, 400, {"code": 21211, "message": "Invalid 'To' Phone Number"}, False),
        (TWILIO, 401, {"code": 20003, "message": "Authenticate"}, False),
        (VONAGE, 200, _vonage_status("1", "Throttled"), False),
        (VONAGE, 200, _vonage_status("5", "Internal Error"), False),
        (VONAGE, 200, _vonage_status("10", "Too many existing binds"), False),
        (VONAGE, 429, {"title": "Too Many Requests"}, False),
        (GATEWAY, 503, {"code": "THROTTLED", "message": "slow down"}, False),
        (GATEWAY, 500, b"gateway exploded", False),
    ],
)
def test_what_counts_as_unavailable_per_provider_kind(
    account: sms_transport.ProviderAccount,
    status: int,
    body: dict[str, Any] | bytes,
    counts: bool,
) -> None:
    with _answer(status, body) as client:
        result = sms_transport.send(client, account, OUTGOING)
    assert result.accepted is False
    assert result.connection is counts, (result.code, result.message)


REQUEST = httpx.Request("POST", "https://gw.test/send")


@pytest.mark.parametrize(
    ("exc", "counts"),
    [
        (httpx.ConnectError("[Errno 111] Connection refused", request=REQUEST), True),
        (httpx.ConnectError("[Errno 104] Connection reset by peer", request=REQUEST), True),
        (httpx.ConnectTimeout("timed out", request=REQUEST), True),
        (httpx.WriteTimeout("timed out", request=REQUEST), True),
        (httpx.WriteError("[Errno 104] Connection reset by peer", request=REQUEST), True),
        # Our own client's pool: nothing about the provider.
        (httpx.PoolTimeout("no connection free", request=REQUEST), False),
        # The request was complete: it may have been accepted, which says nothing either way.
        (httpx.ReadTimeout("timed out", request=REQUEST), False),
        (httpx.ReadError("[Errno 104] Connection reset by peer", request=REQUEST), False),
        (httpx.RemoteProtocolError("Server disconnected", request=REQUEST), False),
    ],
)
def test_failures_before_the_request_was_written_count_on_every_kind(
    exc: Exception, counts: bool
) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise exc

    for account in (TWILIO, VONAGE, GATEWAY):
        with httpx.Client(transport=httpx.MockTransport(handler)) as client:
            result = sms_transport.send(client, account, OUTGOING)
        assert (result.accepted, result.connection) == (False, counts), account.kind


def test_the_definition_itself() -> None:
    assert unavailable(Reach.CONNECT)
    assert unavailable(Reach.REQUEST)
    assert not unavailable(Reach.SENT)
    assert not unavailable(Reach.LOCAL)
    assert unavailable(Reach.ANSWERED, kind="twilio", status=400, provider_code="20503")
    assert not unavailable(Reach.ANSWERED, kind="vonage", status=200, provider_code="1")
    assert unavailable(Reach.ANSWERED, kind="vonage", status=503)
    assert not unavailable(Reach.ANSWERED, kind="http_json", status=500)
