"""The audit log in a real browser: a tenant admin saves a template, opens the audit log,
filters it by action with the plain GET form and finds the row; another tenant's row with the
same action is never shown."""

from __future__ import annotations

import re
from typing import Any

from playwright.sync_api import Page, expect

from portal.extensions import db
from portal.models import AuditAction, add_audit
from tests.browser.conftest import screenshot, sign_in
from tests.conftest import make_tenant


def test_a_tenant_admin_filters_the_log_by_action_and_sees_only_its_tenant(
    page: Page, acme_admin: dict[str, Any]
) -> None:
    globex = make_tenant("globex")
    db.session.flush()
    add_audit(
        db.session(),
        AuditAction.TEMPLATE_SAVE,
        tenant_id=globex.id,
        actor_label="admin@globex.example.com",
        target_type="mail_template",
        target_id=1,
        remark="GLOBEX-ONLY template saved",
    )
    db.session.commit()

    sign_in(page, "admin@acme.example.com")
    page.goto("/mail-templates/new")
    page.get_by_label("Code").fill("welcome")
    page.get_by_label("Subject").fill("Hello")
    page.get_by_label("HTML body").fill("<p>Hi</p>")
    page.get_by_role("button", name="Create template").click()
    expect(page.get_by_text("Template 'welcome' created.")).to_be_visible()

    page.get_by_role("link", name="Audit log").click()
    expect(page.get_by_role("heading", name="Audit log")).to_be_visible()
    page.get_by_label("Action").select_option(label="Template saved")
    page.get_by_role("button", name="Filter").click()
    expect(page).to_have_url(re.compile(r"/audit/\?(.*&)?action=template_save"))
    rows = page.locator("#audit-events tbody tr")
    expect(rows).to_have_count(1)
    expect(rows.first).to_contain_text("admin@acme.example.com")
    expect(rows.first).to_contain_text("Template saved")
    expect(rows.first).to_contain_text("Mail template 'welcome' created (version 1)")
    expect(page.get_by_text("GLOBEX-ONLY")).to_have_count(0)
    expect(page.get_by_label("Action")).to_have_value("template_save")
    screenshot(page, "audit-log")

    # A bad date names its field; the page still answers.
    page.goto("/audit/?from=2025-02-30")
    expect(page.get_by_role("alert")).to_contain_text("From: enter a real date")
