"""Bulk cancel in a real browser: select records on the list, see how many can be cancelled
and how many cannot, have a worker claim one meanwhile, confirm, and read what happened to
each, with the rows swapped in place and no reload."""

from __future__ import annotations

from typing import Any

from playwright.sync_api import Page, expect

from portal.extensions import db
from portal.messaging.sending.claim import claim
from portal.models import MailSendRecord
from tests.browser.conftest import screenshot, sign_in
from tests.browser.test_records import mail, status_of


def test_select_confirm_and_cancel_in_place(page: Page, acme_admin: dict[str, Any]) -> None:
    tenant = acme_admin["tenant_id"]
    waiting = mail(tenant, "Pending", "ann@example.com", "Invoice")
    retrying = mail(tenant, "Retry", "bob@example.com", "Receipt", error_code="451 4.3.0")
    claimed = mail(tenant, "Pending", "carol@example.com", "Reset")
    sent = mail(tenant, "Sent", "dan@example.com", "Welcome")

    sign_in(page, "admin@acme.example.com")
    page.goto("/mail-records/")
    page.evaluate("window.notReloaded = true")  # gone if anything reloads the page
    for record_id in (waiting, retrying, claimed, sent):
        page.get_by_label(f"Select record {record_id}").check()
    page.get_by_role("button", name="Cancel selected").click()

    confirm = page.locator("#bulk-confirm")
    expect(confirm).to_contain_text("Cancel 4 mail records?")
    expect(confirm).to_contain_text("3 can be cancelled and 1 cannot")
    expect(confirm).to_contain_text("Not cancelled, already sent")
    screenshot(page, "mail-bulk-cancel-confirm")
    # "Keep them" takes the confirmation away and changes nothing.
    confirm.get_by_role("button", name="Keep them").click()
    expect(page.locator("#bulk-confirm")).to_have_count(0)
    assert status_of(waiting) == "Pending"

    page.get_by_role("button", name="Cancel selected").click()
    expect(confirm).to_contain_text("3 can be cancelled and 1 cannot")
    # A worker claims one while the person reads the confirmation.
    claim(db.session, MailSendRecord, [claimed], 1)
    db.session.commit()
    confirm.get_by_role("button", name="Confirm: cancel 3").click()

    outcome = page.locator("#bulk-outcome")
    expect(outcome).to_contain_text("2 cancelled")
    expect(outcome).to_contain_text("1 not cancelled: a worker claimed it first.")
    expect(outcome.get_by_role("link", name=f"Record {claimed}")).to_be_visible()
    expect(outcome).to_contain_text("1: already sent")
    screenshot(page, "mail-bulk-cancel-outcome")
    for record_id in (waiting, retrying):
        row = page.locator(f"#mail-records-row-{record_id}")
        expect(row.locator(".pill")).to_have_text("Cancelled")
        expect(row.get_by_role("checkbox")).not_to_be_checked()
    expect(page.locator(f"#mail-records-row-{claimed} .pill")).to_have_text("Sending now")
    expect(page.locator(f"#mail-records-row-{sent} .pill")).to_have_text("Sent")
    assert page.evaluate("window.notReloaded") is True
    assert [status_of(i) for i in (waiting, retrying, claimed, sent)] == [
        "Cancelled",
        "Cancelled",
        "Sending",
        "Sent",
    ]
