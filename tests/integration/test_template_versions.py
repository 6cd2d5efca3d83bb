"""Every save is an immutable version; history, diff and restore pages (admins
and operators edit, support reads, another tenant gets 404); import makes a version only when
the content changed; attachments stored once by hash; sample variables saved."""

from __future__ import annotations

import io
from typing import Any

import pytest
from flask import Flask
from redis import Redis
from sqlalchemy import func, select

from portal.extensions import db
from portal.importer import import_config
from portal.models import (
    MailSendRecord,
    MailTemplate,
    SmsTemplate,
    TemplateBlob,
    TemplateVersion,
)
from tests.integration.test_portal_templates import Portal, mail_form, world

__all__ = ["world"]


@pytest.fixture
def admin(app: Flask, world: dict[str, Any]) -> Portal:
    return Portal(app, "admin@acme.test")


def versions_of(template_id: int, channel: str = "mail") -> list[TemplateVersion]:
    db.session.expire_all()
    return list(
        db.session.scalars(
            select(TemplateVersion)
            .where(TemplateVersion.template_id == template_id, TemplateVersion.channel == channel)
            .order_by(TemplateVersion.number)
        )
    )


def template(template_id: int) -> MailTemplate:
    db.session.expire_all()
    row = db.session.get(MailTemplate, template_id)
    assert row is not None
    return row


def save(admin: Portal, template_id: int, **changes: Any) -> None:
    response = admin.post(
        f"/mail-templates/{template_id}", mail_form(template(template_id), **changes)
    )
    assert response.status_code == 303, response.text[:2000]


def test_create_and_each_save_make_an_immutable_version(
    admin: Portal,
    world: dict[str, Any],
) -> None:
    response = admin.post("/mail-templates/", mail_form(variables='{"name": "Ann"}'))
    assert response.status_code == 303
    row = db.session.scalar(select(MailTemplate).where(MailTemplate.code == "receipt"))
    assert row is not None
    assert row.strict_variables is True
    assert row.sample_variables == {"name": "Ann"}
    save(admin, row.id, subject="Receipt for {{ name }}")
    (first, second) = versions_of(row.id)
    assert (first.number, second.number) == (1, 2)
    assert first.author == "admin@acme.test"
    assert first.content["subject"] == "Your receipt, {{ name }}"
    assert second.content["subject"] == "Receipt for {{ name }}"
    assert set(second.content) >= {
        "subject", "html_body", "text_body", "reply_to", "priority", "preferred_server_id",
        "stream", "strict_variables", "attachments",
    }  # fmt: skip


def test_history_diff_and_restore(admin: Portal, world: dict[str, Any]) -> None:
    tid = world["acme"]["mail"]
    save(admin, tid, subject="One {{ name }}")
    save(admin, tid, subject="Two {{ name }}", html_body="<p>Two</p>")
    history = admin.get(f"/mail-templates/{tid}/versions")
    assert history.status_code == 200
    assert "Version 2" in history.text
    assert "Version 3" in history.text
    assert "Restore this version" in history.text
    shown = admin.get(f"/mail-templates/{tid}/versions/2")
    assert shown.status_code == 200
    assert "One {{ name }}" in shown.text
    diff = admin.get(f"/mail-templates/{tid}/versions/diff?a=2&b=3")
    assert diff.status_code == 200
    assert "One {{ name }}" in diff.text
    assert "Two {{ name }}" in diff.text
    assert "diff-changed" in diff.text
    for query, field in (("a=x&b=3", "a"), ("a=2", "b"), ("a=2&b=-1", "b")):
        bad = admin.get(f"/mail-templates/{tid}/versions/diff?{query}")
        assert bad.status_code == 422
        assert bad.text.startswith(field)
    assert admin.get(f"/mail-templates/{tid}/versions/diff?a=2&b=99").status_code == 404
    restored = admin.post(f"/mail-templates/{tid}/versions/2/restore")
    assert restored.status_code == 303
    row = template(tid)
    assert (row.version, row.subject) == (4, "One {{ name }}")
    assert versions_of(tid)[-1].remark == "restored from version 2"


def test_support_reads_history_but_cannot_restore_and_other_tenants_get_404(
    app: Flask,
    admin: Portal,
    world: dict[str, Any],
) -> None:
    tid = world["acme"]["mail"]
    save(admin, tid, subject="One {{ name }}")
    support = Portal(app, "support@acme.test")
    assert support.get(f"/mail-templates/{tid}/versions").status_code == 200
    page = support.get(f"/mail-templates/{tid}/versions/2")
    assert page.status_code == 200
    assert "Restore this version" not in page.text
    assert support.post(f"/mail-templates/{tid}/versions/2/restore").status_code == 403
    globex = Portal(app, "admin@globex.test")
    for url in (
        f"/mail-templates/{tid}/versions",
        f"/mail-templates/{tid}/versions/2",
        f"/mail-templates/{tid}/versions/diff?a=2&b=2",
    ):
        assert globex.get(url).status_code == 404, url
    assert globex.post(f"/mail-templates/{tid}/versions/2/restore").status_code == 404


