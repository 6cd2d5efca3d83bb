"""Seed 001 mail test points under "Preparing and sending" and "Failures, retries and
recovery", against real PostgreSQL and a real SMTP server in the test process."""

from __future__ import annotations

import logging
from datetime import timedelta

import pytest
from flask import Flask
from sqlalchemy import func, select

from portal.extensions import db
from portal.messaging.records.retry import retry_records
from portal.messaging.records.validation import AcceptanceError
from portal.messaging.sending.backoff import BackoffPolicy
from portal.models import (
    DeadLetterMessage,
    MailSendRecord,
    MailTemplate,
    TenantMessageQuota,
    TenantMessageUsage,
)
from portal.tenancy import PLATFORM_TENANT_ID
from tests.support.delivery import accept_mail, drain, mail_server, record, tenant
from tests.support.smtp_server import ScriptedSmtpServer

FAST = BackoffPolicy(max_retries=5, base_s=0.02, quota_floor_s=0.05, retry_after_cap_s=1.0)


@pytest.fixture
def acme(app: Flask, smtp: ScriptedSmtpServer) -> int:
    row = tenant("acme")
    mail_server(row.id, smtp, name="acme-smtp")
    db.session.commit()
    return row.id


def template(tenant_id: int, code: str = "welcome", **fields: object) -> MailTemplate:
    row = MailTemplate(
        tenant_id=tenant_id,
        code=code,
        name=code,
        subject=fields.pop("subject", "Welcome {{ name }}"),
        html_body=fields.pop("html_body", "<p>Hello {{ name }}</p>"),
        text_body=fields.pop("text_body", None),
        **fields,
    )
    db.session.add(row)
    db.session.commit()
    return row


def test_mail_is_rendered_sent_and_marked_sent(
    app: Flask, smtp: ScriptedSmtpServer, acme: int
) -> None:
    template(acme)
    rid = accept_mail(
        app, acme, subject=None, text=None, templateCode="welcome", variables={"name": "<Ann>"}
    )
    drain(app)
    row = record(rid)
    assert row.status == "Sent"
    assert (row.version, row.retry_count) == (3, 0)  # claim, write-back, sent
    assert row.rendered_subject == "Welcome <Ann>"
    assert row.rendered_html == "<p>Hello &lt;Ann&gt;</p>"  # HTML auto-escaped
    assert "Hello <Ann>" in (row.rendered_text or "")  # text part derived from the HTML
    (message,) = smtp.messages
    assert message.message_id == row.message_id_header == row.provider_message_id
    assert message.rcpt_tos == ["ann@example.com"]
    assert message.message["Subject"] == "Welcome <Ann>"
    assert message.message["From"] == "Sender <sender@acme-smtp.test>"


def test_tenant_uses_own_templates_and_server_else_the_platform_default_server(
    app: Flask, smtp: ScriptedSmtpServer
) -> None:
    acme, globex = tenant("acme"), tenant("globex")
    mail_server(PLATFORM_TENANT_ID, smtp, name="platform-smtp")
    mail_server(acme.id, smtp, name="acme-smtp")
    db.session.commit()
    template(PLATFORM_TENANT_ID, "shared")
    template(globex.id, "welcome")
    # Globex has no server of its own: the platform tier's default carries its mail.
    sent = accept_mail(
        app, globex.id, subject=None, text=None, templateCode="welcome", variables={"name": "G"}
    )
    # A tenant never sees the platform tier's templates: refused at acceptance.
    with pytest.raises(AcceptanceError) as hidden:
        accept_mail(app, acme.id, subject=None, text=None, templateCode="shared")
    assert (hidden.value.code, hidden.value.field) == ("not_found", "templateCode")
    own = accept_mail(app, acme.id)
    drain(app)
    assert record(sent).status == "Sent"
    # Tenants take turns (fair claim), so the order of the two tenants' mails is not the
    # order of acceptance: find Globex's by its Message-ID.
    (globex_mail,) = [m for m in smtp.messages if m.message_id == record(sent).provider_message_id]
    assert globex_mail.mail_from == "sender@platform-smtp.test"
    assert record(own).status == "Sent"
    assert {m.mail_from for m in smtp.messages} == {
        "sender@platform-smtp.test",
        "sender@acme-smtp.test",
    }


