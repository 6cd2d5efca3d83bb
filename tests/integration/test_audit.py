"""The audit log page and the audit rows of template saves, dead-letter triage and quota changes.

Tenant admins see their own tenant's rows only (never another tenant's, the platform tier's,
or rows with no tenant); operators see the tenant they view, or every row when they view all.
Filters (actor, action, dates) answer bad input with 422 naming the field; pages go back in
time without repeating or skipping a row, also among rows written in one transaction.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

import pytest
from flask import Flask, g
from flask.testing import FlaskClient
from sqlalchemy import select

from portal.extensions import db
from portal.models import (
    AppUser,
    AuditAction,
    AuditEvent,
    DeadLetterMessage,
    MailTemplate,
    SmsTemplate,
    TenantMessageQuota,
    add_audit,
)
from portal.tenancy import PLATFORM_TENANT_ID
from portal.web.operations.audit import PAGE_SIZE
from tests.conftest import make_tenant

PASSWORD = "audit-test-password-1"
_CSRF = re.compile(r'name="csrf_token" value="([^"]+)"')
_ROW = re.compile(r'id="audit-event-(\d+)"')


class Browser:
    """A test client signed in through the real sign-in form, carrying its CSRF token."""

    def __init__(self, app: Flask, email: str):
        self.client: FlaskClient = app.test_client()
        self.token = self._token("/auth/login")
        forget()
        response = self.client.post(
            "/auth/login",
            data={"email": email, "password": PASSWORD, "csrf_token": self.token},
        )
        assert response.status_code in (302, 303), response.text
        self.token = self._token("/audit/")

    def _token(self, url: str) -> str:
        forget()
        page = self.client.get(url)
        found = _CSRF.search(page.text)
        assert found is not None, page.text
        return found.group(1)

    def get(self, url: str, **params: str) -> Any:
        forget()
        return self.client.get(url, query_string=params)

    def post(self, url: str, data: dict[str, Any]) -> Any:
        forget()
        return self.client.post(url, data={**data, "csrf_token": self.token})

    def view(self, tenant: int | str) -> None:
        """An operator switches the tenant being looked at."""
        response = self.post("/tenants/view", {"tenant": str(tenant), "next": "/"})
        assert response.status_code in (302, 303)


def forget() -> None:
    """Requests share the test's app context, where flask-login caches the signed-in user and
    Flask-WTF the CSRF token: forget both, so each request loads its own client's."""
    g.pop("_login_user", None)
    g.pop("csrf_token", None)


def make_user(email: str, role: str, tenant_id: int) -> AppUser:
    user = AppUser(email=email, role=role, tenant_id=tenant_id, name=email.split("@")[0])
    user.set_password(PASSWORD)
    db.session.add(user)
    return user


def seed(
    tenant_id: int | None,
    action: AuditAction,
    remark: str,
    *,
    actor: str = "someone@example.test",
    at: datetime | None = None,
    target: tuple[str, object] | None = None,
) -> int:
    event = add_audit(
        db.session(),
        action,
        tenant_id=tenant_id,
        actor_label=actor,
        target_type=target[0] if target else None,
        target_id=target[1] if target else None,
        remark=remark,
    )
    if at is not None:
        event.created_time = at
    db.session.commit()
    return event.id


@pytest.fixture
def world(app: Flask) -> dict[str, Any]:
    acme, globex = make_tenant("acme"), make_tenant("globex")
    db.session.flush()
    make_user("admin@acme.test", "tenant_admin", acme.id)
    make_user("support@acme.test", "support", acme.id)
    make_user("admin@globex.test", "tenant_admin", globex.id)
    make_user("operator@postroom.test", "platform_operator", PLATFORM_TENANT_ID)
    db.session.commit()
    return {"acme": acme.id, "globex": globex.id}


