"""Status callbacks and the inbox in a real browser: an admin adds an endpoint, copies its
secret, sends a test event to a local receiver and sees it delivered in the log; the bell
counts a notice, and marking it read (htmx) clears the count."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from playwright.sync_api import Page, expect

from portal.extensions import db
from portal.messaging.after_send import inbox
from tests.browser.conftest import screenshot, sign_in
from tests.support.callback_receiver import CallbackReceiver

AFTER_POST = 15_000


@pytest.fixture
def receiver() -> Iterator[CallbackReceiver]:
    with CallbackReceiver() as server:
        yield server


def test_add_an_endpoint_and_send_a_test_event(
    page: Page, acme_admin: dict[str, Any], receiver: CallbackReceiver
) -> None:
    sign_in(page, "admin@acme.example.com")
    page.get_by_role("link", name="Status callbacks").click()
    expect(page.get_by_text("No endpoints yet.")).to_be_visible(timeout=AFTER_POST)
    page.get_by_label("Name").fill("orders")
    page.get_by_label("URL").fill(receiver.url())
    page.get_by_role("button", name="Add endpoint").click()
    secret = page.get_by_label("Signing secret")
    expect(secret).to_be_visible(timeout=AFTER_POST)
    value = secret.input_value()
    assert value.startswith("whsec_")
    page.get_by_role("link", name="Go to the endpoint").click()
    expect(page.get_by_role("button", name="Send a test event")).to_be_visible(timeout=AFTER_POST)
    page.get_by_role("button", name="Send a test event").click()
    expect(page.get_by_text("Test event delivered")).to_be_visible(timeout=AFTER_POST)
    expect(page.locator(".callback-log tbody tr")).to_have_count(1)
    screenshot(page, "callbacks")
    assert [m["type"] for m in receiver.verified(value)] == ["test"]


def test_the_bell_counts_and_mark_read_clears(page: Page, acme_admin: dict[str, Any]) -> None:
    inbox.notify(
        db.session(),
        inbox.Notice(
            acme_admin["tenant_id"], "quota", "q", "Mail quota 80 % used", None, "/quotas/"
        ),
    )
    db.session.commit()
    polls: list[str] = []
    page.on("request", lambda r: polls.append(r.url) if r.url.endswith("/inbox/bell") else None)
    sign_in(page, "admin@acme.example.com")
    bell = page.locator("a.bell")
    expect(bell).to_contain_text("1", timeout=AFTER_POST)
    page.wait_for_timeout(1500)
    assert len(polls) <= 2, polls  # once on load, then every minute: not without pause
    bell.click()
    expect(page.get_by_role("link", name="Mail quota 80 % used")).to_be_visible(timeout=AFTER_POST)
    page.get_by_role("button", name="Mark read Mail quota 80 % used").click()
    expect(page.get_by_role("button", name="Mark read Mail quota 80 % used")).to_have_count(
        0, timeout=AFTER_POST
    )
    page.reload()
    expect(page.locator("a.bell .badge")).to_have_count(0, timeout=AFTER_POST)
    screenshot(page, "inbox")
