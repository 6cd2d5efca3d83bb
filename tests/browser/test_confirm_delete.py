"""Deleting a mail server in a real browser with JavaScript turned off: Delete opens a confirm
page that says what the deletion would do, and only its own button deletes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from playwright.sync_api import Browser, Page, expect

from portal.extensions import db
from portal.models import MailSendServerConfig
from tests.browser.conftest import screenshot, sign_in


@pytest.fixture
def page_without_js(browser: Browser, live_server: str) -> Iterator[Page]:
    context = browser.new_context(base_url=live_server, java_script_enabled=False)
    page = context.new_page()
    page.set_default_timeout(10_000)
    yield page
    context.close()


def test_a_server_is_deleted_through_its_confirm_page_without_javascript(
    page_without_js: Page, acme_admin: dict[str, Any]
) -> None:
    page = page_without_js
    server = MailSendServerConfig(
        tenant_id=acme_admin["tenant_id"], name="old-relay", host="127.0.0.1", port=1,
        security="plain", from_address="no-reply@acme.example.com",
    )  # fmt: skip
    db.session.add(server)
    db.session.commit()
    server_id = server.id

    sign_in(page, "admin@acme.example.com")
    page.goto(f"/mail-servers/{server_id}/edit")
    page.get_by_role("button", name="Delete this server").click()
    expect(page.get_by_role("heading", name="Delete mail server 'old-relay'?")).to_be_visible()
    expect(page.get_by_text("0 Pending or Retry mails of Acme are prepared")).to_be_visible()
    screenshot(page, "confirm-delete-server")
    db.session.expire_all()
    assert db.session.get(MailSendServerConfig, server_id) is not None  # asking deleted nothing

    page.get_by_role("button", name="Delete this server").click()
    expect(page.get_by_text("Mail server 'old-relay' deleted.")).to_be_visible()
    expect(page.get_by_role("heading", name="Mail servers")).to_be_visible()
    db.session.expire_all()
    assert db.session.get(MailSendServerConfig, server_id) is None
