"""A verdict "it would fail again" is true: for each reason, the record is brought there by the
real delivery path (acceptance, the claim and the pipeline in this process, against the real
SMTP test server or the fake SMS provider), its diagnosis names the reason, a person retries it
anyway from the record page (the confirmation naming that reason), and the next attempt fails
the same way; nothing reaches the recipient, and the audit says it was retried anyway.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis
from flask import Flask
from sqlalchemy import select, update

from portal.extensions import db
from portal.messaging.after_send import suppression
from portal.messaging.records import diagnosis
from portal.messaging.records.diagnosis.reasons import Reason
from portal.messaging.sending.backoff import BackoffPolicy
from portal.models import (
    AuditEvent,
    Channel,
    MailSendRecord,
    MailSendServerConfig,
    MailTemplate,
    SmsSendRecord,
    TenantMessageQuota,
)
from tests.integration.test_portal_records import cheap_passwords, signed_in, user
from tests.support.delivery import accept_mail, drain, mail_server, tenant
from tests.support.sms import FR, accept_sms, binding, drain_sms, provider, sms_template
from tests.support.sms_provider import FakeSmsProvider
from tests.support.smtp_server import ScriptedSmtpServer

__all__ = ["cheap_passwords"]

ADMIN = "admin@acme.example.com"
NO_RETRIES = BackoffPolicy(max_retries=0, base_s=0.01)  # a temporary failure is dead at once


@dataclass
class Scene:
    app: Flask
    acme: int
    smtp: ScriptedSmtpServer
    sms: FakeSmsProvider

    def drain(self, channel: Channel) -> None:
        if channel is Channel.MAIL:
            drain(self.app, policy=NO_RETRIES)
        else:
            drain_sms(self.app, policy=NO_RETRIES)


@pytest.fixture
def scene(
    app: Flask, smtp: ScriptedSmtpServer, redis_client: redis.Redis, cheap_passwords: None
) -> Iterator[Scene]:
    acme = tenant("acme").id
    db.session.commit()
    user(ADMIN, "tenant_admin", acme)
    with FakeSmsProvider() as sms:
        yield Scene(app, acme, smtp, sms)


def closed_port() -> int:
    """A local port nothing listens on: every connection to it is refused."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _server(scene: Scene, **fields: Any) -> MailSendServerConfig:
    server = mail_server(scene.acme, scene.smtp, **fields)
    db.session.commit()
    return server


def _template(scene: Scene, code: str, **fields: Any) -> None:
    values = {"subject": "Hello", "text_body": "Hi {{ name }}"} | fields
    db.session.add(MailTemplate(tenant_id=scene.acme, code=code, **values))
    db.session.commit()


def _pending_mail(scene: Scene, **fields: Any) -> int:
    """A mail written as acceptance writes it, for a state acceptance itself would refuse."""
    values: dict[str, Any] = {
        "tenant_id": scene.acme,
        "status": "Pending",
        "to_addrs": ["ann@example.com"],
        "variables": {},
    } | fields
    record = MailSendRecord(**values)
    db.session.add(record)
    db.session.commit()
    return record.id


# --- one way into each reason ----------------------------------------------------------------
# Each returns the record, failed by the real pipeline in the state whose verdict is the reason.


def refused(scene: Scene) -> int:
    _server(scene)
    scene.smtp.script("ann@example.com", "550 5.1.1 no such user", stage="rcpt")
    return accept_mail(scene.app, scene.acme)


def refused_not_suppressed(scene: Scene) -> int:
    record = refused(scene)
    scene.drain(Channel.MAIL)
    # A person took the address off the list: the refusal itself is what remains.
    assert suppression.unsuppress(
        db.session(), scene.acme, "mail", "ann@example.com", by=ADMIN, reason="says it works"
    )
    db.session.commit()
    return record


def no_template(scene: Scene) -> int:
    _server(scene)
    return _pending_mail(scene, template_code="gone", subject=None)


