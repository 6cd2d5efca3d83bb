"""A walk-through at a phone's width: the records list fits the screen (its table
scrolls sideways by itself), and a long address is not broken mid-word at desktop width."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

from playwright.sync_api import Page, expect

from portal.extensions import db
from portal.models import SendAttempt, SmsSendRecord
from tests.browser.conftest import screenshot, sign_in
from tests.browser.test_records import mail
from tests.conftest import make_tenant

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
    the header is one row (with the search box), and the page's heading is not pushed below the
    fold. At 390 px they fold behind Menu and, opened, none widens the page."""
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
    # Folded behind Menu on a phone (the header would take half the screen otherwise).
    page.get_by_role("button", name="Menu").click()
    screenshot(page, "nav-operator-390px")
    for link in links.all():
        expect(link).to_be_visible()
        box = link.bounding_box()
        assert box is not None
        assert box["x"] >= 0, box
        assert box["x"] + box["width"] <= 391, box
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= 391, width


# --- The pages a newcomer meets first ---------------------------------------------------------

ANOTHER_LONG = "accounts.payable.notifications@subsidiary.internationalgroup.example.com"
LONG_SUBJECT = (
    "Invoice INV-2024-000123 for services rendered in March: payment due within 30 days of "
    "the date of this notice"
)
LONG_TEXT = (
    "Your parcel 00340434161234567890 from Northwind Logistics is out for delivery today "
    "between 10:00 and 14:00; reply STOP to opt out of these messages"
)


def tops(page: Page, selectors: dict[str, str]) -> dict[str, float]:
    """Each selector's first element's top and bottom from the top of the page, in px."""
    found: dict[str, float] = page.evaluate(
        """(selectors) => Object.fromEntries(Object.entries(selectors).flatMap(([name, s]) => {
            const box = document.querySelector(s).getBoundingClientRect();
            return [[name, box.top + scrollY], [name + ' bottom', box.bottom + scrollY]];
        }))""",
        selectors,
    )
    return found


def heading_tops(page: Page) -> dict[str, float]:
    """Each h2 of the page by its text: its top from the top of the page."""
    found: dict[str, float] = page.evaluate(
        "Object.fromEntries([...document.querySelectorAll('main h2')]"
        ".map(h => [h.textContent.trim(), h.getBoundingClientRect().top + scrollY]))"
    )
    return found


def failed_mail_with_attempts(tenant_id: int) -> int:
    """A failed mail as support meets it: two attempts with the server's words, variables,
    and an HTML part for the preview."""
    rid = mail(
        tenant_id,
        "Failed",
        LONG,
        "Your order A-2024-118839 has shipped",
        error_code="550 5.1.1",
        error_message="550 5.1.1 The email account that you tried to reach does not exist",
        retry_count=1,
        variables={"name": "Carol", "lines": [f"item {n}" for n in range(12)]},
    )
    for number, (outcome, code, words) in enumerate(
        [
            ("retry", "451", "451 4.7.1 Greylisted, please come back later"),
            ("failed", "550", "550 5.1.1 The email account that you tried to reach does not exist"),
        ],
        start=1,
    ):
        db.session.add(
            SendAttempt(
                tenant_id=tenant_id,
                channel="mail",
                record_id=rid,
                number=number,
                started_at=datetime.now(UTC),
                outcome=outcome,
                code=code,
                message=words,
                config_name="acme-relay",
            )
        )
    db.session.commit()
    return rid


