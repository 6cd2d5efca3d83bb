"""Pressing Retry starts a new resend window, whatever the record's status (Retry, Failed,
DeadLetter) and for mail and SMS alike; the automatic schedule is held to the window it runs in.

The window (a Twilio-kind provider's own ``retry_window_s``, mail's ``RESEND_WINDOW_S``) is 60 s;
"the window has passed" is the record's first claim moved 120 s back. Records go through the
real pipeline against a real local SMTP server and a real local HTTP server playing Twilio.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from flask import Flask
from sqlalchemy import update

from portal.config import Settings
from portal.extensions import db
from portal.messaging.after_send import suppression
from portal.messaging.sending.backoff import BackoffPolicy
from portal.messaging.sending.claim import claim_due
from portal.messaging.sending.pipeline import MailContext, SmsContext, process_mail, process_sms
from portal.models import MailSendRecord, SmsSendRecord
from tests.conftest import make_api_key
from tests.integration.test_portal_records import cheap_passwords, signed_in, user
from tests.support.delivery import accept_mail, mail_server, tenant
from tests.support.sms import accept_sms, provider
from tests.support.sms_provider import FakeSmsProvider
from tests.support.smtp_server import ScriptedSmtpServer

__all__ = ["cheap_passwords"]

WINDOW_S = 60.0
NUMBER = "+447400123456"
ADDRESS = "ann@example.com"
# The first failure's automatic retry comes 100-300 s later: long after the window.
SLOW = BackoffPolicy(max_retries=5, base_s=200.0)
# Retries already used up: a temporary failure is a dead letter at once.
EXHAUSTED = BackoffPolicy(max_retries=0, base_s=200.0)

Model = type[MailSendRecord] | type[SmsSendRecord]


@dataclass
class Channel:
    """One channel's side of the scenario: its record model, a context with a 60 s window,
    how to script a failure, how many attempts the server saw, and its retry endpoints."""

    name: str
    model: Model
    tenant_id: int
    settings: Settings
    smtp: ScriptedSmtpServer | None = None
    sms: FakeSmsProvider | None = None

    @property
    def api_path(self) -> str:
        return f"/{'Mail' if self.name == 'mail' else 'Sms'}SendRecord/retry"

    @property
    def portal_path(self) -> str:
        return f"/{self.name}-records"

    def context(self, policy: BackoffPolicy) -> MailContext | SmsContext:
        if self.name == "mail":
            return MailContext(engine=db.engine, settings=self.settings, policy=policy)
        return SmsContext(engine=db.engine, settings=self.settings, policy=policy)

    def fail_next(self, how: str) -> None:
        """The next attempt fails: "transient" (SMTP 451 / HTTP 500) or "permanent"."""
        if self.smtp is not None:
            reply = "451 4.3.0 try again later" if how == "transient" else "550 5.1.1 no such user"
            self.smtp.fail_next(1, reply, stage="rcpt")
        else:
            assert self.sms is not None
            self.sms.script(NUMBER, "server_error" if how == "transient" else "refused")

    def delivered(self) -> int:
        """Messages the server or provider took."""
        if self.smtp is not None:
            return len(self.smtp.messages)
        assert self.sms is not None
        return len(self.sms.accepted())


@pytest.fixture(params=["mail", "sms"])
def channel(request: pytest.FixtureRequest, app: Flask) -> Iterator[Channel]:
    base: Settings = app.config["SETTINGS"]
    acme = tenant("acme")
    if request.param == "mail":
        with ScriptedSmtpServer() as smtp:
            mail_server(acme.id, smtp)
            db.session.commit()
            settings = base.replace(resend_window_s=WINDOW_S)
            yield Channel("mail", MailSendRecord, acme.id, settings, smtp=smtp)
        return
    with FakeSmsProvider() as server:
        provider(acme.id, "twilio", server, retry_window_s=WINDOW_S)
        db.session.commit()
        yield Channel("sms", SmsSendRecord, acme.id, base, sms=server)


def _accept(app: Flask, ch: Channel) -> int:
    if ch.name == "mail":
        return accept_mail(app, ch.tenant_id, to=[ADDRESS])
    return accept_sms(app, ch.tenant_id, phoneNumber=NUMBER)


def _attempt(ch: Channel, policy: BackoffPolicy) -> None:
    """Claim the one due record and run the pipeline on it."""
    (claimed,) = claim_due(db.engine, ch.model, 1)
    ctx = ch.context(policy)
    try:
        if isinstance(ctx, MailContext):
            assert isinstance(claimed, MailSendRecord)
            process_mail(ctx, claimed)
        else:
            assert isinstance(claimed, SmsSendRecord)
            process_sms(ctx, claimed)
    finally:
        ctx.close()


def _row(ch: Channel, rid: int) -> Any:
    db.session.expire_all()
    row = db.session.get(ch.model, rid)
    assert row is not None
    return row


def _window_passes(ch: Channel, rid: int) -> None:
    """The first claim was 120 s earlier: the 60 s window is over."""
    started = _row(ch, rid).first_claimed_at
    assert started is not None
    _set(ch, rid, first_claimed_at=started - timedelta(seconds=2 * WINDOW_S))


def _set(ch: Channel, rid: int, **values: Any) -> None:
    db.session.execute(update(ch.model).where(ch.model.id == rid).values(**values))
    db.session.commit()


def _due_now(ch: Channel, rid: int) -> None:
    """The automatic retry's time has come."""
    _set(ch, rid, next_retry_at=datetime.now(UTC) - timedelta(seconds=1))


