"""The record pages in a real browser: search by recipient, the detail with its sandboxed
message, retry from a row, and bulk retry with its confirmation, all swapped in place."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

from playwright.sync_api import Page, expect

from portal.extensions import db
from portal.models import MailSendRecipient, MailSendRecord, SmsSendRecord
from tests.browser.conftest import SCREENSHOTS, screenshot, sign_in

# A full-page POST and its redirect can outlast expect()'s 5 s on a loaded machine.
AFTER_POST = 15_000


def mail(tenant_id: int, status: str, to: str, subject: str, **fields: Any) -> int:
    record = MailSendRecord(
        tenant_id=tenant_id,
        status=status,
        to_addrs=[to],
        subject=subject,
        rendered_subject=subject,
        rendered_html=f"<h1 style='color:#1d70b8'>{subject}</h1><p>Hello {to}</p>",
        rendered_text=f"Hello {to}",
        prepared_at=datetime.now(UTC),
        **fields,
    )
    db.session.add(record)
    db.session.flush()
    db.session.add(
        MailSendRecipient(record_id=record.id, tenant_id=tenant_id, address=to, kind="to")
    )
    db.session.commit()
    return record.id


def status_of(record_id: int) -> str:
    db.session.expire_all()
    record = db.session.get(MailSendRecord, record_id)
    assert record is not None
    return record.status


def test_search_by_recipient_and_read_the_record(page: Page, acme_admin: dict[str, Any]) -> None:
    tenant = acme_admin["tenant_id"]
    wanted = mail(
        tenant,
        "Failed",
        "ann@example.com",
        "Your invoice",
        error_code="MONTHLY_QUOTA_EXCEEDED",
        error_message="monthly mail quota of 1000 used up",
        retry_count=0,
    )
    mail(tenant, "Sent", "bob@example.com", "Welcome aboard")
    mail(tenant, "Retry", "carol@example.com", "Password reset", error_code="451 4.3.0")
    db.session.add(
        SmsSendRecord(tenant_id=tenant, status="Sent", phone_number="+447911123456", content="Hi")
    )
    db.session.commit()

    sign_in(page, "support@acme.example.com")
    expect(page.get_by_role("heading", name="Mail records")).to_be_visible()
    expect(page.get_by_role("link", name=re.compile(r"Failed\s+1"))).to_be_visible()
    screenshot(page, "dashboard")

    page.get_by_role("link", name="Mail", exact=True).click()
    rows = page.locator("table.records tbody tr")
    expect(rows).to_have_count(3)
    screenshot(page, "mail-records")
    page.get_by_label("Email address or subject").fill("ANN@example.com")
    page.get_by_label("Email address or subject").press("Enter")
    expect(page).to_have_url(re.compile(r"q=ANN%40example\.com"))
    expect(rows).to_have_count(1)
    expect(rows.first).to_contain_text("ann@example.com")
    expect(rows.first).to_contain_text("MONTHLY_QUOTA_EXCEEDED")

    # The address leads to the recipient page (as in search results); the subject to the record.
    expect(rows.first.get_by_role("link", name="ann@example.com")).to_have_attribute(
        "href", re.compile(r"^/recipients/")
    )
    rows.first.get_by_role("link", name="Your invoice").click()
    expect(page).to_have_url(re.compile(rf"/mail-records/{wanted}$"))
    expect(page.get_by_role("heading", name="What happened and what to do")).to_be_visible()
    expect(page.get_by_text("Monthly quota used up")).to_be_visible()
    # Prepared already, so no quota is charged again: nothing found stops a retry.
    expect(page.locator("#diagnosis-action")).to_contain_text("retry it")
    # The message as sent, in its sandboxed frame.
    frame = page.frame_locator("iframe.preview")
    expect(frame.get_by_role("heading", name="Your invoice")).to_be_visible()
    screenshot(page, "mail-record")

    page.get_by_role("button", name="Retry").click()  # a plain form: POST, redirect, GET
    expect(page.get_by_role("status").first).to_contain_text("requeued", timeout=AFTER_POST)
    expect(page.locator(".explain .pill")).to_have_text("Will try again")
    assert status_of(wanted) == "Retry"
    # Full-page captures leave the sandboxed (opaque-origin) frame blank, so it gets its own.
    # Last: clicks on the page right after an element capture of that frame can get lost.
    expect(frame.get_by_role("heading", name="Your invoice")).to_be_visible()
    page.locator("iframe.preview").screenshot(path=str(SCREENSHOTS / "mail-record-message.png"))


def test_select_rows_and_retry_them_in_place(page: Page, acme_admin: dict[str, Any]) -> None:
    tenant = acme_admin["tenant_id"]
    failed = mail(tenant, "Failed", "ann@example.com", "Invoice", error_code="451 4.3.0")
    sent = mail(tenant, "Sent", "bob@example.com", "Welcome")
    dead = mail(tenant, "DeadLetter", "carol@example.com", "Reset", error_code="451 4.3.0")
    untouched = mail(tenant, "Failed", "dan@example.com", "Other", error_code="451 4.3.0")

    sign_in(page, "admin@acme.example.com")
    page.goto("/mail-records/")
    page.evaluate("window.notReloaded = true")  # gone if anything reloads the page
    # Keyboard: focus a row's checkbox and press Space; the others by their labels.
    page.get_by_label(f"Select record {failed}").focus()
    page.keyboard.press("Space")
    expect(page.get_by_label(f"Select record {failed}")).to_be_checked()
    page.get_by_label(f"Select record {sent}").check()
    page.get_by_label(f"Select record {dead}").check()
    page.get_by_role("button", name="Retry selected").click()

    confirm = page.locator("#bulk-confirm")
    expect(confirm).to_contain_text("Retry 3 mail records?")
    expect(confirm).to_contain_text("2 will be requeued and 1 skipped")
    expect(confirm).to_contain_text("Skipped, already sent")
    screenshot(page, "mail-bulk-confirm")
    assert [status_of(i) for i in (failed, sent, dead)] == ["Failed", "Sent", "DeadLetter"]

    confirm.get_by_role("button", name="Confirm: retry 2").click()
    outcome = page.locator("#bulk-outcome")
    expect(outcome).to_contain_text("2 requeued")
    expect(outcome).to_contain_text("1: already sent")
    for record_id in (failed, dead):
        row = page.locator(f"#mail-records-row-{record_id}")
        expect(row.locator(".pill")).to_have_text("Will try again")
        expect(row.get_by_role("checkbox")).not_to_be_checked()
    expect(page.locator(f"#mail-records-row-{sent} .pill")).to_have_text("Sent")
    expect(page.locator(f"#mail-records-row-{untouched} .pill")).to_have_text("Failed")
    assert page.evaluate("window.notReloaded") is True
    assert [status_of(i) for i in (failed, sent, dead, untouched)] == [
        "Retry",
        "Sent",
        "Retry",
        "Failed",
    ]

    # A row's own Retry swaps just that row.
    page.get_by_role("button", name=f"Retry record {untouched}").click()
    row = page.locator(f"#mail-records-row-{untouched}")
    expect(row.get_by_role("status")).to_contain_text("requeued")
    expect(row.locator(".pill")).to_have_text("Will try again")
    assert page.evaluate("window.notReloaded") is True
    assert status_of(untouched) == "Retry"


def test_select_all_and_cancel(page: Page, acme_admin: dict[str, Any]) -> None:
    tenant = acme_admin["tenant_id"]
    ids = [mail(tenant, "Failed", f"user{i}@example.com", f"Note {i}") for i in range(3)]
    sign_in(page, "support@acme.example.com")
    page.goto("/mail-records/?status=Failed")
    page.get_by_label("Select every record on this page").check()
    for record_id in ids:
        expect(page.get_by_label(f"Select record {record_id}")).to_be_checked()
    page.get_by_role("button", name="Retry all matching this filter").click()
    confirm = page.locator("#bulk-confirm")
    expect(confirm).to_contain_text("3 will be requeued and 0 skipped")
    confirm.get_by_role("button", name="Cancel").click()
    expect(page.locator("#bulk-confirm")).to_have_count(0)
    assert all(status_of(i) == "Failed" for i in ids)
