"""The template pages over HTTP (Flask's test client, real PostgreSQL, Redis and SMTP):
permissions per role, tenant isolation, CSRF, validation, live preview, the sandboxed HTML
preview, attachments, provider bindings, and Send test through the real delivery path."""

from __future__ import annotations

import base64
import html
import io
import re
import secrets
import time
from collections.abc import Iterator
from typing import Any

import pytest
from flask import Flask, g
from flask.testing import FlaskClient
from flask_login.utils import _create_identifier
from redis import Redis
from sqlalchemy import func, select
from werkzeug.test import TestResponse

from portal.extensions import db
from portal.models import (
    AppUser,
    MailSendRecord,
    MailSendServerConfig,
    MailTemplate,
    SmsProviderConfig,
    SmsSendRecord,
    SmsTemplate,
    SmsTemplateProviderBinding,
)
from portal.tenancy import PLATFORM_TENANT_ID
from portal.web import auth
from tests.conftest import make_tenant
from tests.support.delivery import drain
from tests.support.smtp_server import ScriptedSmtpServer

_CSRF = re.compile(r'name="csrf_token" value="([^"]+)"')


class Portal:
    """A signed-in (or anonymous) browser stand-in: a test client that carries a CSRF token.

    Signing in puts the user in the session as flask-login does (argon2 takes a second a
    login on a busy machine; the sign-in form has its own tests)."""

    def __init__(self, app: Flask, email: str | None):
        self.client: FlaskClient = app.test_client()
        if email is not None:
            found = db.session.scalar(select(AppUser).where(AppUser.email == email))
            assert found is not None
            with app.test_request_context(environ_base=self.client.environ_base):
                identifier = _create_identifier()  # what session protection compares
            with self.client.session_transaction() as session:
                session["_user_id"] = str(found.id)
                session["_fresh"] = True
                session["_id"] = identifier
                # What sign-in stores for the session checks (generation, sign-in time, seen).
                session[auth.GENERATION] = found.session_generation
                session[auth.SIGNED_IN_AT] = session[auth.SEEN_AT] = time.time()
        page = self.get("/auth/login")
        self.token = _CSRF.search(page.text).group(1)  # type: ignore[union-attr]

    def get(self, url: str, **kwargs: Any) -> TestResponse:
        _forget_user()
        return self.client.get(url, **kwargs)

    def post(
        self, url: str, data: dict[str, Any] | None = None, *, csrf: bool = True, htmx: bool = False
    ) -> TestResponse:
        form = dict(data or {})
        if csrf:
            form["csrf_token"] = self.token
        headers = {"HX-Request": "true"} if htmx else {}
        _forget_user()
        return self.client.post(url, data=form, headers=headers)

    def view(self, tenant_id: int) -> None:
        """An operator switches the tenant being looked at."""
        assert (
            self.post("/tenants/view", {"tenant": str(tenant_id), "next": "/"}).status_code == 302
        )


def _forget_user() -> None:
    """Requests share the test's app context, where flask-login caches the signed-in user and
    Flask-WTF the CSRF token: forget both, so each request loads its own client's."""
    g.pop("_login_user", None)
    g.pop("csrf_token", None)


def user(email: str, role: str, tenant_id: int) -> None:
    row = AppUser(email=email, role=role, tenant_id=tenant_id, name=email.split("@")[0])
    row.password_hash = "not-used"  # tests sign in through the session, not the password
    db.session.add(row)


