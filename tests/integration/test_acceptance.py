"""Seed 001 "Acceptance" test points, on PostgreSQL and on the embedded SQLite default."""

from __future__ import annotations

import base64
import threading
from typing import Any

import pytest
from flask import Flask
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from portal.extensions import db
from portal.messaging.records import acceptance
from portal.messaging.records.validation import AcceptanceError, BusinessKeyConflict
from portal.models import (
    MailSendRecipient,
    MailSendRecord,
    MailSendServerConfig,
    MailTemplate,
    SendStatus,
    SmsSendRecord,
    Tenant,
)
from portal.tenancy import PLATFORM_TENANT_ID, tenant_context

MAIL = {"to": ["ann@example.com"], "subject": "Hello", "text": "Hi Ann"}
SMS = {"phoneNumber": "+447911123456", "content": "Your code is 1234"}


def count(model: Any) -> int:
    return db.session.scalar(select(func.count()).select_from(model)) or 0


def settings(app: Flask) -> Any:
    return app.config["SETTINGS"]


@pytest.mark.parametrize(
    ("request_body", "field"),
    [
        ({"subject": "x", "text": "y"}, "to"),
        ({"to": [], "subject": "x", "text": "y"}, "to"),
        ({"to": ["not-an-address"], "subject": "x", "text": "y"}, "to[0]"),
        ({"to": ["a@example.com"], "cc": ["bad@"], "subject": "x", "text": "y"}, "cc[0]"),
        ({"to": ["a@example.com"], "replyTo": "nope", "subject": "x", "text": "y"}, "replyTo"),
        ({"to": ["a@example.com"]}, "subject"),
        ({"to": ["a@example.com"], "subject": "x"}, "html"),
        ({"to": ["a@example.com"], "subject": "x\r\nBcc: e@vil.test", "text": "y"}, "subject"),
        ({"to": ["a@example.com"], "subject": "x", "text": 5}, "text"),
        ({"to": ["a@example.com"], "templateCode": "w", "priority": 9}, "priority"),
        ({"to": ["a@example.com"], "templateCode": "w", "variables": []}, "variables"),
        ({"to": ["a@example.com"], "templateCode": "w", "bogus": 1}, "bogus"),
        ({"to": ["a@example.com"], "templateCode": "w", "scope": "GLOBAL"}, "scope"),
        ({"to": ["a@example.com"], "templateCode": "w", "expiresAt": "tomorrow"}, "expiresAt"),
    ],
)
def test_invalid_mail_throws_writes_nothing_and_caller_can_commit(
    any_app: Flask, tenants: tuple[Tenant, Tenant], request_body: dict[str, Any], field: str
) -> None:
    acme, _ = tenants
    with tenant_context(acme.id):
        # The caller's own work in the same transaction, before the rejected send.
        db.session.add(Tenant(slug="caller-work", name="Caller's own row"))
        with pytest.raises(AcceptanceError) as caught:
            acceptance.send_mail(db.session, request_body, settings=settings(any_app))
        assert caught.value.field == field
        db.session.commit()  # still usable: the rejection wrote nothing and aborted nothing
    assert count(MailSendRecord) == 0
    assert db.session.scalar(select(Tenant.id).where(Tenant.slug == "caller-work"))


@pytest.mark.parametrize(
    ("request_body", "field"),
    [
        ({"content": "x"}, "phoneNumber"),
        ({"phoneNumber": "07911123456", "content": "x"}, "phoneNumber"),
        ({"phoneNumber": "+44 12", "content": "x"}, "phoneNumber"),
        ({"phoneNumber": "+447911123456"}, "content"),
        ({"phoneNumber": "+447911123456", "content": "x" * 1601}, "content"),
        ({"phoneNumber": 447911123456, "content": "x"}, "phoneNumber"),
    ],
)
def test_invalid_sms_throws_and_writes_nothing(
    any_app: Flask, tenants: tuple[Tenant, Tenant], request_body: dict[str, Any], field: str
) -> None:
    with tenant_context(tenants[0].id):
        with pytest.raises(AcceptanceError) as caught:
            acceptance.send_sms(db.session, request_body, settings=settings(any_app))
        assert caught.value.field == field
        db.session.commit()
    assert count(SmsSendRecord) == 0


