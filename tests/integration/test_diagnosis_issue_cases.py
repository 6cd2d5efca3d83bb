"""The five places where parts of the product disagreed about a record, reproduced with the
simulator's recipients through the real pipeline (the SMTP test server answering as the demo
sink does, the fake SMS provider), and read from the pages support, admins and operators use:
each now gives one answer, and no retry is offered without warning into a foreseeable failure.
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass

import pytest
import redis
from flask import Flask
from sqlalchemy import select

from portal import simulator
from portal.extensions import db
from portal.messaging.after_send import suppression
from portal.messaging.sending.backoff import BackoffPolicy
from portal.models import DeadLetterMessage, MailSendRecord, SmsSendRecord, TenantMessageQuota
from portal.tenancy import PLATFORM_TENANT_ID
from tests.integration.test_portal_records import HX, cheap_passwords, signed_in, user
from tests.support.delivery import accept_mail, drain, mail_server, tenant
from tests.support.sms import FR, accept_sms, binding, drain_sms, provider, sms_template
from tests.support.sms_provider import FakeSmsProvider
from tests.support.smtp_server import ScriptedSmtpServer

__all__ = ["cheap_passwords"]

ADMIN = "admin@acme.example.com"
SUPPORT = "support@acme.example.com"
OPERATOR = "operator@postroom.example.com"
REFUSED = simulator.MAIL["refused"].address
NO_RETRIES = BackoffPolicy(max_retries=0, base_s=0.01)
WHO = "You cannot do this yourself: a tenant admin (or a platform operator) can."


@dataclass
class Scene:
    app: Flask
    acme: int


@pytest.fixture
def scene(app: Flask, redis_client: redis.Redis, cheap_passwords: None) -> Scene:
    acme = tenant("acme").id
    db.session.commit()
    user(ADMIN, "tenant_admin", acme)
    user(SUPPORT, "support", acme)
    user(OPERATOR, "platform_operator", PLATFORM_TENANT_ID)
    return Scene(app, acme)


def status(model: type[MailSendRecord] | type[SmsSendRecord], record_id: int) -> str:
    db.session.expire_all()
    return str(db.session.scalar(select(model.status).where(model.id == record_id)))


def plan(client: object, token: str, path: str, ids: list[int]) -> str:
    answer = client.post(  # type: ignore[attr-defined]
        path,
        data={"ids": [str(i) for i in ids], "scope": "selected"},
        headers=HX | {"X-CSRFToken": token},
    )
    assert answer.status_code == 200, answer.text
    return str(answer.text)


def test_a_recipient_refused_at_rcpt_is_suppressed_and_never_retried_in_one_click(
    scene: Scene, smtp: ScriptedSmtpServer
) -> None:
    """Issue: "Retrying will fail the same way" above a green one-click Retry that requeued it,
    "Will try again" beside "Recipient refused", "Refused recipients: none", not suppressed."""
    mail_server(scene.acme, smtp)
    db.session.commit()
    smtp.script(REFUSED, simulator.REFUSED_REPLY, stage="rcpt")  # as the demo sink answers
    record = accept_mail(scene.app, scene.acme, to=[REFUSED])
    drain(scene.app, policy=NO_RETRIES)
    row = db.session.get(MailSendRecord, record)
    assert row is not None
    assert (row.status, row.error_code) == ("Failed", "550 5.1.1")
    held = suppression.active(db.session(), scene.acme, "mail", REFUSED)
    assert held is not None  # suppressed after the refusal, as a hard bounce is
    assert held.reason == "hard_bounce"
    assert held.source_record_id == record

    client, token = signed_in(scene.app, SUPPORT)
    page = client.get(f"/mail-records/{record}").text
    assert "Sending it again now would fail the same way" in page
    assert '<span class="mono">SUPPRESSED</span>' in page
    assert f"refused {REFUSED}" in page  # the cause names the address and the server's words
    assert "550 5.1.1 simulator: no such mailbox" in page
    assert f'id="diagnosis-suppressed">On the suppression list: {REFUSED}' in page
    assert "<dd>none</dd>" not in page.split("Refused recipients", 1)[1][:200]
    # No one-click Retry: the Retry asks first, naming why.
    assert 'class="secondary" aria-describedby="retry-what">Retry…</button>' in page
    assert '<span class="mono">SUPPRESSED</span>: the recipient refused@' in page  # the why
    assert 'A retry now would fail again (<span class="mono">SUPPRESSED</span>' in page
    assert WHO in page  # support is told who can take it off the list

    asked = client.post(f"/mail-records/{record}/retry", data={"csrf_token": token})
    assert asked.status_code == 200  # the confirm page, not a requeue
    assert 'name="anyway" value="SUPPRESSED"' in asked.text
    assert status(MailSendRecord, record) == "Failed"
    assert "Will try again" not in client.get(f"/mail-records/{record}").text

    # The recipient page says the same: suppressed, and why the latest failure would repeat.
    link = re.search(r'href="(/recipients/[^"]+)"', client.get("/mail-records/").text)
    assert link is not None
    who = client.get(link.group(1)).text
    assert "<strong>Suppressed</strong>: a hard bounce" in who
    assert '<span class="mono">SUPPRESSED</span>' in who


def test_an_sms_whose_template_has_no_binding_for_the_country_says_add_a_binding(
    scene: Scene,
) -> None:
    """Issue: bulk retry found "nothing that stops them now" for a French SMS whose template has
    no binding for FR, and the advice was to add a route while a default provider existed."""
    with FakeSmsProvider() as server:
        twilio = provider(scene.acme, "twilio", server)  # the default provider
        otp = sms_template(scene.acme, "otp")
        binding(otp, twilio, country="GB")  # bound for Great Britain only
        db.session.commit()
        record = accept_sms(
            scene.app, scene.acme, phoneNumber=FR, templateCode="otp", variables={"code": "7"}
        )
        drain_sms(scene.app, policy=NO_RETRIES)
        assert status(SmsSendRecord, record) == "Failed"
        assert server.requests == []

    client, token = signed_in(scene.app, ADMIN)
    bulk = plan(client, token, "/sms-records/retry", [record])
    assert "<strong>1 NO_BINDING</strong>" in bulk
    assert "template `otp` has no binding for FR" in bulk
    assert "nothing found that stops them now" not in bulk
    assert "<strong>0</strong> will be requeued" in bulk
    page = client.get(f"/sms-records/{record}").text
    action = page.split('id="diagnosis-action">', 1)[1].split("</p>", 1)[0]
    assert "Add a binding for FR to the SMS template `otp`" in action
    assert "route" not in action


def test_dead_letters_of_a_server_that_refuses_every_connection_would_fail_again(
    scene: Scene, smtp: ScriptedSmtpServer
) -> None:
    """Issue: "NETWORK_ERROR: nothing found that stops them now" for three dead letters whose
    server refuses every connection (too few for its breaker to open)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: every connection is refused
    mail_server(scene.acme, smtp, name="main", port=port)
    db.session.commit()
    ids = [accept_mail(scene.app, scene.acme, to=[f"user{i}@example.com"]) for i in range(3)]
    drain(scene.app, policy=NO_RETRIES)
    assert [status(MailSendRecord, i) for i in ids] == ["DeadLetter"] * 3

    client, token = signed_in(scene.app, ADMIN)
    bulk = plan(client, token, "/mail-records/retry", ids)
    assert "<strong>3 SERVER_DOWN</strong>" in bulk
    assert "is down (Failing since " in bulk  # its health, as its page says it
    assert "(3 records, last: connection refused)" in bulk
    assert "nothing found that stops them now" not in bulk
    page = client.get(f"/mail-records/{ids[0]}").text
    assert '<span class="mono">SERVER_DOWN</span>' in page
    assert "Connection refused" in page  # what it said when it could not be reached
    # The operator's dead-letter list says it of each.
    operator, _ = signed_in(scene.app, OPERATOR, "all")
    letters = operator.get("/dead-letters/").text
    assert db.session.scalar(select(DeadLetterMessage.id).limit(1)) is not None
    assert letters.count("No: SERVER_DOWN") == 3


