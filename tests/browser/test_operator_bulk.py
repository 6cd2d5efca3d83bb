"""Operators and bulk actions in a real browser: bulk retry leaving out what
would fail again, bulk dead-letter triage, and the operator's all-tenants default view."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from playwright.sync_api import Page, expect

from portal.extensions import db
from portal.messaging.sending.quota import current_month
from portal.models import (
    DeadLetterMessage,
    MailSendRecipient,
    MailSendRecord,
    MailSendServerConfig,
    TenantMessageQuota,
    TenantMessageUsage,
)
from portal.models.enums import DeadLetterSource
from portal.tenancy import PLATFORM_TENANT_ID
from tests.browser.conftest import screenshot, sign_in
from tests.support.delivery import sendable

AFTER_POST = 15_000


def mail(tenant_id: int, status: str, to: str, *, prepared: bool = True, **fields: Any) -> int:
    record = MailSendRecord(
        tenant_id=tenant_id,
        status=status,
        to_addrs=[to],
        subject="Your invoice",
        rendered_subject="Your invoice",
        rendered_text=f"Hello {to}",
        prepared_at=datetime.now(UTC) if prepared else None,
        **fields,
    )
    db.session.add(record)
    db.session.flush()
    db.session.add(
        MailSendRecipient(record_id=record.id, tenant_id=tenant_id, address=to, kind="to")
    )
    db.session.commit()
    return record.id


def dead_letter(tenant_id: int, record_id: int) -> int:
    row = DeadLetterMessage(
        tenant_id=tenant_id,
        source=DeadLetterSource.SEND_EXHAUSTED.value,
        event_id=str(record_id),
        channel="mail",
        error_code="550 5.1.1",
        reason="mailbox unavailable",
        attempts=5,
    )
    db.session.add(row)
    db.session.commit()
    return row.id


def status_of(record_id: int) -> str:
    db.session.expire_all()
    record = db.session.get(MailSendRecord, record_id)
    assert record is not None
    return record.status


def test_bulk_retry_leaves_out_what_would_fail_again(
    page: Page, acme_admin: dict[str, Any]
) -> None:
    tenant = acme_admin["tenant_id"]
    sendable(tenant)  # a server to prepare with: the quota and the template stop them
    db.session.add(TenantMessageQuota(tenant_id=tenant, mail_monthly_limit=5))
    db.session.add(TenantMessageUsage(tenant_id=tenant, month=current_month(), mail_count=5))
    db.session.commit()
    quota = [
        mail(
            tenant,
            "Failed",
            f"q{i}@example.com",
            prepared=False,
            error_code="MONTHLY_QUOTA_EXCEEDED",
        )
        for i in range(2)
    ]
    missing = mail(
        tenant,
        "Failed",
        "t@example.com",
        prepared=False,
        error_code="TEMPLATE_NOT_RESOLVABLE",
        template_code="nonexistent",
    )
    cured = mail(tenant, "Failed", "ok@example.com", error_code="451 4.3.0")

    sign_in(page, "admin@acme.example.com")
    page.goto("/mail-records/")
    for record_id in [*quota, missing, cured]:
        page.get_by_label(f"Select record {record_id}").check()
    page.get_by_role("button", name="Retry selected").click()

    confirm = page.locator("#bulk-confirm")
    groups = confirm.locator("#retry-reasons")
    expect(groups).to_contain_text(
        "2 QUOTA_FULL (monthly quota full): the quota of Acme is full (5 of 5); raise it first"
    )
    expect(groups).to_contain_text(
        "1 NO_TEMPLATE (no such template): template `nonexistent` does not exist"
    )
    expect(confirm).to_contain_text("1 will be requeued")
    include = confirm.get_by_label("Retry the 3 that would fail again as well")
    expect(include).not_to_be_checked()  # left out by default
    screenshot(page, "bulk-retry-fail-again")

    confirm.get_by_role("button", name="Confirm: retry 1").click()
    outcome = page.locator("#bulk-outcome")
    expect(outcome).to_contain_text("1 requeued")
    expect(outcome.locator("#left-out")).to_contain_text("3 left out")
    expect(outcome).to_contain_text("the quota of Acme is full (5 of 5)")
    screenshot(page, "bulk-retry-fail-again-outcome")
    assert status_of(cured) == "Retry"
    assert [status_of(i) for i in [*quota, missing]] == ["Failed"] * 3


def test_bulk_dead_letter_triage(page: Page, acme_admin: dict[str, Any]) -> None:
    tenant = acme_admin["tenant_id"]
    records = [mail(tenant, "DeadLetter", f"d{i}@example.com") for i in range(3)]
    letters = [dead_letter(tenant, r) for r in records]

    sign_in(page, "operator@postroom.example.com")
    page.goto("/dead-letters/")
    page.get_by_label(f"Select dead letter {letters[0]}").check()
    page.get_by_label(f"Select dead letter {letters[1]}").check()
    page.get_by_label("Mark as").select_option("Resolved")
    # No remark: refused, nothing changes, the choice is kept.
    page.get_by_role("button", name="Mark selected").click()
    expect(page.locator("#triage-errors")).to_contain_text("Write a remark", timeout=AFTER_POST)
    expect(page.get_by_label("Mark as")).to_have_value("Resolved")

    page.get_by_label(f"Select dead letter {letters[0]}").check()
    page.get_by_label(f"Select dead letter {letters[1]}").check()
    page.get_by_label("Remark (required; the same for each)").fill("resent by the customer")
    page.get_by_role("button", name="Mark selected").click()
    expect(page.locator(".flash")).to_have_text(
        "2 dead letters marked Resolved.", timeout=AFTER_POST
    )
    for letter in letters[:2]:
        expect(page.locator(f"#dead-letter-{letter} .pill")).to_have_text("Resolved")
    expect(page.locator(f"#dead-letter-{letters[2]} .pill")).to_have_text("Pending")
    screenshot(page, "dead-letters-bulk-triage")

    page.goto(f"/mail-records/{records[0]}")
    panel = page.locator("#dead-letter-triage")
    expect(panel).to_contain_text("Resolved")
    expect(panel).to_contain_text("resent by the customer")
    screenshot(page, "record-dead-letter-triage")


def test_an_operators_default_view_is_all_tenants(page: Page, acme_admin: dict[str, Any]) -> None:
    tenant = acme_admin["tenant_id"]
    failed = mail(tenant, "DeadLetter", "gone@example.com", error_code="550 5.1.1")
    letter = dead_letter(tenant, failed)
    server = MailSendServerConfig(
        tenant_id=PLATFORM_TENANT_ID, name="platform relay", host="127.0.0.1", port=25
    )
    db.session.add(server)
    db.session.commit()

    sign_in(page, "operator@postroom.example.com")
    expect(page.locator("#view-tenant option:checked")).to_have_text("All tenants (records)")
    figures = page.locator("#by-tenant")
    expect(figures).to_contain_text("Failures by tenant")
    expect(figures.locator("tr", has_text="Acme")).to_contain_text("1")
    expect(page.get_by_text("No records yet.")).to_have_count(1)  # SMS only: mail has one
    screenshot(page, "operator-default-view")

    page.goto("/dead-letters/")
    expect(page.locator(f"#dead-letter-{letter}")).to_be_visible()
    expect(page.locator("#waiting-by-tenant")).to_contain_text("Acme 1")

    # Switching "Viewing" on a page of one row lands on that group's list, not a 404.
    page.goto(f"/mail-servers/{server.id}/edit")
    page.locator("#view-tenant").select_option(str(tenant))
    page.wait_for_url("**/mail-servers/", timeout=AFTER_POST)
    expect(page.locator("#view-tenant option:checked")).to_have_text("Acme")
    screenshot(page, "operator-switch-on-edit-page")