def test_platform_scope_uses_platform_templates_quota_and_only_its_default_server(
    app: Flask, smtp: ScriptedSmtpServer, acme: int
) -> None:
    template(PLATFORM_TENANT_ID, "reset", subject="Reset", html_body="<p>{{ link }}</p>")
    # No platform default server yet: PLATFORM does not borrow a tenant's server.
    rid = accept_mail(
        app,
        None,
        scope="PLATFORM",
        subject=None,
        text=None,
        templateCode="reset",
        variables={"link": "https://x.test/r"},
    )
    drain(app)
    assert (record(rid).status, record(rid).error_code) == ("Failed", "CONFIG_NOT_RESOLVABLE")
    mail_server(PLATFORM_TENANT_ID, smtp, name="platform-smtp")
    db.session.commit()
    assert retry_records(db.session, MailSendRecord, [rid], None).requeued == [rid]
    db.session.commit()
    drain(app)
    assert record(rid).status == "Sent"
    usage = db.session.scalar(
        select(TenantMessageUsage.mail_count).where(
            TenantMessageUsage.tenant_id == PLATFORM_TENANT_ID
        )
    )
    assert usage == 1
    assert (
        db.session.scalar(
            select(func.count())
            .select_from(TenantMessageUsage)
            .where(TenantMessageUsage.tenant_id == acme)
        )
        == 0
    )


@pytest.mark.parametrize(
    ("setup", "code"),
    [
        ("missing_template", "TEMPLATE_NOT_RESOLVABLE"),
        ("missing_server", "CONFIG_NOT_RESOLVABLE"),
        ("quota_used_up", "MONTHLY_QUOTA_EXCEEDED"),
        ("empty_render", "CONTENT_INVALID"),
        ("broken_template", "TEMPLATE_NOT_RESOLVABLE"),
    ],
)
def test_preparation_failures_fail_with_their_marker_then_retry_prepares_afresh(
    app: Flask, smtp: ScriptedSmtpServer, caplog: pytest.LogCaptureFixture, setup: str, code: str
) -> None:
    acme = tenant("acme").id
    db.session.commit()
    if setup != "missing_server":
        mail_server(acme, smtp)
    if setup == "quota_used_up":
        db.session.add(TenantMessageQuota(tenant_id=acme, mail_monthly_limit=0))
    if setup == "empty_render":
        template(acme, html_body="{% if nothing %}x{% endif %}")
    if setup == "broken_template":
        template(acme, html_body="{{ name | no_such_filter }}")
    if setup in ("missing_server", "quota_used_up", "missing_template"):
        template(acme)
    db.session.commit()
    rid = accept_mail(
        app, acme, subject=None, text=None, templateCode="welcome", variables={"name": "Ann"}
    )
    if setup == "missing_template":
        # An unknown code is refused at acceptance; one deleted after it fails here.
        db.session.execute(MailTemplate.__table__.delete())
        db.session.commit()
    with caplog.at_level(logging.ERROR, logger="portal.delivery"):
        drain(app)
    row = record(rid)
    assert (row.status, row.error_code, row.retry_count) == ("Failed", code, 0)
    assert row.prepared_at is None
    errors = [
        r
        for r in caplog.records
        if r.levelno == logging.ERROR and getattr(r, "record_id", None) == rid
    ]
    assert errors
    assert errors[0].error_code == code  # type: ignore[attr-defined]
    # Fill the gap, press Retry: prepared afresh, sent.
    if setup == "missing_server":
        mail_server(acme, smtp)
    elif setup == "quota_used_up":
        db.session.execute(TenantMessageQuota.__table__.update().values(mail_monthly_limit=10))
    elif setup == "missing_template":
        template(acme)
    else:
        db.session.execute(
            MailTemplate.__table__.update().values(html_body="<p>Hello {{ name }}</p>")
        )
    db.session.commit()
    assert retry_records(db.session, MailSendRecord, [rid], acme).requeued == [rid]
    db.session.commit()
    drain(app)
    row = record(rid)
    assert (row.status, row.retry_count) == ("Sent", 1)
    assert len(smtp.messages) == 1


def test_a_retry_replays_what_was_prepared(app: Flask, smtp: ScriptedSmtpServer, acme: int) -> None:
    tpl = template(acme)
    smtp.fail_next(1, "451 4.3.0 local error", stage="data")
    rid = accept_mail(
        app, acme, subject=None, text=None, templateCode="welcome", variables={"name": "Ann"}
    )
    drain(app, stop_when=lambda: record(rid).status == "Retry", policy=FAST)
    prepared = record(rid)
    first_message_id = prepared.message_id_header
    # The template and the default server change; the prepared record does not.
    tpl.subject = "Changed {{ name }}"
    tpl.html_body = "<p>changed</p>"
    mail_server(acme, smtp, name="other", from_address="other@other.test")
    db.session.commit()
    drain(app, policy=FAST)
    row = record(rid)
    assert (row.status, row.retry_count) == ("Sent", 1)
    assert row.rendered_subject == "Welcome Ann"
    assert row.message_id_header == first_message_id
    assert [m.message["Subject"] for m in smtp.messages] == ["Welcome Ann"]  # 451 kept none
    assert [m.message_id for m in smtp.messages] == [first_message_id]
    assert {m.mail_from for m in smtp.messages} == {"sender@acme-smtp.test"}
    usage = db.session.scalar(
        select(TenantMessageUsage.mail_count).where(TenantMessageUsage.tenant_id == acme)
    )
    assert usage == 1  # charged once