def test_the_record_page_puts_the_diagnosis_and_the_attempts_first(
    page: Page, acme_admin: dict[str, Any]
) -> None:
    """Support reads what happened and what to do, then each attempt with the server's reply,
    on the first screen at 1366 px; the request, the frozen copy and the preview follow."""
    tenant = acme_admin["tenant_id"]
    rid = failed_mail_with_attempts(tenant)
    sms = SmsSendRecord(
        tenant_id=tenant,
        status="Failed",
        phone_number="+447911123456",
        content=LONG_TEXT,
        rendered_content=LONG_TEXT,
        prepared_at=datetime.now(UTC),
        error_code="21211",
        error_message="The 'To' number is not a valid phone number.",
    )
    db.session.add(sms)
    db.session.flush()
    db.session.add(
        SendAttempt(
            tenant_id=tenant,
            channel="sms",
            record_id=sms.id,
            number=1,
            started_at=datetime.now(UTC),
            outcome="failed",
            code="400 21211",
            message="The 'To' number is not a valid phone number.",
        )
    )
    db.session.commit()
    sign_in(page, "support@acme.example.com")
    page.set_viewport_size({"width": 1366, "height": 900})

    page.goto(f"/mail-records/{rid}")
    attempts = page.locator("#record-timeline li[data-kind=attempt]")
    expect(attempts.last).to_contain_text("does not exist")
    screenshot(page, "record-mail-1366px")
    at = tops(page, {"diagnosis": ".explain", "attempts": "#record-timeline li:last-of-type"})
    headings = heading_tops(page)
    preview = tops(page, {"preview": "iframe.preview"})["preview"]
    assert at["diagnosis"] < at["attempts"], (at, headings)
    for later in ("Request", "Frozen at preparation", "The message as sent"):
        assert at["attempts bottom"] < headings[later], (at, headings)
    assert at["attempts bottom"] < preview, (at, preview)
    # Both on the first screen.
    assert at["diagnosis bottom"] <= 900, at
    assert at["attempts bottom"] <= 900, at

    page.goto(f"/sms-records/{sms.id}")
    expect(page.locator("#record-timeline li[data-kind=attempt]")).to_contain_text("400 21211")
    screenshot(page, "record-sms-1366px")
    at = tops(page, {"diagnosis": ".explain", "attempts": "#record-timeline li[data-kind=attempt]"})
    headings = heading_tops(page)
    assert at["diagnosis"] < at["attempts"] < headings["Request"], (at, headings)
    assert at["attempts bottom"] < headings["Frozen at preparation"], (at, headings)
    assert at["attempts bottom"] <= 900, at


def fits(page: Page) -> dict[str, float]:
    """The page's width and the records table's right edge against its column's."""
    found: dict[str, float] = page.evaluate(
        """() => {
            const main = document.querySelector('main');
            const padding = parseFloat(getComputedStyle(main).paddingRight);
            return {
                page: document.documentElement.scrollWidth,
                table: document.querySelector('table.records').getBoundingClientRect().right,
                column: main.getBoundingClientRect().right - padding,
                columns: [...document.querySelectorAll('table.records thead th')]
                    .map(th => Math.round(th.getBoundingClientRect().width)).join(' '),
            };
        }"""
    )
    return found


def test_the_operators_every_tenant_lists_fit_1366_with_long_data(
    page: Page, acme_admin: dict[str, Any]
) -> None:
    """The operator's list of every tenant's records (and the search results) at 1366 px: no
    sideways scrolling with long addresses, subjects, tenant names and error codes; a cut
    address keeps its whole text (title) and leads to its recipient page."""
    acme = acme_admin["tenant_id"]
    northwind = make_tenant("northwind", "Northwind Logistics International Holdings").id
    db.session.commit()
    for tenant in (acme, northwind):
        mail(tenant, "Failed", LONG, LONG_SUBJECT, error_code="TEMPLATE_NOT_RESOLVABLE")
        mail(
            tenant,
            "Retry",
            ANOTHER_LONG,
            LONG_SUBJECT,
            error_code="MONTHLY_QUOTA_EXCEEDED",
            retry_count=3,
            cc_addrs=["finance.team@internationalgroup.example.com", "b@example.com"],
        )
        db.session.add(
            SmsSendRecord(
                tenant_id=tenant,
                status="Failed",
                phone_number="+4915112345678901",
                content=LONG_TEXT,
                error_code="PROVIDER_REJECTED_INVALID_NUMBER",
            )
        )
    db.session.commit()
    sign_in(page, "operator@postroom.example.com")
    page.set_viewport_size({"width": 1366, "height": 768})
    for name, path in (
        ("mail", "/mail-records/"),
        ("sms", "/sms-records/"),
        ("search", "/search/?q=example.com"),
    ):
        page.goto(path)
        expect(page.locator("table.records tbody tr").first).to_be_visible()
        expect(page.locator("table.records thead")).to_contain_text("Tenant")
        screenshot(page, f"operator-{name}-list-1366px")
        width = fits(page)
        assert width["page"] <= 1366, (path, width)
        assert width["table"] <= width["column"] + 1, (path, width)
    page.goto("/mail-records/")
    cut = page.locator("table.records td.recipient a", has_text=ANOTHER_LONG).first
    expect(cut).to_have_text(ANOTHER_LONG)  # the whole address is there, shown cut
    expect(cut).to_have_attribute("title", re.compile(re.escape(ANOTHER_LONG)))
    expect(page.locator("table.records td.preview-cell a").first).to_have_attribute(
        "title", LONG_SUBJECT
    )


