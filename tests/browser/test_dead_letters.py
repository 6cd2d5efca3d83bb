"""Dead-letter triage in a real browser: an operator looking at every tenant filters the list,
opens a dead letter, is told the remark is missing, then resolves it in place."""

from __future__ import annotations

import re
from typing import Any

from playwright.sync_api import Page, expect

from portal.extensions import db
from portal.models import DeadLetterMessage, MailSendRecord
from tests.browser.conftest import screenshot, sign_in
from tests.support.delivery import sendable

# A full-page POST and its redirect can outlast expect()'s 5 s on a loaded machine.
AFTER_POST = 15_000


def test_triage_a_dead_letter(page: Page, acme_admin: dict[str, Any]) -> None:
    tenant = acme_admin["tenant_id"]
    sendable(tenant)  # a server to prepare with: nothing stops a retry
    record = MailSendRecord(
        tenant_id=tenant,
        status="DeadLetter",
        to_addrs=["ann@example.com"],
        subject="Invoice",
        error_code="451 4.3.0",
        error_message="451 4.3.0 mailbox busy, try again later",
        retry_count=5,
    )
    db.session.add(record)
    db.session.flush()
    letters = []
    for channel, code in [("mail", "451 4.3.0"), ("sms", "HTTP_503")]:
        letter = DeadLetterMessage(
            tenant_id=tenant,
            source="SendExhausted",
            event_id=str(record.id) if channel == "mail" else "999999",
            channel=channel,
            provider="smtp.acme.test" if channel == "mail" else "twilio",
            error_code=code,
            reason="mailbox busy, try again later" if channel == "mail" else "provider down",
            attempts=6,
            payload={"recordId": record.id, "errorCode": code, "attempts": 6},
        )
        db.session.add(letter)
        db.session.flush()
        letters.append(letter.id)
    db.session.commit()

    sign_in(page, "operator@postroom.example.com")
    page.get_by_label("Viewing").select_option(label="All tenants (records)")
    expect(page.get_by_label("Viewing")).to_have_value("all")
    expect(page.get_by_role("heading", name="Dead letters waiting for triage")).to_be_visible()
    page.get_by_role("link", name="Dead letters", exact=True).click()
    expect(page.locator("table.records tbody tr")).to_have_count(2)
    page.get_by_label("Channel").select_option(label="Mail")
    page.get_by_role("button", name="Filter").click()
    expect(page).to_have_url(re.compile(r"channel=mail"), timeout=AFTER_POST)
    expect(page.locator("table.records tbody tr")).to_have_count(1)
    screenshot(page, "dead-letters")

    page.get_by_role("link", name=f"#{letters[0]}").click()
    expect(page.get_by_role("heading", name=f"Dead letter #{letters[0]}")).to_be_visible()
    expect(page.locator("pre.json")).to_contain_text('"errorCode": "451 4.3.0"')
    expect(page.get_by_role("link", name=f"Mail record {record.id}")).to_be_visible()
    expect(page.get_by_role("button", name="Retry the record")).to_be_enabled()
    page.evaluate("window.notReloaded = true")

    triage = page.locator("#triage")
    triage.get_by_label(re.compile("^Resolved")).check()
    triage.get_by_role("button", name="Save the decision").click()
    expect(page.locator("#triage .field-error")).to_contain_text("Write a remark")
    screenshot(page, "dead-letter")
    page.get_by_label("Remark").fill("Mail server was down; retried by hand.")
    page.locator("#triage").get_by_role("button", name="Save the decision").click()
    expect(page.locator("#triage")).to_contain_text("Resolved")
    expect(page.locator("#triage")).to_contain_text("by operator@postroom.example.com")
    expect(page.locator("#triage")).to_contain_text("retried by hand")
    assert page.evaluate("window.notReloaded") is True

    db.session.expire_all()
    handled = db.session.get(DeadLetterMessage, letters[0])
    assert handled is not None
    assert (handled.status, handled.handled_by) == ("Resolved", "operator@postroom.example.com")

    # The record's Retry from here comes back here.
    page.get_by_role("button", name="Retry the record").click()
    expect(page.get_by_role("status").first).to_contain_text("requeued", timeout=AFTER_POST)
    expect(page).to_have_url(re.compile(rf"/dead-letters/{letters[0]}$"))
