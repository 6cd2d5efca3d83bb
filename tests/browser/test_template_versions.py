"""Template versions in a browser: an edit's dry run shows the counts and samples, then Save this
version confirms it; the history with a side-by-side diff; Restore this version; a test send's
badge in the record list and on its page; the editor lists what a send must give."""

from __future__ import annotations

from typing import Any

from flask import Flask
from playwright.sync_api import Page, expect

from portal.extensions import db
from portal.models import MailSendRecord, MailSendServerConfig, MailTemplate
from tests.browser.conftest import screenshot, sign_in


def welcome(tenant_id: int) -> MailTemplate:
    """A saved template (version 1 in history) and a server its test sends can name."""
    db.session.add(
        MailSendServerConfig(
            tenant_id=tenant_id, name="relay", host="127.0.0.1", port=1, security="plain",
            from_address="no-reply@acme.example.com", is_default=True,
        )
    )  # fmt: skip
    row = MailTemplate(
        tenant_id=tenant_id,
        code="welcome",
        name="Welcome",
        subject="Welcome, {{ name }}",
        html_body="<p>Hello {{ name }}</p>",
        sample_variables={"name": "Ann"},
    )
    db.session.add(row)
    db.session.commit()
    return row


def sends(tenant_id: int, variables: list[dict[str, Any]]) -> None:
    for v in variables:
        db.session.add(
            MailSendRecord(
                tenant_id=tenant_id,
                to_addrs=["a@example.com"],
                template_code="welcome",
                variables=v,
            )
        )
    db.session.commit()


def test_an_edit_is_dry_run_against_recent_sends_then_confirmed(
    page: Page, acme_admin: dict[str, Any]
) -> None:
    tenant = acme_admin["tenant_id"]
    row = welcome(tenant)
    sends(
        tenant, [{"name": "Ann", "plan": "pro"}, {"name": "Bea", "plan": "basic"}, {"name": "Cy"}]
    )
    sign_in(page, "admin@acme.example.com")
    page.goto(f"/mail-templates/{row.id}/edit")
    expect(page.locator("#preview-needed")).to_contain_text("name")
    page.get_by_label("HTML body").fill("<p>Hello {{ name }}, your plan: {{ plan | upcase }}</p>")
    expect(page.locator("#preview-refused")).to_contain_text("plan")
    page.get_by_role("button", name="Check against recent sends").click()
    expect(page.locator("#dry-run-summary")).to_contain_text("Checked 3 of 3 recent sends")
    expect(page.locator("#dry-run-confirm")).to_have_count(0)
    page.get_by_role("button", name="Save", exact=True).click()
    expect(page.locator("#dry-run-rendered")).to_have_text("2")
    expect(page.locator("#dry-run-refused")).to_have_text("1")
    expect(page.locator("#dry-run-missing")).to_contain_text("plan")
    expect(page.locator("#dry-run-samples")).to_contain_text("your plan: PRO")
    expect(page.locator("#dry-run-samples")).to_contain_text("Hello Ann")
    screenshot(page, "template-dry-run")
    page.get_by_role("button", name="Save this version").click()
    expect(page.get_by_text("Template saved.")).to_be_visible()
    expect(page.locator(".template-history")).to_contain_text("Version 2")


def test_history_diff_and_restore(page: Page, acme_admin: dict[str, Any]) -> None:
    row = welcome(acme_admin["tenant_id"])
    sign_in(page, "admin@acme.example.com")
    page.goto(f"/mail-templates/{row.id}/edit")
    page.get_by_label("Subject").fill("Hi there, {{ name }}")
    page.get_by_role("button", name="Save", exact=True).click()  # no sends: saves at once
    expect(page.get_by_text("Template saved.")).to_be_visible()
    page.get_by_role("link", name="History, compare and restore").click()
    expect(page.locator("#versions tbody tr")).to_have_count(2)
    page.get_by_label("Compare version").select_option("1")
    page.get_by_label("with version").select_option("2")
    page.get_by_role("button", name="Compare").click()
    subject = page.locator('section[data-field="subject"]')
    expect(subject.locator("tr.diff-changed")).to_contain_text("Welcome, {{ name }}")
    expect(subject.locator("tr.diff-changed")).to_contain_text("Hi there, {{ name }}")
    screenshot(page, "template-diff")
    page.go_back()
    page.locator('tr[data-version="1"]').get_by_role("button", name="Restore this version").click()
    expect(page.get_by_text("Version 1 restored as version 3.")).to_be_visible()
    expect(page.get_by_label("Subject")).to_have_value("Welcome, {{ name }}")


def test_a_test_send_is_badged_in_the_list_and_on_its_page(
    page: Page, app: Flask, acme_admin: dict[str, Any]
) -> None:
    row = welcome(acme_admin["tenant_id"])
    sign_in(page, "admin@acme.example.com")
    page.goto(f"/mail-templates/{row.id}/edit")
    page.get_by_label("Email address").fill("ann@example.com")
    page.get_by_role("button", name="Send test").click()
    expect(page.locator("#send-result")).to_contain_text("accepted as record")
    page.goto("/mail-records/")
    expect(page.locator(".pill-test")).to_have_count(1)
    page.get_by_label("Test sends").select_option("hide")
    page.get_by_role("button", name="Search").click()
    expect(page.locator(".pill-test")).to_have_count(0)
    page.goto("/mail-records/")
    page.locator("table.records td.preview-cell a").first.click()  # the subject: the record
    expect(page.locator("#test-badge")).to_have_text("Test send")
    screenshot(page, "record-test-send")


def test_send_test_with_unsaved_edits_goes_through_the_dry_run_then_sends_the_new_version(
    page: Page, acme_admin: dict[str, Any]
) -> None:
    tenant = acme_admin["tenant_id"]
    row = welcome(tenant)
    sends(tenant, [{"name": "Ann"}, {"name": "Bea"}])
    sign_in(page, "admin@acme.example.com")
    page.goto(f"/mail-templates/{row.id}/edit")
    page.get_by_label("Subject").fill("Hi there, {{ name }}")
    page.get_by_label("Email address").fill("ann@example.com")
    page.get_by_role("button", name="Send test").click()
    # The dry run stands between the click and the save; nothing is saved or sent yet.
    expect(page.locator("#dry-run-title")).to_have_text("Before this change goes live")
    expect(page.locator("#dry-run-rendered")).to_have_text("2")
    expect(page.get_by_label("Subject")).to_have_value("Hi there, {{ name }}")
    screenshot(page, "template-send-test-dry-run")
    page.get_by_role("button", name="Save this version and send the test").click()
    expect(page.locator("#send-result")).to_contain_text(
        "Your changes were saved as version 2. Test mail of version 2 to ann@example.com"
    )
    expect(page.get_by_text("Before this change goes live")).to_have_count(0)
    record = db.session.scalar(db.select(MailSendRecord).where(MailSendRecord.is_test.is_(True)))
    assert record is not None
    assert record.pinned_template_version == 2