def test_accepted_mail_is_pending_in_the_callers_tenant_with_searchable_recipients(
    any_app: Flask, tenants: tuple[Tenant, Tenant]
) -> None:
    acme, _ = tenants
    body = MAIL | {"to": ["Ann@Example.COM"], "cc": ["bob@example.com"], "bcc": ["c@example.com"]}
    with tenant_context(acme.id, trace_id="abc123abc123"):
        result = acceptance.send_mail(db.session, body, settings=settings(any_app))
        db.session.commit()
    record = db.session.get(MailSendRecord, result.id)
    assert record is not None
    assert (record.tenant_id, record.status, record.scope) == (acme.id, "Pending", "TENANT")
    assert (record.version, record.retry_count, record.trace_id) == (0, 0, "abc123abc123")
    assert record.to_addrs == ["Ann@example.com"]  # domain normalised, local part kept
    assert record.created_time.tzinfo is not None  # UTC-aware on both dialects
    found = db.session.scalars(
        select(MailSendRecipient.kind).where(
            MailSendRecipient.tenant_id == acme.id, MailSendRecipient.address == "ann@example.com"
        )
    ).all()
    assert found == ["to"]
    assert count(MailSendRecipient) == 3


def test_caller_rollback_leaves_no_record(any_app: Flask, tenants: tuple[Tenant, Tenant]) -> None:
    with tenant_context(tenants[0].id):
        acceptance.send_mail(db.session, MAIL, settings=settings(any_app))
        acceptance.send_sms(db.session, SMS, settings=settings(any_app))
        db.session.rollback()
    assert count(MailSendRecord) == 0
    assert count(SmsSendRecord) == 0
    assert count(MailSendRecipient) == 0


def test_batch_with_one_invalid_item_is_rejected_whole_naming_its_index(
    any_app: Flask, tenants: tuple[Tenant, Tenant]
) -> None:
    items = [MAIL, MAIL | {"to": ["b@example.com"]}, MAIL | {"to": ["broken"]}, MAIL]
    with tenant_context(tenants[0].id):
        with pytest.raises(AcceptanceError) as caught:
            acceptance.send_mail_batch(db.session, items, settings=settings(any_app))
        db.session.commit()
    assert caught.value.index == 2
    assert caught.value.field == "to[0]"
    assert count(MailSendRecord) == 0


def test_batch_ids_come_back_in_input_order(any_app: Flask, tenants: tuple[Tenant, Tenant]) -> None:
    items = [MAIL | {"to": [f"user{i}@example.com"]} for i in range(50)]
    with tenant_context(tenants[0].id):
        results = acceptance.send_mail_batch(db.session, items, settings=settings(any_app))
        db.session.commit()
    assert len(results) == 50
    for i, result in enumerate(results):
        record = db.session.get(MailSendRecord, result.id)
        assert record is not None
        assert record.to_addrs == [f"user{i}@example.com"]
    sms = [SMS | {"phoneNumber": f"+4479111234{i:02d}"} for i in range(20)]
    with tenant_context(tenants[0].id):
        sms_results = acceptance.send_sms_batch(db.session, sms, settings=settings(any_app))
        db.session.commit()
    numbers = [db.session.get(SmsSendRecord, r.id).phone_number for r in sms_results]  # type: ignore[union-attr]
    assert numbers == [f"+4479111234{i:02d}" for i in range(20)]


@pytest.mark.parametrize("size", [0, 501])
def test_batch_size_limits(any_app: Flask, tenants: tuple[Tenant, Tenant], size: int) -> None:
    with tenant_context(tenants[0].id), pytest.raises(AcceptanceError) as caught:
        acceptance.send_mail_batch(db.session, [MAIL] * size, settings=settings(any_app))
    assert caught.value.field == "items"


