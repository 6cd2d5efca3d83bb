"""Issue 14's walk-through at a phone's width: the records list fits the screen (its table
scrolls sideways by itself), and a long address is not broken mid-word at desktop width."""

from __future__ import annotations

from typing import Any

from playwright.sync_api import Page, expect

from tests.browser.conftest import screenshot, sign_in
from tests.browser.test_records import mail

# No hyphen: a browser may break there, which is a natural place; dots and @ are not.
LONG = "customer.relations.department@verylongsubdomain.examplecompany.co.uk"


def test_the_records_list_fits_a_phone_and_keeps_addresses_whole_on_a_desktop(
    page: Page, acme_admin: dict[str, Any]
) -> None:
    mail(acme_admin["tenant_id"], "Failed", LONG, "A subject long enough to need room")
    sign_in(page, "admin@acme.example.com")
    page.set_viewport_size({"width": 1366, "height": 900})
    page.goto("/mail-records/")
    cell = page.locator("table.records td.recipient a").first
    expect(cell).to_contain_text(LONG)
    line = page.evaluate("parseFloat(getComputedStyle(document.body).lineHeight) || 24")
    screenshot(page, "records-1366px")
    assert cell.bounding_box()["height"] < 2 * line  # type: ignore[index]  # one line
    # Dates are typed as the label's UTC day says, not in the browser's mm/dd/yyyy.
    since = page.get_by_label("Created from")
    expect(since).to_have_attribute("placeholder", "YYYY-MM-DD")
    since.fill("2020-01-01")
    page.get_by_role("button", name="Search").click()
    expect(page.locator("table.records td.recipient a").first).to_contain_text(LONG)
    expect(page.get_by_label("Created from")).to_have_value("2020-01-01")
    page.set_viewport_size({"width": 390, "height": 844})
    page.goto("/mail-records/")
    expect(page.locator("table.records")).to_be_visible()
    width = page.evaluate("document.documentElement.scrollWidth")
    screenshot(page, "records-390px")
    # What sticks out, if anything (outside the table, which scrolls by itself).
    wide = page.evaluate(
        "[...document.querySelectorAll('body *')]"
        ".filter(e => !e.closest('table.records') && e.getBoundingClientRect().right > 392)"
        ".slice(0, 8).map(e => e.tagName + '.' + e.className)"
    )
    assert width <= 391, (width, wide)  # nothing widens the page past the screen
    screenshot(page, "records-390px")
