"""The SMS channel against real PostgreSQL and a real local HTTP server playing the providers:
seed 001's SMS test points (routing, bindings, frozen values), and each provider's documented
answers through the real adapters (seed 002: idempotency key, Retry-After, duplicate keys)."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import socket
from collections.abc import Iterator
from datetime import timedelta

import pytest
from flask import Flask
from prometheus_client import REGISTRY
from sqlalchemy import func, select, update

from portal.extensions import db
from portal.messaging.records.retry import retry_records
from portal.messaging.records.validation import AcceptanceError
from portal.messaging.sending.backoff import BackoffPolicy
from portal.models import (
    DeadLetterMessage,
    SmsProviderConfig,
    SmsSendRecord,
    SmsTemplate,
    TenantMessageQuota,
    TenantMessageUsage,
)
from portal.tenancy import PLATFORM_TENANT_ID
from tests.support import sms_provider as fake
from tests.support.delivery import tenant
from tests.support.sms import (
    FR,
    UK,
    US,
    accept_sms,
    binding,
    drain_sms,
    provider,
    route,
    sms_record,
    sms_template,
)
from tests.support.sms_provider import FakeSmsProvider

FAST = BackoffPolicy(max_retries=5, base_s=0.02, quota_floor_s=0.05, retry_after_cap_s=30.0)
SHORT_READ = 0.3  # s: a "hang" answer times out quickly


@pytest.fixture
def server() -> Iterator[FakeSmsProvider]:
    with FakeSmsProvider(hang_s=2.0) as running:
        yield running


@pytest.fixture
def acme(app: Flask) -> int:
    row = tenant("acme")
    db.session.commit()
    return row.id


def seconds_until_retry(row: SmsSendRecord) -> float:
    assert row.next_retry_at is not None
    return (row.next_retry_at - row.updated_time) / timedelta(seconds=1)


def sent_count(provider_name: str) -> float:
    value = REGISTRY.get_sample_value(
        "message_sent_total", {"channel": "sms", "provider": provider_name}
    )
    return value or 0.0


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# --- preparation: template, content, quota, frozen values ----------------------------------


def test_sms_is_rendered_signed_sent_and_frozen(
    app: Flask, server: FakeSmsProvider, acme: int
) -> None:
    gateway = provider(acme, "http_json", server, name="gw")
    sms_template(acme, content="Hi {{ name }}, your code is {{ code }}")
    db.session.commit()
    before = sent_count("gw")
    rid = accept_sms(
        app, acme, content=None, templateCode="otp", variables={"name": "Ann", "code": "4711"}
    )
    drain_sms(app)
    row = sms_record(rid)
    assert (row.status, row.version, row.retry_count) == ("Sent", 3, 0)  # claim, prepare, sent
    assert row.rendered_content == "Hi Ann, your code is 4711"
    assert (row.provider_config_id, row.provider_kind) == (gateway.id, "http_json")
    assert row.frozen_variables == {"name": "Ann", "code": "4711"}
    assert row.prepared_at is not None
    (request,) = server.requests
    assert row.provider_message_id == "gw-1"
    assert request.fields == {
        "to": UK,
        "from": "+15005550006",
        "content": "Hi Ann, your code is 4711",
        "externalTemplateId": None,
        "signature": None,
        "variables": {"name": "Ann", "code": "4711"},
        "reference": f"postroom-sms-{rid}",
    }
    # The server checked the signature; check it here too, over the raw bytes it received.
    expected = hmac.new(fake.GATEWAY_SECRET.encode(), request.body, hashlib.sha256).hexdigest()
    assert request.headers["x-postroom-signature"] == expected
    assert request.headers["idempotency-key"] == f"postroom-sms-{rid}"
    assert sent_count("gw") == before + 1
    usage = db.session.execute(
        select(TenantMessageUsage.sms_count, TenantMessageUsage.mail_count).where(
            TenantMessageUsage.tenant_id == acme
        )
    ).one()
    assert tuple(usage) == (1, 0)


def test_a_retry_replays_what_was_prepared_and_charges_once(
    app: Flask, server: FakeSmsProvider, acme: int
) -> None:
    first = provider(acme, "http_json", server, name="first")
    template = sms_template(acme)
    db.session.commit()
    server.script(UK, "server_error")
    rid = accept_sms(app, acme, content=None, templateCode="otp", variables={"code": "1"})
    drain_sms(app, until=lambda: sms_record(rid).status == "Retry", policy=FAST)
    # The template changes and another default provider appears; the record does not change.
    template.content = "changed"
    first.is_default = False
    provider(acme, "twilio", server, name="second")
    db.session.commit()
    drain_sms(app, policy=FAST)
    row = sms_record(rid)
    assert (row.status, row.retry_count, row.version) == ("Sent", 1, 5)
    assert (row.rendered_content, row.provider_config_id) == ("Your code is 1", first.id)
    assert [r.kind for r in server.requests] == ["http_json", "http_json"]
    assert [r.fields["content"] for r in server.requests] == ["Your code is 1"] * 2
    usage = db.session.scalar(
        select(TenantMessageUsage.sms_count).where(TenantMessageUsage.tenant_id == acme)
    )
    assert usage == 1


def test_the_callers_content_wins_over_the_template(
    app: Flask, server: FakeSmsProvider, acme: int
) -> None:
    gateway = provider(acme, "http_json", server)
    template = sms_template(acme)
    binding(template, gateway, external_template_id="T-1", signature="Acme")
    db.session.commit()
    rid = accept_sms(app, acme, content="Given by the caller", templateCode="otp")
    drain_sms(app)
    row = sms_record(rid)
    assert (row.status, row.rendered_content) == ("Sent", "Given by the caller")
    assert (row.external_template_id, row.signature) == ("T-1", "Acme")


@pytest.mark.parametrize(
    ("setup", "code"),
    [
        ("missing_template", "TEMPLATE_NOT_RESOLVABLE"),
        ("disabled_template", "TEMPLATE_NOT_RESOLVABLE"),
        ("broken_template", "TEMPLATE_NOT_RESOLVABLE"),
        ("empty_render", "CONTENT_INVALID"),
        ("quota_used_up", "MONTHLY_QUOTA_EXCEEDED"),
        ("no_provider", "CONFIG_NOT_RESOLVABLE"),
    ],
)
def test_preparation_failures_fail_with_their_marker_then_retry_prepares_afresh(
    app: Flask,
    server: FakeSmsProvider,
    acme: int,
    caplog: pytest.LogCaptureFixture,
    setup: str,
    code: str,
) -> None:
    if setup != "no_provider":
        provider(acme, "http_json", server)
    if setup == "broken_template":
        sms_template(acme, content="{{ code | no_such_filter }}")
    elif setup == "empty_render":
        sms_template(acme, content="{% if nothing %}x{% endif %}  ")
    else:
        sms_template(acme)
    if setup == "quota_used_up":
        db.session.add(TenantMessageQuota(tenant_id=acme, sms_monthly_limit=0))
    db.session.commit()
    rid = accept_sms(app, acme, content=None, templateCode="otp", variables={"code": "9"})
    # An unknown or disabled code is refused at acceptance; a template deleted or
    # disabled after it fails at preparation.
    if setup == "missing_template":
        db.session.execute(SmsTemplate.__table__.delete())
    elif setup == "disabled_template":
        db.session.execute(update(SmsTemplate).values(enabled=False))
    db.session.commit()
    with caplog.at_level(logging.ERROR, logger="portal.delivery"):
        drain_sms(app)
    row = sms_record(rid)
    assert (row.status, row.error_code, row.retry_count) == ("Failed", code, 0)
    assert row.prepared_at is None
    assert row.provider_config_id is None
    errors = [r for r in caplog.records if getattr(r, "record_id", None) == rid]
    assert [(r.levelno, r.error_code) for r in errors] == [(logging.ERROR, code)]  # type: ignore[attr-defined]
    assert server.requests == []
    # Fill the gap, press Retry: prepared afresh and sent.
    if setup == "no_provider":
        provider(acme, "http_json", server)
    elif setup == "quota_used_up":
        db.session.execute(update(TenantMessageQuota).values(sms_monthly_limit=10))
    elif setup == "missing_template":
        sms_template(acme)
    else:
        db.session.execute(update(SmsTemplate).values(content="Code {{ code }}", enabled=True))
    db.session.commit()
    assert retry_records(db.session, SmsSendRecord, [rid], acme).requeued == [rid]
    db.session.commit()
    drain_sms(app)
    row = sms_record(rid)
    assert (row.status, row.retry_count, row.error_code) == ("Sent", 1, None)
    assert len(server.requests) == 1


# --- routing (seed 001: "with a country route, the default provider is not used") -----------


def test_a_country_route_beats_the_default_provider(
    app: Flask, server: FakeSmsProvider, acme: int
) -> None:
    default = provider(acme, "http_json", server, name="default")
    uk_low = provider(acme, "vonage", server, name="uk-low", is_default=False)
    uk_high = provider(acme, "twilio", server, name="uk-high", is_default=False)
    route(uk_low, "GB", priority=20)
    route(uk_high, "GB", priority=10)
    db.session.commit()
    to_uk = accept_sms(app, acme, phoneNumber=UK)
    to_us = accept_sms(app, acme, phoneNumber=US)
    drain_sms(app)
    assert sms_record(to_uk).provider_config_id == uk_high.id  # the route, by priority
    assert sms_record(to_us).provider_config_id == default.id  # no US route: the default
    assert {(r.to, r.kind) for r in server.requests} == {(UK, "twilio"), (US, "http_json")}


def test_a_route_to_a_disabled_provider_counts_as_none(
    app: Flask, server: FakeSmsProvider, acme: int
) -> None:
    default = provider(acme, "http_json", server, name="default")
    route(provider(acme, "twilio", server, name="off", enabled=False, is_default=False), "GB")
    db.session.commit()
    rid = accept_sms(app, acme)
    drain_sms(app)
    assert sms_record(rid).provider_config_id == default.id


def test_neither_a_route_nor_a_default_fails_then_a_route_fixes_it(
    app: Flask, server: FakeSmsProvider, acme: int
) -> None:
    us_only = provider(acme, "http_json", server, name="us-only", is_default=False)
    route(us_only, "US")
    # A platform default exists, but acme has providers of its own and owns its routing.
    provider(PLATFORM_TENANT_ID, "twilio", server, name="platform")
    db.session.commit()
    rid = accept_sms(app, acme, phoneNumber=UK)
    drain_sms(app)
    row = sms_record(rid)
    assert (row.status, row.error_code) == ("Failed", "CONFIG_NOT_RESOLVABLE")
    assert "GB" in (row.error_message or "")
    assert server.requests == []
    route(us_only, "GB")
    db.session.commit()
    retry_records(db.session, SmsSendRecord, [rid], acme)
    db.session.commit()
    drain_sms(app)
    assert (sms_record(rid).status, sms_record(rid).provider_config_id) == ("Sent", us_only.id)


def test_tiers_tenant_without_providers_uses_the_platforms_platform_scope_never_a_tenants(
    app: Flask, server: FakeSmsProvider, acme: int
) -> None:
    globex = tenant("globex").id
    platform = provider(PLATFORM_TENANT_ID, "http_json", server, name="platform")
    own = provider(acme, "twilio", server, name="acme-own")
    sms_template(PLATFORM_TENANT_ID, "shared", content="platform text")
    db.session.commit()
    borrowed = accept_sms(app, globex)  # globex has no provider: the platform's carries it
    owned = accept_sms(app, acme)
    platform_send = accept_sms(app, None, scope="PLATFORM", content=None, templateCode="shared")
    # Not acme's template: refused at acceptance.
    with pytest.raises(AcceptanceError) as hidden:
        accept_sms(app, acme, content=None, templateCode="shared")
    assert (hidden.value.code, hidden.value.field) == ("not_found", "templateCode")
    drain_sms(app)
    assert sms_record(borrowed).provider_config_id == platform.id
    assert sms_record(owned).provider_config_id == own.id
    row = sms_record(platform_send)
    assert (row.status, row.provider_config_id, row.rendered_content) == (
        "Sent",
        platform.id,
        "platform text",
    )
    charged = dict(
        db.session.execute(select(TenantMessageUsage.tenant_id, TenantMessageUsage.sms_count)).all()
    )
    assert charged == {globex: 1, acme: 1, PLATFORM_TENANT_ID: 1}  # the scope's bucket


def test_platform_scope_without_a_platform_provider_fails(
    app: Flask, server: FakeSmsProvider, acme: int
) -> None:
    provider(acme, "http_json", server)
    db.session.commit()
    rid = accept_sms(app, None, scope="PLATFORM")
    drain_sms(app)
    assert (sms_record(rid).status, sms_record(rid).error_code) == (
        "Failed",
        "CONFIG_NOT_RESOLVABLE",
    )


# --- template bindings ------------------------------------------------------------------


def test_the_bindings_external_template_id_and_signature_are_frozen_and_sent(
    app: Flask, server: FakeSmsProvider, acme: int
) -> None:
    gateway = provider(acme, "http_json", server)
    twilio = provider(acme, "twilio", server, is_default=False)
    route(twilio, "US")
    template = sms_template(acme)
    binding(template, gateway, external_template_id="GW-OTP-1", signature="Acme Ltd")
    binding(template, twilio, external_template_id="HX0123456789abcdef", signature="Acme")
    db.session.commit()
    to_uk = accept_sms(app, acme, content=None, templateCode="otp", variables={"code": "42"})
    to_us = accept_sms(
        app, acme, phoneNumber=US, content=None, templateCode="otp", variables={"code": "43"}
    )
    drain_sms(app)
    uk, us = sms_record(to_uk), sms_record(to_us)
    assert (uk.status, uk.external_template_id, uk.signature) == ("Sent", "GW-OTP-1", "Acme Ltd")
    assert (us.status, us.external_template_id, us.signature) == (
        "Sent",
        "HX0123456789abcdef",
        "Acme",
    )
    (gw_request,) = [r for r in server.requests if r.kind == "http_json"]
    assert (gw_request.fields["externalTemplateId"], gw_request.fields["signature"]) == (
        "GW-OTP-1",
        "Acme Ltd",
    )
    assert gw_request.fields["variables"] == {"code": "42"}
    # Twilio renders the bound Content template itself, from the frozen variables.
    (tw_request,) = [r for r in server.requests if r.kind == "twilio"]
    assert tw_request.fields["ContentSid"] == "HX0123456789abcdef"
    assert json.loads(tw_request.fields["ContentVariables"]) == {"code": "43"}
    assert "Body" not in tw_request.fields


def test_an_exact_region_binding_beats_a_generic_one(
    app: Flask, server: FakeSmsProvider, acme: int
) -> None:
    gateway = provider(acme, "http_json", server)
    template = sms_template(acme)
    binding(template, gateway, external_template_id="generic", signature="Generic")
    binding(template, gateway, "GB", external_template_id="uk", signature="UK")
    binding(template, gateway, "FR", external_template_id="fr", signature="FR")
    db.session.commit()
    uk = accept_sms(app, acme, content=None, templateCode="otp", variables={"code": "1"})
    us = accept_sms(
        app, acme, phoneNumber=US, content=None, templateCode="otp", variables={"code": "2"}
    )
    drain_sms(app)
    assert (sms_record(uk).external_template_id, sms_record(uk).signature) == ("uk", "UK")
    assert (sms_record(us).external_template_id, sms_record(us).signature) == (
        "generic",
        "Generic",
    )


def test_the_intersection_skips_unbound_providers_in_priority_order(
    app: Flask, server: FakeSmsProvider, acme: int
) -> None:
    unbound = provider(acme, "twilio", server, name="unbound", is_default=False)
    bound = provider(acme, "http_json", server, name="bound", is_default=False)
    route(unbound, "GB", priority=1)
    route(bound, "GB", priority=2)
    template = sms_template(acme)
    binding(template, bound, external_template_id="B-1")
    db.session.commit()
    rid = accept_sms(app, acme, content=None, templateCode="otp", variables={"code": "1"})
    drain_sms(app)
    row = sms_record(rid)
    assert (row.status, row.provider_config_id, row.external_template_id) == (
        "Sent",
        bound.id,
        "B-1",
    )


def test_an_empty_intersection_fails_naming_the_template_and_the_country(
    app: Flask, server: FakeSmsProvider, acme: int
) -> None:
    gateway = provider(acme, "http_json", server, name="gateway")
    other = provider(acme, "twilio", server, name="other", is_default=False)
    template = sms_template(acme, "welcome")
    binding(template, other, external_template_id="X")  # bound, but not to GB's provider
    binding(template, gateway, "FR", external_template_id="FR-only")  # the wrong country
    db.session.commit()
    rid = accept_sms(app, acme, content=None, templateCode="welcome", variables={"code": "1"})
    fr = accept_sms(
        app, acme, phoneNumber=FR, content=None, templateCode="welcome", variables={"code": "2"}
    )
    drain_sms(app)
    row = sms_record(rid)
    assert (row.status, row.error_code) == ("Failed", "CONFIG_NOT_RESOLVABLE")
    assert "'welcome'" in (row.error_message or "")
    assert "GB" in (row.error_message or "")
    assert (sms_record(fr).status, sms_record(fr).external_template_id) == ("Sent", "FR-only")


# --- each provider's documented answers -------------------------------------------------

# (kind, scripted answer, status, error code, ambiguous)
ANSWERS = [
    # Twilio: JSON errors {"code", "message", "more_info", "status"}.
    ("twilio", "invalid_number", "Failed", "SMS_INVALID_RECIPIENT", False),
    ("twilio", "refused", "Failed", "SMS_RECIPIENT_REFUSED", False),
    ("twilio", "code:21606", "Failed", "SMS_SENDER_REJECTED", False),
    ("twilio", "auth", "Failed", "HTTP_401", False),
    ("twilio", "code:21999", "Retry", "TWILIO_21999", False),  # unknown: the seed retries
    ("twilio", "unreadable", "Retry", "HTTP_400", False),
    ("twilio", "throttled", "Retry", "HTTP_429", False),
    ("twilio", "server_error", "Retry", "HTTP_500", False),
    ("twilio", "hang", "Retry", "TIMEOUT", True),
    ("twilio", "drop", "Retry", "NETWORK_ERROR", True),
    # Vonage: HTTP 200 with a per-message status.
    ("vonage", "invalid_number", "Failed", "SMS_INVALID_RECIPIENT", False),
    ("vonage", "refused", "Failed", "SMS_RECIPIENT_REFUSED", False),
    ("vonage", "auth", "Failed", "SMS_AUTH_FAILED", False),
    ("vonage", "code:3", "Failed", "SMS_INVALID_REQUEST", False),
    ("vonage", "code:8", "Failed", "SMS_ACCOUNT_SUSPENDED", False),
    ("vonage", "code:1", "Retry", "SMS_THROTTLED", False),
    ("vonage", "code:5", "Retry", "SMS_PROVIDER_ERROR", False),
    ("vonage", "code:9", "Retry", "SMS_CREDIT_EXHAUSTED", False),
    ("vonage", "code:99", "Retry", "VONAGE_99", False),
    ("vonage", "throttled", "Retry", "HTTP_429", False),
    ("vonage", "server_error", "Retry", "HTTP_500", False),
    ("vonage", "hang", "Retry", "TIMEOUT", True),
    # The JSON gateway.
    ("http_json", "invalid_number", "Failed", "SMS_INVALID_RECIPIENT", False),
    ("http_json", "refused", "Failed", "SMS_RECIPIENT_REFUSED", False),
    ("http_json", "auth", "Failed", "HTTP_401", False),
    ("http_json", "code:DAILY_LIMIT", "Retry", "DAILY_LIMIT", False),  # QUOTA by keyword
    ("http_json", "throttled", "Retry", "HTTP_429", False),
    ("http_json", "server_error", "Retry", "HTTP_500", False),
    ("http_json", "hang", "Retry", "TIMEOUT", True),
    ("http_json", "drop", "Retry", "NETWORK_ERROR", True),
]


@pytest.mark.parametrize(
    ("kind", "answer", "status", "code", "ambiguous"),
    ANSWERS,
    ids=[f"{a[0]}-{a[1]}" for a in ANSWERS],
)
def test_provider_answers_decide_fail_or_retry(
    app: Flask,
    server: FakeSmsProvider,
    acme: int,
    kind: str,
    answer: str,
    status: str,
    code: str,
    ambiguous: bool,
) -> None:
    provider(acme, kind, server)
    db.session.commit()
    server.script(UK, answer)
    rid = accept_sms(app, acme)
    drain_sms(
        app,
        until=lambda: sms_record(rid).status != "Sending",
        policy=FAST,
        read_timeout_s=SHORT_READ,
    )
    row = sms_record(rid)
    assert (row.status, row.error_code, row.ambiguous_attempt) == (status, code, ambiguous)
    assert row.error_message
    assert len(server.requests) == 1
    if ambiguous:
        assert row.ambiguous_at is not None
        assert row.ambiguous_reason == row.error_message
        assert "may have accepted" in row.error_message
    if status == "Retry":
        assert row.retry_count == 1
        assert row.next_retry_at is not None
    else:
        assert (row.retry_count, row.next_retry_at) == (0, None)


@pytest.mark.parametrize("kind", ["twilio", "vonage", "http_json"])
def test_each_provider_accepts_with_its_message_id(
    app: Flask, server: FakeSmsProvider, acme: int, kind: str
) -> None:
    config = provider(acme, kind, server, name=f"{kind}-main")
    db.session.commit()
    before = sent_count(config.name)
    rid = accept_sms(app, acme, content="Grüße ✓")
    drain_sms(app)
    row = sms_record(rid)
    assert row.status == "Sent"
    (request,) = server.requests
    assert request.answer == "ok"
    expected = {"twilio": "SM" + "0" * 31 + "1", "vonage": "0C00000000000001", "http_json": "gw-1"}
    assert row.provider_message_id == expected[kind]
    assert sent_count(config.name) == before + 1
    if kind == "twilio":
        assert (request.fields["To"], request.fields["From"], request.fields["Body"]) == (
            UK,
            "+15005550006",
            "Grüße ✓",
        )
    if kind == "vonage":
        assert (request.fields["to"], request.fields["text"]) == (UK.lstrip("+"), "Grüße ✓")
        assert request.fields["type"] == "unicode"  # ✓ is not in the GSM alphabet
        assert request.fields["client-ref"] == f"postroom-sms-{rid}"


@pytest.mark.parametrize(
    ("retry_after", "floor", "at_least"),
    # A Retry-After is the wait exactly, even below the floor: "1" waits 1 s.
    [("3", 1.0, 3.0), ("1", 2.0, 1.0), (None, 1.5, 1.5)],
)
def test_429_waits_for_retry_after_and_the_quota_floor(
    app: Flask,
    server: FakeSmsProvider,
    acme: int,
    retry_after: str | None,
    floor: float,
    at_least: float,
) -> None:
    provider(acme, "twilio", server)
    db.session.commit()
    server.script(UK, f"throttled:{retry_after}" if retry_after else "throttled")
    rid = accept_sms(app, acme)
    policy = BackoffPolicy(max_retries=5, base_s=0.01, quota_floor_s=floor, retry_after_cap_s=60)
    drain_sms(app, until=lambda: sms_record(rid).status == "Retry", policy=policy)
    row = sms_record(rid)
    assert (row.error_code, row.retry_count) == ("HTTP_429", 1)
    assert at_least <= seconds_until_retry(row) < at_least + 0.5


def test_every_attempt_carries_the_same_idempotency_key(
    app: Flask, server: FakeSmsProvider, acme: int
) -> None:
    provider(acme, "http_json", server, name="gw")
    vonage = provider(acme, "vonage", server, is_default=False)
    twilio = provider(acme, "twilio", server, is_default=False)
    route(vonage, "US")
    route(twilio, "FR")
    db.session.commit()
    for number in (UK, US, FR):
        server.script(number, "server_error", "drop", "ok")
    ids = {n: accept_sms(app, acme, phoneNumber=n) for n in (UK, US, FR)}
    drain_sms(app, policy=FAST, read_timeout_s=SHORT_READ)
    for number, rid in ids.items():
        row = sms_record(rid)
        assert (row.status, row.retry_count, row.ambiguous_attempt) == ("Sent", 2, True)
        attempts = server.to(number)
        assert [a.answer for a in attempts] == ["server_error", "drop", "ok"]
        assert len({a.body for a in attempts}) == 1  # byte for byte the same request
    gateway = server.to(UK)
    assert {a.headers["idempotency-key"] for a in gateway} == {f"postroom-sms-{ids[UK]}"}
    assert {a.headers["x-postroom-signature"] for a in gateway} == {
        gateway[0].headers["x-postroom-signature"]
    }
    assert {a.key for a in server.to(US)} == {f"postroom-sms-{ids[US]}"}  # Vonage client-ref
    # Twilio honours no key: nothing is sent as one (see the adapter's docstring).
    assert all("idempotency-key" not in a.headers for a in server.to(FR))


def test_a_hang_is_ambiguous_and_the_retry_is_recognised_as_a_duplicate(
    app: Flask, server: FakeSmsProvider, acme: int
) -> None:
    provider(acme, "http_json", server)
    db.session.commit()
    server.script(UK, "hang")
    rid = accept_sms(app, acme)
    drain_sms(
        app, until=lambda: sms_record(rid).status == "Retry", policy=FAST, read_timeout_s=SHORT_READ
    )
    row = sms_record(rid)
    assert (row.error_code, row.ambiguous_attempt, row.retry_count) == ("TIMEOUT", True, 1)
    # The gateway had taken it: the retry's key is known, 409 with the first id -> Sent.
    drain_sms(app, policy=FAST, read_timeout_s=SHORT_READ)
    row = sms_record(rid)
    assert (row.status, row.provider_message_id, row.ambiguous_attempt) == ("Sent", "gw-1", True)
    assert [r.answer for r in server.requests] == ["hang", "duplicate"]
    assert len(server.accepted()) == 1  # delivered once


def test_twilio_has_no_key_so_a_hang_then_retry_is_delivered_twice(
    app: Flask, server: FakeSmsProvider, acme: int
) -> None:
    provider(acme, "twilio", server)
    db.session.commit()
    server.script(UK, "hang")
    rid = accept_sms(app, acme)
    drain_sms(app, policy=FAST, read_timeout_s=SHORT_READ)
    row = sms_record(rid)
    assert (row.status, row.ambiguous_attempt, row.retry_count) == ("Sent", True, 1)
    assert len(server.accepted()) == 2  # the record keeps the ambiguity for the operator


@pytest.mark.parametrize(
    ("answer", "message_id"), [("duplicate", True), ("duplicate_no_id", False)]
)
def test_a_duplicate_key_answer_is_sent_never_a_dead_letter(
    app: Flask, server: FakeSmsProvider, acme: int, answer: str, message_id: bool
) -> None:
    provider(acme, "http_json", server)
    db.session.commit()
    server.script(UK, answer)
    rid = accept_sms(app, acme)
    # Its retries are used up: any failure now would dead-letter it.
    db.session.execute(update(SmsSendRecord).where(SmsSendRecord.id == rid).values(retry_count=5))
    db.session.commit()
    drain_sms(app, policy=FAST)
    row = sms_record(rid)
    assert (row.status, row.retry_count, row.error_code) == ("Sent", 5, None)
    expected = f"gw-earlier-postroom-sms-{rid}" if message_id else None
    assert row.provider_message_id == expected
    assert db.session.scalar(select(func.count()).select_from(DeadLetterMessage)) == 0


def test_a_refused_connection_is_not_ambiguous(app: Flask, acme: int) -> None:
    provider(acme, "http_json", None, base_url=f"http://127.0.0.1:{closed_port()}/gw", secret="s")
    db.session.commit()
    rid = accept_sms(app, acme)
    drain_sms(app, until=lambda: sms_record(rid).status == "Retry", policy=FAST)
    row = sms_record(rid)
    assert (row.error_code, row.ambiguous_attempt, row.ambiguous_at) == (
        "NETWORK_ERROR",
        False,
        None,
    )


def test_temporary_provider_errors_back_off_then_dead_letter(
    app: Flask, server: FakeSmsProvider, acme: int
) -> None:
    provider(acme, "vonage", server, name="vonage-main")
    db.session.commit()
    server.script(UK, *["server_error"] * 6)
    rid = accept_sms(app, acme)
    drain_sms(app, until=lambda: sms_record(rid).status == "DeadLetter", policy=FAST, timeout_s=15)
    row = sms_record(rid)
    assert (row.retry_count, row.error_code) == (5, "HTTP_500")
    (letter,) = db.session.scalars(select(DeadLetterMessage)).all()
    assert (letter.channel, letter.provider, letter.attempts, letter.event_id) == (
        "sms",
        "vonage-main",
        6,
        str(rid),
    )
    assert len(server.requests) == 6


# --- the test provider and configuration at send time -------------------------------------


def test_the_test_provider_sends_nothing_and_marks_sent(
    app: Flask, server: FakeSmsProvider, acme: int
) -> None:
    provider(acme, "test", None, name="sandbox")
    db.session.commit()
    rid = accept_sms(app, acme)
    drain_sms(app)
    row = sms_record(rid)
    assert (row.status, row.provider_kind) == ("Sent", "test")
    assert row.provider_message_id == f"test-postroom-sms-{rid}"
    assert server.requests == []


@pytest.mark.parametrize(
    ("change", "status", "code"),
    [
        ("disable", "Failed", "CONFIG_NOT_RESOLVABLE"),
        ("delete", "Failed", "CONFIG_NOT_RESOLVABLE"),
        ("no_base_url", "Failed", "CONFIG_ERROR"),
        ("wrong_secret", "Failed", "HTTP_401"),
        ("fix", "Sent", None),
    ],
)
def test_the_provider_config_is_read_at_every_send(
    app: Flask, server: FakeSmsProvider, acme: int, change: str, status: str, code: str | None
) -> None:
    config = provider(acme, "http_json", server, base_url=f"http://127.0.0.1:{closed_port()}/")
    db.session.commit()
    rid = accept_sms(app, acme)
    drain_sms(app, until=lambda: sms_record(rid).status == "Retry", policy=FAST)
    found = db.session.get(SmsProviderConfig, config.id)
    assert found is not None
    config = found
    if change == "disable":
        config.enabled = False
    elif change == "delete":
        db.session.delete(config)
    elif change == "no_base_url":
        config.base_url = None
    elif change == "wrong_secret":
        config.base_url = server.gateway_url
        config.secret = "not-the-gateway-secret"
    else:
        config.base_url = server.gateway_url
    db.session.commit()
    drain_sms(app, policy=FAST)
    row = sms_record(rid)
    assert (row.status, row.error_code) == (status, code)
