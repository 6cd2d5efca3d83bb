"""No stuck records from our own errors, and two more rules: a
provider's Retry-After is the wait, and every channel has a resend window.

Real PostgreSQL (SQLite where the rule differs), a real SMTP server (aiosmtpd, with and without
SMTPUTF8), the fake SMS provider over HTTP, and a real ``python worker.py`` for the sweep that
must go on while Redis is down.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from flask import Flask
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import select, text, update

from portal.extensions import db
from portal.messaging.records import acceptance
from portal.messaging.records.retry import retry_records
from portal.messaging.records.validation import AcceptanceError
from portal.messaging.sending.backoff import BackoffPolicy
from portal.messaging.sending.claim import claim_due
from portal.messaging.sending.pipeline import MailContext, process_mail
from portal.messaging.sending.sweeper import SWEEP_LOCK_KEY, sweep_if_overdue
from portal.messaging.sending.transports.mail_message import OutgoingMail
from portal.messaging.sending.transports.smtp import SendResult, SmtpConnectionPool, SmtpServer
from portal.models import (
    ChoreRun,
    MailSendRecord,
    MailSendServerConfig,
    SmsProviderConfig,
    SmsSendRecord,
    TenantMessageUsage,
)
from portal.tenancy import tenant_context
from tests.conftest import make_tenant
from tests.support.delivery import accept_mail, drain, mail_server, record
from tests.support.sms import accept_sms, drain_sms, provider, sms_record
from tests.support.sms_provider import FakeSmsProvider
from tests.support.smtp_server import ScriptedSmtpServer
from tests.support.sweeps import examples
from tests.support.workers import accept_abandoned, free_port, stop, wait_for, worker_group

NO_RETRY_AFTER_FLOOR = BackoffPolicy(
    max_retries=5, base_s=0.02, quota_floor_s=300.0, retry_after_cap_s=3600.0
)


def smtputf8(server: ScriptedSmtpServer, offered: bool) -> ScriptedSmtpServer:
    """Offer SMTPUTF8 or not on the server's next connections (aiosmtpd's Controller offers
    it unless ``enable_SMTPUTF8`` is False)."""
    assert server._controller is not None
    server._controller.SMTP_kwargs["enable_SMTPUTF8"] = offered
    return server


@pytest.fixture
def sms_server() -> Iterator[FakeSmsProvider]:
    with FakeSmsProvider(hang_s=2.0) as running:
        yield running


# --- 1. an unexpected error after preparation ---------------------------------------------------


class ExplodingPool(SmtpConnectionPool):
    """A transport with a bug: it raises something no handler expects."""

    def send(self, server: SmtpServer, mail: OutgoingMail) -> SendResult:
        raise RuntimeError("transport bug")


def test_a_transport_raising_after_preparation_leaves_the_record_in_retry_at_once(
    app: Flask, smtp: ScriptedSmtpServer
) -> None:
    acme = make_tenant("acme").id
    mail_server(acme, smtp)
    db.session.commit()
    rid = accept_mail(app, acme)
    settings_ = app.config["SETTINGS"]
    ctx = MailContext(
        engine=db.engine,
        settings=settings_,
        policy=BackoffPolicy.from_settings(settings_),
        pool=ExplodingPool(),
    )
    (claimed,) = claim_due(db.engine, MailSendRecord, 1)
    process_mail(ctx, claimed)
    row = record(rid)
    assert row.prepared_at is not None  # it failed after preparation's write-back
    assert (row.status, row.error_code, row.retry_count) == ("Retry", "RuntimeError", 1)
    assert not row.ambiguous_attempt
    assert row.version == 3  # claim, write-back, the failure: by the current version
    drain(app)
    assert record(rid).status == "Sent"


# --- 2. addresses acceptance takes are addresses we can send -------------------------------------


def test_an_internationalised_domain_goes_out_as_its_a_labels(
    app: Flask, smtp: ScriptedSmtpServer
) -> None:
    acme = make_tenant("acme").id
    mail_server(acme, smtp)
    db.session.commit()
    rid = accept_mail(app, acme, to=["ann@exämple.com"], cc=["bob@bücher.example"])
    drain(app)
    assert record(rid).status == "Sent"
    (message,) = smtp.messages
    assert message.rcpt_tos == ["ann@xn--exmple-cua.com", "bob@xn--bcher-kva.example"]
    assert str(message.message["To"]) == "ann@xn--exmple-cua.com"


def test_a_non_ascii_local_part_goes_out_with_smtputf8_when_offered(
    app: Flask, smtp: ScriptedSmtpServer
) -> None:
    smtputf8(smtp, True)
    acme = make_tenant("acme").id
    mail_server(acme, smtp)
    db.session.commit()
    rid = accept_mail(app, acme, to=["ü@exämple.com"])
    drain(app)
    assert record(rid).status == "Sent"
    (message,) = smtp.messages
    assert message.rcpt_tos == ["ü@xn--exmple-cua.com"]
    assert "To: ü@xn--exmple-cua.com".encode() in message.raw


def test_a_non_ascii_local_part_fails_at_once_without_smtputf8(
    app: Flask, smtp: ScriptedSmtpServer
) -> None:
    smtputf8(smtp, False)
    acme = make_tenant("acme").id
    mail_server(acme, smtp)
    db.session.commit()
    rid = accept_mail(app, acme, to=["ü@exämple.com"])
    fine = accept_mail(app, acme, to=["ann@example.com"])
    drain(app)
    row = record(rid)
    assert (row.status, row.error_code, row.retry_count) == ("Failed", "INVALID_INPUT", 0)
    assert "SMTPUTF8" in (row.error_message or "")
    assert not row.ambiguous_attempt
    assert record(fine).status == "Sent"  # the connection stayed good for the next mail
    assert [m.rcpt_tos for m in smtp.messages] == [["ann@example.com"]]


_LOCAL = st.one_of(
    st.from_regex(r"[a-zA-Z0-9!#$%&'*+/=?^_`{|}~-]{1,10}", fullmatch=True),
    st.text(alphabet=st.characters(categories=("L", "N", "M")), min_size=1, max_size=10),
    st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=10),
)
_DOMAIN = st.sampled_from(
    ["example.com", "exämple.com", "bücher.example", "пример.рф", "例え.jp", "EXAMPLE.org"]
)


def _accepted(app: Flask, tenant_id: int, address: str) -> int | None:
    """The record id, or None when acceptance refuses the address."""
    try:
        with tenant_context(tenant_id):
            result = acceptance.send_mail(
                db.session,
                {"to": [address], "subject": "Hi", "text": "Hi"},
                settings=app.config["SETTINGS"],
            )
    except AcceptanceError:
        db.session.rollback()
        return None
    db.session.commit()
    return result.id


@pytest.mark.parametrize("offer_smtputf8", [False, True])
def test_every_address_acceptance_takes_is_sent_or_failed_at_once(
    app: Flask, smtp: ScriptedSmtpServer, offer_smtputf8: bool
) -> None:
    smtputf8(smtp, offer_smtputf8)
    acme = make_tenant("acme").id
    mail_server(acme, smtp)
    db.session.commit()
    seen: dict[str, int] = {}

    @settings(
        max_examples=examples(40),
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(local=_LOCAL, domain=_DOMAIN)
    def check(local: str, domain: str) -> None:
        rid = _accepted(app, acme, f"{local}@{domain}")
        if rid is None:
            return
        drain(app)
        row = record(rid)
        wired = len(smtp.messages)
        if row.status == "Sent":
            assert wired == seen.get("sent", 0) + 1  # it is on the wire
            seen["sent"] = wired
        else:
            assert (row.status, row.error_code, row.retry_count) == ("Failed", "INVALID_INPUT", 0)
            assert not offer_smtputf8
            assert wired == seen.get("sent", 0)

    check()
    print(f"\nSMTPUTF8 {'offered' if offer_smtputf8 else 'not offered'}: {seen}")


# --- 3. the sweep goes on while Redis is down -----------------------------------------------


def _last_sweep(age_s: float | None) -> None:
    db.session.execute(ChoreRun.__table__.delete())
    if age_s is not None:
        db.session.add(
            ChoreRun(
                name="sweep-stuck-sends", last_run_at=datetime.now(UTC) - timedelta(seconds=age_s)
            )
        )
    db.session.commit()


def test_the_sweep_runs_here_only_when_overdue(any_app: Flask) -> None:
    settings_ = any_app.config["SETTINGS"]  # sweep interval 1 s: overdue after 2 s
    acme = make_tenant("acme").id
    db.session.commit()
    stuck = accept_abandoned(any_app, acme)
    db.session.execute(
        update(MailSendRecord)
        .where(MailSendRecord.id == stuck)
        .values(updated_time=datetime.now(UTC) - timedelta(seconds=30))
    )
    db.session.commit()
    _last_sweep(0.5)
    assert sweep_if_overdue(db.engine, settings_) is None
    assert record(stuck).status == "Sending"
    db.session.rollback()  # SQLite: hold no lock while the sweep writes
    _last_sweep(None)  # never ran (Redis was down from the start)
    report = sweep_if_overdue(db.engine, settings_)
    assert report is not None
    assert report.recovered == {"mail": 1}
    assert record(stuck).status == "Retry"
    db.session.rollback()
    # The sweep wrote its time: not overdue any more.
    assert sweep_if_overdue(db.engine, settings_) is None
    _last_sweep(5.0)
    assert sweep_if_overdue(db.engine, settings_) is not None


def test_one_worker_at_a_time_sweeps_on_postgresql(app: Flask) -> None:
    settings_ = app.config["SETTINGS"]
    _last_sweep(None)
    with db.engine.connect() as other, other.begin():
        assert other.scalar(text("SELECT pg_try_advisory_xact_lock(:k)"), {"k": SWEEP_LOCK_KEY})
        assert sweep_if_overdue(db.engine, settings_) is None  # another worker is at it
    assert sweep_if_overdue(db.engine, settings_) is not None


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_worker_sweeps_while_redis_is_down(
    app: Flask, smtp: ScriptedSmtpServer, tmp_path: Path
) -> None:
    acme = make_tenant("acme").id
    mail_server(acme, smtp)
    db.session.commit()
    nowhere = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens: Redis is down throughout
    env = {
        "REDIS_URL": nowhere,
        "SWEEP_INTERVAL_S": "1",
        "STUCK_SEND_THRESHOLD_S": "2",
        "MAIL_SEND_CONCURRENCY": "1",
        "SMS_SEND_CONCURRENCY": "0",
        "SCHEDULE_CHECK_S": "1",
    }
    with worker_group(tmp_path, app.config["SETTINGS"].secret_key, **env) as workers:
        stuck = accept_abandoned(app, acme)
        worker = workers.start()

        def sent() -> bool:
            db.session.rollback()
            return record(stuck).status == "Sent"

        wait_for(sent, 60.0, "the stuck record swept by the worker and sent")
        row = record(stuck)
        assert (row.retry_count, row.ambiguous_attempt) == (1, False)
        assert worker.logged(
            "stuck-send sweep overdue (the scheduler did not run it: is Redis down?); "
            "this worker ran it"
        )
        stop([worker])


# --- 4. a prepared record whose server or provider is gone ----------------------------------------


def _usage(tenant_id: int) -> tuple[int, int]:
    db.session.expire_all()
    row = db.session.scalar(
        select(TenantMessageUsage).where(TenantMessageUsage.tenant_id == tenant_id)
    )
    assert row is not None
    return row.mail_count, row.sms_count


@pytest.mark.parametrize("gone", ["disabled", "deleted"])
def test_mail_through_a_gone_server_fails_and_a_manual_retry_chooses_again(
    app: Flask, smtp: ScriptedSmtpServer, gone: str
) -> None:
    acme = make_tenant("acme").id
    first = mail_server(acme, smtp, name="first")
    db.session.commit()
    smtp.fail_next(1, "451", "rcpt")
    rid = accept_mail(app, acme)
    drain(app, until=lambda: record(rid).status == "Retry")
    prepared = record(rid)
    assert prepared.server_config_id == first.id
    message_id, subject = prepared.message_id_header, prepared.rendered_subject
    if gone == "disabled":
        db.session.execute(
            update(MailSendServerConfig)
            .where(MailSendServerConfig.id == first.id)
            .values(enabled=False)
        )
    else:
        db.session.execute(update(MailSendRecord).values(server_config_id=first.id))
        db.session.delete(db.session.get(MailSendServerConfig, first.id))
    second = mail_server(acme, smtp, name="second")
    db.session.commit()
    drain(app)
    row = record(rid)
    assert (row.status, row.error_code) == ("Failed", "CONFIG_NOT_RESOLVABLE")
    assert not smtp.messages  # never through the disabled server
    assert retry_records(db.session, MailSendRecord, [rid], acme).requeued == [rid]
    db.session.commit()
    drain(app)
    row = record(rid)
    assert (row.status, row.server_config_id) == ("Sent", second.id)
    assert (row.message_id_header, row.rendered_subject) == (message_id, subject)
    (message,) = smtp.messages
    assert message.message_id == message_id
    assert message.mail_from == "sender@second.test"
    assert _usage(acme)[0] == 1  # charged once


def test_sms_through_a_disabled_provider_fails_and_a_manual_retry_chooses_again(
    app: Flask, sms_server: FakeSmsProvider
) -> None:
    acme = make_tenant("acme").id
    first = provider(acme, "http_json", sms_server, name="first")
    db.session.commit()
    sms_server.script("+447400123456", "server_error")
    rid = accept_sms(app, acme)
    drain_sms(app, until=lambda: sms_record(rid).status == "Retry")
    db.session.execute(
        update(SmsProviderConfig).where(SmsProviderConfig.id == first.id).values(enabled=False)
    )
    second = provider(acme, "http_json", sms_server, name="second")
    db.session.commit()
    drain_sms(app)
    row = sms_record(rid)
    assert (row.status, row.error_code) == ("Failed", "CONFIG_NOT_RESOLVABLE")
    assert retry_records(db.session, SmsSendRecord, [rid], acme).requeued == [rid]
    db.session.commit()
    drain_sms(app)
    row = sms_record(rid)
    assert (row.status, row.provider_config_id) == ("Sent", second.id)
    keys = {r.headers["idempotency-key"] for r in sms_server.requests}
    assert keys == {f"postroom-sms-{rid}"}
    assert len(sms_server.requests) == 2
    assert _usage(acme)[1] == 1


# --- 5. EXPIRED and RETRY_WINDOW_EXPIRED are logged at ERROR -------------------------------------


def test_expired_is_logged_at_error(
    app: Flask, smtp: ScriptedSmtpServer, caplog: pytest.LogCaptureFixture
) -> None:
    acme = make_tenant("acme").id
    mail_server(acme, smtp)
    db.session.commit()
    rid = accept_mail(app, acme, expiresAt=(datetime.now(UTC) + timedelta(hours=1)).isoformat())
    db.session.execute(
        update(MailSendRecord)
        .where(MailSendRecord.id == rid)
        .values(expires_at=datetime.now(UTC) - timedelta(seconds=5))
    )
    db.session.commit()
    with caplog.at_level(logging.INFO, logger="portal.delivery"):
        drain(app)
    (line,) = [r for r in caplog.records if getattr(r, "error_code", None) == "EXPIRED"]
    assert line.levelno == logging.ERROR


# --- 6. Retry-After is the wait ------------------------------------------------------------------


@pytest.mark.parametrize(("cap", "waits"), [(3600.0, 65.0), (30.0, 30.0)])
def test_a_retry_after_of_65_s_waits_65_s_capped(
    app: Flask, sms_server: FakeSmsProvider, cap: float, waits: float
) -> None:
    acme = make_tenant("acme").id
    provider(acme, "twilio", sms_server)
    db.session.commit()
    sms_server.script("+447400123456", "throttled:65")
    rid = accept_sms(app, acme)
    policy = BackoffPolicy(max_retries=5, base_s=0.02, quota_floor_s=300.0, retry_after_cap_s=cap)
    drain_sms(app, until=lambda: sms_record(rid).status == "Retry", policy=policy)
    row = sms_record(rid)
    assert row.next_retry_at is not None
    assert (row.next_retry_at - row.updated_time) / timedelta(seconds=1) == pytest.approx(
        waits, abs=0.5
    )


# --- 7. a resend window on every channel ----------------------------------------------------


def _past_the_window(model: Any, rid: int, hours: float) -> None:
    db.session.execute(
        update(model)
        .where(model.id == rid)
        .values(
            first_claimed_at=datetime.now(UTC) - timedelta(hours=hours),
            status="Retry",
            next_retry_at=datetime.now(UTC) - timedelta(seconds=1),
        )
    )
    db.session.commit()


def test_mail_is_not_retried_past_the_resend_window(
    app: Flask, smtp: ScriptedSmtpServer, caplog: pytest.LogCaptureFixture
) -> None:
    acme = make_tenant("acme").id
    mail_server(acme, smtp)
    db.session.commit()
    smtp.fail_next(1, "451", "rcpt")
    rid = accept_mail(app, acme)
    drain(app, until=lambda: record(rid).status == "Retry")
    _past_the_window(MailSendRecord, rid, 24)  # RESEND_WINDOW_S: 23 h by default
    with caplog.at_level(logging.INFO, logger="portal.delivery"):
        drain(app)
    row = record(rid)
    assert (row.status, row.error_code) == ("Failed", "RETRY_WINDOW_EXPIRED")
    assert not smtp.messages
    (line,) = [
        r for r in caplog.records if getattr(r, "error_code", None) == "RETRY_WINDOW_EXPIRED"
    ]
    assert line.levelno == logging.ERROR


@pytest.mark.parametrize(
    ("window_s", "hours", "status"), [(None, 24, "Failed"), (48 * 3600.0, 24, "Sent")]
)
def test_sms_resend_window_is_the_providers_or_the_default(
    app: Flask, sms_server: FakeSmsProvider, window_s: float | None, hours: float, status: str
) -> None:
    acme = make_tenant("acme").id
    provider(acme, "http_json", sms_server, retry_window_s=window_s)
    db.session.commit()
    sms_server.script("+447400123456", "server_error")
    rid = accept_sms(app, acme)
    drain_sms(app, until=lambda: sms_record(rid).status == "Retry")
    _past_the_window(SmsSendRecord, rid, hours)
    drain_sms(app)
    row = sms_record(rid)
    assert row.status == status
    assert len(sms_server.requests) == (1 if status == "Failed" else 2)
