"""A test send from the editor is marked on its record (a badge in lists and
on its page, a filter to hide them, shown apart in the quota's usage); its subject is what the
preview showed, unchanged."""

from __future__ import annotations

from typing import Any

import pytest
from flask import Flask
from sqlalchemy import func, update

from portal.extensions import db
from portal.models import MailSendRecord, MailTemplate, SmsSendRecord
from tests.integration.test_portal_templates import Portal, mail_form, world

__all__ = ["world"]


@pytest.fixture
def admin(app: Flask, world: dict[str, Any]) -> Portal:
    return Portal(app, "admin@acme.test")


def test_a_test_send_is_marked_badged_and_can_be_hidden(
    app: Flask, world: dict[str, Any], admin: Portal
) -> None:
    template = db.session.get(MailTemplate, world["acme"]["mail"])
    assert template is not None
    response = admin.post(
        f"/mail-templates/{template.id}/send-test",
        mail_form(template, to="ann@example.com", variables='{"name": "Ann"}'),
        htmx=True,
    )
    assert response.status_code == 200, response.text
    plain = MailSendRecord(
        tenant_id=world["acme_id"], to_addrs=["bob@example.com"], subject="Plain", text_body="x"
    )
    db.session.add(plain)
    db.session.commit()
    db.session.expire_all()
    test = db.session.query(MailSendRecord).filter(MailSendRecord.is_test.is_(True)).one()
    assert test.subject is None  # the template's subject, rendered as previewed
    assert plain.is_test is False
    page = admin.get(f"/mail-records/{test.id}")
    assert 'id="test-badge"' in page.text
    assert 'id="test-badge"' not in admin.get(f"/mail-records/{plain.id}").text
    listed = admin.get("/mail-records/")
    assert listed.text.count("pill-test") == 1
    hidden = admin.get("/mail-records/?tests=hide")
    assert hidden.status_code == 200
    assert f"/mail-records/{test.id}" not in hidden.text
    assert f"/mail-records/{plain.id}" in hidden.text
    only = admin.get("/mail-records/?tests=only")
    assert f"/mail-records/{test.id}" in only.text
    assert f"/mail-records/{plain.id}" not in only.text
    assert "Choose whether" in admin.get("/mail-records/?tests=maybe").text


def test_an_sms_test_send_is_marked(app: Flask, world: dict[str, Any], admin: Portal) -> None:
    form = {
        "code": "otp",
        "name": "OTP",
        "content": "Code {{ code }}",
        "enabled": "on",
        "strict_variables": "on",
        "stream": "transactional",
        "variables": '{"code": "1"}',
        "phone": "+447911123456",
    }
    response = admin.post(f"/sms-templates/{world['acme']['sms']}/send-test", form, htmx=True)
    assert response.status_code == 200, response.text
    (record,) = db.session.query(SmsSendRecord).all()
    assert record.is_test is True
    assert 'id="test-badge"' in admin.get(f"/sms-records/{record.id}").text


def test_test_sends_are_shown_apart_in_the_quota_usage(
    app: Flask, world: dict[str, Any], admin: Portal
) -> None:
    template = db.session.get(MailTemplate, world["acme"]["mail"])
    assert template is not None
    response = admin.post(
        f"/mail-templates/{template.id}/send-test",
        mail_form(template, to="ann@example.com", variables='{"name": "Ann"}'),
        htmx=True,
    )
    assert response.status_code == 200
    assert 'id="test-sends-mail"' not in admin.get(f"/quotas/{world['acme_id']}").text
    # Prepared (and charged like any send) this month.
    db.session.execute(
        update(MailSendRecord)
        .where(MailSendRecord.is_test.is_(True))
        .values(prepared_at=func.now())
    )
    db.session.commit()
    page = admin.get(f"/quotas/{world['acme_id']}")
    assert "Of which 1 test send from the template editor." in page.text
