"""Every attempt that reached the transport is a row, written by the
statement that writes the attempt's outcome; deferrals add none and are counted on the record.
Against real PostgreSQL (and SQLite where it says so), a real SMTP server in the test process
and a local HTTP server playing the SMS providers."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from flask import Flask
from sqlalchemy import select, update

from portal.extensions import db
from portal.messaging.after_send import suppression
from portal.messaging.records import retention
from portal.messaging.sending import claim, outcomes, sent_write
from portal.messaging.sending.backoff import BackoffPolicy
from portal.messaging.sending.outcomes import Attempt, Claimed
from portal.messaging.sending.sweeper import sweep_stuck_sends
from portal.models import (
    Channel,
    DeadLetterMessage,
    MailSendRecord,
    MailSendServerConfig,
    SendAttempt,
    SendStatus,
    SmsSendRecord,
)
from portal.tenancy import PLATFORM_TENANT_ID
from tests.conftest import make_api_key
from tests.support.delivery import accept_mail, drain, mail_server, record, tenant
from tests.support.sms import UK, accept_sms, drain_sms, provider, sms_record
from tests.support.sms_provider import FakeSmsProvider
from tests.support.smtp_server import ScriptedSmtpServer

FAST = BackoffPolicy(max_retries=5, base_s=0.02, quota_floor_s=0.05, retry_after_cap_s=1.0)


@pytest.fixture
def acme(app: Flask, smtp: ScriptedSmtpServer) -> int:
    row = tenant("acme")
    mail_server(row.id, smtp, name="acme-smtp")
    db.session.commit()
    return row.id


def attempts(channel: str, record_id: int) -> list[SendAttempt]:
    db.session.expire_all()
    return list(
        db.session.scalars(
            select(SendAttempt)
            .where(SendAttempt.channel == channel, SendAttempt.record_id == record_id)
            .order_by(SendAttempt.number)
        )
    )


def test_each_mail_attempt_is_a_row_with_the_servers_reply(
    app: Flask, smtp: ScriptedSmtpServer, acme: int
) -> None:
    smtp.fail_next(2, "451 4.7.1 Greylisted, try again later", stage="rcpt")
    before = datetime.now(UTC) - timedelta(seconds=1)
    rid = accept_mail(app, acme)
    drain(app, policy=FAST)
    row = record(rid)
    assert (row.status, row.retry_count, row.attempt_count, row.deferral_count) == (
        "Sent",
        2,
        3,
        0,
    )
    rows = attempts("mail", rid)
    assert [a.number for a in rows] == [1, 2, 3]
    assert [a.outcome for a in rows] == ["retry", "retry", "sent"]
    assert [a.code for a in rows] == ["451 4.7.1", "451 4.7.1", "250"]  # with enhanced codes
    assert "Greylisted" in (rows[0].message or "")
    assert all(a.config_name == "acme-smtp" and a.config_id == row.server_config_id for a in rows)
    assert all(a.tenant_id == acme and not a.ambiguous for a in rows)
    assert all(a.worker and ":" in a.worker for a in rows)  # host:pid
    for a in rows:
        assert before <= a.started_at <= a.finished_at
        assert a.duration_ms is not None
        assert a.duration_ms >= 0
    assert rows[2].provider_message_id == row.provider_message_id
    assert rows[0].provider_message_id is None


def test_a_refused_mail_ends_with_a_failed_attempt_and_one_without_a_server_has_none(
    app: Flask, smtp: ScriptedSmtpServer, acme: int
) -> None:
    smtp.fail_next(1, "550 5.1.1 No such user", stage="rcpt")
    refused = accept_mail(app, acme)
    drain(app, policy=FAST)
    (only,) = attempts("mail", refused)
    assert (only.outcome, only.code, record(refused).status) == ("failed", "550 5.1.1", "Failed")
    # A record that never reached a server (its tenant has none) has no attempt.
    lonely = tenant("lonely")
    db.session.commit()
    nowhere = accept_mail(app, lonely.id)
    drain(app, policy=FAST)
    assert record(nowhere).status in ("Failed", "DeadLetter", "Retry")
    assert attempts("mail", nowhere) == []
    assert record(nowhere).attempt_count == 0


def test_a_deferral_adds_no_attempt_and_is_counted_on_the_record(
    app: Flask, smtp: ScriptedSmtpServer, acme: int
) -> None:
    rid = accept_mail(app, acme)
    row = claim.claim_due(db.engine, MailSendRecord, 1)[0]
    claimed = Claimed(Channel.MAIL, row.id, row.version, row.tenant_id, row.retry_count)
    assert outcomes.defer(db.engine, claimed, "SERVER_UNAVAILABLE", "breaker open", 60)
    after = record(rid)
    assert (after.status, after.deferral_count, after.attempt_count) == ("Retry", 1, 0)
    assert attempts("mail", rid) == []


def test_the_sent_write_with_the_next_claim_writes_the_attempt_in_the_same_statement(
    app: Flask, acme: int
) -> None:
    first, second = accept_mail(app, acme), accept_mail(app, acme)
    (held,) = claim.claim_due(db.engine, MailSendRecord, 1)
    claimed = Claimed(Channel.MAIL, held.id, held.version, held.tenant_id, held.retry_count)
    attempt = Attempt(datetime.now(UTC), 0.012, 7, "relay", "250", "2.0.0 Ok: queued as ABC")
    with claim.claiming_next(MailSendRecord, lambda: True) as nxt:
        assert sent_write.record_sent(db.engine, claimed, "<m1@test>", attempt=attempt)
    assert nxt.ran
    assert [r.id for r in nxt.records] == [second]  # the next claim rode along
    (row,) = attempts("mail", first)
    assert (row.number, row.outcome, row.code, row.duration_ms) == (1, "sent", "250", 12)
    assert (row.config_id, row.config_name, row.provider_message_id) == (7, "relay", "<m1@test>")
    assert row.message == "2.0.0 Ok: queued as ABC"
    # A Sent write that lost its race (version moved on) writes no attempt either.
    stale = Claimed(Channel.MAIL, second, 0, acme, 0)
    assert not sent_write.record_sent(db.engine, stale, "<m2@test>", attempt=attempt)
    assert attempts("mail", second) == []


def test_an_ambiguous_failure_is_an_ambiguous_attempt(app: Flask, acme: int) -> None:
    rid = accept_mail(app, acme)
    (held,) = claim.claim_due(db.engine, MailSendRecord, 1)
    claimed = Claimed(Channel.MAIL, held.id, held.version, held.tenant_id, held.retry_count)
    attempt = Attempt(datetime.now(UTC), 30.0, 7, "relay", "TIMEOUT", "no reply after DATA")
    decision = outcomes.handle_failure(
        db.engine,
        claimed,
        "TIMEOUT",
        "no reply after DATA",
        policy=FAST,
        ambiguous=True,
        hold=True,
        attempt=attempt,
    )
    assert decision is not None
    (row,) = attempts("mail", rid)
    assert (row.outcome, row.ambiguous, row.code, row.duration_ms) == (
        "uncertain",
        True,
        "TIMEOUT",
        30_000,
    )
    assert record(rid).status == "Uncertain"


def test_a_swept_attempt_is_a_row_without_a_worker(app: Flask, acme: int) -> None:
    rid = accept_mail(app, acme)
    (held,) = claim.claim_due(db.engine, MailSendRecord, 1)
    settings = app.config["SETTINGS"]
    # Prepared, then its worker vanished mid-send long ago.

    config = db.session.scalar(
        select(MailSendServerConfig).where(MailSendServerConfig.tenant_id == acme)
    )
    assert config is not None
    db.session.execute(
        update(MailSendRecord)
        .where(MailSendRecord.id == rid)
        .values(
            prepared_at=datetime.now(UTC),
            server_config_id=config.id,
            updated_time=datetime.now(UTC) - timedelta(hours=1),
        )
    )
    db.session.commit()
    sweep_stuck_sends(db.engine, settings)
    (row,) = attempts("mail", rid)
    assert (row.outcome, row.ambiguous, row.worker, row.duration_ms) == ("swept", True, None, None)
    assert (row.config_id, row.config_name) == (config.id, config.name)
    assert row.code == "ZOMBIE_RECOVERED"
    assert record(rid).status == SendStatus.RETRY.value
    assert held.id == rid


def test_each_sms_attempt_shows_the_http_status_and_the_providers_code(
    app: Flask, acme: int
) -> None:
    with FakeSmsProvider(hang_s=2.0) as server:
        provider(acme, "twilio", server, name="tw")
        db.session.commit()
        server.script(UK, "server_error", "invalid_number")
        rid = accept_sms(app, acme)
        drain_sms(app, policy=FAST)
    rows = attempts("sms", rid)
    assert [(a.number, a.outcome, a.code) for a in rows] == [
        (1, "retry", "500 20500"),
        (2, "failed", "400 21211"),
    ]
    assert all(a.config_name == "tw" for a in rows)
    assert sms_record(rid).attempt_count == 2


def test_retention_deletes_a_records_attempts_with_it(
    app: Flask, smtp: ScriptedSmtpServer, acme: int
) -> None:
    rid = accept_mail(app, acme)
    drain(app, policy=FAST)
    assert len(attempts("mail", rid)) == 1
    deleted = retention.delete_records(db.session(), Channel.MAIL, [rid])
    db.session.commit()
    assert deleted["attempts"] == 1
    assert attempts("mail", rid) == []


def test_the_api_returns_each_attempt_oldest_first_and_the_worker_only_to_operators(
    app: Flask, smtp: ScriptedSmtpServer, acme: int
) -> None:
    smtp.fail_next(1, "451 4.7.1 Greylisted", stage="rcpt")
    rid = accept_mail(app, acme)
    drain(app, policy=FAST)
    tenant_key = make_api_key(acme)
    operator_key = make_api_key(PLATFORM_TENANT_ID, "ops")
    other_key = make_api_key(tenant("globex").id)
    db.session.commit()
    client = app.test_client()
    body = client.get(
        f"/api/v1/mail/{rid}", headers={"Authorization": f"Bearer {tenant_key}"}
    ).get_json()
    first, second = body["attempts"]
    assert (first["number"], first["outcome"], first["code"]) == (1, "retry", "451 4.7.1")
    assert (second["number"], second["outcome"], second["code"]) == (2, "sent", "250")
    assert first["server"] == "acme-smtp"
    assert first["startedAt"].endswith("Z")
    assert first["ambiguous"] is False
    assert "worker" not in first
    seen = client.get(
        f"/api/v1/mail/{rid}",
        query_string={"tenantId": acme},
        headers={"Authorization": f"Bearer {operator_key}"},
    ).get_json()
    assert ":" in seen["attempts"][0]["worker"]
    # Another tenant learns nothing, attempts included.
    assert (
        client.get(
            f"/api/v1/mail/{rid}", headers={"Authorization": f"Bearer {other_key}"}
        ).status_code
        == 404
    )


def test_the_record_page_shows_attempts_events_and_actions_in_time_order(
    app: Flask, smtp: ScriptedSmtpServer, acme: int
) -> None:
    from tests.integration.test_portal_templates import Portal, user

    user("admin@acme.test", "tenant_admin", acme)
    db.session.commit()
    smtp.fail_next(1, "451 4.7.1 Greylisted", stage="rcpt")
    rid = accept_mail(app, acme)
    drain(app, policy=FAST)
    portal = Portal(app, "admin@acme.test")
    page = portal.get(f"/mail-records/{rid}")
    assert page.status_code == 200
    text = page.text
    order = [
        text.index("Accepted</span>"),
        text.index("Attempt 1: Failed; will be retried"),
        text.index("Attempt 2: Accepted by the server"),
    ]
    assert order == sorted(order)
    assert "451 4.7.1" in text
    assert "acme-smtp" in text
    assert "worker " not in text  # the worker process is for platform operators


def test_a_retry_pressed_by_a_person_is_on_the_timeline_with_who_did_it(
    app: Flask, smtp: ScriptedSmtpServer, acme: int
) -> None:
    from tests.integration.test_portal_templates import Portal, user

    user("admin@acme.test", "tenant_admin", acme)
    db.session.commit()
    smtp.fail_next(1, "550 5.1.1 No such user", stage="rcpt")
    rid = accept_mail(app, acme)
    drain(app, policy=FAST)
    assert record(rid).status == "Failed"
    # The refusal put the address on the suppression list; the admin, told it works again,
    # takes it off and retries anyway (a refused recipient would be refused again, as far as
    # the product can tell).
    assert suppression.unsuppress(
        db.session(), acme, "mail", "ann@example.com", by="admin@acme.test", reason="fixed"
    )
    db.session.commit()
    portal = Portal(app, "admin@acme.test")
    anyway = {"confirm": "yes", "anyway": "RECIPIENT_REFUSED"}
    assert portal.post(f"/mail-records/{rid}/retry", anyway).status_code in (302, 303)
    drain(app, policy=FAST)
    text = portal.get(f"/mail-records/{rid}").text
    order = [
        text.index("Attempt 1: Refused; not retried"),
        text.index("Retry pressed"),
        text.index("retried anyway: would fail again (RECIPIENT_REFUSED)"),
        text.index("Attempt 2: Accepted by the server"),
    ]
    assert order == sorted(order)
    assert "by admin@acme.test" in text


def test_an_attempts_eml_is_the_message_as_sent_without_bcc(
    app: Flask, smtp: ScriptedSmtpServer, acme: int
) -> None:
    from email import message_from_bytes
    from email.utils import parsedate_to_datetime

    from tests.integration.test_portal_templates import Portal, user

    user("admin@acme.test", "tenant_admin", acme)
    user("other@globex.test", "tenant_admin", tenant("globex").id)
    db.session.commit()
    rid = accept_mail(app, acme, cc=["cc@example.com"], bcc=["secret@example.com"])
    drain(app, policy=FAST)
    (sent,) = smtp.messages
    (attempt,) = attempts("mail", rid)
    portal = Portal(app, "admin@acme.test")
    download = portal.get(f"/mail-records/{rid}/attempts/1.eml")
    assert download.status_code == 200
    assert download.mimetype == "message/rfc822"
    assert "attachment" in download.headers["Content-Disposition"]
    rebuilt = message_from_bytes(download.data)
    assert rebuilt["Message-ID"] == sent.message["Message-ID"] == record(rid).message_id_header
    assert rebuilt["Subject"] == sent.message["Subject"]
    assert rebuilt["To"] == sent.message["To"]
    assert rebuilt["Cc"] == "cc@example.com"
    assert rebuilt["Bcc"] is None
    assert b"secret@example.com" not in download.data
    assert abs(parsedate_to_datetime(rebuilt["Date"]) - attempt.started_at) < timedelta(seconds=1)
    assert rebuilt.get_payload() == sent.message.get_payload()  # the same body, as sent
    page = portal.get(f"/mail-records/{rid}/attempts/1")
    assert page.status_code == 200
    assert "Message-ID" in page.text
    assert "was saved after this attempt" not in page.text
    # The server saved since: the page says the From may differ.
    server = db.session.scalar(
        select(MailSendServerConfig).where(MailSendServerConfig.tenant_id == acme)
    )
    assert server is not None
    server.from_name = "Changed"
    server.updated_time = datetime.now(UTC)
    db.session.commit()
    assert "was saved after this attempt" in portal.get(f"/mail-records/{rid}/attempts/1").text
    # No such attempt, another tenant's record: 404.
    assert portal.get(f"/mail-records/{rid}/attempts/2.eml").status_code == 404
    other = Portal(app, "other@globex.test")
    assert other.get(f"/mail-records/{rid}/attempts/1.eml").status_code == 404
    assert other.get(f"/mail-records/{rid}/attempts/1").status_code == 404


def test_ids_and_codes_the_database_would_refuse_are_kept_cleaned(app: Flask, acme: int) -> None:
    # A provider's id with a NUL, and longer than the column: before, the Sent write failed
    # on it and the record was swept and sent again. Kept as a webhook's event would keep it.
    rid = accept_sms(app, acme)
    (held,) = claim.claim_due(db.engine, SmsSendRecord, 1)
    claimed = Claimed(Channel.SMS, held.id, held.version, held.tenant_id, held.retry_count)
    hostile = " SM\x00" + "x" * 300
    attempt = Attempt(datetime.now(UTC), 0.1, None, "gateway", "201", None)
    assert sent_write.record_sent(db.engine, claimed, hostile, attempt=attempt)
    expected = ("SM" + "x" * 300)[:200]
    assert sms_record(rid).provider_message_id == expected
    (row,) = attempts("sms", rid)
    assert row.provider_message_id == expected

    # A provider's code over the dead letter's column, with a NUL: the record still becomes a
    # dead letter (before, the whole write rolled back and the record was sent again).
    mid = accept_mail(app, acme)
    (held_mail,) = claim.claim_due(db.engine, MailSendRecord, 1)
    last = Claimed(Channel.MAIL, held_mail.id, held_mail.version, acme, held_mail.retry_count)
    code = "PROVIDER_" + "Z" * 150 + "\x00"
    none_left = BackoffPolicy(max_retries=0, base_s=0.02, quota_floor_s=0.05, retry_after_cap_s=1)
    decision = outcomes.handle_failure(db.engine, last, code, "gone\x00 away", policy=none_left)
    assert decision is not None
    assert record(mid).status == "DeadLetter"
    (dead,) = db.session.scalars(
        select(DeadLetterMessage).where(DeadLetterMessage.event_id == str(mid))
    ).all()
    assert dead.error_code == code[:100]
    assert dead.reason == "gone\ufffd away"
    assert dead.payload["errorCode"] == code[:100]
