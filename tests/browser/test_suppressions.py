"""The suppression list in a real browser: a tenant admin adds a number, finds it with the
live search, is told a reason is needed to remove it, then removes it with one."""

from __future__ import annotations

from typing import Any

from playwright.sync_api import Page, expect

from tests.browser.conftest import screenshot, sign_in

AFTER_POST = 15_000


def test_add_search_and_remove_a_suppression(page: Page, acme_admin: dict[str, Any]) -> None:
    sign_in(page, "admin@acme.example.com")
    page.get_by_role("link", name="Suppression list").click()
    expect(page.get_by_text("The list is empty.")).to_be_visible()

    page.get_by_label("Channel", exact=True).select_option("sms")
    page.get_by_role("textbox", name="Address or number").fill("0740")
    page.get_by_role("button", name="Add to the list").click()
    expect(page.get_by_role("alert").first).to_contain_text(
        "Address or number must be a phone number", timeout=AFTER_POST
    )
    page.get_by_role("textbox", name="Address or number").fill("+44 7400 123456")
    page.get_by_label("Note").fill("replied STOP")
    page.get_by_role("button", name="Add to the list").click()
    row = page.locator("#suppression-list tbody tr")
    expect(row).to_have_count(1, timeout=AFTER_POST)
    expect(row).to_contain_text("+447400123456")
    expect(row).to_contain_text("Added by hand")
    expect(row).to_contain_text("admin@acme.example.com")
    screenshot(page, "suppressions")

    # The new page's rows show before htmx has wired the live search up (its script runs at
    # the end of parsing): typing earlier would search nothing on a loaded machine.
    page.wait_for_load_state("load")
    page.get_by_label("Email address or phone number").fill("nobody")
    expect(page.get_by_text("Nothing on the list matches")).to_be_visible()
    page.get_by_label("Email address or phone number").fill("7400")
    expect(row).to_have_count(1)

    row.get_by_role("button", name="Remove +447400123456").click()
    expect(page.get_by_text("Reason is required")).to_be_visible(timeout=AFTER_POST)
    page.get_by_label("Reason for removing +447400123456").fill("asked to be contacted again")
    page.get_by_role("button", name="Remove +447400123456").click()
    expect(page.get_by_text("+447400123456 taken off the suppression list.")).to_be_visible(
        timeout=AFTER_POST
    )
    expect(page.get_by_role("cell", name="asked to be contacted again")).to_be_visible()
