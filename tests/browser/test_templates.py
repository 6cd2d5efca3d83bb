"""The template editor in a real browser: live preview as you type, the sandboxed HTML
preview, and Send test arriving at a real SMTP server through the real delivery path."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from flask import Flask
from playwright.sync_api import Page, expect
from redis import Redis

from portal.extensions import db
from portal.models import (
    MailSendRecord,
    MailTemplate,
    SmsProviderConfig,
    SmsSendRecord,
    SmsTemplate,
)
from tests.browser.conftest import screenshot, sign_in
from tests.support.delivery import drain
from tests.support.smtp_server import ScriptedSmtpServer


class RemoteHost:
    """A web server standing in for any remote host: it counts every request it gets."""

    def __init__(self) -> None:
        self.hits: list[str] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                owner.hits.append(self.path)
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.end_headers()
                self.wfile.write(b"remote")

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def remote() -> Iterator[RemoteHost]:
    host = RemoteHost()
    yield host
    host.close()


def hostile_html(remote: str) -> str:
    """Mail HTML that tries everything a preview must not do, and one inline style it must."""
    return (
        f'<meta http-equiv="refresh" content="0;url={remote}/refresh">\n'
        f'<link rel="stylesheet" href="{remote}/style.css">\n'
        '<p id="greeting" style="color: rgb(1, 2, 3)">Hello {{ name }}</p>\n'
        f'<img src="{remote}/pixel.png" alt="">\n'
        f'<script src="{remote}/remote.js"></script>\n'
        "<script>document.getElementById('greeting').textContent = 'SCRIPT RAN'</script>\n"
        "<img src=\"x\" onerror=\"document.getElementById('greeting').textContent='SCRIPT RAN'\">\n"
        f'<iframe src="{remote}/frame"></iframe>\n'
        f'<form action="{remote}/form"><button id="submit">Go</button></form>'
    )


def test_the_preview_follows_typing_and_the_html_runs_nothing_and_loads_nothing(
    page: Page, acme_admin: dict[str, Any], remote: RemoteHost, redis_client: Redis
) -> None:
    template = MailTemplate(
        tenant_id=acme_admin["tenant_id"],
        code="welcome",
        name="Welcome",
        subject="Welcome {{ name }}",
        html_body=hostile_html(remote.url),
        enabled=True,
        version=1,
    )
    db.session.add(template)
    db.session.commit()
    sign_in(page, "admin@acme.example.com")
    page.goto(f"/mail-templates/{template.id}/edit")
    frame = page.frame_locator("#preview-html")
    greeting = frame.locator("#greeting")
    expect(greeting).to_have_text("Hello [name]")
    expect(page.locator("#preview-subject")).to_have_text("Welcome [name]")

    # Live preview: the subject, then the sample variables.
    page.get_by_label("Subject").fill("Hi {{ name }}, your order")
    expect(page.locator("#preview-subject")).to_have_text("Hi [name], your order")
    page.get_by_label("Sample variables").fill('{"name": "Ann"}')
    expect(page.locator("#preview-subject")).to_have_text("Hi Ann, your order")
    expect(greeting).to_have_text("Hello Ann")
    page.get_by_label("Sample variables").fill('{"name": ')
    expect(page.locator("#preview-errors")).to_contain_text("Sample variables are not valid JSON")
    page.get_by_label("Sample variables").fill('{"name": "Bea"}')
    expect(greeting).to_have_text("Hello Bea")

    # The sandbox: inline styles apply; scripts, forms, refreshes and remote loads do not.
    expect(page.locator("#preview-html")).to_have_attribute("sandbox", "")
    expect(greeting).to_have_css("color", "rgb(1, 2, 3)")
    frame.locator("#submit").click()
    page.get_by_label("Name", exact=True).fill("Welcome mail")  # one more round trip
    expect(greeting).to_have_text("Hello Bea")
    assert remote.hits == []

    # Send test with unsaved edits saves them first, as a new version, and sends that version
    # (no earlier sends of this template: nothing for the dry run to check against).
    screenshot(page, "template-editor")
    page.get_by_label("Email address").fill("ann@example.com")
    page.get_by_role("button", name="Send test").click()
    expect(page.locator("#send-result")).to_contain_text(
        "Your changes were saved as version 2. Test mail of version 2 to ann@example.com"
    )
    expect(page.get_by_label("Subject")).to_have_value("Hi {{ name }}, your order")
    db.session.expire_all()
    assert db.session.get(MailTemplate, template.id).subject == "Hi {{ name }}, your order"
    page.get_by_role("button", name="Save").click()  # nothing left unsaved: saves as it is
    expect(page.get_by_text("Template saved.")).to_be_visible()


def test_a_template_error_is_shown_at_save_with_line_and_column(
    page: Page, acme_admin: dict[str, Any]
) -> None:
    sign_in(page, "admin@acme.example.com")
    page.goto("/mail-templates/new")
    page.get_by_label("Code").fill("broken")
    page.get_by_label("Subject").fill("Hello")
    page.get_by_label("HTML body").fill("<p>Hi</p>\n<p>{{ name | shout }}</p>")
    expect(page.locator("#preview-errors")).to_contain_text("unknown filter 'shout'")
    page.get_by_role("button", name="Create template").click()
    expect(page.get_by_role("alert")).to_contain_text(
        "HTML body has an error: unknown filter 'shout' (line 2, column"
    )
    expect(page.get_by_label("HTML body")).to_have_value("<p>Hi</p>\n<p>{{ name | shout }}</p>")
    screenshot(page, "template-editor-error")


def test_send_test_arrives_at_the_smtp_server(
    page: Page, app: Flask, acme_admin: dict[str, Any]
) -> None:
    with ScriptedSmtpServer(auth_users={"mailer": "smtp-secret-1"}, auth_require_tls=False) as smtp:
        sign_in(page, "admin@acme.example.com")

        # A mail server pointing at the test SMTP server, made with the form.
        page.goto("/mail-servers/new")
        page.get_by_label("Name", exact=True).fill("test relay")
        page.get_by_label("Host").fill(smtp.host)
        page.get_by_label("Port").fill(str(smtp.port))
        page.get_by_label("Security").select_option("plain")
        page.get_by_label("Username").fill("mailer")
        page.get_by_label("Password").fill("smtp-secret-1")
        page.get_by_label("From address").fill("news@acme.example.com")
        page.get_by_label("Default server of this tier").check()
        screenshot(page, "mail-server-form")
        page.get_by_role("button", name="Add mail server").click()
        expect(page.get_by_text("Mail server 'test relay' added.")).to_be_visible()
        expect(page.get_by_label("Password", exact=True)).to_have_value("")
        page.get_by_role("button", name="Test connection").click()
        expect(page.locator(".connection")).to_contain_text("Connected and logged in. Took")
        screenshot(page, "mail-server-edit")
        page.get_by_role("navigation").get_by_role("link", name="Mail servers").click()
        expect(page.get_by_role("cell", name="news@acme.example.com")).to_be_visible()
        screenshot(page, "mail-servers")

        # A template, then Send test.
        page.goto("/mail-templates/new")
        page.get_by_label("Code").fill("receipt")
        page.get_by_label("Subject").fill("Receipt for {{ name }}")
        page.get_by_label("HTML body").fill("<p>Thank you, {{ name }}.</p>")
        page.get_by_label("Sample variables").fill('{"name": "Ann"}')
        expect(page.locator("#preview-subject")).to_have_text("Receipt for Ann")
        page.get_by_role("button", name="Create template").click()
        expect(page.get_by_text("Template 'receipt' created.")).to_be_visible()
        # The new page's text shows before htmx has wired the editor up (its script runs at
        # the end of parsing): typing earlier would change nothing on a loaded machine.
        page.wait_for_load_state("load")
        page.get_by_label("Sample variables").fill('{"name": "Bea"}')
        expect(page.locator("#preview-subject")).to_have_text("Receipt for Bea")
        expect(page.frame_locator("#preview-html").locator("p")).to_have_text("Thank you, Bea.")
        page.get_by_label("Email address").fill("bea@example.com")
        page.get_by_role("button", name="Send test").click()
        expect(page.locator("#send-result")).to_contain_text(
            re.compile(r"Test mail of version 1 to bea@example.com accepted as record #\d+")
        )
        # Chromium paints an out-of-process (sandboxed) frame only while it is in view.
        page.locator("#preview-html").scroll_into_view_if_needed()
        expect(page.frame_locator("#preview-html").locator("p")).to_be_visible()
        screenshot(page, "template-send-test")

        page.get_by_role("navigation").get_by_role("link", name="Mail templates").click()
        expect(page.get_by_role("link", name="receipt")).to_be_visible()
        screenshot(page, "mail-templates")

        drain(app)
        (message,) = smtp.wait_for_messages(1)
    assert message.message["Subject"] == "Receipt for Bea"
    assert message.rcpt_tos == ["bea@example.com"]
    assert "Thank you, Bea." in message.raw.decode()
    record = db.session.scalar(db.select(MailSendRecord))
    assert record is not None
    assert record.status == "Sent"


def test_sms_preview_counts_segments_as_you_type_and_routes_and_bindings_are_added(
    page: Page, acme_admin: dict[str, Any], redis_client: Redis
) -> None:
    tenant_id = acme_admin["tenant_id"]
    provider = SmsProviderConfig(tenant_id=tenant_id, name="twilio-uk", provider="twilio")
    template = SmsTemplate(tenant_id=tenant_id, code="otp", name="OTP", content="Code {{ code }}")
    db.session.add_all([provider, template])
    db.session.commit()
    sign_in(page, "admin@acme.example.com")

    page.goto(f"/sms-providers/{provider.id}/edit")
    page.get_by_role("textbox", name="Country").fill("gb")
    page.get_by_role("textbox", name="Priority").fill("10")
    page.get_by_role("button", name="Add route").click()
    expect(page.get_by_text("Route for GB added.")).to_be_visible()
    page.get_by_role("textbox", name="Country").fill("QQ")
    page.get_by_role("button", name="Add route").click()
    expect(page.get_by_role("alert")).to_contain_text("QQ is not a country code we know")
    screenshot(page, "sms-provider-form")

    page.goto(f"/sms-templates/{template.id}/edit")
    page.get_by_label("Sample variables").fill('{"code": "123456"}')
    expect(page.locator("#preview-text")).to_have_text("Code 123456")
    page.get_by_label("Content").fill("Your code is {{ code }}. " + "It expires soon. " * 9)
    expect(page.locator("#preview-count")).to_have_text("173 characters · 2 segments · GSM-7")
    page.get_by_label("Content").fill("Ihr Code: {{ code }} ✓")
    expect(page.locator("#preview-count")).to_have_text(
        "18 characters · 1 segment · UCS-2 (Unicode)"
    )
    page.get_by_role("button", name="Save").click()
    expect(page.get_by_text("Template saved.")).to_be_visible()
    page.get_by_label("Provider", exact=True).select_option(label="twilio-uk")
    page.get_by_label("External template id").fill("HX0001")
    page.get_by_role("button", name="Add binding").click()
    expect(page.get_by_text("Binding added.")).to_be_visible()
    expect(page.get_by_role("cell", name="HX0001")).to_be_visible()
    page.get_by_label("Phone number").fill("+44 7911 123456")
    page.get_by_role("button", name="Send test").click()
    expect(page.locator("#send-result")).to_contain_text("Test SMS to +447911123456 accepted")
    screenshot(page, "sms-template-editor")
    record = db.session.scalar(db.select(SmsSendRecord))
    assert record is not None
    assert (record.content, record.template_code) == ("Ihr Code: 123456 ✓", "otp")