def test_template_id_sends_a_disabled_template_but_code_finds_enabled_only(
    app: Flask, smtp: ScriptedSmtpServer, acme: int
) -> None:
    disabled = template(acme, "draft", enabled=False)
    by_id = accept_mail(
        app, acme, subject=None, text=None, templateId=disabled.id, variables={"name": "A"}
    )
    # By code only an enabled template is found: refused at acceptance.
    with pytest.raises(AcceptanceError) as by_code:
        accept_mail(app, acme, subject=None, text=None, templateCode="draft")
    assert (by_code.value.code, by_code.value.field) == ("not_found", "templateCode")
    drain(app)
    assert record(by_id).status == "Sent"


def test_a_template_disabled_after_acceptance_fails_then_retry_after_enabling_sends(
    app: Flask, smtp: ScriptedSmtpServer, acme: int
) -> None:
    """Seed 000's test point, still reachable: disabled after acceptance, the
    record fails TEMPLATE_NOT_RESOLVABLE at preparation; Retry once it is enabled sends."""
    row = template(acme, "later")
    rid = accept_mail(
        app, acme, subject=None, text=None, templateCode="later", variables={"name": "A"}
    )
    row.enabled = False
    db.session.commit()
    drain(app)
    assert (record(rid).status, record(rid).error_code) == ("Failed", "TEMPLATE_NOT_RESOLVABLE")
    row.enabled = True
    db.session.commit()
    assert retry_records(db.session, MailSendRecord, [rid], acme).requeued == [rid]
    db.session.commit()
    drain(app)
    assert record(rid).status == "Sent"


def test_temporary_errors_back_off_then_dead_letter(
    app: Flask, smtp: ScriptedSmtpServer, acme: int
) -> None:
    rid = accept_mail(app, acme, to=["d451@example.com"])
    delays: list[float] = []
    last_retry = 0

    def moved_on(since: int) -> bool:
        row = record(rid)
        return row.retry_count > since or row.status == "DeadLetter"

    while record(rid).status not in ("DeadLetter", "Failed"):
        drain(app, stop_when=lambda since=last_retry: moved_on(since), policy=FAST)
        row = record(rid)
        if row.status == "Retry":
            assert row.next_retry_at is not None
            delays.append((row.next_retry_at - row.updated_time) / timedelta(seconds=1))
            last_retry = row.retry_count
    row = record(rid)
    assert (row.status, row.retry_count, row.error_code) == ("DeadLetter", 5, "451 4.3.0")
    assert len(delays) == 5
    for n, delay in enumerate(delays):
        nominal = FAST.base_s * 2**n  # 30 s, 1, 2, 4, 8 min at the default base
        assert 0.5 * nominal - 0.005 <= delay <= 1.5 * nominal + 0.005, (n, delay)
    (letter,) = db.session.scalars(select(DeadLetterMessage)).all()
    assert (letter.source, letter.event_id, letter.channel, letter.attempts) == (
        "SendExhausted",
        str(rid),
        "mail",
        6,
    )
    assert letter.error_code == "451 4.3.0"
    assert letter.provider == "acme-smtp"
    assert len(smtp.messages) == 0  # 451 at DATA: refused every time


@pytest.mark.parametrize(
    ("recipient", "status", "code"),
    [
        ("r550@example.com", "Failed", "550 5.1.1"),
        ("r553@example.com", "Failed", "553 5.1.3"),
        ("d552@example.com", "Failed", "552 5.3.4"),
        ("r421@example.com", "Retry", "421 4.3.0"),
        ("r450@example.com", "Retry", "450 4.2.1"),
        ("r452@example.com", "Retry", "452 4.5.3"),
        ("d451@example.com", "Retry", "451 4.3.0"),
    ],
)
def test_smtp_reply_codes_decide_fail_or_retry(
    app: Flask, smtp: ScriptedSmtpServer, acme: int, recipient: str, status: str, code: str
) -> None:
    rid = accept_mail(app, acme, to=[recipient])
    drain(app, until=lambda: record(rid).status in ("Failed", "Retry"), policy=FAST)
    row = record(rid)
    assert (row.status, row.error_code) == (status, code)
    assert row.error_message


@pytest.mark.parametrize("code", ["530", "535"])
def test_authentication_failures_fail_at_once(app: Flask, code: str) -> None:
    with ScriptedSmtpServer(auth_users={"user": "right"}, auth_require_tls=False) as smtp:
        acme = tenant("acme").id
        # 535: wrong password; 530: no login at all on a server that requires one.
        server = mail_server(
            acme, smtp, username="user" if code == "535" else None, from_address="a@acme.test"
        )
        server.password = "wrong" if code == "535" else None
        db.session.commit()
        rid = accept_mail(app, acme)
        drain(app, until=lambda: record(rid).status != "Sending", policy=FAST)
    row = record(rid)
    assert row.status == "Failed"
    assert row.error_code is not None
    assert row.error_code.startswith(code)