@pytest.fixture
def markers(world: dict[str, Any]) -> dict[str, int]:
    """One row per scope, each with a remark found nowhere else."""
    return {
        "acme": seed(world["acme"], AuditAction.KEY_CREATE, "MARKER-ACME"),
        "globex": seed(world["globex"], AuditAction.KEY_CREATE, "MARKER-GLOBEX"),
        "platform": seed(PLATFORM_TENANT_ID, AuditAction.KEY_CREATE, "MARKER-PLATFORM"),
        "none": seed(None, AuditAction.SIGN_IN_FAILED, "MARKER-NO-TENANT"),
    }


def shown(response: Any) -> list[int]:
    return [int(i) for i in _ROW.findall(response.text)]


# --- who sees what ---------------------------------------------------------------------------


def test_a_tenant_admin_sees_only_its_own_tenants_rows(
    app: Flask, world: dict[str, Any], markers: dict[str, int]
) -> None:
    admin = Browser(app, "admin@acme.test")
    for params in ({}, {"action": "key_create"}, {"actor": "someone"}):
        page = admin.get("/audit/", **params)
        assert page.status_code == 200
        assert "MARKER-ACME" in page.text
        for other in ("MARKER-GLOBEX", "MARKER-PLATFORM", "MARKER-NO-TENANT"):
            assert other not in page.text, (params, other)
    assert "API key created" in page.text  # the plain label, not the stored string


def test_a_cursor_from_another_tenants_log_is_refused_not_followed(
    app: Flask, world: dict[str, Any], markers: dict[str, int]
) -> None:
    admin = Browser(app, "admin@acme.test")
    page = admin.get("/audit/", before=str(markers["globex"]))
    assert page.status_code == 422
    assert "page link is broken" in page.text
    assert "MARKER-GLOBEX" not in page.text


def test_support_users_may_not_read_the_log(app: Flask, world: dict[str, Any]) -> None:
    assert Browser(app, "support@acme.test").get("/audit/").status_code == 403


def test_an_operator_sees_the_viewed_tenant_or_every_row(
    app: Flask, world: dict[str, Any], markers: dict[str, int]
) -> None:
    operator = Browser(app, "operator@postroom.test")
    operator.view(world["acme"])
    page = operator.get("/audit/")
    assert "MARKER-ACME" in page.text
    assert "MARKER-GLOBEX" not in page.text
    assert "MARKER-NO-TENANT" not in page.text
    operator.view("all")
    page = operator.get("/audit/")
    for marker in ("MARKER-ACME", "MARKER-GLOBEX", "MARKER-PLATFORM", "MARKER-NO-TENANT"):
        assert marker in page.text
    assert "No tenant" in page.text  # the failed sign-in of an unknown address
    assert "Platform tier" in page.text


# --- filters ---------------------------------------------------------------------------------


def test_filters_by_actor_action_and_utc_dates_newest_first(
    app: Flask, world: dict[str, Any]
) -> None:
    acme = world["acme"]
    old = seed(
        acme,
        AuditAction.QUOTA_CHANGE,
        "old",
        actor="Ops@Example.test",
        at=datetime(2025, 3, 1, 23, 59, 59, tzinfo=UTC),
    )
    mid = seed(
        acme,
        AuditAction.TEMPLATE_SAVE,
        "mid",
        actor="ann@acme.test",
        at=datetime(2025, 3, 2, 0, 0, 0, tzinfo=UTC),
    )
    new = seed(
        acme,
        AuditAction.QUOTA_CHANGE,
        "new",
        actor="API key 100%_done",
        at=datetime(2025, 3, 3, 12, 0, tzinfo=UTC),
    )
    admin = Browser(app, "admin@acme.test")

    def ids(**params: str) -> list[int]:
        page = admin.get("/audit/", **params)
        assert page.status_code == 200, page.text
        return [i for i in shown(page) if i in (old, mid, new)]

    assert ids() == [new, mid, old]
    assert ids(action="quota_change") == [new, old]
    assert ids(actor="ops@example") == [old]  # case does not matter
    assert ids(actor="100%_") == [new]  # % and _ are text, not wildcards
    assert ids(actor="0%") == [new]
    assert ids(actor="%") == [new]
    assert ids(**{"from": "2025-03-02"}) == [new, mid]
    assert ids(to="2025-03-01") == [old]  # "to" takes the whole day
    assert ids(**{"from": "2025-03-02", "to": "2025-03-02"}) == [mid]
    assert ids(action="quota_change", **{"from": "2025-03-02"}) == [new]
    page = admin.get("/audit/", action="quota_change")
    assert '<option value="quota_change" selected>Quota changed</option>' in page.text


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"action": "drop_tables"}, "Action: choose one from the list."),
        ({"from": "2025-02-30"}, "From: enter a real date"),
        ({"to": "yesterday"}, "To: enter a real date"),
        ({"from": "2025-03-02", "to": "2025-03-01"}, "To: the end date must be on or after"),
        ({"actor": "x" * 401}, "Actor: type at most 400 characters."),
        ({"before": "abc"}, "That page link is broken"),
        ({"before": "99999999999999999999"}, "That page link is broken"),
        ({"before": "123456789"}, "That page link is broken"),
        ({"from": "99999-01-01"}, "From: enter a real date"),
        ({"actor": "nul\x00byte"}, "Actor: type letters, digits and punctuation only"),
        ({"actor": "tab\there"}, "Actor: type letters, digits and punctuation only"),
    ],
)
def test_bad_filter_input_names_the_field_and_never_500s(
    app: Flask, world: dict[str, Any], params: dict[str, str], message: str
) -> None:
    page = Browser(app, "admin@acme.test").get("/audit/", **params)
    assert page.status_code == 422
    assert message in page.text