def disabled_template(scene: Scene) -> int:
    _server(scene)
    _template(scene, "welcome")
    record = accept_mail(scene.app, scene.acme, templateCode="welcome", variables={"name": "Ann"})
    db.session.execute(update(MailTemplate).values(enabled=False))
    db.session.commit()
    return record


def broken_template(scene: Scene) -> int:
    _server(scene)
    _template(scene, "strict", strict_variables=True)  # needs a name the request lacks
    return _pending_mail(scene, template_code="strict", subject=None)


def blank_template(scene: Scene) -> int:
    _server(scene)
    _template(scene, "blank", text_body="   ")
    return _pending_mail(scene, template_code="blank", subject=None)


def no_default_server(scene: Scene) -> int:
    _server(scene, is_default=False)
    return accept_mail(scene.app, scene.acme)


def disabled_server(scene: Scene) -> int:
    server = _server(scene, enabled=False)
    return _pending_mail(scene, subject="Hello", text_body="Hi", server_id=server.id)


def misconfigured_server(scene: Scene) -> int:
    _server(scene, from_address=None, username=None)
    return accept_mail(scene.app, scene.acme)


def server_down(scene: Scene) -> int:
    _server(scene, port=closed_port())
    return accept_mail(scene.app, scene.acme)


def message_refused(scene: Scene) -> int:
    _server(scene)
    scene.smtp.fail_next(2, "552 5.3.4 message too big for system", stage="data")
    return accept_mail(scene.app, scene.acme)


def quota_full(scene: Scene) -> int:
    _server(scene)
    db.session.add(TenantMessageQuota(tenant_id=scene.acme, mail_monthly_limit=0))
    db.session.commit()
    return accept_mail(scene.app, scene.acme)


def expired(scene: Scene) -> int:
    _server(scene)
    later = (datetime.now(UTC) + timedelta(minutes=5)).isoformat()
    record = accept_mail(scene.app, scene.acme, expiresAt=later)
    db.session.execute(
        update(MailSendRecord).values(expires_at=datetime.now(UTC) - timedelta(seconds=1))
    )
    db.session.commit()
    return record


def sms_no_binding(scene: Scene) -> int:
    twilio = provider(scene.acme, "twilio", scene.sms)
    otp = sms_template(scene.acme, "otp")
    binding(otp, twilio, country="GB")  # bound for another country only
    db.session.commit()
    return accept_sms(
        scene.app, scene.acme, phoneNumber=FR, templateCode="otp", variables={"code": "1"}
    )


def sms_credentials(scene: Scene) -> int:
    provider(scene.acme, "twilio", scene.sms, secret="not-the-token")
    db.session.commit()
    return accept_sms(scene.app, scene.acme)


def sms_invalid_number(scene: Scene) -> int:
    provider(scene.acme, "twilio", scene.sms)
    db.session.commit()
    record = accept_sms(scene.app, scene.acme, phoneNumber=FR)
    scene.sms.script(FR, "invalid_number", "invalid_number")
    return record


@dataclass(frozen=True)
class Way:
    reason: Reason
    channel: Channel
    make: Callable[[Scene], int]
    again: tuple[str, str]  # the (status, error code) the retry ends in