@pytest.fixture
def world(app: Flask, redis_client: Redis) -> dict[str, Any]:
    """Two tenants with an admin each, acme's support user, the operator, and config rows
    (Redis emptied: previews and kept sample variables are keyed by ids a new run reuses)."""
    acme, globex = make_tenant("acme"), make_tenant("globex")
    user("admin@acme.test", "tenant_admin", acme.id)
    user("support@acme.test", "support", acme.id)
    user("admin@globex.test", "tenant_admin", globex.id)
    user("operator@postroom.test", "platform_operator", PLATFORM_TENANT_ID)
    rows: dict[str, Any] = {"acme_id": acme.id, "globex_id": globex.id}
    for tier, prefix in ((acme.id, "acme"), (globex.id, "globex"), (PLATFORM_TENANT_ID, "pf")):
        server = MailSendServerConfig(
            tenant_id=tier, name=f"{prefix}-smtp", host="127.0.0.1", port=1,
            security="plain", from_address=f"no-reply@{prefix}.test", is_default=True,
        )  # fmt: skip
        provider = SmsProviderConfig(tenant_id=tier, name=f"{prefix}-sms", provider="test")
        db.session.add_all([server, provider])
        db.session.flush()
        mail = MailTemplate(
            tenant_id=tier, code="welcome", name="Welcome", subject="Hello {{ name }}",
            html_body="<p>Hi <b>{{ name }}</b></p>", text_body=None, enabled=True, version=1,
        )  # fmt: skip
        sms = SmsTemplate(tenant_id=tier, code="otp", name="OTP", content="Code {{ code }}")
        db.session.add_all([mail, sms])
        db.session.flush()
        binding = SmsTemplateProviderBinding(
            tenant_id=tier, template_id=sms.id, provider_id=provider.id, signature="Acme"
        )
        db.session.add(binding)
        db.session.flush()
        rows[prefix] = {
            "server": server.id,
            "provider": provider.id,
            "mail": mail.id,
            "sms": sms.id,
            "binding": binding.id,
        }
    db.session.commit()
    return rows


@pytest.fixture
def admin(app: Flask, world: dict[str, Any]) -> Portal:
    return Portal(app, "admin@acme.test")


def mail_form(template: MailTemplate | None = None, **changes: Any) -> dict[str, Any]:
    """The editor's fields as the browser posts them (a saved template's, or a new one)."""
    base: dict[str, Any] = {
        "code": "receipt",
        "name": "Receipt",
        "subject": "Your receipt, {{ name }}",
        "html_body": "<p>Thanks {{ name }}</p>",
        "text_body": "",
        "enabled": "on",
        "strict_variables": "on",  # on for a new template
        "priority": "",
        "reply_to": "",
        "preferred_server_id": "",
        "variables": '{"name": "Ann"}',
        "preview_slot": secrets.token_urlsafe(12),  # Redis outlives the test database
    }
    if template is not None:
        base.update(
            code=template.code,
            name=template.name,
            subject=template.subject,
            html_body=template.html_body or "",
            text_body=template.text_body or "",
            enabled="on" if template.enabled else "",
            priority=str(template.priority or ""),
            reply_to=template.reply_to or "",
            preferred_server_id=str(template.preferred_server_id or ""),
            version=str(template.version),
        )
        if not template.enabled:
            del base["enabled"]
        if not template.strict_variables:
            del base["strict_variables"]
    base.update(changes)
    return {k: v for k, v in base.items() if v is not None}


def count(model: Any) -> int:
    db.session.expire_all()
    return db.session.scalar(select(func.count()).select_from(model)) or 0


# --- permissions: role x route --------------------------------------------------------------

ROUTES = [
    # (method, url template, expected status for a permitted user)
    ("GET", "/mail-templates/", 200),
    ("GET", "/mail-templates/new", 200),
    ("POST", "/mail-templates/", 422),
    ("GET", "/mail-templates/{mail}/edit", 200),
    ("POST", "/mail-templates/{mail}", 422),
    ("POST", "/mail-templates/preview", 200),
    ("POST", "/mail-templates/{mail}/send-test", 422),
    ("POST", "/mail-templates/{mail}/attachments", 422),
    ("POST", "/mail-templates/{mail}/attachments/0/delete", 404),
    ("GET", "/sms-templates/", 200),
    ("GET", "/sms-templates/new", 200),
    ("POST", "/sms-templates/", 422),
    ("GET", "/sms-templates/{sms}/edit", 200),
    ("POST", "/sms-templates/{sms}", 422),
    ("POST", "/sms-templates/preview", 200),
    ("POST", "/sms-templates/{sms}/send-test", 422),
    ("POST", "/sms-templates/{sms}/bindings", 422),
    ("POST", "/sms-templates/{sms}/bindings/{binding}/delete", 303),
]
ROLES = {
    "operator": "operator@postroom.test",
    "admin": "admin@acme.test",
    "support": "support@acme.test",
    "anonymous": None,
}


