"""The five cases where parts of the product disagreed about a record, in a real browser, as
the role that met each: every record is made by the real pipeline (acceptance, then claims and
sends in the test thread to a real SMTP server answering as the simulator's demo sink does, a
port that refuses every connection, or the fake SMS provider), and each page must give one
answer, with no one-click retry into a failure the product can foresee."""

from __future__ import annotations

import re
from typing import Any

import pytest
import redis
from flask import Flask
from playwright.sync_api import Page, expect
from sqlalchemy import select

from portal import simulator
from portal.extensions import db
from portal.messaging.sending.backoff import BackoffPolicy
from portal.models import MailSendRecord, SmsSendRecord
from tests.browser.conftest import screenshot, sign_in
from tests.support.delivery import accept_mail, drain, mail_server
from tests.support.sms import FR, accept_sms, binding, drain_sms, provider, sms_template
from tests.support.sms_provider import FakeSmsProvider
from tests.support.smtp_server import ScriptedSmtpServer
from tests.support.workers import free_port

ADMIN = "admin@acme.example.com"
SUPPORT = "support@acme.example.com"
OPERATOR = "operator@postroom.example.com"
REFUSED = simulator.MAIL["refused"].address
NO_ANSWER = simulator.MAIL["no_answer"].address
NO_RETRIES = BackoffPolicy(max_retries=0, base_s=0.01)
WHO = "You cannot do this yourself: a tenant admin (or a platform operator) can."
AFTER_POST = 15_000


@pytest.fixture
def acme(acme_admin: dict[str, Any], redis_client: redis.Redis) -> int:
    """Acme's id, with its admin, its support user and the operator; Redis empty (breakers)."""
    return int(acme_admin["tenant_id"])


def status(model: type[MailSendRecord] | type[SmsSendRecord], record_id: int) -> str:
    db.session.expire_all()
    return str(db.session.scalar(select(model.status).where(model.id == record_id)))


def uncertain(app: Flask, acme: int, smtp: ScriptedSmtpServer) -> int:
    """A mail the server took whole and then dropped unanswered, on a server that holds such
    records: Uncertain."""
    mail_server(acme, smtp, uncertain_policy="hold")
    db.session.commit()
    smtp.script(NO_ANSWER, "drop", stage="data")  # as the demo sink treats the address
    record = accept_mail(app, acme, to=[NO_ANSWER])
    drain(app, policy=NO_RETRIES)
    assert status(MailSendRecord, record) == "Uncertain"
    return record


def test_a_recipient_refused_at_rcpt_is_suppressed_and_retry_asks_first(
    page: Page, app: Flask, acme: int, smtp: ScriptedSmtpServer
) -> None:
    mail_server(acme, smtp)
    db.session.commit()
    smtp.script(REFUSED, simulator.REFUSED_REPLY, stage="rcpt")  # the demo sink's answer
    record = accept_mail(app, acme, to=[REFUSED])
    drain(app, policy=NO_RETRIES)
    assert status(MailSendRecord, record) == "Failed"

    sign_in(page, SUPPORT)
    page.goto(f"/mail-records/{record}")
    panel = page.locator("#diagnosis")
    expect(panel.locator("#diagnosis-verdict")).to_contain_text(
        "Sending it again now would fail the same way"
    )
    expect(panel.locator("#diagnosis-verdict")).to_contain_text("SUPPRESSED")
    expect(panel.locator("#diagnosis-suppressed")).to_contain_text(
        f"On the suppression list: {REFUSED}"
    )
    expect(panel).to_contain_text("550 5.1.1 simulator: no such mailbox")
    expect(panel).not_to_contain_text("Will try again")
    # "Refused recipients" is not a bare "none": it names the address or points at the refusal.
    refused = page.locator("dt", has_text="Refused recipients").locator(
        "xpath=following-sibling::dd[1]"
    )
    expect(refused).not_to_have_text("none")
    expect(refused).to_contain_text(re.compile(f"{re.escape(REFUSED)}|the refusal is above"))
    # No one-click Retry: "Retry…" names why it would fail again before anything happens.
    expect(page.get_by_role("button", name="Retry", exact=True)).to_have_count(0)
    expect(page.locator("#retry-fail-again")).to_contain_text("would fail again (SUPPRESSED")
    timeline = page.locator("#record-timeline")
    attempt = timeline.locator("li[data-kind]", has_text="550 5.1.1")
    expect(attempt.first).to_contain_text("no such mailbox")
    expect(timeline).to_contain_text("Recipient suppressed")
    screenshot(page, "refused-record")

    page.get_by_role("button", name="Retry…").click()
    expect(page.locator("#fail-again")).to_contain_text("SUPPRESSED", timeout=AFTER_POST)
    expect(page.locator("#fail-again")).to_contain_text(REFUSED)
    expect(page.get_by_role("button", name="Retry anyway")).to_be_visible()
    assert status(MailSendRecord, record) == "Failed"  # asking requeued nothing
    screenshot(page, "refused-retry-asks")

    page.goto("/mail-records/")
    href = page.locator("a[href^='/recipients/']").first.get_attribute("href")
    assert href is not None
    page.goto(href)
    expect(page.locator("#recipient-suppression")).to_contain_text("Suppressed: a hard bounce")
    expect(page.locator("#recipient-suppression")).to_contain_text(f"record {record}")
    expect(page.locator("#recipient-diagnosis")).to_contain_text("SUPPRESSED")
    screenshot(page, "refused-recipient")