def test_pages_go_back_in_time_without_repeats_or_gaps(app: Flask, world: dict[str, Any]) -> None:
    """Rows written in one transaction share created_time: the id breaks the tie."""
    acme = world["acme"]
    for i in range(PAGE_SIZE + 30):
        add_audit(db.session(), AuditAction.RETRY, tenant_id=acme, remark=f"n{i}")
    db.session.commit()
    seed(acme, AuditAction.RETRY, "later")
    admin = Browser(app, "admin@acme.test")
    seen: list[int] = []
    params: dict[str, str] = {"action": "retry"}
    for _ in range(5):
        page = admin.get("/audit/", **params)
        assert page.status_code == 200
        seen += shown(page)
        older = re.search(r'href="[^"]*before=(\d+)[^"]*" rel="next"', page.text)
        if older is None:
            break
        params = {"action": "retry", "before": older.group(1)}
    expected = list(
        db.session.scalars(
            select(AuditEvent.id)
            .where(AuditEvent.tenant_id == acme, AuditEvent.action == "retry")
            .order_by(AuditEvent.created_time.desc(), AuditEvent.id.desc())
        )
    )
    assert seen == expected
    assert len(seen) == PAGE_SIZE + 31


def test_a_record_target_links_to_its_page_and_other_targets_do_not(
    app: Flask, world: dict[str, Any]
) -> None:
    acme = world["acme"]
    seed(acme, AuditAction.RESOLVE, "r", target=("MailSendRecord", 4242))
    seed(acme, AuditAction.CANCEL, "c", target=("SmsSendRecord", 4343))
    seed(acme, AuditAction.USER_DEACTIVATE, "u", target=("user", 7))
    page = Browser(app, "admin@acme.test").get("/audit/")
    assert '<a href="/mail-records/4242">Mail record 4242</a>' in page.text
    assert '<a href="/sms-records/4343">SMS record 4343</a>' in page.text
    assert "User 7" in page.text
    assert 'href="/users/7"' not in page.text


# --- the rows this part writes ----------------------------------------------------------------


def events(action: AuditAction) -> list[AuditEvent]:
    db.session.expire_all()
    return list(
        db.session.scalars(
            select(AuditEvent).where(AuditEvent.action == action).order_by(AuditEvent.id)
        )
    )


