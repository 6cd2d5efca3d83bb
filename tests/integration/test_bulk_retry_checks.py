"""Bulk retry says what would fail again, read from the causes as they are
(quota used vs its ceiling this month, the template, the server, suppression), not from the
status or the error code, and leaves those out unless asked; the all-tenants view's "all
matching" needs the explicit choice; a tenant admin never reaches another tenant's records.
"""

from __future__ import annotations

from typing import Any

import pytest
from flask import Flask
from sqlalchemy import select

from portal.extensions import db
from portal.messaging.after_send import suppression
from portal.messaging.sending.quota import current_month
from portal.models import (
    AuditEvent,
    MailSendRecord,
    MailSendServerConfig,
    MailTemplate,
    TenantMessageQuota,
    TenantMessageUsage,
)
from tests.integration import test_operator_bulk
from tests.integration.test_operator_bulk import (  # the same people and helpers
    ADMIN,
    OPERATOR,
    full_quota,
    post,
)
from tests.integration.test_portal_records import mail, signed_in, sms, status_of

tenants = test_operator_bulk.tenants  # its fixture: acme, globex and their people

# --- bulk retry: what would fail again ----------------------------------------------------------


def blocked_world(acme: int) -> dict[str, int]:
    """acme's failed records: two stopped by its full quota, one by a missing template, one by
    a disabled one, one to a suppressed address, one that a retry would cure."""
    full_quota(acme)
    db.session.add(MailTemplate(tenant_id=acme, code="old-offer", enabled=False))
    db.session.commit()
    suppression.suppress(db.session(), acme, "mail", "gone@example.com", "hard_bounce")
    db.session.commit()
    return {
        "quota1": mail(acme, error_code="MONTHLY_QUOTA_EXCEEDED"),
        "quota2": mail(acme, error_code="MONTHLY_QUOTA_EXCEEDED"),
        "missing": mail(acme, error_code="TEMPLATE_NOT_RESOLVABLE", template_code="nonexistent"),
        "disabled": mail(acme, error_code="TEMPLATE_NOT_RESOLVABLE", template_code="old-offer"),
        "suppressed": mail(
            acme, error_code="550", to="gone@example.com", prepared_at=db_now_value()
        ),
        "cured": mail(acme, error_code="451", prepared_at=db_now_value()),
    }


def db_now_value() -> Any:
    from datetime import UTC, datetime

    return datetime.now(UTC)


def test_bulk_retry_groups_by_error_code_and_says_what_would_fail_again(
    app: Flask, tenants: tuple[int, int]
) -> None:
    acme, _ = tenants
    ids = blocked_world(acme)
    client, token = signed_in(app, ADMIN)
    preview = post(
        client,
        token,
        "/mail-records/retry",
        {"ids": [str(i) for i in ids.values()], "scope": "selected"},
    )
    assert preview.status_code == 200
    text = preview.text
    assert (
        "2 QUOTA_FULL</strong> (monthly quota full): the quota of Acme is full (5 of 5); "
        "raise it first" in text
    )
    assert (
        "1 NO_TEMPLATE</strong> (no such template): template `nonexistent` does not exist" in text
    )
    assert (
        "1 TEMPLATE_DISABLED</strong> (template disabled): template `old-offer` is disabled; "
        "enable it first" in text
    )
    assert "the recipient gone@example.com is suppressed (hard bounce since" in text
    assert "<strong>1</strong> will be requeued" in text
    assert "<strong>5</strong> of the skipped would fail again and are left out" in text
    assert 'name="include_blocked" value="yes"' in text
    assert 'name="include_blocked" value="yes" checked' not in text  # left out by default

    done = post(
        client,
        token,
        "/mail-records/retry",
        {"confirm": "yes", "confirmed": ",".join(str(i) for i in ids.values())},
    )
    assert done.status_code == 200
    assert "<strong>1 requeued</strong>" in done.text
    assert "<strong>5 left out</strong>" in done.text
    assert status_of(MailSendRecord, ids["cured"]) == "Retry"
    for name in ("quota1", "quota2", "missing", "disabled", "suppressed"):
        assert status_of(MailSendRecord, ids[name]) == "Failed", name
    [row] = db.session.scalars(select(AuditEvent).where(AuditEvent.action == "bulk_retry")).all()
    assert row.tenant_id == acme
    assert (
        "left out: would fail again, QUOTA_FULL: the quota of Acme is full (5 of 5)" in row.remark
    )


def test_a_cause_that_is_gone_does_not_block_whatever_the_error_code(
    app: Flask, tenants: tuple[int, int]
) -> None:
    acme, _ = tenants
    full_quota(acme, used=5, limit=5)
    quota_row = db.session.scalar(
        select(TenantMessageQuota).where(TenantMessageQuota.tenant_id == acme)
    )
    assert quota_row is not None
    quota_row.mail_monthly_limit = 10  # raised since
    db.session.add(MailTemplate(tenant_id=acme, code="now-there", enabled=True))
    db.session.commit()
    ids = [
        mail(acme, error_code="MONTHLY_QUOTA_EXCEEDED"),
        mail(acme, error_code="TEMPLATE_NOT_RESOLVABLE", template_code="now-there"),
    ]
    client, token = signed_in(app, ADMIN)
    preview = post(client, token, "/mail-records/retry", {"ids": [str(i) for i in ids]})
    assert "<strong>2</strong> will be requeued" in preview.text
    assert "would fail again" not in preview.text