def test_sms_is_parsed_to_e164_with_its_country(
    any_app: Flask, tenants: tuple[Tenant, Tenant]
) -> None:
    with tenant_context(tenants[0].id):
        result = acceptance.send_sms(
            db.session, SMS | {"phoneNumber": "+1 (202) 555-0143"}, settings=settings(any_app)
        )
        db.session.commit()
    record = db.session.get(SmsSendRecord, result.id)
    assert record is not None
    assert (record.phone_number, record.country_code) == ("+12025550143", "US")


def test_non_geographic_numbers_have_no_country(
    any_app: Flask, tenants: tuple[Tenant, Tenant]
) -> None:
    with tenant_context(tenants[0].id):
        result = acceptance.send_sms(
            db.session, SMS | {"phoneNumber": "+80012345678"}, settings=settings(any_app)
        )
        db.session.commit()
    record = db.session.get(SmsSendRecord, result.id)
    assert record is not None
    assert (record.phone_number, record.country_code) == ("+80012345678", None)


def test_tenant_context_and_platform_scope(any_app: Flask, tenants: tuple[Tenant, Tenant]) -> None:
    _, globex = tenants
    with tenant_context(globex.id):
        in_tenant = acceptance.send_mail(db.session, MAIL, settings=settings(any_app))
        with pytest.raises(AcceptanceError) as forbidden:
            acceptance.send_mail(
                db.session, MAIL | {"scope": "PLATFORM"}, settings=settings(any_app)
            )
    assert forbidden.value.field == "scope"
    platform = acceptance.send_mail(
        db.session, MAIL | {"scope": "PLATFORM"}, settings=settings(any_app)
    )
    with pytest.raises(AcceptanceError):  # no tenant context and scope TENANT: whose is it?
        acceptance.send_mail(db.session, MAIL, settings=settings(any_app))
    db.session.commit()
    assert db.session.get(MailSendRecord, in_tenant.id).tenant_id == globex.id  # type: ignore[union-attr]
    record = db.session.get(MailSendRecord, platform.id)
    assert record is not None
    assert (record.tenant_id, record.scope) == (PLATFORM_TENANT_ID, "PLATFORM")


def test_another_tenants_template_or_server_is_rejected_as_missing(
    any_app: Flask, tenants: tuple[Tenant, Tenant]
) -> None:
    acme, globex = tenants
    template = MailTemplate(tenant_id=globex.id, code="welcome", subject="Hi", text_body="x")
    server = MailSendServerConfig(
        tenant_id=globex.id, name="smtp", host="localhost", from_address="a@globex.test"
    )
    db.session.add_all([template, server])
    db.session.commit()
    with tenant_context(acme.id):
        with pytest.raises(AcceptanceError) as by_template:
            acceptance.send_mail(
                db.session,
                {"to": ["a@example.com"], "templateId": template.id},
                settings=settings(any_app),
            )
        with pytest.raises(AcceptanceError) as by_server:
            acceptance.send_mail(
                db.session, MAIL | {"serverId": server.id}, settings=settings(any_app)
            )
    assert (by_template.value.code, by_template.value.field) == ("not_found", "templateId")
    assert (by_server.value.code, by_server.value.field) == ("not_found", "serverId")
    with tenant_context(globex.id):  # the owner may use both
        acceptance.send_mail(
            db.session,
            {"to": ["a@example.com"], "templateId": template.id, "serverId": server.id},
            settings=settings(any_app),
        )
    db.session.commit()
    assert count(MailSendRecord) == 1


def test_business_key_is_idempotent_and_conflicts_on_a_different_request(
    any_app: Flask, tenants: tuple[Tenant, Tenant]
) -> None:
    acme, globex = tenants
    keyed = MAIL | {"businessKey": "order-42"}
    with tenant_context(acme.id):
        first = acceptance.send_mail(db.session, keyed, settings=settings(any_app))
        db.session.commit()
        again = acceptance.send_mail(db.session, keyed, settings=settings(any_app))
        db.session.commit()
        with pytest.raises(BusinessKeyConflict):
            acceptance.send_mail(
                db.session, keyed | {"subject": "Other"}, settings=settings(any_app)
            )
        db.session.commit()
    assert (first.duplicate, again.duplicate, again.id) == (False, True, first.id)
    with tenant_context(globex.id):  # keys are per tenant
        other = acceptance.send_mail(db.session, keyed, settings=settings(any_app))
        db.session.commit()
    assert other.id != first.id
    assert count(MailSendRecord) == 2