def test_a_quota_change_is_audited_with_old_and_new_limits(
    app: Flask, world: dict[str, Any]
) -> None:
    acme = world["acme"]
    db.session.add(TenantMessageQuota(tenant_id=acme, mail_monthly_limit=1000))
    db.session.commit()
    operator = Browser(app, "operator@postroom.test")
    bad = operator.post(f"/quotas/{acme}", {"mail_monthly_limit": "-1", "sms_monthly_limit": ""})
    assert bad.status_code == 422
    assert events(AuditAction.QUOTA_CHANGE) == []
    done = operator.post(
        f"/quotas/{acme}", {"mail_monthly_limit": "2000", "sms_monthly_limit": "50"}
    )
    assert done.status_code == 303
    (row,) = events(AuditAction.QUOTA_CHANGE)
    assert row.tenant_id == acme
    assert row.actor_label == "operator@postroom.test"
    assert (row.target_type, row.target_id) == ("tenant", str(acme))
    assert row.remark == "Mail per month: 1,000 -> 2,000; SMS per month: default -> 50"
    # The tenant's admin reads it in its log.
    page = Browser(app, "admin@acme.test").get("/audit/", action="quota_change")
    assert "Mail per month: 1,000 -&gt; 2,000" in page.text


def test_dead_letter_triage_is_audited_once(app: Flask, world: dict[str, Any]) -> None:
    acme = world["acme"]
    letter = DeadLetterMessage(
        tenant_id=acme, source="SendExhausted", channel="mail", reason="r", attempts=3
    )
    db.session.add(letter)
    db.session.commit()
    operator = Browser(app, "operator@postroom.test")
    operator.view(acme)
    url = f"/dead-letters/{letter.id}"
    assert operator.post(url, {"decision": "Resolved", "remark": ""}).status_code == 422
    assert events(AuditAction.DEAD_LETTER_TRIAGE) == []
    assert operator.post(url, {"decision": "Discarded", "remark": "a test"}).status_code == 302
    (row,) = events(AuditAction.DEAD_LETTER_TRIAGE)
    assert (row.tenant_id, row.target_type, row.target_id) == (acme, "dead_letter", str(letter.id))
    assert row.remark == "Discarded: a test"
    # Handled already: refused, and nothing more is written.
    assert operator.post(url, {"decision": "Resolved", "remark": "again"}).status_code == 422
    assert len(events(AuditAction.DEAD_LETTER_TRIAGE)) == 1


def test_template_saves_are_audited_with_code_and_channel(
    app: Flask, world: dict[str, Any]
) -> None:
    acme = world["acme"]
    admin = Browser(app, "admin@acme.test")
    form = {
        "code": "receipt",
        "name": "Receipt",
        "subject": "Your receipt",
        "html_body": "<p>Thanks</p>",
        "text_body": "",
        "enabled": "on",
        "variables": "{}",
    }
    assert admin.post("/mail-templates/", form | {"subject": ""}).status_code == 422
    assert events(AuditAction.TEMPLATE_SAVE) == []
    assert admin.post("/mail-templates/", form).status_code == 303
    mail = db.session.scalar(select(MailTemplate).where(MailTemplate.tenant_id == acme))
    assert mail is not None
    saved = admin.post(f"/mail-templates/{mail.id}", form | {"version": "1", "name": "R2"})
    assert saved.status_code == 303
    stale = admin.post(f"/mail-templates/{mail.id}", form | {"version": "1"})
    assert stale.status_code == 422
    sms_form = {"code": "otp", "name": "OTP", "content": "Code {{ code }}", "enabled": "on"}
    assert admin.post("/sms-templates/", sms_form | {"variables": "{}"}).status_code == 303
    sms = db.session.scalar(select(SmsTemplate).where(SmsTemplate.tenant_id == acme))
    assert sms is not None
    rows = events(AuditAction.TEMPLATE_SAVE)
    assert [(r.tenant_id, r.target_type, r.target_id, r.remark) for r in rows] == [
        (acme, "mail_template", str(mail.id), "Mail template 'receipt' created (version 1)"),
        (acme, "mail_template", str(mail.id), "Mail template 'receipt' saved (version 2)"),
        (acme, "sms_template", str(sms.id), "SMS template 'otp' created (version 1)"),
    ]
    assert {r.actor_label for r in rows} == {"admin@acme.test"}
