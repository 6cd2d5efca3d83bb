"""Retention on real PostgreSQL and SQLite: what the chore deletes and what
it must keep, ids never reused, and forgetting a recipient."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from flask import Flask
from sqlalchemy import func, select, update

from portal.extensions import db
from portal.importer import ConfigImportError, import_config
from portal.messaging.after_send import suppression
from portal.messaging.records import retention
from portal.models import (
    CallbackDelivery,
    CallbackEndpoint,
    Channel,
    DeadLetterMessage,
    DeliveryEvent,
    MailSendRecipient,
    MailSendRecord,
    MailSendSubject,
    RecipientToken,
    SmsSendRecord,
    Suppression,
    Tenant,
    TenantMessageUsage,
)
from tests.support.delivery import accept_mail

OLD = datetime.now(UTC) - timedelta(days=40)


def mail(app: Flask, tenant_id: int, status: str, **values: Any) -> int:
    rid = accept_mail(app, tenant_id, to=[f"{status.lower()}-{values.pop('n', 0)}@example.com"])
    db.session.execute(
        update(MailSendRecord)
        .where(MailSendRecord.id == rid)
        .values(status=status, updated_time=values.pop("updated_time", OLD), **values)
    )
    db.session.commit()
    return rid


def count(model: Any, *where: Any) -> int:
    db.session.expire_all()
    return db.session.scalar(select(func.count()).select_from(model).where(*where)) or 0


def test_the_chore_deletes_what_is_past_retention_and_keeps_the_rest(any_app: Flask) -> None:
    acme = Tenant(slug="acme", name="Acme", mail_retention_days=30)
    forever = Tenant(slug="forever", name="Forever")
    db.session.add_all([acme, forever])
    db.session.commit()
    app = any_app
    settings = app.config["SETTINGS"]
    gone = [mail(app, acme.id, s, n=i) for i, s in enumerate(("Sent", "Failed", "Cancelled"))]
    db.session.add(
        DeliveryEvent(
            tenant_id=acme.id,
            channel="mail",
            config_id=1,
            provider="generic",
            dedup_key="e1",
            event_type="delivered",
            record_id=gone[0],
        )
    )
    triaged = mail(app, acme.id, "DeadLetter", n=9)
    db.session.add(
        DeadLetterMessage(
            tenant_id=acme.id,
            source="SendExhausted",
            channel="mail",
            event_id=str(triaged),
            attempts=5,
            status="Resolved",
        )
    )
    kept = [
        mail(app, acme.id, "Pending", n=1),
        mail(app, acme.id, "Retry", n=2),
        mail(app, acme.id, "Sending", n=3),
        mail(app, acme.id, "Uncertain", n=4),
        mail(app, acme.id, "Sent", n=5, updated_time=datetime.now(UTC) - timedelta(days=29)),
        mail(app, acme.id, "Sent", n=6, expires_at=datetime.now(UTC) + timedelta(days=1)),
        mail(app, acme.id, "Failed", n=7, first_claimed_at=datetime.now(UTC) - timedelta(hours=1)),
        mail(app, forever.id, "Sent", n=8),
    ]
    untriaged = mail(app, acme.id, "DeadLetter", n=10)
    db.session.add(
        DeadLetterMessage(
            tenant_id=acme.id,
            source="SendExhausted",
            channel="mail",
            event_id=str(untriaged),
            attempts=5,
            status="Pending",
        )
    )
    endpoint = CallbackEndpoint(tenant_id=acme.id, name="e", url="http://127.0.0.1:9/", events=",")
    endpoint.secret = "whsec_" + "A" * 32
    db.session.add(endpoint)
    db.session.flush()
    waiting = mail(app, acme.id, "Sent", n=11)
    db.session.add(
        CallbackDelivery(
            tenant_id=acme.id,
            endpoint_id=endpoint.id,
            channel="mail",
            record_id=waiting,
            event_type="mail.sent",
            payload={},
            status="pending",
        )
    )
    db.session.add(
        DeliveryEvent(
            tenant_id=acme.id,
            channel="mail",
            config_id=1,
            provider="generic",
            dedup_key="early",
            event_type="delivered",
            received_at=datetime.now(UTC) - timedelta(days=8),
        )
    )
    db.session.add(TenantMessageUsage(tenant_id=acme.id, month="2020-01", mail_count=3))
    suppression.suppress(db.session(), acme.id, "mail", "sent-0@example.com", "manual")
    db.session.commit()
    kept += [untriaged, waiting]

    report = retention.purge(db.engine, settings, batch=2)
    assert report.deleted["mail_records"] == 4
    assert report.deleted["dead_letters"] == 1
    assert report.deleted["early_events"] == 1
    assert report.deleted["events"] == 1
    assert report.deleted["recipients"] == 4
    remaining = set(db.session.scalars(select(MailSendRecord.id)))
    assert remaining == set(kept)
    assert count(MailSendRecipient, MailSendRecipient.record_id.in_([*gone, triaged])) == 0
    assert count(TenantMessageUsage) == 1
    assert count(Suppression) == 1
    assert count(DeadLetterMessage) == 1
    db.session.rollback()  # SQLite: an open read would block the purge's writes
    assert retention.purge(db.engine, settings).deleted == {}
    # Ids are never reused, on either dialect: purge everything, send, the id is above.
    top = max(remaining)
    db.session.execute(
        update(MailSendRecord).values(
            status="Sent", updated_time=OLD, expires_at=None, first_claimed_at=None
        )
    )
    db.session.execute(update(DeadLetterMessage).values(status="Resolved"))
    db.session.execute(update(CallbackDelivery).values(status="delivered"))
    db.session.execute(update(Tenant).values(mail_retention_days=2))
    db.session.commit()
    retention.purge(db.engine, settings)
    assert count(MailSendRecord) == 0
    db.session.rollback()
    assert accept_mail(app, acme.id) > top


def test_counting_and_oldest_kept(app: Flask) -> None:
    acme = Tenant(slug="acme", name="Acme")
    db.session.add(acme)
    db.session.commit()
    mail(app, acme.id, "Sent")
    mail(app, acme.id, "Pending", n=1)
    settings = app.config["SETTINGS"]
    assert retention.count_purgeable(db.session(), acme.id, Channel.MAIL, 30, settings) == 1
    assert retention.count_purgeable(db.session(), acme.id, Channel.MAIL, 60, settings) == 0
    assert retention.oldest_kept(db.session(), acme.id, Channel.MAIL) is not None
    assert retention.oldest_kept(db.session(), acme.id, Channel.SMS) is None
    assert retention.days_problem(1)
    assert retention.days_problem(2) is None


def test_forget_a_recipient_keeps_its_suppression_by_hash(app: Flask) -> None:
    acme = Tenant(slug="acme", name="Acme")
    other = Tenant(slug="other", name="Other")
    db.session.add_all([acme, other])
    db.session.commit()
    rid = accept_mail(app, acme.id, to=["Ann@Example.com"])
    accept_mail(app, acme.id, to=["bob@example.com"], cc=["ann@example.com"])
    kept = accept_mail(app, acme.id, to=["bob@example.com"])
    theirs = accept_mail(app, other.id, to=["ann@example.com"])
    suppression.suppress(db.session(), acme.id, "mail", "ann@example.com", "hard_bounce")
    db.session.add(
        DeliveryEvent(
            tenant_id=acme.id,
            channel="mail",
            config_id=1,
            provider="generic",
            dedup_key="x",
            event_type="bounced",
            recipient="ann@example.com",
        )
    )
    # The recipient pages' token rows hold the address in clear: they go too.
    for tenant_id, token in ((acme.id, "t-acme"), (other.id, "t-other")):
        db.session.add(
            RecipientToken(
                token=token, tenant_id=tenant_id, channel="mail", address="ann@example.com"
            )
        )
    db.session.commit()
    done = retention.forget(db.session(), acme.id, Channel.MAIL, "ANN@example.com")
    db.session.commit()
    assert done["recipient_tokens"] == 1
    assert set(db.session.scalars(select(RecipientToken.token))) == {"t-other"}
    assert done["mail_records"] == 2
    assert done["suppressions_hashed"] == 1
    assert set(db.session.scalars(select(MailSendRecord.id))) == {kept, theirs}
    assert count(MailSendRecipient, MailSendRecipient.address == "ann@example.com") == 1  # other's
    assert count(DeliveryEvent) == 0
    row = db.session.scalar(select(Suppression))
    assert row is not None
    assert row.address.startswith("sha256:")
    assert row.reason == "hard_bounce"
    assert suppression.active(db.session(), acme.id, "mail", "ann@example.com") is not None
    assert rid not in set(db.session.scalars(select(MailSendRecord.id)))
    with pytest.raises(suppression.InvalidAddress):
        retention.forget(db.session(), acme.id, Channel.SMS, "not a number")
    assert count(SmsSendRecord) == 0


def test_import_config_sets_retention(app: Flask) -> None:
    import_config(
        db.session(), {"tenants": [{"slug": "acme", "name": "Acme", "mailRetentionDays": 7}]}
    )
    db.session.commit()
    tenant = db.session.scalar(select(Tenant).where(Tenant.slug == "acme"))
    assert tenant is not None
    assert (tenant.mail_retention_days, tenant.sms_retention_days) == (7, None)
    with pytest.raises(ConfigImportError, match="smsRetentionDays"):
        import_config(
            db.session(), {"tenants": [{"slug": "acme", "name": "Acme", "smsRetentionDays": 1}]}
        )
    db.session.rollback()


def test_a_forgotten_recipient_stays_suppressed_at_delivery(app: Flask) -> None:
    """The delivery path's own check finds a suppression kept only by hash: a later mail to
    the forgotten address ends Suppressed, not sent."""
    from portal.messaging.sending.preparation import suppressed_recipients

    acme = Tenant(slug="acme", name="Acme")
    db.session.add(acme)
    db.session.commit()
    suppression.suppress(db.session(), acme.id, "mail", "ann@example.com", "hard_bounce")
    db.session.commit()
    retention.forget(db.session(), acme.id, Channel.MAIL, "ann@example.com")
    db.session.commit()
    later = accept_mail(app, acme.id, to=["Ann@Example.com"], cc=["bob@example.com"])
    record = db.session.get(MailSendRecord, later)
    assert record is not None
    blocked, total = suppressed_recipients(db.engine, record)
    assert total == 2
    assert list(blocked) == ["ann@example.com"]
    assert "hard bounce" in blocked["ann@example.com"]


def test_a_recipient_token_goes_with_the_last_record_to_its_address(any_app: Flask) -> None:
    """The recipient pages' token rows hold the address in clear: the purge batch that takes a
    recipient's last record (mail or SMS) takes its token too, and the search then finds
    nothing; a recipient with a record left keeps its token, and so does the same address in a
    tenant whose records stay."""
    from portal.messaging.records import search
    from portal.web.records.recipients import token_for
    from tests.integration.test_portal_records import mail as mail_row
    from tests.integration.test_portal_records import sms as sms_row

    acme = Tenant(slug="acme", name="Acme", mail_retention_days=30, sms_retention_days=30)
    forever = Tenant(slug="forever", name="Forever")
    db.session.add_all([acme, forever])
    db.session.commit()
    old = {"status": "Sent", "updated_time": OLD}
    recent = {"status": "Sent", "updated_time": datetime.now(UTC) - timedelta(days=1)}
    gone_mail = [mail_row(acme.id, to="ann@example.com", **old) for _ in range(3)]
    mail_row(acme.id, to="bob@example.com", **old)
    bob_kept = mail_row(acme.id, to="bob@example.com", **recent)
    theirs = mail_row(forever.id, to="ann@example.com", **old)
    gone_sms = [sms_row(acme.id, number="+447911000001", **old) for _ in range(2)]
    sms_row(acme.id, number="+447911000002", **old)
    sms_kept = sms_row(acme.id, number="+447911000002", **recent)
    wanted = [
        (acme.id, "mail", "ann@example.com"),
        (acme.id, "mail", "bob@example.com"),
        (forever.id, "mail", "ann@example.com"),
        (acme.id, "sms", "+447911000001"),
        (acme.id, "sms", "+447911000002"),
        (acme.id, "mail", "carol@example.com"),  # never had a record here: not retention's
    ]
    with any_app.test_request_context():
        tokens = {row: token_for(*row) for row in wanted}
    for (tenant_id, channel, address), token in tokens.items():
        db.session.add(
            RecipientToken(token=token, tenant_id=tenant_id, channel=channel, address=address)
        )
    db.session.commit()

    report = retention.purge(db.engine, any_app.config["SETTINGS"], batch=2, between=lambda _: None)
    assert report.deleted["recipient_tokens"] == 2
    assert report.deleted["mail_records"] == 4
    assert report.deleted["sms_records"] == 3
    assert report.deleted["subjects"] == 4
    db.session.expire_all()
    left = set(db.session.scalars(select(RecipientToken.token)))
    assert left == {
        tokens[acme.id, "mail", "bob@example.com"],
        tokens[forever.id, "mail", "ann@example.com"],
        tokens[acme.id, "sms", "+447911000002"],
        tokens[acme.id, "mail", "carol@example.com"],
    }
    assert set(db.session.scalars(select(MailSendRecord.id))) == {bob_kept, theirs}
    assert set(db.session.scalars(select(SmsSendRecord.id))) == {sms_kept}
    assert count(MailSendSubject, MailSendSubject.record_id.in_(gone_mail)) == 0

    def found(channel: Channel, typed: str) -> list[int]:
        model = MailSendRecord if channel is Channel.MAIL else SmsSendRecord
        where = search.conditions(
            search.interpret(typed, "GB"), channel, lambda column: column == acme.id
        )
        assert where is not None
        return list(db.session.scalars(select(model.id).where(where)))

    assert found(Channel.MAIL, "ann@example.com") == []
    assert found(Channel.MAIL, "bob@example.com") == [bob_kept]
    assert found(Channel.SMS, "+447911000001") == []
    assert found(Channel.SMS, "+447911000002") == [sms_kept]
    assert not set(gone_sms) & set(db.session.scalars(select(SmsSendRecord.id)))
    db.session.rollback()  # SQLite: an open read would block the purge's writes
    assert retention.purge(db.engine, any_app.config["SETTINGS"]).deleted == {}