def test_batch_business_keys_existing_duplicate_and_repeated(
    any_app: Flask, tenants: tuple[Tenant, Tenant]
) -> None:
    with tenant_context(tenants[0].id):
        first = acceptance.send_mail(
            db.session, MAIL | {"businessKey": "k1"}, settings=settings(any_app)
        )
        db.session.commit()
        results = acceptance.send_mail_batch(
            db.session,
            [MAIL | {"businessKey": "k0"}, MAIL | {"businessKey": "k1"}, MAIL],
            settings=settings(any_app),
        )
        db.session.commit()
        with pytest.raises(AcceptanceError) as repeated:
            acceptance.send_mail_batch(
                db.session,
                [MAIL | {"businessKey": "k9"}, MAIL | {"businessKey": "k9"}],
                settings=settings(any_app),
            )
    assert [r.duplicate for r in results] == [False, True, False]
    assert results[1].id == first.id
    assert repeated.value.index == 1
    assert count(MailSendRecord) == 3


def test_two_callers_racing_on_one_key_get_one_record_and_both_commit(
    app: Flask, session: Session
) -> None:
    """Two PostgreSQL transactions insert the same key at once: the unique index makes the
    second wait for the first; it then sees the winner's row and neither is aborted."""
    tenant = Tenant(slug="racer", name="Racer")
    session.add(tenant)
    session.commit()
    tenant_id = tenant.id  # read here: the ORM object belongs to this thread's session
    barrier = threading.Barrier(2, timeout=20)
    results: list[acceptance.Accepted] = []
    errors: list[BaseException] = []

    def caller() -> None:
        try:
            with app.app_context(), tenant_context(tenant_id):
                own = Session(db.engine)
                try:
                    own.add(Tenant(slug=f"own-{threading.get_ident()}", name="caller's work"))
                    own.flush()
                    barrier.wait()
                    results.append(
                        acceptance.send_mail(
                            own, MAIL | {"businessKey": "race"}, settings=settings(app)
                        )
                    )
                    own.commit()
                finally:
                    own.close()
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=caller) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert errors == []
    assert len({r.id for r in results}) == 1
    assert sorted(r.duplicate for r in results) == [False, True]
    assert count(MailSendRecord) == 1
    assert (
        session.scalar(select(func.count()).select_from(Tenant).where(Tenant.slug.like("own-%")))
        == 2
    )


def test_attachments_are_checked_and_capped(any_app: Flask, tenants: tuple[Tenant, Tenant]) -> None:
    ok = {"name": "a.txt", "contentType": "text/plain", "content": base64.b64encode(b"hi").decode()}
    big = settings(any_app).attachment_max_bytes + 1
    cases = [
        ({"name": "../etc/passwd", "content": ok["content"]}, "attachments[0].name"),
        ({"name": "a.txt", "content": "%%%"}, "attachments[0].content"),
        (
            {"name": "a.txt", "content": base64.b64encode(b"x" * big).decode()},
            "attachments[0].content",
        ),
        (
            {"name": "a.txt", "contentType": "text", "content": ok["content"]},
            "attachments[0].contentType",
        ),
    ]
    with tenant_context(tenants[0].id):
        for attachment, field in cases:
            with pytest.raises(AcceptanceError) as caught:
                acceptance.send_mail(
                    db.session, MAIL | {"attachments": [attachment]}, settings=settings(any_app)
                )
            assert caught.value.field == field
        result = acceptance.send_mail(
            db.session, MAIL | {"attachments": [ok]}, settings=settings(any_app)
        )
        db.session.commit()
    record = db.session.get(MailSendRecord, result.id)
    assert record is not None
    assert record.attachments == [ok]
    assert record.status == SendStatus.PENDING