@pytest.mark.parametrize("role", list(ROLES))
def test_every_route_answers_each_role_as_its_permissions_say(
    app: Flask, world: dict[str, Any], role: str
) -> None:
    portal = Portal(app, ROLES[role])
    if role == "operator":
        portal.view(world["acme_id"])  # operators edit the viewed tenant's templates
    for method, template, permitted in ROUTES:
        url = template.format(**world["acme"])
        response = portal.get(url) if method == "GET" else portal.post(url, {"code": ""})
        expected = {"anonymous": 302, "support": 403}.get(role, permitted)
        assert response.status_code == expected, f"{role} {method} {url}: {response.status_code}"
        if role == "anonymous":
            assert "/auth/login" in response.headers["Location"]


def test_operators_edit_the_platform_tier_by_default(app: Flask, world: dict[str, Any]) -> None:
    operator = Portal(app, "operator@postroom.test")
    page = operator.get("/mail-templates/")
    assert "Platform tier" in page.text
    assert f"/mail-templates/{world['pf']['mail']}/edit" in page.text
    assert f"/mail-templates/{world['acme']['mail']}/edit" not in page.text
    assert operator.get(f"/mail-templates/{world['pf']['mail']}/edit").status_code == 200
    assert operator.get(f"/mail-templates/{world['acme']['mail']}/edit").status_code == 404
    operator.view(world["acme_id"])
    assert operator.get(f"/mail-templates/{world['acme']['mail']}/edit").status_code == 200


# --- tenant isolation ----------------------------------------------------------------------------


def test_another_tenants_ids_are_404_on_every_route(
    app: Flask, world: dict[str, Any], admin: Portal
) -> None:
    lists = admin.get("/mail-templates/").text + admin.get("/sms-templates/").text
    # Links by their whole path: "/5/edit" is also part of "/15/edit".
    assert f"/mail-templates/{world['acme']['mail']}/edit" in lists
    for other in ("globex", "pf"):
        for method, template, _ in ROUTES:
            if "{" not in template:
                continue
            url = template.format(**world[other])
            response = admin.get(url) if method == "GET" else admin.post(url, mail_form())
            assert response.status_code == 404, f"{method} {url}: {response.status_code}"
        assert f"/mail-templates/{world[other]['mail']}/edit" not in lists
    # A binding of another tenant under one's own template is not found either.
    url = f"/sms-templates/{world['acme']['sms']}/bindings/{world['globex']['binding']}/delete"
    assert admin.post(url).status_code == 404
    assert count(SmsTemplateProviderBinding) == 3
    # Ids beyond any column's range are a 404 as well, never a database error.
    assert admin.get(f"/mail-templates/{2**70}/edit").status_code == 404
    assert (
        admin.post(f"/sms-templates/{2**64}/send-test", {"phone": "+447911123456"}).status_code
        == 404
    )


def test_unsafe_requests_without_the_csrf_token_are_refused(
    app: Flask, world: dict[str, Any], admin: Portal
) -> None:
    template_id = world["acme"]["mail"]
    for url, data in (
        ("/mail-templates/", mail_form()),
        (f"/mail-templates/{template_id}", mail_form(code="changed")),
        (f"/mail-templates/{template_id}/send-test", {"to": "ann@example.com"}),
        ("/sms-templates/", {"code": "x", "content": "y"}),
        ("/mail-templates/preview", mail_form()),
    ):
        response = admin.post(url, data, csrf=False)
        assert response.status_code == 400, url
        assert "Your form expired" in response.text
    assert count(MailTemplate) == 3
    assert count(MailSendRecord) == 0
    assert db.session.get(MailTemplate, template_id).code == "welcome"  # type: ignore[union-attr]


