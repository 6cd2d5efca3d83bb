"""Browser tests: Playwright driving Debian's Chromium against a live portal on PostgreSQL.

The portal runs in a thread of the test process (werkzeug's server) on a free port, on the
same database as the other integration tests; a failing test leaves a full-page screenshot of
where it stopped in test-output/screenshots/.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from flask import Flask
from playwright.sync_api import Browser, Page, expect, sync_playwright
from werkzeug.serving import make_server

from portal.extensions import db
from portal.models import AppUser
from tests.conftest import make_tenant

CHROMIUM = "/usr/bin/chromium"
SCREENSHOTS = Path(__file__).resolve().parents[2] / "test-output" / "screenshots"
PASSWORD = "browser-test-password-1"


@pytest.fixture(scope="session")
def live_server(pg_app: Flask) -> Iterator[str]:
    pg_app.config["WTF_CSRF_SSL_STRICT"] = False
    server = make_server("127.0.0.1", 0, pg_app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


@pytest.fixture(scope="session")
def browser() -> Iterator[Browser]:
    if not Path(CHROMIUM).exists():
        raise pytest.UsageError("Debian's chromium is missing: run the README's test command")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
            ],
        )
        yield browser
        browser.close()


@pytest.fixture
def page(browser: Browser, live_server: str, request: pytest.FixtureRequest) -> Iterator[Page]:
    context = browser.new_context(base_url=live_server)
    page = context.new_page()
    page.set_default_timeout(10_000)
    yield page
    report = getattr(request.node, "call_report", None)
    if report is not None and report.failed:
        # What the page showed when the test failed, named by the test and its last step.
        step = CHECKPOINTS.pop(id(page), "end")
        name = re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{request.node.name}--{step}")
        with contextlib.suppress(Exception):
            SCREENSHOTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)
    CHECKPOINTS.pop(id(page), None)
    context.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Keep the call's report on the test, for the page fixture's teardown."""
    report = yield
    if report.when == "call":
        item.call_report = report  # type: ignore[attr-defined]
    return report


def make_user(email: str, role: str, tenant_id: int) -> AppUser:
    user = AppUser(email=email, role=role, tenant_id=tenant_id, name=email.split("@")[0])
    user.set_password(PASSWORD)
    db.session.add(user)
    db.session.commit()
    return user


@pytest.fixture
def acme_admin(app: Flask) -> dict[str, Any]:
    """A tenant (acme) with an admin, a support user, and the platform operator."""
    tenant = make_tenant("acme")
    db.session.commit()
    make_user("admin@acme.example.com", "tenant_admin", tenant.id)
    make_user("support@acme.example.com", "support", tenant.id)
    make_user("operator@postroom.example.com", "platform_operator", -1)
    return {"tenant_id": tenant.id}


def sign_in(page: Page, email: str) -> None:
    page.goto("/auth/login")
    page.get_by_label("Email address").fill(email)
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url("**/")


# The last step each open page reached (``screenshot``), for the picture taken on failure.
CHECKPOINTS: dict[int, str] = {}


def screenshot(page: Page, name: str) -> None:
    """A step worth a picture: taken only if the test fails (test-output/screenshots/), since
    full-page pictures of passing tests cost every run seconds and nobody looks at them."""
    CHECKPOINTS[id(page)] = name


# A page on a 2-core machine that also runs the portal, the workers and PostgreSQL can take
# more than Playwright's default 5 s to show what a test waits for (fresh-clone runs saw it
# at start-up); what a test waits for is still checked, only the patience is longer.
expect.set_options(timeout=15_000)