def test_a_quota_full_now_blocks_a_record_that_failed_for_something_else(
    app: Flask, tenants: tuple[int, int]
) -> None:
    acme, _ = tenants
    full_quota(acme, used=7, limit=7)
    unprepared = mail(acme, error_code="SMTP_CONNECT")
    prepared = mail(acme, error_code="SMTP_CONNECT", prepared_at=db_now_value())
    client, token = signed_in(app, ADMIN)
    preview = post(client, token, "/mail-records/retry", {"ids": [str(unprepared), str(prepared)]})
    assert (
        "1 QUOTA_FULL</strong> (monthly quota full): the quota of Acme is full (7 of 7)"
        in preview.text
    )
    assert "<strong>1</strong> will be requeued" in preview.text  # the charged one goes


def test_a_disabled_server_blocks_with_no_default_to_fall_back_on(
    app: Flask, tenants: tuple[int, int]
) -> None:
    acme, _ = tenants
    server = MailSendServerConfig(
        tenant_id=acme,
        name="main",
        host="127.0.0.1",
        port=25,
        from_address="news@acme.test",
        enabled=False,
    )
    db.session.add(server)
    db.session.commit()
    record = mail(acme, error_code="CONFIG_NOT_RESOLVABLE", server_id=server.id)
    client, token = signed_in(app, ADMIN)
    preview = post(client, token, "/mail-records/retry", {"ids": [str(record)]})
    assert (
        f"mail server {server.id} is missing or disabled in this tier; enable it first"
        in preview.text
    )
    server.enabled = True
    db.session.commit()
    preview = post(client, token, "/mail-records/retry", {"ids": [str(record)]})
    assert "would fail again" not in preview.text


def test_ticking_include_retries_those_that_would_fail_again_too(
    app: Flask, tenants: tuple[int, int]
) -> None:
    acme, _ = tenants
    full_quota(acme)
    ids = [mail(acme, error_code="MONTHLY_QUOTA_EXCEEDED") for _ in range(2)]
    client, token = signed_in(app, ADMIN)
    done = post(
        client,
        token,
        "/mail-records/retry",
        {"confirm": "yes", "confirmed": ",".join(map(str, ids)), "include_blocked": "yes"},
    )
    assert "<strong>2 requeued</strong>" in done.text
    assert all(status_of(MailSendRecord, i) == "Retry" for i in ids)
    [row] = db.session.scalars(select(AuditEvent).where(AuditEvent.action == "bulk_retry")).all()
    assert "Retried anyway although they would fail again: 2 (2: QUOTA_FULL)." in row.remark


def test_a_tenant_admin_never_reaches_another_tenants_records_in_a_bulk_retry(
    app: Flask, tenants: tuple[int, int]
) -> None:
    acme, globex = tenants
    full_quota(globex)
    theirs = mail(globex, error_code="MONTHLY_QUOTA_EXCEEDED")
    ours = mail(acme, error_code="451", prepared_at=db_now_value())
    client, token = signed_in(app, ADMIN)
    preview = post(client, token, "/mail-records/retry", {"ids": [str(theirs), str(ours)]})
    assert "Globex" not in preview.text
    assert "no such record" in preview.text
    post(client, token, "/mail-records/retry", {"confirm": "yes", "confirmed": f"{theirs},{ours}"})
    assert status_of(MailSendRecord, theirs) == "Failed"
    assert status_of(MailSendRecord, ours) == "Retry"
    # Even with the all-tenants fields a tenant may not have.
    post(
        client,
        token,
        "/mail-records/retry",
        {
            "confirm": "yes",
            "confirmed": str(theirs),
            "planned_scope": "filter",
            "all_tenants": "yes",
            "include_blocked": "yes",
        },
    )
    assert status_of(MailSendRecord, theirs) == "Failed"


# --- the all-tenants view's explicit choice -----------------------------------------------------


@pytest.mark.parametrize("verb", ["retry", "cancel"])
def test_everything_matching_in_the_all_tenants_view_needs_the_explicit_choice(
    app: Flask, tenants: tuple[int, int], verb: str
) -> None:
    acme, globex = tenants
    status = "Failed" if verb == "retry" else "Pending"
    ids = [mail(acme, status=status), mail(globex, status=status), mail(globex, status=status)]
    client, token = signed_in(app, OPERATOR, "all")
    preview = post(client, token, f"/mail-records/{verb}", {"scope": "filter", "status": status})
    assert preview.status_code == 200
    text = preview.text
    assert '<td>Globex</td><td class="num">2</td>' in text
    assert '<td>Acme</td><td class="num">1</td>' in text
    assert 'name="all_tenants" value="yes"' in text
    assert 'name="planned_scope" value="filter"' in text

    confirmed = ",".join(map(str, ids)) if verb == "retry" else ",".join(f"{i}:0" for i in ids)
    form = {"confirm": "yes", "confirmed": confirmed, "planned_scope": "filter", "status": status}
    refused = post(client, token, f"/mail-records/{verb}", form)
    assert refused.status_code == 422
    assert "Yes, all these tenants" in refused.text
    assert all(status_of(MailSendRecord, i) == status for i in ids)

    done = post(client, token, f"/mail-records/{verb}", form | {"all_tenants": "yes"})
    assert done.status_code == 200
    changed = "Retry" if verb == "retry" else "Cancelled"
    assert all(status_of(MailSendRecord, i) == changed for i in ids)