def test_at_390_the_header_and_nav_take_a_quarter_and_headings_wrap(
    page: Page, acme_admin: dict[str, Any]
) -> None:
    """At a phone's width the header (brand, search box, Menu) and the folded navigation take
    at most a quarter of the first screen; Menu opens every link; a record's heading with a
    long address wraps instead of running off the screen."""
    rid = failed_mail_with_attempts(acme_admin["tenant_id"])
    for who in ("operator@postroom.example.com", "support@acme.example.com"):
        sign_in(page, who)
        page.set_viewport_size({"width": 390, "height": 844})
        for path in ("/", f"/mail-records/{rid}"):
            page.goto(path)
            expect(page.get_by_role("heading", level=1)).to_be_visible()
            bottom = page.evaluate(
                "Math.max(...['header.top', 'nav.site-nav']"
                ".map(s => document.querySelector(s).getBoundingClientRect().bottom))"
            )
            assert bottom <= 844 / 4, (who, path, bottom)
            expect(page.locator("header.top").get_by_role("searchbox")).to_be_visible()
        screenshot(page, f"record-390px-{who.split('@')[0]}")
        heading = page.get_by_role("heading", level=1)
        expect(heading).to_contain_text(LONG)
        clipped = heading.evaluate("h => h.scrollWidth - h.clientWidth")
        assert clipped <= 0, clipped
        assert page.evaluate("document.documentElement.scrollWidth") <= 391
        menu = page.get_by_role("button", name="Menu")
        expect(menu).to_have_attribute("aria-expanded", "false")
        expect(page.get_by_role("navigation", name="Main")).to_be_hidden()
        menu.click()
        expect(menu).to_have_attribute("aria-expanded", "true")
        expect(page.get_by_role("link", name="SMS", exact=True)).to_be_visible()
        expect(page.get_by_role("button", name="Sign out")).to_be_visible()


def header_search(page: Page) -> Any:
    return page.locator("header.top").get_by_role("searchbox", name="Find mail or SMS")


def test_the_header_search_box_is_on_every_page_and_lands_on_the_results(
    page: Page, acme_admin: dict[str, Any]
) -> None:
    """Signed in, the header has the search box on the dashboard, a configuration page and a
    record page; it submits to the search page. Signed out there is none."""
    tenant = acme_admin["tenant_id"]
    rid = failed_mail_with_attempts(tenant)
    other = mail(tenant, "Sent", "dora@shop.example.org", "Welcome aboard")
    page.goto("/auth/login")
    expect(page.locator("header.top").get_by_role("searchbox")).to_have_count(0)
    sign_in(page, "admin@acme.example.com")
    page.set_viewport_size({"width": 1366, "height": 768})
    for path, typed, found in (
        ("/", "dora@shop.example.org", other),
        ("/mail-servers/", "customer.relations.department", rid),
        (f"/mail-records/{rid}", str(other), other),
    ):
        page.goto(path)
        box = header_search(page)
        expect(box).to_be_visible()
        box.fill(typed)
        box.press("Enter")
        expect(page).to_have_url(re.compile(r"/search/\?q="))
        expect(page.get_by_role("heading", name="Search", exact=True)).to_be_visible()
        expect(page.locator(f"#hit-mail-{found}")).to_be_visible()
    screenshot(page, "header-search-results")


def test_an_address_leads_to_its_recipient_page_from_the_list_and_from_search(
    page: Page, acme_admin: dict[str, Any]
) -> None:
    """The address in a record list and in a search result is the same link (the recipient
    page); the subject (and, in search, the record id) opens the record."""
    rid = mail(acme_admin["tenant_id"], "Failed", "erin@shop.example.org", "Your receipt")
    sign_in(page, "support@acme.example.com")
    page.goto("/mail-records/")
    listed = page.locator(f"#mail-records-row-{rid} td.recipient a").get_attribute("href")
    page.goto("/search/?q=erin%40shop.example.org")
    found = page.locator(f"#hit-mail-{rid} td.recipient a").get_attribute("href")
    assert listed == found, (listed, found)
    assert listed is not None
    assert listed.startswith("/recipients/"), listed
    page.goto("/mail-records/")
    page.get_by_role("link", name="erin@shop.example.org").click()
    expect(page.get_by_role("heading", level=1)).to_contain_text("erin@shop.example.org")
    page.goto("/mail-records/")
    page.get_by_role("link", name="Your receipt").click()
    expect(page).to_have_url(re.compile(rf"/mail-records/{rid}$"))
