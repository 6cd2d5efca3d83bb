"""Quotas and API keys in a real browser: an operator edits a tenant's ceilings; a tenant
admin reads its own usage, creates a key (shown once) and revokes it."""

from __future__ import annotations

import re
from typing import Any

from playwright.sync_api import Page, expect

from portal.extensions import db
from portal.messaging.sending.quota import current_month
from portal.models import ApiKey, TenantMessageQuota, TenantMessageUsage
from tests.browser.conftest import screenshot, sign_in


def _usage(tenant_id: int) -> None:
    db.session.add_all(
        [
            TenantMessageQuota(tenant_id=tenant_id, mail_monthly_limit=1000),
            TenantMessageUsage(tenant_id=tenant_id, month=current_month(), mail_count=820),
            TenantMessageUsage(tenant_id=tenant_id, month="2026-01", mail_count=640, sms_count=12),
        ]
    )
    db.session.commit()


def test_an_operator_edits_a_tenants_quota(page: Page, acme_admin: dict[str, Any]) -> None:
    _usage(acme_admin["tenant_id"])
    sign_in(page, "operator@postroom.example.com")
    page.get_by_role("link", name="Quotas").click()
    row = page.locator(f"#quota-{acme_admin['tenant_id']}")
    expect(row).to_contain_text("820 of 1,000 mails · 82%")
    expect(row.locator("meter").first).to_have_attribute("value", "820")
    screenshot(page, "quotas")

    row.get_by_role("link", name="Edit").click()
    page.get_by_label("Mail per month").fill("-5")
    page.get_by_label("SMS per month").fill("200")
    page.get_by_role("button", name="Save quota").click()
    expect(page.get_by_role("alert")).to_contain_text(
        "Mail per month must be a whole number from 0 to 2,147,483,647"
    )
    expect(page.get_by_label("SMS per month")).to_have_value("200")
    screenshot(page, "quota-edit-error")
    page.get_by_label("Mail per month").fill("2000")
    page.get_by_role("button", name="Save quota").click()
    expect(page.get_by_text("Quota of Acme saved.")).to_be_visible()
    expect(row).to_contain_text("820 of 2,000 mails · 41%")
    expect(row).to_contain_text("0 of 200 SMS · 0%")
    db.session.expire_all()
    quota = db.session.scalar(
        db.select(TenantMessageQuota).where(TenantMessageQuota.tenant_id == acme_admin["tenant_id"])
    )
    assert quota is not None
    assert (quota.mail_monthly_limit, quota.sms_monthly_limit) == (2000, 200)
    assert quota.updated_by == "operator@postroom.example.com"


def test_a_tenant_admin_reads_its_quota_and_manages_api_keys(
    page: Page, acme_admin: dict[str, Any]
) -> None:
    _usage(acme_admin["tenant_id"])
    sign_in(page, "admin@acme.example.com")
    page.get_by_role("link", name="Quotas").click()
    expect(page.get_by_role("heading", name="Quota of Acme")).to_be_visible()
    expect(page.get_by_text("820 of 1,000 mails")).to_be_visible()
    expect(page.get_by_role("cell", name="2026-01")).to_be_visible()
    expect(page.get_by_role("link", name="Edit the ceilings")).to_have_count(0)
    screenshot(page, "quota-tenant")

    page.get_by_role("link", name="API keys").click()
    page.get_by_role("button", name="Create key").click()
    expect(page.get_by_role("alert")).to_contain_text("Name is required")
    page.get_by_label("Name").fill("billing (production)")
    page.get_by_role("button", name="Create key").click()
    token_field = page.get_by_label("Your new key")
    expect(token_field).to_have_value(re.compile(r"^pk_[\w-]{40,}$"))
    token = token_field.input_value()
    screenshot(page, "api-key-created")
    page.get_by_role("link", name="Back to API keys").click()
    row = page.get_by_role("row", name=re.compile("billing \\(production\\)"))
    expect(row).to_contain_text(token[:10])
    expect(row).to_contain_text("Active")
    assert token not in page.content()
    screenshot(page, "api-keys")
    row.get_by_role("link", name=re.compile("Revoke")).click()
    # Revoking asks first, on a page of its own.
    expect(page.get_by_role("heading", name=re.compile("Revoke API key"))).to_be_visible()
    page.get_by_role("button", name=re.compile("Revoke")).click()
    expect(page.get_by_text("Key 'billing (production)' revoked")).to_be_visible()
    expect(page.get_by_role("row", name=re.compile("billing"))).to_contain_text("Revoked")
    key = db.session.scalar(db.select(ApiKey).where(ApiKey.name == "billing (production)"))
    assert key is not None
    db.session.refresh(key)
    assert key.revoked_at is not None
