"""The safety net for delivery events (``events.match_waiting``, a scheduled chore): an event
stored unmatched whose record later got its provider id without either look applying it (a
process died between the two) is applied on the next run, once; others wait as they are."""

from __future__ import annotations

from flask import Flask
from sqlalchemy import select, update

from portal.delivery.chores import schedules
from portal.extensions import db
from portal.messaging.after_send import events
from portal.models import Channel, DeliveryEvent, MailSendRecord, SmsSendRecord
from tests.conftest import make_tenant
from tests.support.after_send import mail_config, mail_row, sms_config, sms_row


def _stored_unmatched(channel: Channel, tenant_id: int, config_id: int, pmid: str) -> int:
    stored = events.store(
        db.session,
        channel,
        tenant_id=tenant_id,
        config_id=config_id,
        provider="generic",
        event=events.ProviderEvent(
            f"ev-{pmid}",
            events.EventType.BOUNCED if channel is Channel.MAIL else events.EventType.DELIVERED,
            pmid,
            code="550 5.1.1",
        ),
    )
    assert stored.record_id is None
    assert stored.event_id is not None
    return stored.event_id


def test_a_waiting_event_is_applied_once_its_record_has_the_id(any_app: Flask) -> None:
    acme = make_tenant("acme").id
    server = mail_config(acme)
    provider = sms_config(acme)
    mail = mail_row(acme, server)  # Sent, provider id not written yet
    sms = sms_row(acme, provider)
    lost = mail_row(acme, server)  # never gets the id: its event keeps waiting
    ids = (mail.id, sms.id, lost.id)
    mail_event = _stored_unmatched(Channel.MAIL, acme, server.id, "<m1@smtp.test>")
    sms_event = _stored_unmatched(Channel.SMS, acme, provider.id, "SM-1")
    other_event = _stored_unmatched(Channel.MAIL, acme, server.id, "<never@smtp.test>")
    # The ids are written by a process that died before applying anything.
    db.session.execute(
        update(MailSendRecord)
        .where(MailSendRecord.id == ids[0])
        .values(provider_message_id="<m1@smtp.test>")
    )
    db.session.execute(
        update(SmsSendRecord).where(SmsSendRecord.id == ids[1]).values(provider_message_id="SM-1")
    )
    db.session.commit()

    report = events.match_waiting(db.engine)
    assert (report.looked, report.applied) == (2, 2)
    db.session.expire_all()
    rows = {e.id: e for e in db.session.scalars(select(DeliveryEvent))}
    assert rows[mail_event].record_id == ids[0]
    assert rows[sms_event].record_id == ids[1]
    assert rows[other_event].record_id is None
    failed = db.session.get(MailSendRecord, ids[0])
    assert failed is not None
    assert (failed.status, failed.delivery_outcome) == ("Failed", "bounced")
    delivered = db.session.get(SmsSendRecord, ids[1])
    assert delivered is not None
    assert delivered.delivery_outcome == "delivered"
    db.session.rollback()

    assert events.match_waiting(db.engine) == events.MatchReport(0, 0)


def test_the_safety_net_is_a_scheduled_chore() -> None:
    from tests.integration.test_chores import short_settings

    found = {s.func: s.interval_s for s in schedules(short_settings())}
    assert found["portal.delivery.chores.match_events_job"] == 300
