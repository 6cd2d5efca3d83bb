"""Every surface that shows or acts on a record gives the same verdict: for every error code the
product writes (its marker and deferral codes, and servers' and providers' codes of every error
category), for mail and SMS, for a tenant's send and a platform send, in a configuration that
makes "would fail again" true and in one that makes it false, the record page's panel, its
single Retry (the POST), bulk retry's plan, the operator API's bulk retry and the API's record
GET all answer the same reason (or none).

Records are written directly in the state the delivery loop leaves them in (their error code,
status, prepared or not), beside the configuration of their tier; the verdict is read from
each surface as a person or a machine would read it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis
from flask import Flask
from sqlalchemy import select, update

from portal.extensions import db
from portal.messaging.after_send import suppression
from portal.messaging.records.diagnosis.reasons import Reason
from portal.messaging.sending.classify import DeferralCode, ErrorCategory, MarkerCode, classify
from portal.messaging.sending.quota import current_month
from portal.models import (
    BreakerState,
    MailSendRecipient,
    MailSendRecord,
    MailSendServerConfig,
    MailTemplate,
    SmsProviderConfig,
    SmsSendRecord,
    SmsTemplate,
    SmsTemplateProviderBinding,
    TenantMessageQuota,
    TenantMessageUsage,
)
from portal.tenancy import PLATFORM_TENANT_ID
from tests.conftest import make_api_key, make_tenant
from tests.integration.test_portal_records import HX, cheap_passwords, signed_in, user
from tests.support import sweeps

__all__ = ["cheap_passwords"]

ADMIN = "admin@acme.example.com"
NUMBER, COUNTRY = "+33612345678", "FR"
ADDRESS = "ann@example.com"
RETRYABLE = ("Pending", "Retry", "Failed", "DeadLetter")

# The configurations a case is built in, each a cause the diagnosis reads.
CLEAR = "clear"  # the tier configured to send it
DOWN = "down"  # its server's or provider's breaker open
QUOTA = "quota full"  # the tier's monthly quota used up
NO_TEMPLATE = "no template"  # the template it names does not exist
BLANK = "blank template"  # the template it names renders nothing
NO_DEFAULT = "no default"  # mail: no default server in the tier
NO_BINDING = "no binding"  # SMS: its template bound for another country only
SUPPRESSED = "suppressed"  # its recipient on the tenant's suppression list
SAVED = "saved since"  # its server or provider saved after the failure
EXPIRED = "expired"  # past its expiry


@dataclass(frozen=True)
class Case:
    """A record carrying ``code`` in ``status``, in configuration ``setup``: the reason every
    surface must give (None: nothing found that stops a retry)."""

    code: str
    status: str
    setup: str
    expected: Reason | None
    fresh: bool = False  # not prepared yet (preparation's markers)
    template: str | None = None  # the template code it names
    fields: dict[str, Any] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.code}-{self.status}-{self.setup}"


def _both_ways(code: str, status: str, **kw: Any) -> list[Case]:
    """A code whose verdict is the server's state: down, or not."""
    return [
        Case(code, status, DOWN, Reason.SERVER_DOWN, **kw),
        Case(code, status, CLEAR, None, **kw),
    ]


