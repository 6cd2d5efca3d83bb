"""Deadlines checked at each claim: expiresAt -> Failed EXPIRED instead of being sent; a
provider's retry window after the first claim -> Failed RETRY_WINDOW_EXPIRED, or Uncertain
when an earlier attempt was ambiguous (seed 002)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from flask import Flask
from sqlalchemy import update

from portal.extensions import db
from portal.models import MailSendRecord, SmsSendRecord
from tests.conftest import make_tenant
from tests.support.delivery import accept_mail, drain, mail_server, record
from tests.support.sms import accept_sms, drain_sms, provider, sms_record
from tests.support.sms_provider import FakeSmsProvider
from tests.support.smtp_server import ScriptedSmtpServer


@pytest.fixture
def sms_server() -> Iterator[FakeSmsProvider]:
    with FakeSmsProvider(hang_s=2.0) as running:
        yield running


def test_an_expired_mail_fails_instead_of_being_sent(app: Flask, smtp: ScriptedSmtpServer) -> None:
    acme = make_tenant("acme").id
    mail_server(acme, smtp)
    db.session.commit()
    soon = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    late = accept_mail(app, acme, expiresAt=soon)
    fine = accept_mail(app, acme, expiresAt=soon)
    db.session.execute(
        update(MailSendRecord)
        .where(MailSendRecord.id == late)
        .values(expires_at=datetime.now(UTC) - timedelta(seconds=5))
    )
    db.session.commit()
    drain(app)
    row = record(late)
    assert (row.status, row.error_code) == ("Failed", "EXPIRED")
    assert record(fine).status == "Sent"
    assert len(smtp.messages) == 1


def _stale_retry(rid: int, *, ambiguous: bool) -> None:
    db.session.execute(
        update(SmsSendRecord)
        .where(SmsSendRecord.id == rid)
        .values(
            first_claimed_at=datetime.now(UTC) - timedelta(hours=24),
            status="Retry",
            next_retry_at=datetime.now(UTC) - timedelta(seconds=1),
            ambiguous_attempt=ambiguous,
        )
    )
    db.session.commit()


@pytest.mark.parametrize(("ambiguous", "status"), [(False, "Failed"), (True, "Uncertain")])
def test_no_automatic_retry_past_the_providers_window(
    app: Flask, sms_server: FakeSmsProvider, ambiguous: bool, status: str
) -> None:
    acme = make_tenant("acme").id
    provider(acme, "http_json", sms_server, retry_window_s=23 * 3600)
    db.session.commit()
    sms_server.script("+447400123456", "server_error")
    rid = accept_sms(app, acme)
    drain_sms(app, until=lambda: sms_record(rid).status == "Retry")
    assert len(sms_server.requests) == 1
    _stale_retry(rid, ambiguous=ambiguous)
    drain_sms(app)
    row = sms_record(rid)
    assert (row.status, row.error_code, row.ambiguous_attempt) == (
        status,
        "RETRY_WINDOW_EXPIRED",
        ambiguous,
    )
    assert len(sms_server.requests) == 1  # never sent again


def test_within_the_window_the_retry_goes_out(app: Flask, sms_server: FakeSmsProvider) -> None:
    acme = make_tenant("acme").id
    provider(acme, "http_json", sms_server, retry_window_s=23 * 3600)
    db.session.commit()
    sms_server.script("+447400123456", "server_error")
    rid = accept_sms(app, acme)
    drain_sms(app)
    assert sms_record(rid).status == "Sent"
    assert len(sms_server.requests) == 2
