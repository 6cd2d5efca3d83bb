"""The record page's own Retry asks first when the record would fail again (bulk retry
said so, the single Retry requeued a record whose cause was still there and it failed again at
once). The page says why in bulk retry's words, before anything is requeued; "Retry anyway"
(confirm=yes) requeues it; a record nothing stops is retried in one click, as before; another
tenant's record id is a 404, with or without the confirmation.
"""

from __future__ import annotations

from datetime import UTC, datetime

from flask import Flask
from sqlalchemy import select

from portal.extensions import db
from portal.models import AuditEvent, MailSendRecord, SmsSendRecord
from tests.integration import test_operator_bulk
from tests.integration.test_operator_bulk import ADMIN, GLOBEX_ADMIN, OPERATOR, full_quota
from tests.integration.test_portal_records import HX, mail, signed_in, sms, status_of

tenants = test_operator_bulk.tenants  # its fixture: acme, globex and their people

QUOTA_FULL = "the quota of Acme is full (5 of 5); raise it first"


def retry_rows() -> list[AuditEvent]:
    return list(db.session.scalars(select(AuditEvent).where(AuditEvent.action == "retry")))


def test_a_record_whose_quota_is_full_says_so_and_is_not_requeued_without_confirming(
    app: Flask, tenants: tuple[int, int]
) -> None:
    acme, _ = tenants
    full_quota(acme)
    record = mail(acme, error_code="MONTHLY_QUOTA_EXCEEDED")
    client, token = signed_in(app, ADMIN)

    page = client.get(f"/mail-records/{record}").text  # said before retrying
    assert f'<span class="mono">QUOTA_FULL</span>: {QUOTA_FULL}' in page  # the panel's why
    assert 'A retry now would fail again (<span class="mono">QUOTA_FULL</span>' in page
    assert "Retry…</button>" in page

    asked = client.post(f"/mail-records/{record}/retry", data={"csrf_token": token})
    assert asked.status_code == 200  # the confirm page, nothing requeued
    assert f"<strong>QUOTA_FULL</strong>: {QUOTA_FULL}" in asked.text
    assert '<input type="hidden" name="anyway" value="QUOTA_FULL">' in asked.text
    assert "a platform operator can" in asked.text  # a tenant admin cannot raise a quota
    assert "It will fail again unless this changes first" in asked.text
    assert 'name="confirm" value="yes" class="secondary">Retry anyway</button>' in asked.text
    assert f'href="/mail-records/{record}">Cancel</a>' in asked.text
    assert status_of(MailSendRecord, record) == "Failed"
    assert retry_rows() == []

    # With htmx from a list row: the row says why, and offers the confirm page instead.
    row = client.post(
        f"/mail-records/{record}/retry",
        data={"view": "row"},
        headers=HX | {"X-CSRFToken": token},
    )
    assert row.status_code == 200
    assert row.text.strip().startswith(f'<tr id="mail-records-row-{record}"')
    assert f"Not retried: it would fail again — QUOTA_FULL: {QUOTA_FULL}." in row.text
    assert "hx-post" not in row.text  # its Retry… posts to the confirm page
    assert status_of(MailSendRecord, record) == "Failed"

    # A confirmation that does not name the reason (another page's) asks again.
    unnamed = client.post(
        f"/mail-records/{record}/retry", data={"csrf_token": token, "confirm": "yes"}
    )
    assert unnamed.status_code == 200
    assert 'name="anyway" value="QUOTA_FULL"' in unnamed.text
    assert status_of(MailSendRecord, record) == "Failed"
    done = client.post(
        f"/mail-records/{record}/retry",
        data={"csrf_token": token, "confirm": "yes", "anyway": "QUOTA_FULL"},
    )
    assert done.status_code == 302
    assert done.headers["Location"] == f"/mail-records/{record}"
    assert status_of(MailSendRecord, record) == "Retry"
    [audit] = retry_rows()
    assert audit.tenant_id == acme
    assert f"retried anyway: would fail again (QUOTA_FULL): {QUOTA_FULL}" in (audit.remark or "")


def test_a_record_nothing_stops_is_retried_in_one_click(
    app: Flask, tenants: tuple[int, int]
) -> None:
    acme, _ = tenants
    record = mail(acme, error_code="451", prepared_at=datetime.now(UTC))
    client, token = signed_in(app, ADMIN)
    page = client.get(f"/mail-records/{record}").text
    assert "would fail again" not in page
    assert "Retry</button>" in page
    response = client.post(f"/mail-records/{record}/retry", data={"csrf_token": token})
    assert response.status_code == 302
    assert status_of(MailSendRecord, record) == "Retry"
    assert "requeued" in client.get(response.headers["Location"]).text


def test_a_cause_fixed_since_lets_it_go_in_one_click(app: Flask, tenants: tuple[int, int]) -> None:
    """The check reads the cause as it is now, not the record's error code."""
    acme, _ = tenants
    full_quota(acme, used=3, limit=5)
    record = mail(acme, error_code="MONTHLY_QUOTA_EXCEEDED")
    client, token = signed_in(app, ADMIN)
    response = client.post(f"/mail-records/{record}/retry", data={"csrf_token": token})
    assert response.status_code == 302
    assert status_of(MailSendRecord, record) == "Retry"


def test_an_sms_whose_template_does_not_exist_asks_first(
    app: Flask, tenants: tuple[int, int]
) -> None:
    acme, _ = tenants
    record = sms(acme, error_code="TEMPLATE_NOT_RESOLVABLE", template_code="nonexistent")
    client, token = signed_in(app, ADMIN)
    why = "<strong>NO_TEMPLATE</strong>: template `nonexistent` does not exist"
    shown = '<span class="mono">NO_TEMPLATE</span>: template `nonexistent` does not exist'
    assert shown in client.get(f"/sms-records/{record}").text  # the panel's why
    asked = client.post(f"/sms-records/{record}/retry", data={"csrf_token": token})
    assert asked.status_code == 200
    assert why in asked.text
    assert status_of(SmsSendRecord, record) == "Failed"
    anyway = {"csrf_token": token, "confirm": "yes", "anyway": "NO_TEMPLATE"}
    done = client.post(f"/sms-records/{record}/retry", data=anyway)
    assert done.status_code == 302
    assert status_of(SmsSendRecord, record) == "Retry"


def test_another_tenants_record_is_a_404_with_or_without_the_confirmation(
    app: Flask, tenants: tuple[int, int]
) -> None:
    acme, globex = tenants
    full_quota(globex)
    theirs = mail(globex, error_code="MONTHLY_QUOTA_EXCEEDED")
    client, token = signed_in(app, ADMIN)
    assert client.get(f"/mail-records/{theirs}").status_code == 404
    for data in ({"csrf_token": token}, {"csrf_token": token, "confirm": "yes"}):
        response = client.post(f"/mail-records/{theirs}/retry", data=data)
        assert response.status_code == 404
        assert "Globex" not in response.text
    assert status_of(MailSendRecord, theirs) == "Failed"
    # Their own admin and the operator (all tenants) see the reason with their tier's name.
    globex_admin, _ = signed_in(app, GLOBEX_ADMIN)
    assert (
        "the quota of Globex is full (5 of 5)" in globex_admin.get(f"/mail-records/{theirs}").text
    )
    operator, _ = signed_in(app, OPERATOR)
    assert "the quota of Globex is full (5 of 5)" in operator.get(f"/mail-records/{theirs}").text
    assert acme != globex