# --- the editor: validation -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"code": ""}, "Code is required"),
        ({"code": "x" * 101}, "Code must be at most 100 characters"),
        ({"subject": ""}, "Subject is required"),
        (
            {"subject": "Hi {{ name | nope }}"},
            "Subject has an error: unknown filter &#39;nope&#39;",
        ),
        ({"html_body": "<p>\n  {% if x %}\n</p>"}, "HTML body has an error:"),
        ({"html_body": "", "text_body": ""}, "HTML body or a text body is required"),
        ({"priority": "9"}, "Priority must be a whole number from 1 to 5"),
        ({"priority": "high"}, "Priority must be a whole number from 1 to 5"),
        ({"reply_to": "not an address"}, "Reply-To is not a valid email address"),
        ({"preferred_server_id": "999999"}, "Preferred server must be one of this tier"),
        ({"code": "welcome"}, "Code &#39;welcome&#39; is already used by another mail template"),
        ({"name": "bad\x00name"}, "Name must not contain control characters"),
    ],
)
def test_an_invalid_template_is_422_with_the_field_named_and_the_input_kept(
    app: Flask, world: dict[str, Any], admin: Portal, changes: dict[str, str], message: str
) -> None:
    form = mail_form(**changes)
    response = admin.post("/mail-templates/", form)
    assert response.status_code == 422
    assert message in response.text
    assert "There is a problem" in response.text
    assert html.escape(form["html_body"]) in response.text  # what was typed is still there
    assert count(MailTemplate) == 3


def test_a_template_error_names_its_line_and_column(
    app: Flask, world: dict[str, Any], admin: Portal
) -> None:
    response = admin.post(
        "/mail-templates/", mail_form(html_body="<p>Hi</p>\n<p>{{ name | frobnicate }}</p>")
    )
    assert response.status_code == 422
    assert "line 2, column" in response.text


def test_a_preferred_server_of_another_tier_is_refused(
    app: Flask, world: dict[str, Any], admin: Portal
) -> None:
    for other in ("globex", "pf"):
        response = admin.post(
            "/mail-templates/", mail_form(preferred_server_id=str(world[other]["server"]))
        )
        assert response.status_code == 422
        assert "Preferred server must be one of this tier" in response.text
    page = admin.get("/mail-templates/new").text
    assert "acme-smtp" in page
    assert "globex-smtp" not in page
    assert "pf-smtp" not in page


def test_create_then_update_saves_and_bumps_the_version(
    app: Flask, world: dict[str, Any], admin: Portal
) -> None:
    created = admin.post(
        "/mail-templates/",
        mail_form(
            priority="2",
            reply_to="Help@Acme.example.com",
            preferred_server_id=str(world["acme"]["server"]),
        ),
    )
    assert created.status_code == 303
    template = db.session.scalar(select(MailTemplate).where(MailTemplate.code == "receipt"))
    assert template is not None
    assert template.tenant_id == world["acme_id"]
    assert (template.priority, template.reply_to, template.version) == (
        2,
        "help@acme.example.com",
        1,
    )
    assert template.preferred_server_id == world["acme"]["server"]
    edit_url = f"/mail-templates/{template.id}/edit"
    assert created.headers["Location"].endswith(edit_url)
    assert "Template &#39;receipt&#39; created." in admin.get(edit_url).text
    updated = admin.post(
        f"/mail-templates/{template.id}", mail_form(template, subject="New {{ name }}", enabled="")
    )
    assert updated.status_code == 303
    db.session.expire_all()
    assert (template.subject, template.enabled, template.version) == ("New {{ name }}", False, 2)


def test_saving_over_a_newer_version_is_refused(
    app: Flask, world: dict[str, Any], admin: Portal
) -> None:
    template = db.session.get(MailTemplate, world["acme"]["mail"])
    assert template is not None
    stale = mail_form(template, subject="Mine")
    assert (
        admin.post(
            f"/mail-templates/{template.id}", mail_form(template, subject="Theirs")
        ).status_code
        == 303
    )
    response = admin.post(f"/mail-templates/{template.id}", stale)
    assert response.status_code == 422
    assert "saved again since you opened it" in response.text
    assert 'value="Mine"' in response.text
    db.session.expire_all()
    assert template.subject == "Theirs"


# --- live preview ---------------------------------------------------------------------------------


