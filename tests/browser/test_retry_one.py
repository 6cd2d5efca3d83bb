"""The record page's Retry when the record would fail again: the page says why before
retrying, in bulk retry's words; Retry… leads to "Retry anyway" or Cancel; one that nothing stops
is retried in one click, as before."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from playwright.sync_api import Page, expect

from portal.extensions import db
from portal.messaging.sending.quota import current_month
from portal.models import (
    MailSendRecipient,
    MailSendRecord,
    TenantMessageQuota,
    TenantMessageUsage,
)
from tests.browser.conftest import screenshot, sign_in
from tests.browser.test_records import AFTER_POST, status_of
from tests.support.delivery import sendable

QUOTA_FULL = "QUOTA_FULL: the quota of Acme is full (5 of 5); raise it first"


def failed_mail(tenant_id: int, error_code: str, prepared: bool) -> int:
    record = MailSendRecord(
        tenant_id=tenant_id,
        status="Failed",
        to_addrs=["ann@example.com"],
        subject="Your invoice",
        text_body="Hello",
        error_code=error_code,
        prepared_at=datetime.now(UTC) if prepared else None,
    )
    db.session.add(record)
    db.session.flush()
    db.session.add(
        MailSendRecipient(
            record_id=record.id, tenant_id=tenant_id, address="ann@example.com", kind="to"
        )
    )
    db.session.commit()
    return record.id


def test_retry_of_a_record_that_would_fail_again_asks_first(
    page: Page, acme_admin: dict[str, Any]
) -> None:
    tenant = acme_admin["tenant_id"]
    sendable(tenant)  # a server to prepare with: the full quota is what stops it
    db.session.add(TenantMessageQuota(tenant_id=tenant, mail_monthly_limit=5))
    db.session.add(TenantMessageUsage(tenant_id=tenant, month=current_month(), mail_count=5))
    db.session.commit()
    blocked = failed_mail(tenant, "MONTHLY_QUOTA_EXCEEDED", prepared=False)
    cured = failed_mail(tenant, "451", prepared=True)
    sign_in(page, "admin@acme.example.com")

    page.goto(f"/mail-records/{blocked}")
    # The panel names the reason and why; the Retry beside it says it will ask first.
    expect(page.locator("#diagnosis-verdict")).to_contain_text(QUOTA_FULL.split(": ", 1)[1])
    expect(page.locator("#diagnosis-verdict")).to_contain_text("QUOTA_FULL")
    expect(page.locator("#retry-fail-again")).to_contain_text("would fail again (QUOTA_FULL")
    screenshot(page, "retry-one-would-fail-again")
    page.get_by_role("button", name="Retry…").click()
    expect(page.get_by_role("heading", name=f"Retry mail record {blocked}?")).to_be_visible(
        timeout=AFTER_POST
    )
    expect(page.locator("#fail-again")).to_contain_text(QUOTA_FULL)
    expect(page.get_by_role("button", name="Retry anyway")).to_be_visible()
    screenshot(page, "retry-one-confirm")
    assert status_of(blocked) == "Failed"  # asking requeued nothing

    page.get_by_role("link", name="Cancel").click()
    expect(page.locator("#retry-fail-again")).to_be_visible(timeout=AFTER_POST)
    assert status_of(blocked) == "Failed"

    page.get_by_role("button", name="Retry…").click()
    page.get_by_role("button", name="Retry anyway").click()
    expect(page.get_by_text(f"Record {blocked} requeued")).to_be_visible(timeout=AFTER_POST)
    assert status_of(blocked) == "Retry"

    # Nothing stops this one: Retry requeues it in one click, no confirmation.
    page.goto(f"/mail-records/{cured}")
    expect(page.locator("#retry-fail-again")).to_have_count(0)
    page.get_by_role("button", name="Retry", exact=True).click()
    expect(page.get_by_text(f"Record {cured} requeued")).to_be_visible(timeout=AFTER_POST)
    assert status_of(cured) == "Retry"
    screenshot(page, "retry-one-requeued")