def test_starttls_and_auth_server(app: Flask) -> None:
    with ScriptedSmtpServer(tls=True, auth_users={"user": "secret"}) as smtp:
        acme = tenant("acme").id
        server = mail_server(acme, smtp, security="starttls", verify_tls=False, username="user")
        server.password = "secret"
        db.session.commit()
        assert "secret" not in (server.password_encrypted or "")
        rid = accept_mail(app, acme)
        drain(app)
        assert record(rid).status == "Sent"
        assert smtp.logins == ["user"]


def test_partially_refused_recipients_are_recorded(
    app: Flask, smtp: ScriptedSmtpServer, acme: int
) -> None:
    rid = accept_mail(app, acme, to=["ok@example.com", "r550@example.com"])
    drain(app)
    row = record(rid)
    assert row.status == "Sent"
    assert row.refused_recipients is not None
    assert list(row.refused_recipients) == ["r550@example.com"]
    assert smtp.messages[0].rcpt_tos == ["ok@example.com"]


def test_hang_after_data_is_a_timeout_marked_ambiguous(
    app: Flask, acme: int, smtp: ScriptedSmtpServer
) -> None:
    rid = accept_mail(app, acme, to=["hang@example.com"])
    drain(app, stop_when=lambda: record(rid).status == "Retry", policy=FAST, timeout_s=15)
    row = record(rid)
    assert row.error_code == "TIMEOUT"
    assert row.ambiguous_attempt is True
    # The server got it but answered too late; the retry carries the same Message-ID, so the
    # receiving side can tell the duplicate (at least once, seed 000).
    smtp.script("hang@example.com", "250 2.0.0 OK", stage="data")
    drain(app, policy=FAST)
    row = record(rid)
    assert (row.status, row.ambiguous_attempt) == ("Sent", True)
    assert [m.message_id for m in smtp.messages] == [row.message_id_header] * 2


def test_connections_are_reused_across_records(
    app: Flask, smtp: ScriptedSmtpServer, acme: int
) -> None:
    ids = [accept_mail(app, acme, to=[f"u{i}@example.com"]) for i in range(5)]
    drain(app)
    assert all(record(i).status == "Sent" for i in ids)
    assert smtp.connection_count == 1


def test_manual_retry_refuses_sent_and_sending_and_counts_as_a_retry(
    app: Flask, smtp: ScriptedSmtpServer, acme: int
) -> None:
    sent = accept_mail(app, acme)
    failed = accept_mail(app, acme, to=["r550@example.com"])
    drain(app)
    sending = accept_mail(app, acme, to=["x@example.com"])
    db.session.execute(
        MailSendRecord.__table__.update()
        .where(MailSendRecord.id == sending)
        .values(status="Sending")  # as a worker would hold it
    )
    dead = accept_mail(app, acme, to=["d451@example.com"])
    db.session.execute(
        MailSendRecord.__table__.update()
        .where(MailSendRecord.id == dead)
        .values(status="DeadLetter", retry_count=5)
    )
    db.session.commit()
    report = retry_records(db.session, MailSendRecord, [sent, failed, sending, dead, 999999], acme)
    db.session.commit()
    assert report.requeued == [failed, dead]
    assert set(report.skipped) == {sent, sending, 999999}
    assert "already sent" in report.skipped[sent]
    assert "being sent" in report.skipped[sending]
    assert record(failed).retry_count == 1
    # A dead letter gets exactly one chance, then returns to DeadLetter.
    drain(app, until=lambda: record(dead).status == "DeadLetter", policy=FAST)
    assert record(dead).retry_count == 6
    assert db.session.scalar(select(func.count()).select_from(DeadLetterMessage)) == 1


def test_a_lost_version_race_writes_nothing_and_logs_nothing(
    app: Flask, smtp: ScriptedSmtpServer, acme: int, caplog: pytest.LogCaptureFixture
) -> None:
    from portal.messaging.sending import outcomes, sent_write
    from portal.messaging.sending.outcomes import Claimed
    from portal.models import Channel

    rid = accept_mail(app, acme)
    stale = Claimed(Channel.MAIL, rid, version=7, tenant_id=acme, retry_count=0)
    with caplog.at_level(logging.DEBUG, logger="portal.delivery"):
        assert outcomes.handle_failure(db.engine, stale, "451", "x", policy=FAST) is None
        assert sent_write.record_sent(db.engine, stale, "<id>") is False
    assert caplog.records == []
    row = record(rid)
    assert (row.status, row.version, row.error_code) == ("Pending", 0, None)