def test_attachments_are_versioned_by_hash_and_restored_with_their_bytes(
    admin: Portal,
    world: dict[str, Any],
) -> None:
    tid = world["acme"]["mail"]
    admin._forget = None  # type: ignore[attr-defined]
    data = {"file": (io.BytesIO(b"hello pdf"), "a.pdf"), "csrf_token": admin.token}
    response = admin.client.post(
        f"/mail-templates/{tid}/attachments", data=data, content_type="multipart/form-data"
    )
    assert response.status_code == 303, response.get_data(as_text=True)[:500]
    removed = admin.post(f"/mail-templates/{tid}/attachments/0/delete")
    assert removed.status_code == 303
    with_file, without = versions_of(tid)[-2:]
    assert [a["name"] for a in with_file.content["attachments"]] == ["a.pdf"]
    assert without.content["attachments"] == []
    digest = with_file.content["attachments"][0]["sha256"]
    assert db.session.get(TemplateBlob, digest) is not None
    assert (
        admin.post(f"/mail-templates/{tid}/versions/{with_file.number}/restore").status_code == 303
    )
    row = template(tid)
    assert row.attachments is not None
    assert row.attachments[0]["name"] == "a.pdf"
    assert row.attachments[0]["content"] == "aGVsbG8gcGRm"  # base64 of b"hello pdf"


def test_import_makes_a_version_only_when_the_content_changed(
    app: Flask, redis_client: Redis
) -> None:
    data: dict[str, Any] = {
        "tenants": [{"slug": "imp", "name": "Imp"}],
        "mailTemplates": [
            {"tenant": "imp", "code": "hi", "subject": "Hi {{ name }}", "text": "Hello"}
        ],
        "smsTemplates": [{"tenant": "imp", "code": "otp", "content": "Code {{ code }}"}],
    }
    import_config(db.session, data)
    db.session.commit()
    row = db.session.scalar(select(MailTemplate).where(MailTemplate.code == "hi"))
    sms = db.session.scalar(select(SmsTemplate).where(SmsTemplate.code == "otp"))
    assert row is not None
    assert sms is not None
    assert (row.version, row.strict_variables) == (1, True)
    import_config(db.session, data)  # the same again: no new version
    db.session.commit()
    assert [v.number for v in versions_of(row.id)] == [1]
    data["mailTemplates"][0]["text"] = "Hello again {{ plan }}"
    data["mailTemplates"][0]["strictVariables"] = False
    db.session.add(
        MailSendRecord(
            tenant_id=row.tenant_id, to_addrs=["a@example.com"], template_code="hi", variables={}
        )
    )
    db.session.commit()
    report = import_config(db.session, data)
    db.session.commit()
    # No dry run stops an import; its counts are printed.
    assert any("checked against 1 of 1 recent sends: 1 render" in n for n in report.notes)
    assert [v.number for v in versions_of(row.id)] == [1, 2]
    assert template(row.id).strict_variables is False
    assert versions_of(row.id)[-1].content["text_body"] == "Hello again {{ plan }}"
    assert [v.number for v in versions_of(sms.id, "sms")] == [1]
    assert db.session.scalar(select(func.count()).select_from(TemplateVersion)) == 3


def test_a_record_links_to_the_version_it_was_prepared_with(
    app: Flask, admin: Portal, world: dict[str, Any]
) -> None:
    tid = world["acme"]["mail"]
    save(admin, tid, subject="One {{ name }}")
    prepared = MailSendRecord(
        tenant_id=world["acme_id"],
        to_addrs=["a@example.com"],
        template_code="welcome",
        template_version=2,
        rendered_subject="One Ann",
    )
    db.session.add(prepared)
    db.session.commit()
    page = admin.get(f"/mail-records/{prepared.id}")
    assert page.status_code == 200
    assert "version 2" in page.text
    link = admin.get(f"/mail-templates/versions/record/{prepared.id}")
    assert link.status_code == 200
    assert "One {{ name }}" in link.text
    assert f"/mail-templates/{tid}/versions" in link.text
    # An operator looking at every tenant's records opens the record and the link from it:
    # the version shows (before, the link answered 404 outside acme's tier).
    operator = Portal(app, "operator@postroom.test")
    assert operator.get(f"/mail-records/{prepared.id}").status_code == 200
    seen = operator.get(f"/mail-templates/versions/record/{prepared.id}")
    assert seen.status_code == 200
    assert "One {{ name }}" in seen.text
    globex = Portal(app, "admin@globex.test")
    assert globex.get(f"/mail-templates/versions/record/{prepared.id}").status_code == 404