def test_an_fr_sms_without_a_binding_is_left_out_of_bulk_retry_as_no_binding(
    page: Page, app: Flask, acme: int
) -> None:
    with FakeSmsProvider() as server:
        twilio = provider(acme, "twilio", server)  # the tier's default provider
        otp = sms_template(acme, "otp")
        binding(otp, twilio, country="GB")  # no binding for FR
        db.session.commit()
        record = accept_sms(app, acme, phoneNumber=FR, templateCode="otp", variables={"code": "7"})
        drain_sms(app, policy=NO_RETRIES)
        assert server.requests == []
    assert status(SmsSendRecord, record) == "Failed"

    sign_in(page, OPERATOR)
    page.goto("/sms-records/")
    page.get_by_label(f"Select record {record}").check()
    page.get_by_role("button", name="Retry selected").click()
    confirm = page.locator("#bulk-confirm")
    reasons = confirm.locator("#retry-reasons")
    expect(reasons).to_contain_text("1 NO_BINDING", timeout=AFTER_POST)
    expect(reasons).to_contain_text("template `otp` has no binding for FR")
    expect(confirm).not_to_contain_text("nothing found that stops them now")
    expect(confirm).not_to_contain_text("route")
    expect(confirm).to_contain_text("0 will be requeued")
    expect(
        confirm.get_by_label(re.compile("Retry the 1 that would fail again"))
    ).not_to_be_checked()
    screenshot(page, "no-binding-bulk-plan")

    page.goto(f"/sms-records/{record}")
    action = page.locator("#diagnosis-action")
    expect(action).to_contain_text("Add a binding for FR to the SMS template `otp`")
    expect(action).not_to_contain_text("route")


def test_dead_letters_of_a_refusing_server_are_server_down_as_its_page_says(
    page: Page, app: Flask, acme: int
) -> None:
    dead = ScriptedSmtpServer(port=free_port())  # never started: every connection refused
    mail_server(acme, dead, name="acme-smtp")
    db.session.commit()
    ids = [accept_mail(app, acme, to=[f"user{i}@example.com"]) for i in range(3)]
    drain(app, policy=NO_RETRIES)
    assert [status(MailSendRecord, i) for i in ids] == ["DeadLetter"] * 3
    assert len(ids) < app.config["SETTINGS"].breaker_failures  # the breaker stays shut

    sign_in(page, ADMIN)
    banner = page.locator(".server-down")
    expect(banner).to_contain_text("Mail server acme-smtp: Failing")
    expect(banner).to_contain_text("3 records, last: connection refused")

    page.goto("/mail-servers/")
    row = page.locator("tr", has_text="acme-smtp")
    expect(row).to_contain_text("Failing since ")
    expect(row).not_to_contain_text(re.compile(r"\bUp\b"))
    shown = re.search(r"Failing since [^()]*\([^)]*\)", row.inner_text())
    assert shown is not None, row.inner_text()
    screenshot(page, "refusing-server-list")

    page.goto("/mail-records/")
    for record_id in ids:
        page.get_by_label(f"Select record {record_id}").check()
    page.get_by_role("button", name="Retry selected").click()
    reasons = page.locator("#bulk-confirm #retry-reasons")
    expect(reasons).to_contain_text("3 SERVER_DOWN", timeout=AFTER_POST)
    expect(reasons).to_contain_text(shown.group(0))  # the server's page's own words
    expect(page.locator("#bulk-confirm")).not_to_contain_text("nothing found that stops")
    expect(page.locator("#bulk-confirm")).to_contain_text("0 will be requeued")
    screenshot(page, "refusing-server-bulk-plan")


def test_an_uncertain_record_is_outcome_unknown_without_temporary_fault_advice(
    page: Page, app: Flask, acme: int, smtp: ScriptedSmtpServer
) -> None:
    record = uncertain(app, acme, smtp)
    sign_in(page, ADMIN)
    page.goto(f"/mail-records/{record}")
    panel = page.locator("#diagnosis")
    expect(panel).to_contain_text("Outcome unknown")
    for words in ("Temporary fault", "unreachable", "timed out"):
        expect(panel).not_to_contain_text(words)
    expect(page.locator("main")).not_to_contain_text("Temporary fault")
    expect(page.get_by_role("button", name=re.compile(r"^Retry"))).not_to_be_enabled()
    screenshot(page, "uncertain-record")


def test_support_is_told_who_can_act_on_an_uncertain_record(
    page: Page, app: Flask, acme: int, smtp: ScriptedSmtpServer
) -> None:
    record = uncertain(app, acme, smtp)
    sign_in(page, SUPPORT)
    page.goto(f"/mail-records/{record}")
    expect(page.locator("#diagnosis-who")).to_have_text(WHO)
    expect(page.locator("#retry-why")).to_contain_text("Retry is not available")
    expect(page.locator("#retry-why")).to_contain_text(WHO)
    expect(page.get_by_role("button", name="It was accepted")).to_have_count(0)
    screenshot(page, "uncertain-support")
