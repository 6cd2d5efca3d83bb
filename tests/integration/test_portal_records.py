"""The dashboard and the mail / SMS record pages through Flask's test client, on PostgreSQL:
permissions per role, tenant isolation by id guessing, CSRF, validation, search, keyset pages,
the rendered message's sandbox, and retry (one record and bulk, with and without htmx)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import pytest
from argon2 import PasswordHasher
from flask import Flask, current_app
from flask.testing import FlaskClient
from sqlalchemy import select

from portal.extensions import db
from portal.messaging.records import diagnosis
from portal.messaging.records.diagnosis import reasons
from portal.messaging.sending.classify import CATEGORY_HELP, MARKER_HELP, ErrorCategory, MarkerCode
from portal.models import (
    AppUser,
    Channel,
    DeadLetterMessage,
    MailSendRecipient,
    MailSendRecord,
    SendStatus,
    SmsSendRecord,
)
from portal.models import tenant as tenant_model
from portal.web.records import bulk, explain, record_page
from portal.web.records.filters import BULK_CAP
from tests.conftest import make_tenant
from tests.support.delivery import sendable

PASSWORD = "records-test-password-1"
HX = {"HX-Request": "true"}


# --- fixtures -------------------------------------------------------------------------------------


def mail(tenant_id: int, status: str = "Failed", to: str = "ann@example.com", **fields: Any) -> int:
    """A mail record with its recipient rows, as acceptance writes them (addresses lower-cased)."""
    values: dict[str, Any] = {
        "tenant_id": tenant_id,
        "status": status,
        "to_addrs": [to],
        "subject": "Your order",
        "text_body": "Hello",
    } | fields
    record = MailSendRecord(**values)
    db.session.add(record)
    db.session.flush()
    addresses = [("to", a) for a in record.to_addrs] + [("cc", a) for a in record.cc_addrs or []]
    for kind, address in addresses:
        db.session.add(
            MailSendRecipient(
                record_id=record.id, tenant_id=tenant_id, address=address.lower(), kind=kind
            )
        )
    db.session.commit()
    return record.id


def sms(
    tenant_id: int, status: str = "Failed", number: str = "+447911123456", **fields: Any
) -> int:
    record = SmsSendRecord(
        tenant_id=tenant_id, status=status, phone_number=number, content="Your code is 1234"
    )
    for name, value in fields.items():
        setattr(record, name, value)
    db.session.add(record)
    db.session.commit()
    return record.id


def user(email: str, role: str, tenant_id: int) -> None:
    row = AppUser(email=email, role=role, tenant_id=tenant_id, name=email.split("@")[0])
    row.set_password(PASSWORD)
    db.session.add(row)
    db.session.commit()


@dataclass
class World:
    acme: int
    globex: int
    mail: int  # acme's Failed mail
    sent_mail: int  # acme's Sent mail
    mail_other: int  # globex's Failed mail
    sms: int  # acme's Failed SMS
    sms_other: int  # globex's Failed SMS
    dead_letter: int  # acme's


@pytest.fixture
def cheap_passwords(monkeypatch: pytest.MonkeyPatch) -> None:
    """Argon2 at its cheapest: these tests sign in a lot and test pages, not hashing."""
    monkeypatch.setattr(tenant_model, "_hasher", PasswordHasher(1, 8, 1))


@pytest.fixture
def world(app: Flask, cheap_passwords: None) -> World:
    acme, globex = make_tenant("acme").id, make_tenant("globex").id
    db.session.commit()
    sendable(acme)  # a retry's diagnosis finds a server and a provider to prepare with
    sendable(globex)
    user("operator@postroom.example.com", "platform_operator", -1)
    user("admin@acme.example.com", "tenant_admin", acme)
    user("support@acme.example.com", "support", acme)
    failed = mail(
        acme,
        to="Ann@Example.com",
        error_code="451 4.3.0",
        error_message="451 4.3.0 mailbox busy, try again later",
        rendered_html="<p style='color:red'>Hi <script>alert(1)</script></p>",
        rendered_text="Hi Ann",
        prepared_at=None,
    )
    sent = mail(acme, status="Sent", to="bob@example.com", subject="Receipt")
    letter = DeadLetterMessage(
        tenant_id=acme,
        source="SendExhausted",
        event_id=str(failed),
        channel="mail",
        error_code="451 4.3.0",
        reason="try again later",
        attempts=6,
        payload={"recordId": failed},
    )
    db.session.add(letter)
    db.session.commit()
    return World(
        acme=acme,
        globex=globex,
        mail=failed,
        sent_mail=sent,
        mail_other=mail(globex, to="ann@example.com"),
        sms=sms(acme),
        sms_other=sms(globex),
        dead_letter=letter.id,
    )


class Client:
    """A test client whose every request runs in a fresh app context.

    The ``app`` fixture holds an app context open, and a request reuses an open one, so
    without this ``g`` (flask-login's cached user, flask-wtf's cached token) would leak from
    one client's request into another's.
    """

    def __init__(self, app: Flask):
        self.app = app
        self.client: FlaskClient = app.test_client()

    def get(self, *args: Any, **kwargs: Any) -> Any:
        with self.app.app_context():
            return self.client.get(*args, **kwargs)

    def post(self, *args: Any, **kwargs: Any) -> Any:
        with self.app.app_context():
            return self.client.post(*args, **kwargs)

    def session_transaction(self) -> Any:
        return self.client.session_transaction()


def signed_in(app: Flask, email: str | None, view_tenant: str | int | None = None) -> Any:
    """A client signed in as ``email`` (None: anonymous) and its CSRF token."""
    client = Client(app)
    found = re.search(r'name="csrf_token" value="([^"]+)"', client.get("/auth/login").text)
    assert found is not None
    token = found.group(1)
    if email is not None:
        response = client.post(
            "/auth/login", data={"email": email, "password": PASSWORD, "csrf_token": token}
        )
        assert response.status_code == 302, response.text
    if view_tenant is not None:
        with client.session_transaction() as session:
            session["view_tenant"] = view_tenant
    return client, token


def status_of(model: Any, record_id: int) -> str:
    db.session.expire_all()
    return str(db.session.scalar(select(model.status).where(model.id == record_id)))


# --- permissions: role x route --------------------------------------------------------------------

OPERATOR = "operator@postroom.example.com"
ADMIN = "admin@acme.example.com"
SUPPORT = "support@acme.example.com"

# (method, path template, {role: expected status}); the operator looks at every tenant.
ROUTES: list[tuple[str, str, dict[str | None, int]]] = [
    ("GET", "/", {OPERATOR: 200, ADMIN: 200, SUPPORT: 200, None: 302}),
    ("GET", "/search?q=ann@example.com", {OPERATOR: 302, ADMIN: 302, SUPPORT: 302, None: 302}),
    ("GET", "/mail-records/", {OPERATOR: 200, ADMIN: 200, SUPPORT: 200, None: 302}),
    ("GET", "/mail-records/{mail}", {OPERATOR: 200, ADMIN: 200, SUPPORT: 200, None: 302}),
    ("GET", "/mail-records/{mail}/rendered", {OPERATOR: 200, ADMIN: 200, SUPPORT: 200, None: 302}),
    ("GET", "/sms-records/", {OPERATOR: 200, ADMIN: 200, SUPPORT: 200, None: 302}),
    ("GET", "/sms-records/{sms}", {OPERATOR: 200, ADMIN: 200, SUPPORT: 200, None: 302}),
    ("POST", "/mail-records/{mail}/retry", {OPERATOR: 302, ADMIN: 302, SUPPORT: 302, None: 302}),
    ("POST", "/sms-records/{sms}/retry", {OPERATOR: 302, ADMIN: 302, SUPPORT: 302, None: 302}),
    ("POST", "/mail-records/retry", {OPERATOR: 200, ADMIN: 200, SUPPORT: 200, None: 302}),
    ("POST", "/sms-records/retry", {OPERATOR: 200, ADMIN: 200, SUPPORT: 200, None: 302}),
    ("GET", "/dead-letters/", {OPERATOR: 200, ADMIN: 403, SUPPORT: 403, None: 302}),
    ("GET", "/dead-letters/{dead_letter}", {OPERATOR: 200, ADMIN: 403, SUPPORT: 403, None: 302}),
    ("POST", "/dead-letters/{dead_letter}", {OPERATOR: 302, ADMIN: 403, SUPPORT: 403, None: 302}),
]


def _form_for(path: str, world: World) -> dict[str, Any]:
    if path.endswith("/retry") and path.count("/") == 2:  # the bulk endpoints
        return {"ids": [str(world.mail), str(world.sms)], "scope": "selected"}
    if path.startswith("/dead-letters/"):
        return {"decision": "Resolved", "remark": "server fixed"}
    return {}


@pytest.mark.parametrize("role", [OPERATOR, ADMIN, SUPPORT, None])
def test_every_route_answers_each_role_as_the_table_says(
    app: Flask, world: World, role: str | None
) -> None:
    client, token = signed_in(app, role, "all" if role == OPERATOR else None)
    for method, template, expected in ROUTES:
        path = template.format(**world.__dict__)
        if method == "GET":
            response = client.get(path)
        else:
            data = _form_for(path, world) | {"csrf_token": token}
            response = client.post(path, data=data)
        assert response.status_code == expected[role], f"{role} {method} {path}"
        if response.status_code == 302 and role is None:
            assert "/auth/login" in response.headers["Location"]


def test_a_page_without_a_declared_permission_is_refused(app: Flask, world: World) -> None:
    for endpoint, view in app.view_functions.items():
        blueprint = endpoint.split(".", 1)[0]
        if blueprint in {"dashboard", "mail_records", "sms_records", "dead_letters"}:
            assert getattr(view, "required_permission", None) is not None, endpoint


# --- tenant isolation -----------------------------------------------------------------------------


@pytest.mark.parametrize("role", [ADMIN, SUPPORT])
def test_another_tenants_ids_are_404_on_every_route(app: Flask, world: World, role: str) -> None:
    client, token = signed_in(app, role)
    for path in [
        f"/mail-records/{world.mail_other}",
        f"/mail-records/{world.mail_other}/rendered",
        f"/sms-records/{world.sms_other}",
    ]:
        assert client.get(path).status_code == 404, path
    for path in [
        f"/mail-records/{world.mail_other}/retry",
        f"/sms-records/{world.sms_other}/retry",
    ]:
        assert client.post(path, data={"csrf_token": token}).status_code == 404, path
    assert status_of(MailSendRecord, world.mail_other) == "Failed"
    assert status_of(SmsSendRecord, world.sms_other) == "Failed"


def test_bulk_retry_cannot_reach_another_tenants_records(app: Flask, world: World) -> None:
    client, token = signed_in(app, ADMIN)
    ids = [str(world.mail), str(world.mail_other)]
    preview = client.post(
        "/mail-records/retry", data={"ids": ids, "scope": "selected", "csrf_token": token}
    )
    assert "<strong>1</strong> will be requeued and <strong>1</strong> skipped" in preview.text
    assert "no such record" in preview.text
    done = client.post(
        "/mail-records/retry",
        data={"confirmed": ",".join(ids), "confirm": "yes", "csrf_token": token},
    )
    assert done.status_code == 302
    assert status_of(MailSendRecord, world.mail) == "Retry"
    assert status_of(MailSendRecord, world.mail_other) == "Failed"


def test_lists_show_only_the_own_tenant_and_the_operator_sees_all(app: Flask, world: World) -> None:
    admin, _ = signed_in(app, ADMIN)
    page = admin.get("/mail-records/").text
    assert f'/mail-records/{world.mail}"' in page
    assert f'/mail-records/{world.mail_other}"' not in page
    operator, _ = signed_in(app, OPERATOR, "all")
    page = operator.get("/mail-records/").text
    assert f'/mail-records/{world.mail_other}"' in page
    assert "Globex" in page  # the tenant column when looking at every tenant
    # The operator looking at one tenant is held to it like everyone else.
    scoped, _ = signed_in(app, OPERATOR, world.acme)
    assert scoped.get(f"/mail-records/{world.mail_other}").status_code == 404


# --- CSRF -----------------------------------------------------------------------------------------


def test_every_post_without_the_csrf_token_is_refused(app: Flask, world: World) -> None:
    assert app.config.get("WTF_CSRF_ENABLED", True) is True  # the app fixture keeps CSRF on
    client, _ = signed_in(app, OPERATOR, "all")
    for path, data in [
        (f"/mail-records/{world.mail}/retry", {}),
        (f"/sms-records/{world.sms}/retry", {}),
        ("/mail-records/retry", {"ids": str(world.mail), "scope": "selected"}),
        ("/mail-records/retry", {"confirmed": str(world.mail), "confirm": "yes"}),
        ("/sms-records/retry", {"confirmed": str(world.sms), "confirm": "yes"}),
        (f"/dead-letters/{world.dead_letter}", {"decision": "Resolved", "remark": "x"}),
    ]:
        response = client.post(path, data=data)
        assert response.status_code == 400, path
        assert "Your form expired" in response.text
        bad = client.post(path, data=data, headers={"X-CSRFToken": "forged"})
        assert bad.status_code == 400, path
    assert status_of(MailSendRecord, world.mail) == "Failed"
    assert status_of(SmsSendRecord, world.sms) == "Failed"
    assert status_of(DeadLetterMessage, world.dead_letter) == "Pending"


# --- validation -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("from=2025-02-30", "Enter a real date"),
        ("to=yesterday", "Enter a real date"),
        ("from=2025-03-02&to=2025-03-01", "on or after the start date"),
        ("status=Lost", "Choose a status"),
        ("q=" + "a" * 321, "at most 320 characters"),
        ("template=" + "t" * 101, "at most 100 characters"),
        ("before=abc", "page link is broken"),
        ("before=99999999999999999999", "page link is broken"),
    ],
)
def test_bad_filters_re_render_with_422(app: Flask, world: World, query: str, message: str) -> None:
    client, _ = signed_in(app, SUPPORT)
    for prefix in ("/mail-records/", "/sms-records/"):
        response = client.get(f"{prefix}?{query}")
        assert response.status_code == 422, prefix
        assert message in response.text
        assert 'class="error-summary"' in response.text


def test_bad_ids_are_404_never_500(app: Flask, world: World) -> None:
    client, token = signed_in(app, ADMIN)
    for path in [
        "/mail-records/abc",
        "/mail-records/-1",
        "/mail-records/99999999999999999999999",
        "/mail-records/99999999999999999999999/rendered",
        "/sms-records/12abc",
        "/sms-records/9223372036854775808",
    ]:
        assert client.get(path).status_code == 404, path
    huge = "/mail-records/99999999999999999999999/retry"
    assert client.post(huge, data={"csrf_token": token}).status_code == 404


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"scope": "selected"}, "Select at least one record"),
        ({"scope": "selected", "ids": "abc"}, "not valid"),
        ({"scope": "selected", "ids": "99999999999999999999"}, "not valid"),
        ({"confirm": "yes", "confirmed": ""}, "Nothing to retry"),
        ({"confirm": "yes", "confirmed": "1,x"}, "not valid"),
        ({"scope": "filter", "status": "Lost"}, "Choose a status"),
        ({"scope": "filter", "q": "nobody@example.com"}, "No records match"),
    ],
)
def test_bad_bulk_forms_are_422_with_a_message(
    app: Flask, world: World, data: dict[str, str], message: str
) -> None:
    client, token = signed_in(app, ADMIN)
    for headers in ({}, HX):
        response = client.post(
            "/mail-records/retry", data=data | {"csrf_token": token}, headers=headers
        )
        assert response.status_code == 422
        assert message in response.text
    assert status_of(MailSendRecord, world.mail) == "Failed"


def test_too_many_ids_are_refused(app: Flask, world: World) -> None:
    client, token = signed_in(app, ADMIN)
    ids = ",".join(str(i) for i in range(1, BULK_CAP + 2))
    response = client.post(
        "/mail-records/retry", data={"ids": ids, "scope": "selected", "csrf_token": token}
    )
    assert response.status_code == 422
    assert "at most 1,000" in response.text


# --- search, filters, pages -----------------------------------------------------------------------


def test_search_by_address_is_exact_and_case_blind(app: Flask, world: World) -> None:
    cc = mail(world.acme, to="carol@example.com", cc_addrs=["Ann@Example.com"], subject="Copy")
    client, _ = signed_in(app, SUPPORT)
    page = client.get("/mail-records/?q=ANN@example.COM").text
    assert f'/mail-records/{world.mail}"' in page
    assert f'/mail-records/{cc}"' in page  # found as a cc
    assert f'/mail-records/{world.sent_mail}"' not in page
    assert f'/mail-records/{world.mail_other}"' not in page  # same address, other tenant
    assert "email address ann@example.com" in page
    assert "No mail records match" in client.get("/mail-records/?q=ann@example.co").text


def test_search_by_subject(app: Flask, world: World) -> None:
    mail(world.acme, subject="100% off_today")
    client, _ = signed_in(app, SUPPORT)
    page = client.get("/mail-records/?q=receipt").text
    assert f'/mail-records/{world.sent_mail}"' in page
    assert f'/mail-records/{world.mail}"' not in page
    # LIKE's wildcards are taken literally.
    assert "100% off_today" in client.get("/mail-records/?q=0%25 off_").text
    assert "No mail records match" in client.get("/mail-records/?q=%25%25x").text


def test_subject_search_reaches_every_record(app: Flask, world: World) -> None:
    """Subjects are found through their side table: no window, no "Older" to press."""
    old = mail(world.acme, subject="Needle")
    for _ in range(3):
        mail(world.acme, subject="Hay")
    client, _ = signed_in(app, SUPPORT)
    first = client.get("/mail-records/?q=needle").text
    assert f'/mail-records/{old}"' in first
    assert 'rel="next"' not in first


def test_sms_search_normalises_the_number(app: Flask, world: World) -> None:
    other = sms(world.acme, number="+14155550100")
    client, _ = signed_in(app, SUPPORT)
    for typed in ("+44 7911 123456", "+447911123456", "+44-7911-123-456"):
        page = client.get("/sms-records/", query_string={"q": typed}).text
        assert f'/sms-records/{world.sms}"' in page, typed
        assert f'/sms-records/{other}"' not in page
        assert f'/sms-records/{world.sms_other}"' not in page
    # A number that does not parse is looked for as typed.
    raw = sms(world.acme, number="12345")
    assert f'/sms-records/{raw}"' in client.get("/sms-records/?q=12345").text


def test_the_operator_searches_every_tenant(app: Flask, world: World) -> None:
    client, _ = signed_in(app, OPERATOR, "all")
    page = client.get("/mail-records/?q=ann@example.com").text
    assert f'/mail-records/{world.mail}"' in page
    assert f'/mail-records/{world.mail_other}"' in page
    page = client.get("/sms-records/?q=%2B447911123456").text
    assert f'/sms-records/{world.sms}"' in page
    assert f'/sms-records/{world.sms_other}"' in page


def test_filters_by_status_template_and_date(app: Flask, world: World) -> None:
    templated = mail(world.acme, status="Retry", template_code="welcome", subject=None)
    client, _ = signed_in(app, SUPPORT)
    page = client.get("/mail-records/?status=Sent").text
    assert f'/mail-records/{world.sent_mail}"' in page
    assert f'/mail-records/{world.mail}"' not in page
    page = client.get("/mail-records/?template=welcome").text
    assert f'/mail-records/{templated}"' in page
    assert f'/mail-records/{world.mail}"' not in page
    assert "template welcome" in page  # the preview cell of a templated mail
    assert "No mail records match" in client.get("/mail-records/?to=2001-01-01").text
    page = client.get("/mail-records/?from=2001-01-01").text
    assert f'/mail-records/{world.mail}"' in page


def test_keyset_pages_newest_first(app: Flask, world: World) -> None:
    ids = [mail(world.acme, status="Sent", subject=f"bulk {i}") for i in range(55)]
    client, _ = signed_in(app, SUPPORT)
    first = client.get("/mail-records/?status=Sent").text
    shown = [int(i) for i in re.findall(r'name="ids" value="(\d+)"', first)]
    assert shown == sorted([*ids, world.sent_mail], reverse=True)[:50]
    older = re.search(r'href="([^"]*)" rel="next"', first)
    assert older is not None
    assert "status=Sent" in older.group(1)
    second = client.get(older.group(1).replace("&amp;", "&")).text
    rest = [int(i) for i in re.findall(r'name="ids" value="(\d+)"', second)]
    assert rest == sorted([*ids, world.sent_mail], reverse=True)[50:]
    assert 'rel="next"' not in second
    assert ">Newest</a>" in second


def test_lists_read_without_javascript(app: Flask, world: World) -> None:
    client, _ = signed_in(app, SUPPORT)
    page = client.get("/mail-records/").text
    # Every row's checkbox is labelled; the select-all needs JS and is hidden without it.
    for record_id in (world.mail, world.sent_mail):
        assert f'<label for="pick-{record_id}" class="visually-hidden">' in page
    assert 'data-select-all="ids" class="needs-js"' in page
    assert 'method="post" action="/mail-records/retry"' in page
    assert "style=" not in page
    assert "onclick" not in page
    assert "<script>" not in page


# --- detail and the rendered message --------------------------------------------------------------


def test_detail_explains_and_shows_the_message_in_a_sandbox(app: Flask, world: World) -> None:
    client, _ = signed_in(app, SUPPORT)
    page = client.get(f"/mail-records/{world.mail}").text
    assert "What happened and what to do" in page
    assert "Temporary fault" in page  # 451 -> TRANSIENT
    assert "451 4.3.0 mailbox busy, try again later" in page
    assert f'<iframe class="preview" sandbox src="/mail-records/{world.mail}/rendered"' in page
    assert "Hi Ann" in page  # the text part
    assert "Not prepared yet" in page
    status = re.search(r"<dt>Status</dt><dd>(.*?)</dd>", page, re.S)
    assert status is not None
    assert re.sub(r"<[^>]+>", " ", status.group(1)).split() == ["Failed"]  # not "Failed Failed"
    rendered = client.get(f"/mail-records/{world.mail}/rendered")
    assert rendered.mimetype == "text/html"
    csp = rendered.headers["Content-Security-Policy"]
    assert "sandbox" in csp
    assert "default-src 'none'" in csp
    assert "script-src" not in csp
    assert "frame-ancestors 'self'" in csp
    assert rendered.headers["X-Frame-Options"] == "SAMEORIGIN"
    # The portal's own pages keep the strict CSP.
    assert (
        "sandbox"
        not in client.get(f"/mail-records/{world.mail}").headers["Content-Security-Policy"]
    )


def test_retry_is_disabled_with_the_reason_for_sent(app: Flask, world: World) -> None:
    client, token = signed_in(app, SUPPORT)
    page = client.get(f"/mail-records/{world.sent_mail}").text
    assert '<button type="submit" disabled aria-describedby="retry-why">Retry</button>' in page
    assert "Retry is not available — already sent" in page
    response = client.post(f"/mail-records/{world.sent_mail}/retry", data={"csrf_token": token})
    assert response.status_code == 302
    assert "not retried — already sent" in client.get(response.headers["Location"]).text
    assert status_of(MailSendRecord, world.sent_mail) == "Sent"


def test_sms_detail(app: Flask, world: World) -> None:
    record = sms(world.acme, number="+14155550100", error_code="HTTP_401")
    client, _ = signed_in(app, SUPPORT)
    page = client.get(f"/sms-records/{record}").text
    assert "Text message to +14155550100" in page
    assert "Credentials refused" in page  # HTTP_401 -> AUTH
    assert "Your code is 1234" in page


# --- retry: one record ----------------------------------------------------------------------------


def test_retry_from_the_detail_page_redirects_back_with_a_message(app: Flask, world: World) -> None:
    client, token = signed_in(app, SUPPORT)
    response = client.post(f"/mail-records/{world.mail}/retry", data={"csrf_token": token})
    assert response.status_code == 302
    assert response.headers["Location"] == f"/mail-records/{world.mail}"
    assert status_of(MailSendRecord, world.mail) == "Retry"
    assert "requeued" in client.get(response.headers["Location"]).text


def test_retry_from_a_list_row(app: Flask, world: World) -> None:
    client, token = signed_in(app, SUPPORT)
    # Without JavaScript: the row's button posts the list form and comes back to the list.
    response = client.post(
        f"/sms-records/{world.sms}/retry",
        data={"csrf_token": token, "next": "/sms-records/?status=Failed"},
    )
    assert response.headers["Location"] == "/sms-records/?status=Failed"
    assert status_of(SmsSendRecord, world.sms) == "Retry"
    # With htmx: the row swaps itself, saying what happened.
    response = client.post(
        f"/mail-records/{world.mail}/retry",
        data={"view": "row", "next": "/mail-records/"},
        headers=HX | {"X-CSRFToken": token},
    )
    assert response.status_code == 200
    assert response.text.strip().startswith(f'<tr id="mail-records-row-{world.mail}"')
    assert "Will try again" in response.text
    assert "requeued" in response.text
    assert response.headers["Vary"].startswith("HX-Request")


def test_an_open_redirect_through_next_is_refused(app: Flask, world: World) -> None:
    client, token = signed_in(app, SUPPORT)
    for target in ("https://evil.example", "//evil.example", "/\\evil.example", "/\t/evil.example"):
        response = client.post(
            f"/mail-records/{world.mail}/retry", data={"csrf_token": token, "next": target}
        )
        assert response.headers["Location"] == f"/mail-records/{world.mail}"


# --- retry: bulk ----------------------------------------------------------------------------------


def test_bulk_retry_confirms_with_counts_then_requeues_in_place(app: Flask, world: World) -> None:
    sending = mail(world.acme, status="Sending")
    dead = mail(world.acme, status="DeadLetter")
    client, token = signed_in(app, ADMIN)
    chosen = [world.mail, world.sent_mail, sending, dead]
    headers = HX | {"X-CSRFToken": token}
    preview = client.post(
        "/mail-records/retry",
        data={"ids": [str(i) for i in chosen], "scope": "selected"},
        headers=headers,
    )
    assert preview.status_code == 200
    text = preview.text
    assert "Retry 4 mail records?" in text
    assert "<strong>2</strong> will be requeued and <strong>2</strong> skipped" in text
    assert "Skipped, already sent" in text
    assert "Skipped, being sent right now" in text
    assert f'name="confirmed" value="{",".join(map(str, chosen))}"' in text
    assert "<html" not in text  # a fragment
    # Counting changed nothing.
    assert [status_of(MailSendRecord, i) for i in chosen] == [
        "Failed",
        "Sent",
        "Sending",
        "DeadLetter",
    ]

    done = client.post(
        "/mail-records/retry",
        data={
            "confirm": "yes",
            "confirmed": ",".join(map(str, chosen)),
            "shown": [str(world.mail), str(world.sent_mail), str(dead)],
        },
        headers=headers,
    )
    assert done.status_code == 200
    assert "2 requeued" in done.text
    assert "1: already sent" in done.text
    # The rows on the page come back out of band, wrapped in <template> (table rows).
    assert f'<tr id="mail-records-row-{world.mail}" hx-swap-oob="true">' in done.text
    assert f'<tr id="mail-records-row-{dead}" hx-swap-oob="true">' in done.text
    assert f'<tr id="mail-records-row-{sending}"' not in done.text  # not on the page
    assert done.text.count("<template>") == 3
    assert [status_of(MailSendRecord, i) for i in chosen] == ["Retry", "Sent", "Sending", "Retry"]


def test_bulk_retry_without_javascript(app: Flask, world: World) -> None:
    client, token = signed_in(app, ADMIN)
    preview = client.post(
        "/mail-records/retry",
        data={
            "ids": [str(world.mail)],
            "scope": "selected",
            "status": "Failed",
            "csrf_token": token,
        },
    )
    assert preview.status_code == 200
    assert "<html" in preview.text
    assert "Confirm: retry 1" in preview.text
    assert '<input type="hidden" name="status" value="Failed">' in preview.text
    done = client.post(
        "/mail-records/retry",
        data={
            "confirm": "yes",
            "confirmed": str(world.mail),
            "status": "Failed",
            "csrf_token": token,
        },
    )
    assert done.status_code == 302
    assert done.headers["Location"] == "/mail-records/?status=Failed"
    assert "1 requeued." in client.get(done.headers["Location"]).text
    cancel = client.post(
        "/mail-records/retry",
        data={"confirm": "no", "confirmed": str(world.sent_mail), "csrf_token": token},
    )
    assert cancel.status_code == 302


def test_bulk_retry_of_everything_matching_a_filter_is_capped(
    app: Flask, world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bulk, "BULK_CAP", 3)  # what matching_ids cuts at
    failed = [mail(world.acme, subject=f"f{i}") for i in range(4)]
    client, token = signed_in(app, ADMIN)
    preview = client.post(
        "/mail-records/retry",
        data={"scope": "filter", "status": "Failed"},
        headers=HX | {"X-CSRFToken": token},
    )
    assert "More than 3 records match this filter" in preview.text
    newest = sorted(failed, reverse=True)[:3]
    assert f'name="confirmed" value="{",".join(map(str, newest))}"' in preview.text
    # The filter is every page's records, not just the one on screen.
    preview = client.post(
        "/mail-records/retry",
        data={"scope": "filter", "status": "Failed", "before": str(min(failed))},
        headers=HX | {"X-CSRFToken": token},
    )
    assert f'name="confirmed" value="{",".join(map(str, newest))}"' in preview.text


def test_sms_bulk_retry(app: Flask, world: World) -> None:
    client, token = signed_in(app, SUPPORT)
    headers = HX | {"X-CSRFToken": token}
    preview = client.post(
        "/sms-records/retry", data={"ids": [str(world.sms)], "scope": "selected"}, headers=headers
    )
    assert "Retry 1 text message record?" in preview.text
    done = client.post(
        "/sms-records/retry",
        data={"confirm": "yes", "confirmed": str(world.sms), "shown": str(world.sms)},
        headers=headers,
    )
    assert f'<tr id="sms-records-row-{world.sms}" hx-swap-oob="true">' in done.text
    assert status_of(SmsSendRecord, world.sms) == "Retry"


# --- the dashboard --------------------------------------------------------------------------------


def test_dashboard_counts_backlog_chart_and_refresh(app: Flask, world: World) -> None:
    pending = mail(world.acme, status="Pending")
    client, _ = signed_in(app, SUPPORT)
    page = client.get("/")
    assert page.status_code == 200
    assert page.headers["Vary"].startswith("HX-Request")
    text = page.text
    # Pills that link to the filtered lists, with plain labels and counts.
    assert 'href="/mail-records/?status=Failed">Failed <strong>1</strong>' in text
    assert 'href="/mail-records/?status=Pending">Waiting to send <strong>1</strong>' in text
    assert 'href="/sms-records/?status=Failed">Failed <strong>1</strong>' in text
    assert f'<a href="/mail-records/{pending}">' in text  # the longest-waiting record
    assert "<strong>3</strong> created" in text  # acme's mail in the last 24 hours
    assert text.count('<div class="hour">') == 48
    assert 'hx-trigger="every 15s"' in text
    assert "Dead letters waiting" not in text  # support is no operator
    fragment = client.get("/", headers=HX)
    assert fragment.text.lstrip().startswith('<div id="dashboard-summary"')
    assert "<html" not in fragment.text
    assert fragment.headers["Vary"].startswith("HX-Request")


def test_dashboard_counts_are_per_tenant_and_capped(
    app: Flask, world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    from portal.web.operations import dashboard

    monkeypatch.setattr(dashboard, "COUNT_CAP", 2)
    for _ in range(3):
        mail(world.acme)
    client, _ = signed_in(app, OPERATOR, "all")
    text = client.get("/").text
    assert 'href="/mail-records/?status=Failed">Failed <strong>2+</strong>' in text
    assert "Dead letters waiting for triage" in text
    assert f'href="/dead-letters/{world.dead_letter}"' in text
    scoped, _ = signed_in(app, OPERATOR, world.globex)
    text = scoped.get("/").text
    assert 'href="/mail-records/?status=Failed">Failed <strong>1</strong>' in text
    assert f'href="/dead-letters/{world.dead_letter}"' not in text


def test_dashboard_search_goes_to_the_one_results_page(app: Flask, world: World) -> None:
    client, _ = signed_in(app, SUPPORT)
    to_mail = client.get("/search?q=ann@example.com")
    assert to_mail.headers["Location"] == "/search/?q=ann@example.com"
    # A subject or a name no longer lands on the SMS list.
    assert client.get("/search?q=Invoice").headers["Location"] == "/search/?q=Invoice"
    assert client.get("/search?q=").headers["Location"] == "/"


# --- the record's diagnosis, as the pages show it -------------------------------------------------


def diagnosed(model: Any, record_id: int) -> diagnosis.Diagnosis:
    record = db.session.get(model, record_id)
    assert record is not None
    channel = Channel.MAIL if model is MailSendRecord else Channel.SMS
    settings = current_app.config["SETTINGS"]
    return diagnosis.diagnose(db.session(), channel, record, settings)


def test_every_status_has_a_label_and_every_code_a_title() -> None:
    assert set(explain.STATUS_LOOK) == set(SendStatus)
    assert set(reasons.MARKER_TITLE) == set(MarkerCode) == set(MARKER_HELP)
    assert set(reasons.CATEGORY_TITLE) == set(ErrorCategory) == set(CATEGORY_HELP)
    assert set(reasons.REASON_LABEL) == set(reasons.Reason)
    assert explain.label("Teleported") == "Teleported"


def test_every_status_is_diagnosed_with_a_cause_and_a_next_step(app: Flask, world: World) -> None:
    for status in SendStatus:
        for model in (MailSendRecord, SmsSendRecord):
            make = mail if model is MailSendRecord else sms
            found = diagnosed(model, make(world.acme, status=status.value))
            assert found.title, status
            assert found.action, status
            assert found.retryable is (status.value in record_page.RETRYABLE)


@pytest.mark.parametrize(
    ("code", "message", "title"),
    [
        ("MONTHLY_QUOTA_EXCEEDED", None, "Monthly quota used up"),
        ("TEMPLATE_NOT_RESOLVABLE", None, "Template missing, disabled or broken"),
        ("451 4.3.0", None, "Temporary fault"),
        ("535 5.7.8", None, "Credentials refused"),
        (None, "connection reset by peer", "Temporary fault"),
        ("WEIRD", "something odd", "Unrecognised error"),
    ],
)
def test_the_cause_follows_the_error_code(
    app: Flask, world: World, code: str | None, message: str | None, title: str
) -> None:
    found = diagnosed(MailSendRecord, mail(world.acme, error_code=code, error_message=message))
    assert found.title == title


def test_a_sent_record_says_where_to_look_next_per_channel(app: Flask, world: World) -> None:
    sent = diagnosed(MailSendRecord, mail(world.acme, status="Sent", error_code="451"))
    assert "Temporary" not in sent.title  # an old attempt's error explains nothing now
    assert "spam" in sent.action
    assert "receipt" in diagnosed(SmsSendRecord, sms(world.acme, status="Sent")).action
    assert not sent.would_fail_again


def test_an_uncertain_record_is_resolved_not_retried(app: Flask, world: World) -> None:
    record = sms(world.acme, status="Uncertain", error_code="HTTP_503", ambiguous_attempt=True)
    found = diagnosed(SmsSendRecord, record)
    assert found.title == "Outcome unknown"
    assert "Temporary fault" not in found.cause
    assert "resolve it" in found.action  # not "tried again automatically"
    assert not found.retryable


@pytest.mark.parametrize("code", ["451", "HTTP_503", "QUOTA_EXCEEDED", "ZOMBIE_RECOVERED", None])
def test_a_dead_letter_never_says_it_is_tried_again_by_itself(
    app: Flask, world: World, code: str | None
) -> None:
    # Its retries are used up: nothing happens by itself any more.
    found = diagnosed(
        MailSendRecord, mail(world.acme, status="DeadLetter", error_code=code, retry_count=5)
    )
    assert "by itself" not in found.action
    assert "retry it" in found.action


def test_config_not_resolvable_is_explained_in_the_channels_own_words(
    app: Flask, world: World
) -> None:
    message = "no SMS provider serves country FR: no route for it and no default provider"
    found = diagnosed(
        SmsSendRecord, sms(world.acme, error_code="CONFIG_NOT_RESOLVABLE", error_message=message)
    )
    assert "SMS provider" in found.cause
    assert "mail" not in (found.cause + found.action).lower()