def test_the_preview_renders_what_is_typed_and_lists_the_variables(
    app: Flask, world: dict[str, Any], admin: Portal
) -> None:
    response = admin.post(
        "/mail-templates/preview",
        mail_form(
            subject="Hello {{ name }}",
            html_body="<p>{{ name }} owes {{ amount }}</p>",
            variables='{"name": "<Ann>"}',
        ),
        htmx=True,
    )
    assert response.status_code == 200
    assert response.text.lstrip().startswith('<section id="preview"')  # a fragment, one root
    assert "Hello &lt;Ann&gt;" in response.text
    assert "&lt;Ann&gt; owes" in response.text  # the text version, made from the HTML
    assert re.search(r'<li class="mono">name</li>', response.text)
    assert re.search(r'<li class="mono missing">amount', response.text)
    assert "(made from the HTML)" in response.text
    frame = re.search(
        r'<iframe class="preview" id="preview-html" sandbox src="([^"]+)"', response.text
    )
    assert frame is not None
    shown = admin.get(html.unescape(frame.group(1)))
    assert shown.status_code == 200
    # Escaped by the template engine; served with the sandboxing CSP.
    assert shown.text == "<p>&lt;Ann&gt; owes </p>"
    csp = shown.headers["Content-Security-Policy"]
    assert "sandbox" in csp
    assert "default-src 'none'" in csp
    assert "script-src" not in csp
    assert shown.headers["X-Frame-Options"] == "SAMEORIGIN"
    # The stored preview is this user's alone.
    other = Portal(app, "admin@globex.test")
    assert other.get(html.unescape(frame.group(1))).status_code == 404
    assert admin.get("/mail-templates/preview/not-a-slot!").status_code == 404


@pytest.mark.parametrize(
    ("variables", "message"),
    [
        ("{not json", "Sample variables are not valid JSON"),
        ("[1, 2]", "Sample variables must be a JSON object"),
        ('{"name": ' * 40 + "1" + "}" * 40, "nested too deeply"),
    ],
)
def test_bad_sample_variables_are_a_message_in_the_preview_never_a_500(
    app: Flask, world: dict[str, Any], admin: Portal, variables: str, message: str
) -> None:
    for url in ("/mail-templates/preview", "/sms-templates/preview"):
        response = admin.post(
            url, mail_form(variables=variables) | {"content": "Hi {{ name }}"}, htmx=True
        )
        assert response.status_code == 200
        assert message in response.text


def test_a_template_error_shows_in_the_preview_with_its_position(
    app: Flask, world: dict[str, Any], admin: Portal
) -> None:
    response = admin.post("/mail-templates/preview", mail_form(html_body="ok\n{% if %}"), htmx=True)
    assert response.status_code == 200
    assert "HTML body: missing expression (line 2, column 4)" in response.text
    runaway = admin.post(
        "/mail-templates/preview",
        mail_form(
            text_body="{% for i in (1..100000) %}{% for j in (1..100000) %}x{% endfor %}"
            "{% endfor %}"
        ),
        htmx=True,
    )
    assert runaway.status_code == 200
    assert "Text body:" in runaway.text


def test_the_editor_previews_the_saved_template_on_first_load(
    app: Flask, world: dict[str, Any], admin: Portal
) -> None:
    page = admin.get(f"/mail-templates/{world['acme']['mail']}/edit")
    assert page.status_code == 200
    assert "Hello [name]" in page.text  # the sample variables made from the template's names
    assert "&#34;name&#34;: &#34;[name]&#34;" in page.text or '"name": "[name]"' in page.text
    assert "<iframe" in page.text
    assert "<script" not in page.text.split("</head>", 1)[1]  # no inline script anywhere


def test_sms_preview_counts_characters_and_segments(
    app: Flask, world: dict[str, Any], admin: Portal
) -> None:
    response = admin.post(
        "/sms-templates/preview",
        {"content": "Code {{ code }} " + "x" * 150, "variables": '{"code": "123456"}'},
        htmx=True,
    )
    assert response.status_code == 200
    assert "Code 123456" in response.text
    assert "162 characters · 2 segments · GSM-7" in response.text
    unicode = admin.post("/sms-templates/preview", {"content": "Grüße 😀", "variables": ""})
    assert "1 segment · UCS-2" in unicode.text


# --- send test ------------------------------------------------------------------------------------