def _marker_cases(channel: str) -> list[Case]:
    config_blocked = (
        Case("CONFIG_NOT_RESOLVABLE", "Failed", NO_DEFAULT, Reason.NO_ROUTE, fresh=True)
        if channel == "mail"
        else Case(
            "CONFIG_NOT_RESOLVABLE",
            "Failed",
            NO_BINDING,
            Reason.NO_BINDING,
            fresh=True,
            template="otp",
        )
    )
    template = "welcome" if channel == "mail" else "otp"
    return [
        Case("TEMPLATE_NOT_RESOLVABLE", "Failed", NO_TEMPLATE, Reason.NO_TEMPLATE, True, "gone"),
        Case("TEMPLATE_NOT_RESOLVABLE", "Failed", CLEAR, None, True, template),
        config_blocked,
        Case("CONFIG_NOT_RESOLVABLE", "Failed", CLEAR, None, fresh=True, template=template),
        Case("MONTHLY_QUOTA_EXCEEDED", "Failed", QUOTA, Reason.QUOTA_FULL, fresh=True),
        Case("MONTHLY_QUOTA_EXCEEDED", "Failed", CLEAR, None, fresh=True),
        Case("CONTENT_INVALID", "Failed", BLANK, Reason.CONTENT_INVALID, True, "blank"),
        Case("CONTENT_INVALID", "Failed", CLEAR, None, fresh=True, template=template),
        *_both_ways("QUOTA_EXCEEDED", "Retry"),
        *_both_ways("RATE_LIMIT_UNAVAILABLE", "Retry"),
        *_both_ways("ZOMBIE_RECOVERED", "Retry"),
        *_both_ways("ZOMBIE_EXHAUSTED", "DeadLetter"),
        Case("EXPIRED", "Failed", EXPIRED, Reason.EXPIRED),
        Case("EXPIRED", "Failed", CLEAR, None),
        *_both_ways("RETRY_WINDOW_EXPIRED", "Failed"),
        Case("SUPPRESSED", "Suppressed", SUPPRESSED, Reason.SUPPRESSED, fresh=True),
        Case("SUPPRESSED", "Suppressed", CLEAR, None, fresh=True),
        *_both_ways(
            "RESOLVED_FAILED",
            "Failed",
            fields={"ambiguous_attempt": True, "resolution": "failed"},
        ),
        *_both_ways("SERVER_UNAVAILABLE", "Retry"),
        *_both_ways("SERVER_BUSY", "Retry"),
    ]


def _refusal(code: str) -> list[Case]:
    return [
        Case(code, "Failed", SUPPRESSED, Reason.SUPPRESSED),
        Case(code, "Failed", CLEAR, Reason.RECIPIENT_REFUSED),
    ]


def _until_saved(code: str, reason: Reason) -> list[Case]:
    return [Case(code, "Failed", CLEAR, reason), Case(code, "Failed", SAVED, None)]


ANSWERS = {
    "mail": [
        *_both_ways("451 4.3.0", "Retry"),  # TRANSIENT
        *_both_ways("NETWORK_ERROR", "DeadLetter"),  # TRANSIENT, no answer
        *_both_ways("TIMEOUT", "DeadLetter"),
        *_both_ways("DATABASE_ERROR", "Retry"),  # UNKNOWN
        *_refusal("550 5.1.1"),  # PERMANENT
        *_until_saved("552 5.3.4", Reason.MESSAGE_REFUSED),  # INVALID_INPUT
        *_until_saved("INVALID_INPUT", Reason.MESSAGE_REFUSED),
        *_until_saved("535 5.7.8", Reason.CREDENTIALS_REFUSED),  # AUTH
        *_until_saved("CONFIG_ERROR", Reason.SERVER_MISCONFIGURED),  # CONFIG
    ],
    "sms": [
        *_both_ways("HTTP_503", "Retry"),  # TRANSIENT
        *_both_ways("NETWORK_ERROR", "DeadLetter"),
        *_both_ways("SMS_PROVIDER_ERROR", "DeadLetter"),
        *_both_ways("SMS_THROTTLED", "Retry"),  # QUOTA
        *_both_ways("SMS_CREDIT_EXHAUSTED", "DeadLetter"),
        *_both_ways("DATABASE_ERROR", "Retry"),  # UNKNOWN
        *_refusal("SMS_RECIPIENT_REFUSED"),  # PERMANENT
        *_refusal("SMS_INVALID_RECIPIENT"),  # INVALID_INPUT, about the number
        *_until_saved("SMS_INVALID_REQUEST", Reason.MESSAGE_REFUSED),
        *_until_saved("SMS_AUTH_FAILED", Reason.CREDENTIALS_REFUSED),  # AUTH
        *_until_saved("SMS_ACCOUNT_SUSPENDED", Reason.CREDENTIALS_REFUSED),
        *_until_saved("SMS_SENDER_REJECTED", Reason.SERVER_MISCONFIGURED),  # CONFIG
    ],
}
CASES = {channel: _marker_cases(channel) + ANSWERS[channel] for channel in ("mail", "sms")}