WAYS = [
    Way(Reason.SUPPRESSED, Channel.MAIL, refused, ("Suppressed", "SUPPRESSED")),
    Way(Reason.RECIPIENT_REFUSED, Channel.MAIL, refused_not_suppressed, ("Failed", "550 5.1.1")),
    Way(Reason.NO_TEMPLATE, Channel.MAIL, no_template, ("Failed", "TEMPLATE_NOT_RESOLVABLE")),
    Way(
        Reason.TEMPLATE_DISABLED,
        Channel.MAIL,
        disabled_template,
        ("Failed", "TEMPLATE_NOT_RESOLVABLE"),
    ),
    Way(
        Reason.TEMPLATE_BROKEN, Channel.MAIL, broken_template, ("Failed", "TEMPLATE_NOT_RESOLVABLE")
    ),
    Way(Reason.CONTENT_INVALID, Channel.MAIL, blank_template, ("Failed", "CONTENT_INVALID")),
    Way(Reason.NO_ROUTE, Channel.MAIL, no_default_server, ("Failed", "CONFIG_NOT_RESOLVABLE")),
    Way(Reason.NO_BINDING, Channel.SMS, sms_no_binding, ("Failed", "CONFIG_NOT_RESOLVABLE")),
    Way(Reason.SERVER_DISABLED, Channel.MAIL, disabled_server, ("Failed", "CONFIG_NOT_RESOLVABLE")),
    Way(
        Reason.SERVER_MISCONFIGURED,
        Channel.MAIL,
        misconfigured_server,
        ("Failed", "CONFIG_NOT_RESOLVABLE"),
    ),
    Way(Reason.SERVER_DOWN, Channel.MAIL, server_down, ("DeadLetter", "NETWORK_ERROR")),
    Way(Reason.CREDENTIALS_REFUSED, Channel.SMS, sms_credentials, ("Failed", "HTTP_401")),
    Way(Reason.MESSAGE_REFUSED, Channel.MAIL, message_refused, ("Failed", "552 5.3.4")),
    Way(Reason.QUOTA_FULL, Channel.MAIL, quota_full, ("Failed", "MONTHLY_QUOTA_EXCEEDED")),
    Way(Reason.EXPIRED, Channel.MAIL, expired, ("Failed", "EXPIRED")),
    # A provider's "invalid number": the number goes on the list, so its retry is suppressed.
    Way(Reason.SUPPRESSED, Channel.SMS, sms_invalid_number, ("Suppressed", "SUPPRESSED")),
]


def test_every_reason_is_retried_anyway_here() -> None:
    assert {way.reason for way in WAYS} == set(Reason)


def _record(channel: Channel, record_id: int) -> Any:
    db.session.expire_all()
    model: Any = MailSendRecord if channel is Channel.MAIL else SmsSendRecord
    found = db.session.get(model, record_id)
    assert found is not None
    return found


def _delivered(scene: Scene) -> int:
    return len(scene.smtp.messages) + len(scene.sms.accepted())


@pytest.mark.parametrize("way", WAYS, ids=lambda w: f"{w.reason}-{w.channel}")
def test_retrying_anyway_fails_the_same_way(scene: Scene, way: Way) -> None:
    record_id = way.make(scene)
    scene.drain(way.channel)
    first = _record(way.channel, record_id)
    assert first.status not in ("Sent", "Pending", "Retry"), (first.status, first.error_code)
    found = diagnosis.diagnose(db.session(), way.channel, first, scene.app.config["SETTINGS"])
    assert (found.would_fail_again, found.reason) == (True, way.reason), found
    assert found.retryable

    prefix = "mail-records" if way.channel is Channel.MAIL else "sms-records"
    client, token = signed_in(scene.app, ADMIN)
    if way.reason is Reason.EXPIRED:
        # Its confirmation asks for a new expiry, which would cure it; the worker meets it
        # as it is when it comes round again without one.
        asked = client.post(f"/{prefix}/{record_id}/retry", data={"csrf_token": token})
        assert 'name="expiresAt"' in asked.text
        db.session.execute(
            update(MailSendRecord).values(status="Retry", next_retry_at=datetime.now(UTC))
        )
        db.session.commit()
    else:
        form = {"csrf_token": token, "confirm": "yes", "anyway": way.reason.value}
        pressed = client.post(f"/{prefix}/{record_id}/retry", data=form)
        assert pressed.status_code == 302, pressed.text
        assert _record(way.channel, record_id).status == "Retry"
        remark = db.session.scalar(
            select(AuditEvent.remark).where(
                AuditEvent.action == "retry", AuditEvent.target_id == str(record_id)
            )
        )
        assert f"retried anyway: would fail again ({way.reason})" in (remark or "")
    scene.drain(way.channel)
    after = _record(way.channel, record_id)
    assert (after.status, after.error_code) == way.again, after.error_message
    assert _delivered(scene) == 0