def test_a_mail_test_sends_the_saved_template_through_the_real_delivery_path(
    app: Flask, world: dict[str, Any], admin: Portal
) -> None:
    template = db.session.get(MailTemplate, world["acme"]["mail"])
    server = db.session.get(MailSendServerConfig, world["acme"]["server"])
    assert template is not None
    assert server is not None
    template.enabled = False  # a test send goes out all the same (seed 000)
    template.version += 1
    db.session.commit()
    with ScriptedSmtpServer() as smtp:
        server.host, server.port = smtp.host, smtp.port
        db.session.commit()
        response = admin.post(
            f"/mail-templates/{template.id}/send-test",
            mail_form(template, to="Ann@Example.com", variables='{"name": "Ann"}'),
            htmx=True,
        )
        assert response.status_code == 200, response.text
        assert response.headers["Vary"] == "HX-Request" or "HX-Request" in response.headers["Vary"]
        assert response.text.lstrip().startswith('<section id="send-test"')
        record = db.session.scalar(select(MailSendRecord))
        assert record is not None
        assert f"#{record.id}" in response.text
        assert record.tenant_id == world["acme_id"]
        assert record.template_id == template.id
        assert record.to_addrs == ["ann@example.com"]
        assert record.variables == {"name": "Ann"}
        drain(app)
        (message,) = smtp.wait_for_messages(1)
    assert message.message["Subject"] == "Hello Ann"
    assert "Hi <b>Ann</b>" in message.raw.decode()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"version": "0"}, "saved again since you opened it"),
        ({"version": "0", "subject": "Edited"}, "saved again since you opened it"),
        ({"subject": "{{ broken"}, "The editor has errors"),
        ({"to": "nobody"}, "Email address is not a valid email address"),
        ({"to": ""}, "Email address is required"),
        ({"variables": "{oops"}, "Sample variables are not valid JSON"),
    ],
)
def test_a_mail_test_is_refused_when_the_editor_is_stale_or_the_test_is_malformed(
    app: Flask, world: dict[str, Any], admin: Portal, changes: dict[str, Any], message: str
) -> None:
    template = db.session.get(MailTemplate, world["acme"]["mail"])
    assert template is not None
    form = mail_form(template, to="ann@example.com") | changes
    form = {k: v for k, v in form.items() if v is not None}
    for htmx in (True, False):
        response = admin.post(f"/mail-templates/{template.id}/send-test", form, htmx=htmx)
        assert response.status_code == 422
        assert message in html.unescape(response.text)
        assert "HX-Request" in response.headers["Vary"]
    assert count(MailSendRecord) == 0


def test_a_mail_test_with_unsaved_edits_saves_them_first_and_sends_that_version(
    app: Flask, world: dict[str, Any], admin: Portal
) -> None:
    template = db.session.get(MailTemplate, world["acme"]["mail"])
    server = db.session.get(MailSendServerConfig, world["acme"]["server"])
    assert template is not None
    assert server is not None
    before = template.version
    with ScriptedSmtpServer() as smtp:
        server.host, server.port = smtp.host, smtp.port
        db.session.commit()
        form = mail_form(template, to="ann@example.com", subject="Edited {{ name }}")
        # No sends of this template yet: nothing to check against, so it saves at once.
        response = admin.post(f"/mail-templates/{template.id}/send-test", form, htmx=True)
        assert response.status_code == 200, response.text
        # The whole editor comes back in place of the page's (its version field moved on).
        assert response.headers["HX-Retarget"] == "#main"
        assert response.headers["HX-Reselect"] == "#main"
        assert f"saved as version {before + 1}" in response.text
        assert f'name="version" value="{before + 1}"' in response.text
        db.session.expire_all()
        assert template.version == before + 1
        assert template.subject == "Edited {{ name }}"
        record = db.session.scalar(select(MailSendRecord))
        assert record is not None
        assert (record.is_test, record.pinned_template_version) == (True, before + 1)
        drain(app)
        (message,) = smtp.wait_for_messages(1)
    assert message.message["Subject"] == "Edited Ann"


def test_a_mail_test_renders_the_version_previewed_though_a_later_one_was_saved(
    app: Flask, world: dict[str, Any], admin: Portal
) -> None:
    template = db.session.get(MailTemplate, world["acme"]["mail"])
    server = db.session.get(MailSendServerConfig, world["acme"]["server"])
    assert template is not None
    assert server is not None
    previewed = template.version
    with ScriptedSmtpServer() as smtp:
        server.host, server.port = smtp.host, smtp.port
        db.session.commit()
        sent = admin.post(
            f"/mail-templates/{template.id}/send-test",
            mail_form(template, to="ann@example.com"),
            htmx=True,
        )
        assert sent.status_code == 200, sent.text
        assert f"of version {previewed}" in sent.text
        # Someone saves a new version before a worker prepares the test.
        later = mail_form(template, subject="Later {{ name }}", dry_run_seen="yes")
        assert admin.post(f"/mail-templates/{template.id}", later).status_code == 303
        db.session.expire_all()
        assert template.version == previewed + 1
        drain(app)
        (message,) = smtp.wait_for_messages(1)
    assert message.message["Subject"] == "Hello Ann"  # the version previewed, not the later one
    record = db.session.scalar(select(MailSendRecord))
    assert record is not None
    assert (record.template_version, record.pinned_template_version) == (previewed, previewed)