def test_the_matrix_covers_every_code_the_product_writes() -> None:
    for channel, cases in CASES.items():
        codes = {case.code for case in cases}
        assert {m.value for m in MarkerCode} <= codes, channel
        assert {d.value for d in DeferralCode} <= codes, channel
        assert {classify(c, None) for c in codes} == set(ErrorCategory), channel
        for code in codes:  # each code both ways where its configuration can decide
            assert len([c for c in cases if c.code == code]) == 2, code


# --- the world a case is built in ----------------------------------------------------------------


@dataclass
class World:
    acme: int
    tier: int
    scope: str
    server: MailSendServerConfig
    provider: SmsProviderConfig
    key: dict[str, str]


def build_world(tier_name: str) -> World:
    acme = make_tenant("acme").id
    db.session.commit()
    tier = acme if tier_name == "tenant" else PLATFORM_TENANT_ID
    server = MailSendServerConfig(
        tenant_id=tier,
        name="main",
        host="127.0.0.1",
        port=25,
        security="plain",
        from_address="news@acme.test",
        is_default=True,
    )
    provider = SmsProviderConfig(tenant_id=tier, name="main", provider="twilio", is_default=True)
    db.session.add_all([server, provider])
    db.session.flush()
    db.session.add(MailTemplate(tenant_id=tier, code="welcome", subject="Hi", text_body="Hello"))
    db.session.add(MailTemplate(tenant_id=tier, code="blank", subject="Hi", text_body="  "))
    otp = SmsTemplate(tenant_id=tier, code="otp", name="otp", content="Code {{ code }}")
    blank = SmsTemplate(tenant_id=tier, code="blank", name="blank", content="  ")
    db.session.add_all([otp, blank])
    db.session.flush()
    db.session.add(
        SmsTemplateProviderBinding(
            tenant_id=tier, template_id=otp.id, provider_id=provider.id, country_code=COUNTRY
        )
    )
    key = make_api_key(acme)
    db.session.commit()
    user(ADMIN, "tenant_admin", acme)
    return World(
        acme,
        tier,
        "TENANT" if tier_name == "tenant" else "PLATFORM",
        server,
        provider,
        {"Authorization": f"Bearer {key}"},
    )


def configure(world: World, channel: str, setup: str) -> None:
    """The tier's configuration for ``setup`` (before the records are written)."""
    if setup == QUOTA:
        db.session.add(
            TenantMessageQuota(tenant_id=world.tier, mail_monthly_limit=1, sms_monthly_limit=1)
        )
        db.session.add(
            TenantMessageUsage(
                tenant_id=world.tier, month=current_month(), mail_count=1, sms_count=1
            )
        )
    elif setup == NO_DEFAULT:
        world.server.is_default = False
    elif setup == NO_BINDING:
        db.session.execute(
            update(SmsTemplateProviderBinding).values(country_code="GB")
        )  # bound for another country only
    elif setup == DOWN:
        config_id = world.server.id if channel == "mail" else world.provider.id
        db.session.add(
            BreakerState(
                channel=channel,
                config_id=config_id,
                down_since=datetime.now(UTC) - timedelta(minutes=3),
                last_error="NETWORK_ERROR connect: [Errno 111] Connection refused",
                interval_s=30.0,
                streak=[],
            )
        )
    elif setup == SUPPRESSED:
        recipient = ADDRESS if channel == "mail" else NUMBER
        suppression.suppress(db.session(), world.acme, channel, recipient, "hard_bounce")
    db.session.commit()


