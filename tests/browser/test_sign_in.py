"""Sign in and out in a real browser."""

from __future__ import annotations

import re
from typing import Any

from playwright.sync_api import Page, expect

from tests.browser.conftest import screenshot, sign_in


def test_sign_in_shows_the_dashboard_and_sign_out_returns_to_login(
    page: Page, acme_admin: dict[str, Any]
) -> None:
    page.goto("/")
    expect(page).to_have_url(re.compile(r"/auth/login$"))  # the front door: no "next" to go back to
    page.get_by_label("Email address").fill("admin@acme.example.com")
    page.get_by_label("Password").fill("wrong password")
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("alert")).to_contain_text("do not match")
    screenshot(page, "login")
    sign_in(page, "admin@acme.example.com")
    expect(page.get_by_role("heading", name="Dashboard")).to_be_visible()
    expect(page.get_by_text("admin@acme.example.com")).to_be_visible()
    page.get_by_role("button", name="Sign out").click()
    expect(page.get_by_role("heading", name="Sign in")).to_be_visible()