def test_a_mail_test_with_edits_to_a_template_with_sends_confirms_the_dry_run_first(
    app: Flask, world: dict[str, Any], admin: Portal
) -> None:
    template = db.session.get(MailTemplate, world["acme"]["mail"])
    assert template is not None
    url = f"/mail-templates/{template.id}/send-test"
    first = admin.post(url, mail_form(template, to="ann@example.com"), htmx=True)
    assert first.status_code == 200, first.text  # a send of this template to check against
    before = template.version
    edited = mail_form(
        template,
        to="ann@example.com",
        subject="Hi {{ name }} {{ plan }}",
        variables='{"name": "Ann", "plan": "Pro"}',
    )
    asked = admin.post(url, edited, htmx=True)
    assert asked.status_code == 200, asked.text
    assert asked.headers["HX-Retarget"] == "#main"
    page = html.unescape(asked.text)
    assert "Before this change goes live" in page
    assert re.search(r'id="dry-run-refused">1<', page)  # the earlier send gives no plan
    assert "Save this version and send the test" in page
    assert f'formaction="{url}"' in page
    db.session.expire_all()
    assert template.version == before  # nothing saved, nothing sent yet
    assert count(MailSendRecord) == 1
    confirmed = admin.post(url, edited | {"dry_run_seen": "yes"})
    assert confirmed.status_code == 200, confirmed.text
    db.session.expire_all()
    assert template.version == before + 1
    assert template.subject == "Hi {{ name }} {{ plan }}"
    latest = db.session.scalars(select(MailSendRecord).order_by(MailSendRecord.id.desc())).first()
    assert latest is not None
    assert (latest.is_test, latest.pinned_template_version) == (True, before + 1)
    # A bad recipient refuses the test before anything is saved.
    bad = admin.post(url, edited | {"subject": "Other", "to": "nobody"}, htmx=True)
    assert bad.status_code == 422
    db.session.expire_all()
    assert template.version == before + 1


def test_an_sms_test_sends_the_previewed_text_as_its_content(
    app: Flask, world: dict[str, Any], admin: Portal
) -> None:
    template_id = world["acme"]["sms"]
    form = {
        "code": "otp",
        "name": "OTP",
        "content": "Unsaved: {{ code }}",
        "enabled": "on",
        "variables": '{"code": "4242"}',
        "phone": "+44 7911 123456",
    }
    preview = admin.post("/sms-templates/preview", form, htmx=True)
    assert "Unsaved: 4242" in preview.text
    response = admin.post(f"/sms-templates/{template_id}/send-test", form, htmx=True)
    assert response.status_code == 200, response.text
    record = db.session.scalar(select(SmsSendRecord))
    assert record is not None
    assert (record.content, record.phone_number) == ("Unsaved: 4242", "+447911123456")
    assert record.template_code == "otp"  # enabled: its provider bindings apply
    assert record.tenant_id == world["acme_id"]
    # A disabled template's test goes out as plain content (code lookups skip disabled ones).
    template = db.session.get(SmsTemplate, template_id)
    assert template is not None
    template.enabled = False
    db.session.commit()
    assert admin.post(f"/sms-templates/{template_id}/send-test", form).status_code == 200
    latest = db.session.scalars(select(SmsSendRecord).order_by(SmsSendRecord.id.desc())).first()
    assert latest is not None
    assert (latest.content, latest.template_code) == ("Unsaved: 4242", None)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"phone": "07911 123456"}, "Phone number must be in international form"),
        ({"phone": "+44 12"}, "Phone number is not a valid phone number"),
        ({"phone": ""}, "Phone number is required"),
        ({"variables": "nope"}, "Sample variables are not valid JSON"),
        ({"content": "{{ code"}, "Fix the preview first"),
        ({"content": "{{ code }}", "variables": '{"code": "  "}'}, "comes out empty"),
    ],
)
def test_an_invalid_sms_test_is_422_and_sends_nothing(
    app: Flask, world: dict[str, Any], admin: Portal, changes: dict[str, str], message: str
) -> None:
    form = {"content": "Code {{ code }}", "variables": '{"code": "1"}', "phone": "+447911123456"}
    response = admin.post(
        f"/sms-templates/{world['acme']['sms']}/send-test", form | changes, htmx=True
    )
    assert response.status_code == 422
    assert message in html.unescape(response.text)
    assert count(SmsSendRecord) == 0


