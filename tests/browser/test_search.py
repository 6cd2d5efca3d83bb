"""The one search box and the recipient page in a real browser: each
kind of input typed in the dashboard's box lands on one results page of mail and SMS that says
what it understood; a result leads to the recipient page, which shows everything sent there,
the suppression, the bounces and what to do about the latest failure."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

import pytest
from playwright.sync_api import Page, expect

from portal.extensions import db
from portal.messaging.after_send import suppression
from portal.models import (
    MailSendRecipient,
    MailSendRecord,
    SendAttempt,
    SmsSendRecord,
    Tenant,
)
from tests.browser.conftest import screenshot, sign_in

AFTER_POST = 15_000


def mail(tenant_id: int, status: str, to: str, subject: str, **fields: Any) -> int:
    record = MailSendRecord(
        tenant_id=tenant_id, status=status, to_addrs=[to], subject=subject, **fields
    )
    db.session.add(record)
    db.session.flush()
    db.session.add(
        MailSendRecipient(record_id=record.id, tenant_id=tenant_id, address=to, kind="to")
    )
    db.session.commit()
    return record.id


def sms(tenant_id: int, status: str, number: str, **fields: Any) -> int:
    record = SmsSendRecord(
        tenant_id=tenant_id, status=status, phone_number=number, content="Your code", **fields
    )
    db.session.add(record)
    db.session.commit()
    return record.id


@pytest.fixture
def records(acme_admin: dict[str, Any]) -> dict[str, int]:
    tenant = acme_admin["tenant_id"]
    found = {
        "invoice": mail(
            tenant,
            "Failed",
            "carol@shop.example.org",
            "Your Invoice for March",
            error_code="550 5.1.1",
            error_message="550 5.1.1 user unknown",
        ),
        "welcome": mail(
            tenant,
            "Sent",
            "carol@shop.example.org",
            "Welcome",
            business_key="order-1001",
            sent_at=datetime(2026, 1, 2, tzinfo=UTC),
        ),
        "other": mail(tenant, "Sent", "dave@example.net", "Receipt"),
        "sms": sms(tenant, "Failed", "+447911123456", error_code="400 21211"),
        "sms_keyed": sms(tenant, "Sent", "+447400123456"),
    }
    db.session.add(
        SendAttempt(
            tenant_id=tenant,
            channel="sms",
            record_id=found["sms_keyed"],
            number=1,
            started_at=datetime.now(UTC),
            outcome="sent",
            ambiguous=False,
            provider_message_id="SM5f8a9c",
        )
    )
    db.session.commit()
    return found


def search_from_the_dashboard(page: Page, typed: str) -> None:
    page.goto("/")
    page.get_by_label("Search mail and SMS").fill(typed)
    page.get_by_label("Search mail and SMS").press("Enter")
    expect(page.get_by_role("heading", name="Search", exact=True)).to_be_visible()


def hits(page: Page) -> Any:
    return page.locator("table.records tbody tr")


@pytest.mark.parametrize(
    ("typed", "understood", "found", "name"),
    [
        ("carol@shop.example.org", "email address carol@shop.example.org", 2, "address"),
        ("carol", "an address containing", 2, "partial-address"),
        ("carol@", "an address starting with “carol@”", 2, "address-prefix"),
        ("@shop.example.org", "an address at shop.example.org", 2, "domain"),
        ("Invoice", "mail subject containing “Invoice”", 1, "subject"),
        ("07911 123456", "phone number +447911123456 (GB)", 1, "national-number"),
        ("447911123456", "phone number +447911123456", 1, "number-without-plus"),
        ("+44 7911 123456", "phone number +447911123456", 1, "international-number"),
        ("order-1001", "business key “order-1001”", 1, "business-key"),
        ("SM5f8a9c", "provider message id “SM5f8a9c”", 1, "provider-id"),
    ],
)
def test_search_by_each_kind_of_input(
    page: Page, records: dict[str, int], typed: str, understood: str, found: int, name: str
) -> None:
    sign_in(page, "support@acme.example.com")
    search_from_the_dashboard(page, typed)
    expect(page.locator("#understood")).to_contain_text(understood)
    expect(hits(page)).to_have_count(found)
    expect(page.get_by_text("No text message records match")).to_have_count(0)
    screenshot(page, f"search-{name}")


def test_search_by_record_id_and_message_id(page: Page, records: dict[str, int]) -> None:
    db.session.query(MailSendRecord).filter_by(id=records["welcome"]).update(
        {"message_id_header": f"<mail-{records['welcome']}@shop.example.org>"}
    )
    db.session.commit()
    sign_in(page, "support@acme.example.com")
    search_from_the_dashboard(page, str(records["invoice"]))
    expect(page.locator("#understood")).to_contain_text(f"record id {records['invoice']}")
    expect(page.get_by_role("link", name=f"Record {records['invoice']}").first).to_be_visible()
    screenshot(page, "search-record-id")
    search_from_the_dashboard(page, f"<mail-{records['welcome']}@shop.example.org>")
    expect(page.locator("#understood")).to_contain_text("Message-ID")
    expect(hits(page)).to_have_count(1)
    expect(hits(page).first).to_contain_text("Welcome")
    screenshot(page, "search-message-id")


def test_a_national_number_in_the_tenants_country(
    page: Page, records: dict[str, int], acme_admin: dict[str, Any]
) -> None:
    berlin = sms(acme_admin["tenant_id"], "Sent", "+49301234567")
    sign_in(page, "admin@acme.example.com")
    page.goto("/tenant-settings/")
    page.get_by_role("textbox", name="Country").fill("DE")
    page.get_by_role("button", name="Save").click()
    expect(page.locator("#country-in-force")).to_have_text("DE", timeout=AFTER_POST)
    screenshot(page, "tenant-settings-country")
    search_from_the_dashboard(page, "030 1234567")
    expect(page.locator("#understood")).to_contain_text("phone number +49301234567 (DE)")
    expect(hits(page)).to_have_count(1)
    expect(page.get_by_role("link", name=f"Record {berlin}")).to_be_visible()
    screenshot(page, "search-national-number-de")
    db.session.expire_all()
    tenant = db.session.get(Tenant, acme_admin["tenant_id"])
    assert tenant is not None
    assert tenant.country == "DE"


def test_the_recipient_page(
    page: Page, records: dict[str, int], acme_admin: dict[str, Any]
) -> None:
    suppression.suppress(
        db.session(),
        acme_admin["tenant_id"],
        "mail",
        "carol@shop.example.org",
        suppression.SuppressionReason.HARD_BOUNCE,
        detail="550 5.1.1 user unknown",
        by="bounce mailbox",
        record_id=records["invoice"],
    )
    db.session.commit()
    sign_in(page, "admin@acme.example.com")
    search_from_the_dashboard(page, "Invoice")
    page.get_by_role("link", name="carol@shop.example.org").first.click()
    expect(page).to_have_url(re.compile(r"/recipients/[A-Za-z0-9_-]+$"))
    assert "carol" not in page.url
    expect(page.get_by_role("heading", name="carol@shop.example.org", exact=True)).to_be_visible()
    expect(page.locator("#recipient-figures")).to_contain_text("50 %")
    expect(page.locator("#recipient-suppression")).to_contain_text("a hard bounce")
    expect(page.locator("#recipient-records tbody tr")).to_have_count(2)
    expect(page.get_by_text("What to do:")).to_be_visible()
    screenshot(page, "recipient-page")

    # Removing the suppression needs a reason (the suppression page's own rule).
    page.get_by_label("Reason for taking it off the list").fill("mailbox fixed, confirmed")
    page.get_by_role("button", name="Take off the suppression list").click()
    expect(page.get_by_text("taken off the suppression list")).to_be_visible(timeout=AFTER_POST)
    screenshot(page, "recipient-unsuppressed")

    # The record page links the recipient page too.
    page.goto(f"/sms-records/{records['sms']}")
    page.locator("#recipient-pages").get_by_role("link", name="+447911123456").click()
    expect(page.get_by_role("heading", name="+447911123456", exact=True)).to_be_visible()
    expect(page.locator("#recipient-records tbody tr")).to_have_count(1)
    screenshot(page, "recipient-page-sms")
