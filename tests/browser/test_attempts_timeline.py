"""In a real browser: a record's timeline shows each attempt with the
server's reply, and the message as sent can be looked at (headers) and downloaded (.eml)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flask import Flask
from playwright.sync_api import Page, expect

from portal.extensions import db
from portal.messaging.sending.backoff import BackoffPolicy
from tests.browser.conftest import screenshot, sign_in
from tests.support.delivery import accept_mail, drain, mail_server
from tests.support.smtp_server import ScriptedSmtpServer

FAST = BackoffPolicy(max_retries=5, base_s=0.02, quota_floor_s=0.05, retry_after_cap_s=1.0)


def test_the_timeline_shows_each_attempt_and_the_message_as_sent_downloads(
    page: Page, app: Flask, acme_admin: dict[str, Any]
) -> None:
    tenant_id = acme_admin["tenant_id"]
    with ScriptedSmtpServer() as smtp:
        mail_server(tenant_id, smtp, name="acme-relay")
        db.session.commit()
        smtp.fail_next(1, "451 4.7.1 Greylisted, come back later", stage="mail")
        rid = accept_mail(app, tenant_id, bcc=["hidden@example.com"])
        drain(app, policy=FAST)
    sign_in(page, "admin@acme.example.com")
    page.goto(f"/mail-records/{rid}")
    timeline = page.locator("#record-timeline li")
    expect(timeline.filter(has_text="Attempt 1: Failed; will be retried")).to_contain_text(
        "451 4.7.1"
    )
    expect(timeline.filter(has_text="Attempt 2: Accepted by the server")).to_contain_text(
        "acme-relay"
    )
    kinds = [item.get_attribute("data-kind") for item in timeline.all()]
    assert kinds[:3] == ["accepted", "attempt", "attempt"]
    screenshot(page, "record-timeline")

    timeline.filter(has_text="Attempt 2").get_by_role(
        "link", name="The message as sent: headers and .eml"
    ).click()
    expect(page.get_by_role("heading", name="Attempt 2: the message as sent")).to_be_visible()
    expect(page.locator("#eml-headers")).to_contain_text("Message-ID")
    expect(page.locator("#eml-headers")).not_to_contain_text("hidden@example.com")
    screenshot(page, "attempt-headers")
    with page.expect_download() as info:
        page.locator("#download-eml").click()
    download = info.value
    assert download.suggested_filename == f"mail-{rid}-attempt-2.eml"
    data = Path(download.path()).read_bytes()
    assert b"Message-ID:" in data
    assert b"hidden@example.com" not in data
