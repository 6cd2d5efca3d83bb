"""Who gets in, in a real browser: a tenant admin invites someone, changes a role and
deactivates a user; the invited person opens the link, sets a password and signs in; a user
changes their own password and signs in with the new one."""

from __future__ import annotations

import re
from typing import Any

import pytest
from flask import Flask
from playwright.sync_api import Browser, Page, expect
from sqlalchemy import select

from portal.extensions import db
from portal.models import AppUser, MailSendRecord
from tests.browser.conftest import PASSWORD, screenshot, sign_in


@pytest.fixture(autouse=True)
def portal_address(pg_app: Flask, live_server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Invitations need the portal's address: the live server's."""
    settings = pg_app.config["SETTINGS"].replace(public_base_url=live_server)
    monkeypatch.setitem(pg_app.config, "SETTINGS", settings)


def _user(email: str) -> AppUser:
    db.session.expire_all()
    found = db.session.scalar(select(AppUser).where(AppUser.email == email))
    assert found is not None
    return found


def _invite(page: Page, email: str, role: str) -> str:
    """Invite ``email`` from the users page; the link shown once."""
    page.goto("/users/")
    page.get_by_label("Email address").fill(email)
    page.get_by_label("Role", exact=True).select_option(label=role)
    page.get_by_role("button", name="Invite").click()
    expect(page.get_by_role("heading", name=f"{email} is invited")).to_be_visible()
    link = page.get_by_label("Set-password link").input_value()
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/users/accept/[\w-]{40,}", link), link
    return link


def _sign_in_with(page: Page, email: str, password: str) -> None:
    page.goto("/auth/login")
    page.get_by_label("Email address").fill(email)
    page.get_by_label("Password").fill(password)
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("heading", name="Dashboard")).to_be_visible()


def test_a_tenant_admin_invites_changes_a_role_and_deactivates(
    page: Page, acme_admin: dict[str, Any]
) -> None:
    sign_in(page, "admin@acme.example.com")
    page.get_by_role("link", name="Users").click()
    expect(page.get_by_role("heading", name="Users")).to_be_visible()
    expect(page.get_by_text("operator@postroom.example.com")).to_have_count(0)

    page.get_by_label("Email address").fill("not an address")
    page.get_by_role("button", name="Invite").click()
    expect(page.get_by_role("alert")).to_contain_text("Email address is not a valid email address")

    _invite(page, "new.person@acme.example.com", "Tenant admin")
    expect(
        page.get_by_text("also queued for mailing to new.person@acme.example.com")
    ).to_be_visible()
    screenshot(page, "users-invited")
    page.get_by_role("link", name="Back to users").click()
    invited_row = page.locator(f"#user-{_user('new.person@acme.example.com').id}")
    expect(invited_row).to_contain_text("Invited, link valid until")
    expect(invited_row).to_contain_text("Tenant admin")

    support = _user("support@acme.example.com")
    support_id, generation = support.id, support.session_generation
    row = page.locator(f"#user-{support_id}")
    row.get_by_label("Role of support@acme.example.com").select_option(label="Tenant admin")
    row.get_by_role("button", name="Change role of support@acme.example.com").click()
    expect(page.get_by_role("status")).to_contain_text(
        "support@acme.example.com is now tenant admin"
    )
    expect(row.get_by_label("Role of support@acme.example.com")).to_have_value("tenant_admin")

    row.get_by_role("button", name="Deactivate support@acme.example.com").click()
    expect(page.get_by_role("status")).to_contain_text("deactivated and signed out everywhere")
    expect(row).to_contain_text("Deactivated")
    expect(row.get_by_role("button", name="Reactivate support@acme.example.com")).to_be_visible()
    screenshot(page, "users")
    changed = _user("support@acme.example.com")
    assert (changed.role, changed.is_active) == ("tenant_admin", False)
    assert changed.session_generation > generation


def test_an_invited_person_sets_a_password_with_the_link_and_signs_in(
    page: Page, browser: Browser, live_server: str, acme_admin: dict[str, Any]
) -> None:
    sign_in(page, "admin@acme.example.com")
    link = _invite(page, "invitee@acme.example.com", "Support")
    (mail,) = db.session.scalars(select(MailSendRecord))
    assert link in (mail.text_body or "")

    # The invited person, in their own browser, signed in as nobody.
    context = browser.new_context(base_url=live_server)
    invitee = context.new_page()
    invitee.set_default_timeout(10_000)
    try:
        invitee.goto(link)
        expect(invitee.get_by_role("heading", name="Set your password")).to_be_visible()
        expect(invitee.get_by_text("For invitee@acme.example.com.")).to_be_visible()
        invitee.get_by_label("New password", exact=True).fill("invitee-password-1")
        invitee.get_by_label("New password again").fill("invitee-password-2")
        invitee.get_by_role("button", name="Set password").click()
        expect(invitee.get_by_role("alert")).to_contain_text("New password again does not match")
        invitee.get_by_label("New password", exact=True).fill("invitee-password-1")
        invitee.get_by_label("New password again").fill("invitee-password-1")
        invitee.get_by_role("button", name="Set password").click()
        expect(invitee.get_by_role("status")).to_contain_text("Your password is set")
        expect(invitee.get_by_role("heading", name="Sign in")).to_be_visible()
        _sign_in_with(invitee, "invitee@acme.example.com", "invitee-password-1")
        expect(invitee.get_by_text("invitee@acme.example.com")).to_be_visible()

        invitee.goto(link)  # used once: never again
        expect(invitee.get_by_role("heading", name="This link cannot be used")).to_be_visible()
        screenshot(invitee, "users-link-used")
    finally:
        context.close()


def test_a_user_changes_their_password_and_signs_in_with_the_new_one(
    page: Page, acme_admin: dict[str, Any]
) -> None:
    sign_in(page, "support@acme.example.com")
    page.goto("/users/password")
    page.get_by_label("Current password").fill("not my password")
    page.get_by_label("New password", exact=True).fill("support-password-2")
    page.get_by_label("New password again").fill("support-password-2")
    page.get_by_role("button", name="Change password").click()
    expect(page.get_by_role("alert")).to_contain_text("Current password is not right")
    expect(page.get_by_label("New password", exact=True)).to_have_value("")  # never echoed

    page.get_by_label("Current password").fill(PASSWORD)
    page.get_by_label("New password", exact=True).fill("support-password-2")
    page.get_by_label("New password again").fill("support-password-2")
    page.get_by_role("button", name="Change password").click()
    expect(page.get_by_role("status")).to_contain_text("Your password is changed")
    screenshot(page, "users-password")
    page.goto("/")  # this session stayed signed in
    expect(page.get_by_role("heading", name="Dashboard")).to_be_visible()

    page.get_by_role("button", name="Sign out").click()
    page.get_by_label("Email address").fill("support@acme.example.com")
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("alert")).to_contain_text("do not match")
    _sign_in_with(page, "support@acme.example.com", "support-password-2")