def test_a_selection_in_one_tenants_view_needs_no_choice(
    app: Flask, tenants: tuple[int, int]
) -> None:
    acme, _ = tenants
    record = mail(acme)
    client, token = signed_in(app, OPERATOR, acme)
    preview = post(client, token, "/mail-records/retry", {"scope": "filter", "status": "Failed"})
    assert 'name="all_tenants"' not in preview.text
    done = post(
        client,
        token,
        "/mail-records/retry",
        {"confirm": "yes", "confirmed": str(record), "planned_scope": "filter", "status": "Failed"},
    )
    assert done.status_code == 200
    assert status_of(MailSendRecord, record) == "Retry"


def test_a_quota_with_room_for_some_lets_the_oldest_through(
    app: Flask, tenants: tuple[int, int]
) -> None:
    acme, _ = tenants
    full_quota(acme, used=3, limit=5)
    ids = [mail(acme, error_code="MONTHLY_QUOTA_EXCEEDED") for _ in range(4)]
    client, token = signed_in(app, ADMIN)
    preview = post(client, token, "/mail-records/retry", {"ids": [str(i) for i in ids]})
    assert "<strong>2</strong> will be requeued" in preview.text
    assert (
        "2 QUOTA_FULL</strong> (monthly quota full): the quota of Acme has room for 2 more (3 of 5)"
        in preview.text
    )
    post(
        client,
        token,
        "/mail-records/retry",
        {"confirm": "yes", "confirmed": ",".join(map(str, ids))},
    )
    assert [status_of(MailSendRecord, i) for i in ids] == ["Retry", "Retry", "Failed", "Failed"]


def test_sms_checks_its_own_template_provider_and_quota(
    app: Flask, tenants: tuple[int, int]
) -> None:
    acme, _ = tenants
    db.session.add(TenantMessageQuota(tenant_id=acme, sms_monthly_limit=2))
    db.session.add(TenantMessageUsage(tenant_id=acme, month=current_month(), sms_count=2))
    db.session.commit()
    no_template = sms(acme, error_code="TEMPLATE_NOT_RESOLVABLE", template_code="otp-missing")
    # A platform send: the platform tier has no SMS provider to choose again.
    no_provider = sms(
        acme, error_code="CONFIG_NOT_RESOLVABLE", prepared_at=db_now_value(), scope="PLATFORM"
    )
    over_quota = sms(acme, error_code="MONTHLY_QUOTA_EXCEEDED")
    client, token = signed_in(app, ADMIN)
    ids = [no_template, no_provider, over_quota]
    preview = post(client, token, "/sms-records/retry", {"ids": [str(i) for i in ids]})
    text = preview.text
    assert (
        "1 NO_TEMPLATE</strong> (no such template): template `otp-missing` does not exist" in text
    )
    assert (
        "1 NO_ROUTE</strong> (no server or provider for it): no SMS provider serves (unknown) "
        "in the platform tier" in text
    )
    assert "1 QUOTA_FULL</strong> (monthly quota full): the quota of Acme is full (2 of 2)" in text
    assert "<strong>0</strong> will be requeued" in text
    assert "Confirm: retry only if ticked above" in text
    left = post(
        client,
        token,
        "/sms-records/retry",
        {"confirm": "yes", "confirmed": ",".join(map(str, ids))},
    )
    assert "<strong>0 requeued</strong>" in left.text
    assert "<strong>3 left out</strong>" in left.text
    # The mail quota is another bucket: a full SMS quota does not stop mail.
    record = mail(acme, error_code="MONTHLY_QUOTA_EXCEEDED")
    preview = post(client, token, "/mail-records/retry", {"ids": [str(record)]})
    assert "would fail again" not in preview.text


def test_a_confirmation_left_on_the_page_does_not_widen_the_next_selection(
    app: Flask, tenants: tuple[int, int]
) -> None:
    acme, globex = tenants
    chosen = mail(acme)
    mail(globex)
    client, token = signed_in(app, OPERATOR, "all")
    # The list form still holds an earlier "all matching" confirmation's fields.
    preview = post(
        client,
        token,
        "/mail-records/retry",
        {"scope": "selected", "ids": str(chosen), "planned_scope": "filter", "status": "Failed"},
    )
    assert "Retry 1 mail record?" in preview.text
    assert 'name="planned_scope" value="selected"' in preview.text
    assert 'name="all_tenants"' not in preview.text