def uncertain(scene: Scene, smtp: ScriptedSmtpServer) -> int:
    """A mail whose whole message the server took before dropping the connection unanswered,
    on a server whose policy holds such records: Uncertain."""
    mail_server(scene.acme, smtp, uncertain_policy="hold")
    db.session.commit()
    no_answer = simulator.MAIL["no_answer"].address
    smtp.script(no_answer, "drop", stage="data")
    record = accept_mail(scene.app, scene.acme, to=[no_answer])
    drain(scene.app, policy=NO_RETRIES)
    assert status(MailSendRecord, record) == "Uncertain"
    return record


def test_an_uncertain_record_gives_no_temporary_fault_advice(
    scene: Scene, smtp: ScriptedSmtpServer
) -> None:
    """Issue: "Outcome unknown" beside "Temporary fault … unreachable, timed out"."""
    record = uncertain(scene, smtp)
    client, _ = signed_in(scene.app, ADMIN)
    page = client.get(f"/mail-records/{record}").text
    panel = page.split('id="diagnosis"', 1)[1].split("</section>", 1)[0]
    assert "Outcome unknown" in panel
    assert "may have been delivered" in panel
    assert "Temporary fault" not in panel
    assert "unreachable" not in panel
    assert "tried again" not in panel
    assert "resolve it" in panel
    assert WHO not in panel  # an admin can resolve it: nothing to pass on


def test_support_is_told_who_can_act(scene: Scene, smtp: ScriptedSmtpServer) -> None:
    """Issue: support was told Retry is "not available — resolve it", which it cannot do, and
    not who can; the same for what only an operator can change (a tier's quota)."""
    record = uncertain(scene, smtp)
    client, _ = signed_in(scene.app, SUPPORT)
    page = client.get(f"/mail-records/{record}").text
    retry = page.split('class="retry-form"', 1)[1].split("</form>", 1)[0]
    assert "Retry is not available" in retry
    assert "resolve it" in retry
    assert WHO in retry
    assert WHO in page.split('id="diagnosis"', 1)[1].split("</section>", 1)[0]

    db.session.add(TenantMessageQuota(tenant_id=scene.acme, mail_monthly_limit=0))
    db.session.commit()
    stopped = accept_mail(scene.app, scene.acme)
    drain(scene.app, policy=NO_RETRIES)
    assert status(MailSendRecord, stopped) == "Failed"
    quota = client.get(f"/mail-records/{stopped}").text
    assert '<span class="mono">QUOTA_FULL</span>' in quota
    assert "You cannot do this yourself: a platform operator can." in quota
