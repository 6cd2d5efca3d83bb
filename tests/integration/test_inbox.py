"""The inbox: each trigger writes its notice exactly once per occurrence,
the bell counts unread per user, mark read and mark all read; and the retention page."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from flask import Flask
from sqlalchemy import func, select, update

from portal.extensions import db
from portal.messaging.after_send import inbox
from portal.messaging.sending.quota import current_month
from portal.models import (
    AuditEvent,
    BreakerState,
    CallbackEndpoint,
    DeadLetterMessage,
    MailReceiveConfig,
    MailReceiveState,
    MailSendRecord,
    MailSendServerConfig,
    Notification,
    Tenant,
    TenantMessageQuota,
    TenantMessageUsage,
)
from portal.tenancy import PLATFORM_TENANT_ID
from tests.conftest import make_tenant
from tests.integration.test_portal_templates import Portal, user
from tests.support.delivery import accept_mail


@pytest.fixture
def world(app: Flask) -> dict[str, Any]:
    acme, globex = make_tenant("acme"), make_tenant("globex")
    user("admin@acme.test", "tenant_admin", acme.id)
    user("other@acme.test", "tenant_admin", acme.id)
    user("support@acme.test", "support", acme.id)
    user("operator@postroom.test", "platform_operator", PLATFORM_TENANT_ID)
    db.session.commit()
    return {"acme": acme.id, "globex": globex.id}


def keys(tenant_id: int) -> list[str]:
    db.session.expire_all()
    return sorted(
        db.session.scalars(
            select(Notification.dedup_key).where(Notification.tenant_id == tenant_id)
        )
    )


def scan_twice() -> None:
    inbox.scan(db.engine)
    assert inbox.scan(db.engine) == 0  # a second look at the same state writes nothing


def test_quota_thresholds_once_per_threshold_per_month(app: Flask, world: dict[str, Any]) -> None:
    acme = world["acme"]
    month = current_month()
    db.session.add(TenantMessageQuota(tenant_id=acme, mail_monthly_limit=100))
    db.session.add(TenantMessageUsage(tenant_id=acme, month=month, mail_count=85))
    db.session.commit()
    scan_twice()
    assert keys(acme) == [f"quota:mail:{month}:80"]
    db.session.execute(update(TenantMessageUsage).values(mail_count=100))
    db.session.commit()
    scan_twice()
    assert keys(acme) == [f"quota:mail:{month}:{t}" for t in (100, 80, 90)]


def test_server_down_and_back_up_tenants_hear_of_the_platform_unnamed(
    app: Flask, world: dict[str, Any]
) -> None:
    acme = world["acme"]
    own = MailSendServerConfig(tenant_id=acme, name="acme-smtp", host="127.0.0.1", port=1)
    platform = MailSendServerConfig(
        tenant_id=PLATFORM_TENANT_ID, name="secret-relay", host="127.0.0.1", port=1
    )
    db.session.add_all([own, platform])
    db.session.flush()
    since = datetime.now(UTC) - timedelta(minutes=1)
    for server in (own, platform):
        db.session.add(
            BreakerState(channel="mail", config_id=server.id, down_since=since, streak=[])
        )
    db.session.commit()
    scan_twice()
    titles = db.session.scalars(
        select(Notification.title).where(Notification.tenant_id == acme).order_by(Notification.id)
    ).all()
    assert "Mail server acme-smtp is failing" in titles
    assert "The platform's mail service is degraded" in titles
    assert not any("secret-relay" in t for t in titles)
    assert any("secret-relay" in k for k in db.session.scalars(select(Notification.title)))
    db.session.execute(update(BreakerState).values(down_since=None))
    db.session.commit()
    scan_twice()
    ups = db.session.scalars(
        select(Notification.title).where(Notification.kind == "server_up")
    ).all()
    assert sorted(ups) == sorted(
        [
            "Mail server acme-smtp is back up",
            "Mail server secret-relay is back up",
            "The platform's mail service is back to normal",
            "The platform's mail service is back to normal",  # globex too
        ]
    )


def test_dead_letters_decisions_and_mailboxes(app: Flask, world: dict[str, Any]) -> None:
    acme = world["acme"]
    for _ in range(3):
        db.session.add(
            DeadLetterMessage(tenant_id=acme, source="SendExhausted", channel="mail", attempts=5)
        )
    rid = accept_mail(app, acme)
    db.session.execute(
        update(MailSendRecord).where(MailSendRecord.id == rid).values(status="Uncertain")
    )
    box = MailReceiveConfig(tenant_id=acme, name="bounces", host="127.0.0.1", username="u")
    db.session.add(box)
    db.session.flush()
    db.session.add(
        MailReceiveState(
            config_id=box.id,
            folder="INBOX",
            last_error="login refused",
            last_error_at=datetime.now(UTC) - timedelta(minutes=16),
        )
    )
    db.session.commit()
    scan_twice()
    kinds = sorted(
        db.session.scalars(select(Notification.kind).where(Notification.tenant_id == acme))
    )
    assert kinds == ["dead_letters", "decision", "mailbox"]
    assert (
        "dead_letters"
        in db.session.scalars(
            select(Notification.kind).where(Notification.tenant_id == PLATFORM_TENANT_ID)
        ).all()
    )


def test_callback_trouble_once(app: Flask, world: dict[str, Any]) -> None:
    endpoint = CallbackEndpoint(tenant_id=world["acme"], name="hook", url="http://127.0.0.1:9/")
    endpoint.event_list = ["mail.sent"]
    endpoint.secret = "whsec_" + "A" * 32
    db.session.add(endpoint)
    db.session.commit()
    for _ in range(3):
        inbox.callback_trouble(db.engine, endpoint.id, 1, paused=False)
    inbox.callback_trouble(db.engine, endpoint.id, None, paused=True)
    assert sorted(
        db.session.scalars(select(Notification.kind).where(Notification.tenant_id == world["acme"]))
    ) == ["callback_dead", "callback_paused"]


def test_the_bell_and_marking_read_are_per_user(app: Flask, world: dict[str, Any]) -> None:
    acme = world["acme"]
    for i in range(3):
        inbox.notify(
            db.session(), inbox.Notice(acme, "quota", f"k{i}", f"Notice {i}", None, "/quotas/")
        )
    inbox.notify(db.session(), inbox.Notice(world["globex"], "quota", "g", "Globex only"))
    db.session.commit()
    admin = Portal(app, "admin@acme.test")
    bell = admin.get("/inbox/bell").text
    assert ">3<" in bell
    # The swapped-in bell polls every minute; with "load" it would ask again at once, forever.
    assert 'hx-trigger="every 60s"' in bell
    page = admin.get("/inbox/")
    assert "Notice 2" in page.text
    assert "Globex only" not in page.text
    first = db.session.scalar(select(Notification.id).where(Notification.dedup_key == "k0"))
    answer = admin.post(f"/inbox/{first}/read", htmx=True)
    assert answer.status_code == 200
    assert "Mark read" not in answer.text
    assert ">2<" in admin.get("/inbox/bell").text
    other = Portal(app, "other@acme.test")
    assert ">3<" in other.get("/inbox/bell").text
    assert admin.post("/inbox/read-all").status_code == 303
    assert "badge" not in admin.get("/inbox/bell").text
    globex_id = db.session.scalar(select(Notification.id).where(Notification.dedup_key == "g"))
    assert admin.post(f"/inbox/{globex_id}/read").status_code == 404
    assert Portal(app, "support@acme.test").get("/inbox/").status_code == 403


def test_the_retention_page_asks_before_deleting_and_forgets(
    app: Flask, world: dict[str, Any]
) -> None:
    acme = world["acme"]
    rid = accept_mail(app, acme, to=["ann@example.com"])
    db.session.execute(
        update(MailSendRecord)
        .where(MailSendRecord.id == rid)
        .values(status="Sent", updated_time=datetime.now(UTC) - timedelta(days=10))
    )
    db.session.commit()
    admin = Portal(app, "admin@acme.test")
    assert "kept forever" in admin.get("/retention/").text
    bad = admin.post("/retention/", {"mail_days": "1", "sms_days": ""})
    assert bad.status_code == 422
    assert "at least 2" in bad.text
    ask = admin.post("/retention/", {"mail_days": "7", "sms_days": ""})
    assert ask.status_code == 200
    assert "<strong>1</strong>" in ask.text
    db.session.expire_all()
    assert db.session.get(Tenant, acme).mail_retention_days is None  # type: ignore[union-attr]
    done = admin.post("/retention/", {"mail_days": "7", "sms_days": "", "confirm": "yes"})
    assert done.status_code == 303
    db.session.expire_all()
    assert db.session.get(Tenant, acme).mail_retention_days == 7  # type: ignore[union-attr]
    assert "7 days" in admin.get("/retention/").text
    ask = admin.post("/retention/forget", {"channel": "mail", "address": "Ann@Example.com"})
    assert ask.status_code == 200
    assert "1 mail record" in ask.text
    assert admin.post("/retention/forget", {"channel": "sms", "address": "x"}).status_code == 422
    done = admin.post(
        "/retention/forget",
        {"channel": "mail", "address": "ann@example.com", "confirm": "yes"},
    )
    assert done.status_code == 303
    assert db.session.scalar(select(func.count()).select_from(MailSendRecord)) == 0
    row = db.session.scalar(select(AuditEvent).where(AuditEvent.action == "recipient_forget"))
    assert row is not None
    assert "ann@example.com" not in (row.remark or "") + str(row.target_id)


def test_notices_by_mail_once_and_never_about_themselves(app: Flask, world: dict[str, Any]) -> None:
    acme = world["acme"]
    user("mailme@example.com", "tenant_admin", acme)  # an address acceptance takes
    db.session.commit()
    admin = Portal(app, "mailme@example.com")
    assert admin.post("/inbox/mail", {"on": "1"}).status_code == 303
    # An address acceptance refuses (a reserved domain) keeps the notice in the inbox only.
    Portal(app, "admin@acme.test").post("/inbox/mail", {"on": "1"})
    for _ in range(2):
        inbox.notify(db.session(), inbox.Notice(acme, "quota", "q1", "Quota at 80 %"))
    db.session.commit()
    mails = db.session.scalars(
        select(MailSendRecord).where(MailSendRecord.business_key.startswith("notice:"))
    ).all()
    assert len(mails) == 1  # the other admin did not ask; the second notify was no notice
    assert mails[0].to_addrs == ["mailme@example.com"]
    assert mails[0].tenant_id == PLATFORM_TENANT_ID
    assert mails[0].scope == "PLATFORM"
    # That mail gives up: its dead letter and its record are no occasion for a notice.
    db.session.add(
        DeadLetterMessage(
            tenant_id=PLATFORM_TENANT_ID,
            source="SendExhausted",
            channel="mail",
            event_id=str(mails[0].id),
            attempts=5,
        )
    )
    db.session.execute(
        update(MailSendRecord)
        .where(MailSendRecord.id == mails[0].id)
        .values(status="Uncertain", updated_time=datetime.now(UTC))
    )
    db.session.commit()
    inbox.scan(db.engine)
    assert keys(PLATFORM_TENANT_ID) == []
    assert admin.post("/inbox/mail", {"on": "0"}).status_code == 303