# --- attachments ----------------------------------------------------------------------------------


def upload(portal: Portal, template_id: int, name: str, data: bytes, ctype: str) -> TestResponse:
    _forget_user()
    return portal.client.post(
        f"/mail-templates/{template_id}/attachments",
        data={"csrf_token": portal.token, "file": (io.BytesIO(data), name, ctype)},
        content_type="multipart/form-data",
    )


def test_attachments_are_stored_base64_within_the_cap_and_can_be_removed(
    app: Flask, world: dict[str, Any], admin: Portal
) -> None:
    template_id = world["acme"]["mail"]
    assert (
        upload(admin, template_id, "terms.pdf", b"%PDF-1.4 terms", "application/pdf").status_code
        == 303
    )
    template = db.session.get(MailTemplate, template_id)
    assert template is not None
    assert template.attachments == [
        {
            "name": "terms.pdf",
            "contentType": "application/pdf",
            "content": base64.b64encode(b"%PDF-1.4 terms").decode(),
        }
    ]
    assert template.version == 2
    assert "terms.pdf" in admin.get(f"/mail-templates/{template_id}/edit").text
    again = upload(admin, template_id, "terms.pdf", b"x", "application/pdf")
    assert again.status_code == 422
    assert "already attached" in again.text
    cap = app.config["SETTINGS"].attachment_max_bytes
    big = upload(admin, template_id, "big.bin", b"x" * cap, "application/octet-stream")
    assert big.status_code == 422
    assert "Attachment is too large" in big.text
    empty = upload(admin, template_id, "empty.txt", b"", "text/plain")
    assert empty.status_code == 422
    assert admin.post(f"/mail-templates/{template_id}/attachments/0/delete").status_code == 303
    db.session.expire_all()
    assert template.attachments is None
    assert admin.post(f"/mail-templates/{template_id}/attachments/0/delete").status_code == 404


# --- provider bindings ----------------------------------------------------------------------------


def test_bindings_are_validated_and_tenant_scoped(
    app: Flask, world: dict[str, Any], admin: Portal
) -> None:
    url = f"/sms-templates/{world['acme']['sms']}/bindings"
    cases = [
        ({"provider_id": str(world["globex"]["provider"])}, "Provider must be one of this tier"),
        ({"provider_id": ""}, "Provider is required"),
        (
            {"provider_id": str(world["acme"]["provider"]), "country": "G1"},
            "Country must be an ISO",
        ),
        ({"provider_id": str(world["acme"]["provider"]), "country": "ZZ"}, "ZZ is not a country"),
        ({"provider_id": str(world["acme"]["provider"]), "country": ""}, "already has a binding"),
        (
            {"provider_id": str(world["acme"]["provider"]), "signature": "s" * 201},
            "Signature must be at most 200",
        ),
    ]
    for data, message in cases:
        response = admin.post(url, data)
        assert response.status_code == 422, data
        assert message in response.text, data
    done = admin.post(
        url,
        {
            "provider_id": str(world["acme"]["provider"]),
            "country": "gb",
            "external_template_id": "HX1",
        },
    )
    assert done.status_code == 303
    binding = db.session.scalar(
        select(SmsTemplateProviderBinding).where(SmsTemplateProviderBinding.country_code == "GB")
    )
    assert binding is not None
    assert (binding.tenant_id, binding.external_template_id) == (world["acme_id"], "HX1")
    page = admin.get(f"/sms-templates/{world['acme']['sms']}/edit").text
    assert "HX1" in page
    assert "globex-sms" not in page


@pytest.fixture(autouse=True)
def _no_leftover_sessions(app: Flask) -> Iterator[None]:
    yield
    db.session.rollback()
