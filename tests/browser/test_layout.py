"""A walk-through at a phone's width: the records list fits the screen (its table
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


NAV_LINKS = "nav[aria-label=Main] a"


def test_the_operators_nav_fits_1366_without_wrapping_and_390_without_widening(
    page: Page, acme_admin: dict[str, Any]
) -> None:
    """At 1366 px the nav's 18 links (the operator's, who also has the tenant
    switcher, the inbox bell and the user menu in the header) wrapped to two or three rows. Now
    they are either one row or one column (the sidebar), every one visible on the first screen,
    the header is one row, and the page's heading is not pushed below the fold."""
    sign_in(page, "operator@postroom.example.com")
    page.set_viewport_size({"width": 1366, "height": 768})
    page.goto("/mail-records/")
    links = page.locator(NAV_LINKS)
    expect(links).to_have_count(18)  # every page an operator has
    expect(page.get_by_label("Viewing")).to_be_visible()
    expect(page.get_by_role("button", name="Sign out")).to_be_visible()
    screenshot(page, "nav-operator-1366px")
    boxes = [box for box in (link.bounding_box() for link in links.all()) if box is not None]
    assert len(boxes) == 18  # each one rendered
    for box in boxes:  # on the first screen, not scrolled to
        assert box["x"] >= 0, box
        assert box["x"] + box["width"] <= 1366, box
        assert box["y"] >= 0, box
        assert box["y"] + box["height"] <= 768, box
    tops = {round(box["y"]) for box in boxes}
    lefts = {round(box["x"]) for box in boxes}
    one_row = len(tops) == 1
    one_column = len(lefts) == 1 and len(tops) == 18  # stacked, one link a line
    assert one_row or one_column, f"the nav wraps: rows at {sorted(tops)}, lefts {sorted(lefts)}"
    line = page.evaluate("parseFloat(getComputedStyle(document.body).lineHeight) || 24")
    header = page.locator("header.top").bounding_box()
    assert header is not None
    assert header["height"] < 3 * line, header  # one row
    heading = page.get_by_role("heading", level=1).bounding_box()
    assert heading is not None
    assert heading["y"] < 768 / 3, heading  # the page starts at once
    if one_column:  # the sidebar sits beside the page, not over it
        nav = page.get_by_role("navigation", name="Main").bounding_box()
        assert nav is not None
        assert heading["x"] >= nav["x"] + nav["width"], (nav, heading)
    # The groups, each under its heading.
    groups = page.locator("nav[aria-label=Main] .nav-heading")
    expect(groups).to_have_text(["Records", "Configuration", "Operations"])

    page.set_viewport_size({"width": 390, "height": 844})
    page.goto("/mail-records/")
    screenshot(page, "nav-operator-390px")
    for link in links.all():
        expect(link).to_be_visible()
        box = link.bounding_box()
        assert box is not None
        assert box["x"] >= 0, box
        assert box["x"] + box["width"] <= 391, box
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= 391, width
