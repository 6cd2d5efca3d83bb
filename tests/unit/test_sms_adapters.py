"""The SMS adapters as pure functions of the provider's answer (httpx.MockTransport, no I/O):
request shapes, how far a failed request got, Retry-After, and codes that classify() decides."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from urllib.parse import parse_qs

import httpx
import pytest

from portal.messaging.sending.backoff import BackoffPolicy, Fail, Retry
from portal.messaging.sending.classify import ErrorCategory, classify
from portal.messaging.sending.outcomes import deferral
from portal.messaging.sending.transports import sms
from portal.messaging.sending.transports.sms import _http, http_json, twilio, vonage
from portal.models import SmsProviderKind

Handler = Callable[[httpx.Request], httpx.Response]

OUT = sms.OutgoingSms(
    record_id=42, to="+447400123456", content="Hello", idempotency_key="postroom-sms-42"
)
TWILIO = sms.ProviderAccount("twilio", "tw", "https://tw.test", "AC1", "token", "+15005550006")
VONAGE = sms.ProviderAccount("vonage", "vo", "https://vo.test", "key", "secret", "Postroom")
GATEWAY = sms.ProviderAccount("http_json", "gw", "https://gw.test/send", None, "s3cret", "Acme")


@pytest.fixture(autouse=True)
def _public_addresses(monkeypatch: pytest.MonkeyPatch) -> None:
    # No I/O: every provider host "resolves" to one public address (requests go to it, with
    # the host name kept as Host).
    monkeypatch.setattr(_http, "RESOLVER", lambda host, port: ["93.184.216.34"])


def host_and_path(request: httpx.Request) -> str:
    """The URL as configured: the host name (Host) and the path the request was sent to."""
    return f"{request.url.scheme}://{request.headers['host']}{request.url.raw_path.decode()}"


def client(handler: Handler) -> httpx.Client:
    return httpx.Client(transport=httpx.MockTransport(handler))


def send(
    account: sms.ProviderAccount, handler: Handler, out: sms.OutgoingSms = OUT
) -> sms.SmsResult:
    with client(handler) as c:
        return sms.send(c, account, out)


def answer(status: int, body: object = None, **headers: str) -> Handler:
    def handle(request: httpx.Request) -> httpx.Response:
        if isinstance(body, bytes):
            return httpx.Response(status, content=body, headers=headers)
        return httpx.Response(status, json=body, headers=headers)

    return handle


def raising(exc: Exception) -> Handler:
    def handle(request: httpx.Request) -> httpx.Response:
        raise exc

    return handle


# --- the tables ----------------------------------------------------------------------------

CATEGORIES = {
    sms.SmsErrorCode.INVALID_RECIPIENT: ErrorCategory.INVALID_INPUT,
    sms.SmsErrorCode.INVALID_REQUEST: ErrorCategory.INVALID_INPUT,
    sms.SmsErrorCode.RECIPIENT_REFUSED: ErrorCategory.PERMANENT,
    sms.SmsErrorCode.AUTH_FAILED: ErrorCategory.AUTH,
    sms.SmsErrorCode.ACCOUNT_SUSPENDED: ErrorCategory.AUTH,
    sms.SmsErrorCode.SENDER_REJECTED: ErrorCategory.CONFIG,
    sms.SmsErrorCode.THROTTLED: ErrorCategory.QUOTA,
    sms.SmsErrorCode.CREDIT_EXHAUSTED: ErrorCategory.QUOTA,
    sms.SmsErrorCode.PROVIDER_ERROR: ErrorCategory.TRANSIENT,
}


def test_every_sms_code_has_the_category_it_is_named_for() -> None:
    assert set(CATEGORIES) == set(sms.SmsErrorCode)
    for code, category in CATEGORIES.items():
        # Whatever the provider's message says: the code decides.
        assert classify(code.value, "please try again later") is category, code


@pytest.mark.parametrize("table", [twilio.CODES, vonage.CODES, http_json.CODES])
def test_adapter_tables_map_onto_our_codes_only(table: dict[str, str]) -> None:
    assert set(table.values()) <= {c.value for c in sms.SmsErrorCode}


def test_there_is_an_adapter_for_every_provider_kind() -> None:
    assert set(sms.ADAPTERS) == {k.value for k in SmsProviderKind}


def test_an_unknown_kind_is_a_config_error() -> None:
    account = sms.ProviderAccount("carrier-pigeon", "x", None, None, None, None)
    result = send(account, answer(200, {}))
    assert (result.accepted, result.code) == (False, "CONFIG_ERROR")
    assert classify(result.code, result.message) is ErrorCategory.CONFIG


# --- how far a failed request got --------------------------------------------------------

REQUEST = httpx.Request("POST", "https://gw.test/send")


@pytest.mark.parametrize(
    ("exc", "code", "ambiguous"),
    [
        (httpx.ConnectError("refused", request=REQUEST), "NETWORK_ERROR", False),
        (httpx.ConnectTimeout("slow", request=REQUEST), "TIMEOUT", False),
        (httpx.WriteTimeout("slow", request=REQUEST), "TIMEOUT", False),
        (httpx.PoolTimeout("busy", request=REQUEST), "TIMEOUT", False),
        (httpx.WriteError("reset", request=REQUEST), "NETWORK_ERROR", False),
        (httpx.ReadTimeout("no answer", request=REQUEST), "TIMEOUT", True),
        (httpx.ReadError("reset", request=REQUEST), "NETWORK_ERROR", True),
        (httpx.RemoteProtocolError("disconnected", request=REQUEST), "NETWORK_ERROR", True),
    ],
)
def test_failures_after_the_request_was_written_are_ambiguous(
    exc: Exception, code: str, ambiguous: bool
) -> None:
    for account in (TWILIO, VONAGE, GATEWAY):
        result = send(account, raising(exc))
        assert (result.accepted, result.code, result.ambiguous) == (False, code, ambiguous)
        assert classify(result.code, result.message) is ErrorCategory.TRANSIENT
        assert ("may have accepted" in (result.message or "")) is ambiguous


def test_an_unusable_base_url_is_a_config_error() -> None:
    account = sms.ProviderAccount("http_json", "gw", "ftp://gw.test/", None, "s", None)
    with httpx.Client() as real:  # the scheme is refused before any I/O
        result = sms.send(real, account, OUT)
    assert (result.code, result.ambiguous) == ("CONFIG_ERROR", False)


# --- Retry-After and statuses --------------------------------------------------------------


def test_retry_after_in_seconds_or_as_an_http_date() -> None:
    now = datetime(2025, 1, 1, 12, 0, tzinfo=UTC)

    def parsed(value: str) -> float | None:
        return _http.retry_after_s(httpx.Response(429, headers={"Retry-After": value}), now=now)

    assert parsed("120") == 120.0
    assert parsed(format_datetime(now + timedelta(seconds=90), usegmt=True)) == 90.0
    assert parsed(format_datetime(now - timedelta(seconds=90), usegmt=True)) == 0.0
    assert parsed("soon") is None
    assert parsed("inf") is None
    assert _http.retry_after_s(httpx.Response(429)) is None


@pytest.mark.parametrize(
    ("status", "code", "category"),
    [
        (401, "HTTP_401", ErrorCategory.AUTH),
        (403, "HTTP_403", ErrorCategory.AUTH),
        (408, "HTTP_408", ErrorCategory.TRANSIENT),
        (425, "HTTP_425", ErrorCategory.TRANSIENT),
        (429, "HTTP_429", ErrorCategory.QUOTA),
        (500, "HTTP_500", ErrorCategory.TRANSIENT),
        (503, "HTTP_503", ErrorCategory.TRANSIENT),
        (400, "SMS_INVALID_RECIPIENT", ErrorCategory.INVALID_INPUT),  # by the provider's code
    ],
)
def test_the_status_decides_except_for_other_4xx(
    status: int, code: str, category: ErrorCategory
) -> None:
    body = {"code": 21211, "message": "Invalid 'To' Phone Number", "status": status}
    result = send(TWILIO, answer(status, body, **{"Retry-After": "7"}))
    assert (result.code, result.retry_after_s) == (code, 7.0)
    assert "Twilio (tw) 21211: Invalid 'To' Phone Number" in (result.message or "")
    assert classify(result.code, result.message) is category


def test_a_body_that_is_not_understood_gives_the_http_status() -> None:
    result = send(TWILIO, answer(404, b"<html>Not Found</html>"))
    assert result.code == "HTTP_404"
    assert "<html>" not in (result.message or "")  # a body in no provider's format: not shown


# --- Twilio --------------------------------------------------------------------------------


def test_twilio_posts_a_form_with_basic_auth() -> None:
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(201, json={"sid": "SM1", "status": "queued"})

    result = send(TWILIO, handle)
    assert (result.accepted, result.provider_message_id) == (True, "SM1")
    (request,) = seen
    assert host_and_path(request) == "https://tw.test/2010-04-01/Accounts/AC1/Messages.json"
    assert request.headers["authorization"] == "Basic " + base64.b64encode(b"AC1:token").decode()
    form = {k: v[0] for k, v in parse_qs(request.content.decode()).items()}
    assert form == {"To": "+447400123456", "From": "+15005550006", "Body": "Hello"}
    assert "idempotency-key" not in request.headers


def test_twilio_messaging_service_and_content_template() -> None:
    seen: list[dict[str, str]] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append({k: v[0] for k, v in parse_qs(request.content.decode()).items()})
        return httpx.Response(201, json={"sid": "SM2"})

    account = sms.ProviderAccount("twilio", "tw", None, "AC1", "t", "MG123")
    templated = sms.OutgoingSms(42, "+1202", "ignored", "k", "HX9", None, {"1": "4711"})
    send(account, handle, templated)
    assert seen == [
        {
            "To": "+1202",
            "MessagingServiceSid": "MG123",
            "ContentSid": "HX9",
            "ContentVariables": '{"1": "4711"}',
        }
    ]


def test_twilio_defaults_to_its_production_url_and_needs_credentials() -> None:
    urls: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        urls.append(host_and_path(request))
        return httpx.Response(201, json={"sid": "SM3"})

    send(sms.ProviderAccount("twilio", "tw", "", "AC1", "t", "+1"), handle)
    assert urls == ["https://api.twilio.com/2010-04-01/Accounts/AC1/Messages.json"]
    no_token = sms.ProviderAccount("twilio", "tw", None, "AC1", None, "+1")
    assert send(no_token, handle).code == "CONFIG_ERROR"
    assert len(urls) == 1


# --- Vonage --------------------------------------------------------------------------------


def test_vonage_posts_the_key_and_the_client_ref() -> None:
    seen: list[dict[str, str]] = []

    def handle(request: httpx.Request) -> httpx.Response:
        assert host_and_path(request) == "https://vo.test/sms/json"
        seen.append({k: v[0] for k, v in parse_qs(request.content.decode()).items()})
        return httpx.Response(
            200, json={"message-count": "1", "messages": [{"status": "0", "message-id": "0C1"}]}
        )

    result = send(VONAGE, handle)
    assert (result.accepted, result.provider_message_id) == (True, "0C1")
    assert seen == [
        {
            "api_key": "key",
            "api_secret": "secret",
            "from": "Postroom",
            "to": "447400123456",
            "text": "Hello",
            "client-ref": "postroom-sms-42",
        }
    ]


def test_vonage_unicode_only_when_needed() -> None:
    assert vonage.is_gsm("Hello {name} @ £5 ÄÖÜ €")
    assert not vonage.is_gsm("Grüße ✓")
    assert not vonage.is_gsm("你好")


def test_vonage_a_refused_later_part_is_an_error_naming_the_part() -> None:
    parts = [{"status": "0", "message-id": "A"}, {"status": "7", "error-text": "Number barred"}]
    result = send(VONAGE, answer(200, {"message-count": "2", "messages": parts}))
    assert result.code == "SMS_RECIPIENT_REFUSED"
    assert "part 2 of 2" in (result.message or "")


def test_vonage_an_unreadable_200_may_have_been_accepted() -> None:
    result = send(VONAGE, answer(200, b"<html>ok?</html>"))
    assert (result.accepted, result.ambiguous, result.code) == (False, True, "HTTP_200")


# --- the JSON gateway -------------------------------------------------------------------------


def test_gateway_request_is_signed_over_the_exact_body() -> None:
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(202, json={"id": "g1"})

    out = sms.OutgoingSms(42, "+447400123456", "Hi", "postroom-sms-42", "T1", "Acme", {"a": 1})
    result = send(GATEWAY, handle, out)
    assert (result.accepted, result.provider_message_id) == (True, "g1")
    (request,) = seen
    assert json.loads(request.content) == {
        "to": "+447400123456",
        "from": "Acme",
        "content": "Hi",
        "externalTemplateId": "T1",
        "signature": "Acme",
        "variables": {"a": 1},
        "reference": "postroom-sms-42",
    }
    expected = hmac.new(b"s3cret", request.content, hashlib.sha256).hexdigest()
    assert request.headers["x-postroom-signature"] == expected
    assert request.headers["idempotency-key"] == "postroom-sms-42"
    assert request.headers["content-type"] == "application/json"


@pytest.mark.parametrize(("body", "message_id"), [({"id": "g0"}, "g0"), ({}, None), (b"", None)])
def test_gateway_409_is_an_earlier_accepted_attempt(body: object, message_id: str | None) -> None:
    result = send(GATEWAY, answer(409, body))
    assert (result.accepted, result.duplicate, result.provider_message_id) == (
        True,
        True,
        message_id,
    )


def test_gateway_needs_a_url_and_a_secret() -> None:
    assert send(
        sms.ProviderAccount("http_json", "gw", None, None, "s", None), answer(200)
    ).code == ("CONFIG_ERROR")
    assert send(
        sms.ProviderAccount("http_json", "gw", "https://g", None, None, None), answer(200)
    ).code == ("CONFIG_ERROR")


def test_the_test_provider_needs_no_network() -> None:
    result = send(
        sms.ProviderAccount("test", "t", None, None, None, None), raising(AssertionError())
    )
    assert (result.accepted, result.provider_message_id) == (True, "test-postroom-sms-42")


# --- deferrals --------------------------------------------------------------------------------


def test_a_deferral_waits_for_the_window_uncapped_and_never_dead_letters() -> None:
    policy = BackoffPolicy(max_retries=0, base_s=30, quota_floor_s=300, retry_after_cap_s=3600)
    decision = deferral(policy, ErrorCategory.QUOTA, 9 * 3600.0)
    assert decision == Retry(delay_s=9 * 3600.0)  # the cap is for providers' Retry-After
    floor = deferral(policy, ErrorCategory.QUOTA, 2.0)
    assert floor == Retry(delay_s=300.0)
    transient = deferral(policy, ErrorCategory.TRANSIENT, None)
    assert isinstance(transient, Retry)
    assert 15 <= transient.delay_s <= 45
    assert deferral(policy, ErrorCategory.AUTH, None) == Fail()