def _in(ch: Channel, status: str, app: Flask) -> int:
    """A record that failed its first attempt and ended in ``status``, its window passed."""
    rid = _accept(app, ch)
    if status == "Retry":
        ch.fail_next("transient")
        _attempt(ch, SLOW)
    elif status == "Failed":
        ch.fail_next("permanent")
        _attempt(ch, SLOW)
        # The refusal put the recipient on the suppression list; a person who knows the
        # address works again takes it off before retrying.
        address = ADDRESS if ch.name == "mail" else NUMBER
        assert suppression.unsuppress(
            db.session(), ch.tenant_id, ch.name, address, by="test", reason="works again"
        )
        db.session.commit()
    else:
        ch.fail_next("transient")
        _attempt(ch, EXHAUSTED)
    row = _row(ch, rid)
    assert row.status == status, (row.status, row.error_code, row.error_message)
    assert row.first_claimed_at is not None
    if status == "Retry":
        # The automatic retry is scheduled long after the window.
        assert row.next_retry_at > datetime.now(UTC) + timedelta(seconds=90)
    _window_passes(ch, rid)
    return rid


@pytest.mark.parametrize("status", ["Retry", "Failed", "DeadLetter"])
def test_retry_through_the_api_starts_a_new_window(
    app: Flask, channel: Channel, status: str
) -> None:
    rid = _in(channel, status, app)
    key = make_api_key(channel.tenant_id)
    db.session.commit()
    pressed_at = datetime.now(UTC)
    answer = app.test_client().post(
        f"{channel.api_path}?id={rid}", headers={"Authorization": f"Bearer {key}"}
    )
    assert answer.status_code == 200, answer.json
    assert _row(channel, rid).first_claimed_at is None  # the next claim starts the window

    _attempt(channel, SLOW)
    row = _row(channel, rid)
    assert row.status == "Sent", (row.error_code, row.error_message)
    assert channel.delivered() == 1
    if channel.sms is not None:
        assert len(channel.sms.requests) == 2  # the failed one, then the one asked for
    # The new window runs from the claim after the press.
    assert row.first_claimed_at >= pressed_at - timedelta(seconds=5)


@pytest.mark.parametrize("status", ["Retry", "Failed", "DeadLetter"])
def test_retry_from_the_portal_starts_a_new_window(
    app: Flask, channel: Channel, status: str, cheap_passwords: None
) -> None:
    rid = _in(channel, status, app)
    user("admin@acme.example.com", "tenant_admin", channel.tenant_id)
    client, token = signed_in(app, "admin@acme.example.com")
    # A refused recipient would be refused again as far as the product can tell: the
    # person retries anyway, naming that reason.
    form = {"csrf_token": token, "confirm": "yes", "anyway": "RECIPIENT_REFUSED"}
    pressed = client.post(f"{channel.portal_path}/{rid}/retry", data=form)
    assert pressed.status_code == 302, pressed.text
    assert _row(channel, rid).status == "Retry"

    _attempt(channel, SLOW)
    assert _row(channel, rid).status == "Sent"
    assert channel.delivered() == 1


def test_the_automatic_schedule_keeps_the_old_window(app: Flask, channel: Channel) -> None:
    rid = _in(channel, "Retry", app)
    # Nobody pressed Retry: the automatic retry comes due after the window.
    _due_now(channel, rid)
    _attempt(channel, SLOW)
    row = _row(channel, rid)
    assert (row.status, row.error_code) == ("Failed", "RETRY_WINDOW_EXPIRED")
    assert channel.delivered() == 0
    if channel.sms is not None:
        assert len(channel.sms.requests) == 1  # not sent again


def test_after_a_manual_retry_the_automatic_retries_keep_the_new_window(
    app: Flask, channel: Channel
) -> None:
    rid = _in(channel, "Retry", app)
    key = make_api_key(channel.tenant_id)
    db.session.commit()
    auth = {"Authorization": f"Bearer {key}"}
    assert app.test_client().post(f"{channel.api_path}?id={rid}", headers=auth).status_code == 200
    channel.fail_next("transient")
    _attempt(channel, SLOW)  # the person's attempt fails too: back to the automatic schedule
    row = _row(channel, rid)
    assert row.status == "Retry"
    new_start = row.first_claimed_at
    assert new_start is not None
    assert new_start > datetime.now(UTC) - timedelta(seconds=30)  # the new window, kept
    # Its automatic retry comes due after the new window too: it stops, unsent.
    _window_passes(channel, rid)
    _due_now(channel, rid)
    _attempt(channel, SLOW)
    row = _row(channel, rid)
    assert (row.status, row.error_code) == ("Failed", "RETRY_WINDOW_EXPIRED")
    assert channel.delivered() == 0
