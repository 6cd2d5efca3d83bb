"""A mail refused by the server for all of its several recipients puts on the tenant's
suppression list each one whose own RCPT reply says it is gone for good (5.1.1 and its
kin), as a hard bounce does, and no other: a policy refusal (5.7.1) or a full mailbox
(4.2.2, 5.2.2) says nothing about the address being gone."""

from __future__ import annotations

import pytest
from flask import Flask

from portal.extensions import db
from portal.messaging.after_send import suppression
from portal.messaging.sending.backoff import BackoffPolicy
from portal.models import MailSendRecord
from tests.support.delivery import accept_mail, drain, mail_server, tenant
from tests.support.smtp_server import ScriptedSmtpServer

NO_RETRIES = BackoffPolicy(max_retries=0, base_s=0.01)
GONE = ["gone-one@example.com", "gone-two@example.com"]
POLICY = "policy@example.com"


@pytest.mark.usefixtures("redis_client")
def test_each_recipient_refused_for_good_is_suppressed(
    app: Flask, smtp: ScriptedSmtpServer
) -> None:
    acme = tenant("acme").id
    mail_server(acme, smtp)
    db.session.commit()
    for address in GONE:
        smtp.script(address, "550 5.1.1 no such mailbox", stage="rcpt")
    smtp.script(POLICY, "550 5.7.1 relaying denied by policy", stage="rcpt")
    record = accept_mail(app, acme, to=[GONE[0], POLICY], cc=[GONE[1]])
    drain(app, policy=NO_RETRIES)

    db.session.expire_all()
    row = db.session.get(MailSendRecord, record)
    assert row is not None
    assert row.status == "Failed", (row.status, row.error_code, row.error_message)
    for address in GONE:
        held = suppression.active(db.session(), acme, "mail", address)
        assert held is not None, f"{address} was refused for good and is not suppressed"
        assert (held.reason, held.source_record_id) == ("hard_bounce", record)
        assert "5.1.1" in (held.detail or "")
    assert suppression.active(db.session(), acme, "mail", POLICY) is None


@pytest.mark.usefixtures("redis_client")
def test_a_sent_mail_suppresses_the_recipients_refused_for_good(
    app: Flask, smtp: ScriptedSmtpServer
) -> None:
    acme = tenant("acme").id
    mail_server(acme, smtp)
    db.session.commit()
    smtp.script(GONE[0], "550 5.1.1 no such mailbox", stage="rcpt")
    smtp.script(POLICY, "550 5.7.1 relaying denied by policy", stage="rcpt")
    record = accept_mail(app, acme, to=["ann@example.com", GONE[0], POLICY])
    drain(app, policy=NO_RETRIES)

    db.session.expire_all()
    row = db.session.get(MailSendRecord, record)
    assert row is not None
    assert row.status == "Sent"
    assert set(row.refused_recipients or {}) == {GONE[0], POLICY}
    held = suppression.active(db.session(), acme, "mail", GONE[0])
    assert held is not None
    assert (held.reason, held.source_record_id) == ("hard_bounce", record)
    assert suppression.active(db.session(), acme, "mail", POLICY) is None
    assert suppression.active(db.session(), acme, "mail", "ann@example.com") is None