def make_record(world: World, channel: str, case: Case) -> int:
    """A record as the delivery loop leaves it with ``case.code``."""
    values: dict[str, Any] = {
        "tenant_id": world.acme,
        "scope": world.scope,
        "status": case.status,
        "error_code": case.code,
        "error_message": f"{case.code}: as the other side said it",
        "retry_count": 5 if case.status == "DeadLetter" else 1,
        "next_retry_at": datetime.now(UTC) + timedelta(hours=1) if case.status == "Retry" else None,
        "template_code": case.template,
        "expires_at": datetime.now(UTC) + timedelta(days=1 if case.setup != EXPIRED else -1),
    } | case.fields
    if not case.fresh:
        values["prepared_at"] = datetime.now(UTC) - timedelta(minutes=1)
    record: MailSendRecord | SmsSendRecord
    if channel == "mail":
        if case.template is None:
            values |= {"subject": "Hi", "text_body": "Hello"}
        if not case.fresh:
            values |= {
                "server_config_id": world.server.id,
                "rendered_subject": "Hi",
                "rendered_text": "Hello",
            }
        record = MailSendRecord(to_addrs=[ADDRESS], **values)
    else:
        if case.template is None:
            values["content"] = "Your code is 1234"
        else:
            values["variables"] = {"code": "1234"}
        if not case.fresh:
            values |= {
                "provider_config_id": world.provider.id,
                "provider_kind": "twilio",
                "rendered_content": "Your code is 1234",
            }
        record = SmsSendRecord(phone_number=NUMBER, country_code=COUNTRY, **values)
    db.session.add(record)
    db.session.flush()
    if isinstance(record, MailSendRecord):
        db.session.add(
            MailSendRecipient(record_id=record.id, tenant_id=world.acme, address=ADDRESS, kind="to")
        )
    db.session.commit()
    if case.setup == SAVED:
        # Its server or provider saved (someone changed it) after the failure.
        model: Any = MailSendServerConfig if channel == "mail" else SmsProviderConfig
        config_id = world.server.id if channel == "mail" else world.provider.id
        db.session.execute(
            update(model)
            .where(model.id == config_id)
            .values(updated_time=datetime.now(UTC) + timedelta(minutes=1))
        )
        db.session.commit()
    return record.id


# --- reading the verdict off each surface ---------------------------------------------------------

_PANEL = re.compile(
    r'id="diagnosis-verdict"><strong>Sending it again now would fail the same way</strong> '
    r'<span class="mono">(\w+)</span>'
)
_ANYWAY = re.compile(r'name="anyway" value="(\w+)"')
_PLAN = re.compile(r"<strong>1 (\w+)</strong> \(")


def panel(client: Any, channel: str, record_id: int) -> Reason | None:
    page = client.get(f"/{channel}-records/{record_id}")
    assert page.status_code == 200
    found = _PANEL.search(page.text)
    return Reason(found.group(1)) if found else None


def api_get(app: Flask, world: World, channel: str, record_id: int) -> tuple[Reason | None, str]:
    answer = app.test_client().get(f"/api/v1/{channel}/{record_id}", headers=world.key)
    assert answer.status_code == 200, answer.json
    verdict = answer.json["diagnosis"]["wouldFailAgain"]
    assert verdict["value"] is (verdict["reason"] is not None)
    who = answer.json["diagnosis"]["who"]
    return (Reason(verdict["reason"]) if verdict["reason"] else None), who


def bulk_plan(client: Any, token: str, channel: str, record_id: int) -> Reason | str | None:
    """The plan's reason; the status's own refusal (a string) when it is not retryable."""
    plan = client.post(
        f"/{channel}-records/retry",
        data={"ids": [str(record_id)], "scope": "selected"},
        headers=HX | {"X-CSRFToken": token},
    )
    assert plan.status_code == 200, plan.text
    found = _PLAN.search(plan.text)
    if found:
        return Reason(found.group(1))
    if "Skipped, " in plan.text:
        return "not retryable"
    assert "<strong>1</strong> will be requeued" in plan.text, plan.text
    return None


def operator_api(app: Flask, world: World, channel: str, record_id: int) -> Reason | str | None:
    kind = "MailSendRecord" if channel == "mail" else "SmsSendRecord"
    answer = app.test_client().post(
        f"/{kind}/retryByIds", json={"ids": [record_id]}, headers=world.key
    )
    assert answer.status_code == 200, answer.json
    body = answer.json
    if body["skipped"]:
        [skipped] = body["skipped"]
        return Reason.EXPIRED if "expired" in skipped["reason"] else "not retryable"
    return Reason(body["wouldFailAgain"][0]["reasonCode"]) if body["wouldFailAgain"] else None


def single_retry(client: Any, token: str, channel: str, record_id: int) -> Reason | str | None:
    """What pressing Retry does: the confirm page naming the reason, or a requeue."""
    pressed = client.post(f"/{channel}-records/{record_id}/retry", data={"csrf_token": token})
    if pressed.status_code == 302:
        db.session.expire_all()
        model: Any = MailSendRecord if channel == "mail" else SmsSendRecord
        status = db.session.scalar(select(model.status).where(model.id == record_id))
        return None if status == "Retry" else "not retryable"
    assert pressed.status_code == 200, pressed.text
    found = _ANYWAY.search(pressed.text)
    if found:
        return Reason(found.group(1))
    if 'name="expiresAt"' in pressed.text:
        return Reason.EXPIRED
    assert "delivered twice" in pressed.text  # it asks for the risk of a duplicate only
    return None


# Who can act on each reason: the tier's admin for its configuration, an operator for quotas.
_TIER_ADMIN = {
    Reason.NO_TEMPLATE,
    Reason.CONTENT_INVALID,
    Reason.NO_ROUTE,
    Reason.NO_BINDING,
    Reason.SERVER_DOWN,
    Reason.MESSAGE_REFUSED,
    Reason.CREDENTIALS_REFUSED,
    Reason.SERVER_MISCONFIGURED,
}


def expected_who(reason: Reason | None, tier: int) -> str | None:
    if reason in _TIER_ADMIN:
        return "platform_operator" if tier == PLATFORM_TENANT_ID else "tenant_admin"
    return {
        Reason.QUOTA_FULL: "platform_operator",
        Reason.SUPPRESSED: "tenant_admin",
        Reason.RECIPIENT_REFUSED: "tenant_admin",
        Reason.EXPIRED: "support",
    }.get(reason)  # type: ignore[arg-type]


@pytest.mark.long
@pytest.mark.parametrize("tier", ["tenant", "platform"])
@pytest.mark.parametrize("channel", ["mail", "sms"])
def test_every_surface_gives_the_same_verdict(
    app: Flask, redis_client: redis.Redis, cheap_passwords: None, channel: str, tier: str
) -> None:
    world = build_world(tier)
    client, token = signed_in(app, ADMIN)
    mismatches = []
    # A quick run (make check) tries each case once, in one tier or the other; a full run in
    # both tiers.
    for case in sweeps.share(CASES[channel], ["tenant", "platform"].index(tier), 2):
        # Each case in a configuration of its own: undone before the next.
        configure(world, channel, case.setup)
        record_id = make_record(world, channel, case)
        twin = make_record(world, channel, case)  # the operator API's (it requeues)
        retryable = case.status in RETRYABLE
        api, who = api_get(app, world, channel, record_id)
        seen = {
            "panel": panel(client, channel, record_id),
            "api": api,
            "plan": bulk_plan(client, token, channel, record_id),
            "operator api": operator_api(app, world, channel, twin),
            "retry": single_retry(client, token, channel, record_id),
        }
        wanted: dict[str, Reason | str | None] = {
            "panel": case.expected,
            "api": case.expected,
            "plan": case.expected if retryable else "not retryable",
            "operator api": case.expected if retryable else "not retryable",
            "retry": case.expected if retryable else "not retryable",
        }
        if seen != wanted:
            mismatches.append((case.id, seen))
        if expected_who(case.expected, world.tier) not in (None, who):
            mismatches.append((case.id, {"who": who}))
        undo(world)
    assert mismatches == [], mismatches


def undo(world: World) -> None:
    """Back to the configured tier, with no records: the next case starts clean."""
    for model in (MailSendRecipient, MailSendRecord, SmsSendRecord, BreakerState):
        db.session.execute(model.__table__.delete())
    for model in (TenantMessageQuota, TenantMessageUsage):
        db.session.execute(model.__table__.delete())
    db.session.execute(suppression_table().delete())
    world.server.is_default = True
    db.session.execute(update(SmsTemplateProviderBinding).values(country_code=COUNTRY))
    db.session.execute(
        update(MailSendServerConfig).values(updated_time=datetime.now(UTC) - timedelta(hours=1))
    )
    db.session.execute(
        update(SmsProviderConfig).values(updated_time=datetime.now(UTC) - timedelta(hours=1))
    )
    db.session.commit()


def suppression_table() -> Any:
    from portal.models import Suppression

    return Suppression.__table__
