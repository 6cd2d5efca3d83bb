"""The record pages keep tenants apart, send ``next`` through the
one ``safe_next``, and write an audit row with every retry and cancel, in its transaction.

Another tenant's records carry marker strings in their text fields, so a leak shows up as a
marker in a response body, whichever field it came from.
"""

from __future__ import annotations

from typing import Any

import pytest
from flask import Flask
from sqlalchemy import select

from portal.extensions import db
from portal.models import (
    AuditAction,
    AuditEvent,
    MailSendRecord,
    MailSendServerConfig,
    SmsProviderConfig,
    SmsSendRecord,
)
from portal.tenancy import PLATFORM_TENANT_ID
from portal.web import security
from portal.web.records import record_page
from tests.conftest import make_tenant
from tests.integration.test_portal_records import HX, mail, signed_in, sms, status_of, user
from tests.support.delivery import sendable

OPERATOR = "operator@postroom.example.com"
ADMIN = "admin@acme.example.com"
SUPPORT = "support@acme.example.com"
MARKER = "GLOBEX-SECRET-7f3a"  # in every text field of globex's records
PLATFORM_MARKER = "PLATFORM-SECRET-c91e"  # in the platform tier's config names


@pytest.fixture
def tenants(app: Flask, monkeypatch: pytest.MonkeyPatch) -> tuple[int, int]:
    """acme (admin, support), globex, the operator; argon2 at its cheapest (many sign-ins)."""
    acme, globex = make_tenant("acme").id, make_tenant("globex").id
    db.session.commit()
    user(OPERATOR, "platform_operator", PLATFORM_TENANT_ID)
    user(ADMIN, "tenant_admin", acme)
    user(SUPPORT, "support", acme)
    sendable(acme)  # their records can be prepared: a retry's diagnosis finds a route
    sendable(globex)
    return acme, globex


def marked_mail(tenant_id: int, status: str) -> int:
    return mail(
        tenant_id,
        status=status,
        to=f"{MARKER.lower()}@example.com",
        subject=f"{MARKER} subject",
        rendered_subject=f"{MARKER} rendered",
        text_body=f"{MARKER} body",
        error_code=f"{MARKER}-code",
        error_message=f"{MARKER} error",
    )


def marked_sms(tenant_id: int, status: str) -> int:
    return sms(
        tenant_id,
        status=status,
        content=f"{MARKER} content",
        rendered_content=f"{MARKER} rendered",
        error_code=f"{MARKER}-code",
        error_message=f"{MARKER} error",
    )


RECORD_ACTIONS = [
    AuditAction.RETRY,
    AuditAction.BULK_RETRY,
    AuditAction.CANCEL,
    AuditAction.BULK_CANCEL,
]


def audit_rows() -> list[AuditEvent]:
    """The audit rows of record actions (sign-ins are audited too)."""
    db.session.expire_all()
    return list(
        db.session.scalars(
            select(AuditEvent)
            .where(AuditEvent.action.in_([str(a) for a in RECORD_ACTIONS]))
            .order_by(AuditEvent.id)
        )
    )


# --- finding 1: the bulk outcome fragment --------------------------------------------------------

# (list path, the status that the verb acts on, how to make a marked record of that channel)
BULK = [
    ("/mail-records/retry", "Failed", marked_mail, MailSendRecord),
    ("/mail-records/cancel", "Pending", marked_mail, MailSendRecord),
    ("/sms-records/retry", "Failed", marked_sms, SmsSendRecord),
    ("/sms-records/cancel", "Pending", marked_sms, SmsSendRecord),
]


@pytest.mark.parametrize("role", [ADMIN, SUPPORT, OPERATOR])
@pytest.mark.parametrize(("path", "status", "make", "model"), BULK)
def test_the_bulk_outcome_never_shows_another_tenants_rows(
    app: Flask, tenants: tuple[int, int], role: str, path: str, status: str, make: Any, model: Any
) -> None:
    """Finding 1: ``confirmed`` and ``shown`` naming globex's ids gave back globex's rows."""
    acme, globex = tenants
    theirs = make(globex, status)
    # The operator looking at acme is held to acme like acme's own users.
    client, token = signed_in(app, role, acme if role == OPERATOR else None)
    response = client.post(
        path,
        data={"confirm": "yes", "confirmed": str(theirs), "shown": str(theirs)},
        headers=HX | {"X-CSRFToken": token},
    )
    assert response.status_code == 200, response.text
    assert MARKER not in response.text
    assert MARKER.lower() not in response.text
    assert f"-row-{theirs}" not in response.text
    assert status_of(model, theirs) == status  # and nothing was done to it


@pytest.mark.parametrize(("path", "status", "make", "model"), BULK)
def test_an_operator_viewing_every_tenant_gets_every_tenants_rows(
    app: Flask, tenants: tuple[int, int], path: str, status: str, make: Any, model: Any
) -> None:
    """As on the list pages, "all tenants" reaches every tenant's records."""
    _, globex = tenants
    theirs = make(globex, status)
    version = db.session.scalar(select(model.version).where(model.id == theirs))
    confirmed = f"{theirs}:{version}" if path.endswith("/cancel") else str(theirs)
    client, token = signed_in(app, OPERATOR, "all")
    response = client.post(
        path,
        data={"confirm": "yes", "confirmed": confirmed, "shown": str(theirs)},
        headers=HX | {"X-CSRFToken": token},
    )
    assert response.status_code == 200, response.text
    assert f"-row-{theirs}" in response.text
    assert status_of(model, theirs) != status


def test_every_id_lookup_of_the_record_pages_is_scoped(
    app: Flask, tenants: tuple[int, int]
) -> None:
    """The confirmation counts, the detail page, the rendered HTML and a row's retry treat
    another tenant's id as one that does not exist."""
    _, globex = tenants
    theirs = marked_mail(globex, "Pending")
    their_sms = marked_sms(globex, "Pending")
    client, token = signed_in(app, SUPPORT)
    headers = HX | {"X-CSRFToken": token}
    for path in ("/mail-records/retry", "/mail-records/cancel"):
        preview = client.post(path, data={"ids": [str(theirs)]}, headers=headers)
        assert "no such record" in preview.text
        assert MARKER not in preview.text
        assert f"{theirs}:" not in preview.text  # no version of theirs in the confirmation
    for path in (f"/mail-records/{theirs}", f"/mail-records/{theirs}/rendered"):
        assert client.get(path).status_code == 404
    assert client.get(f"/sms-records/{their_sms}").status_code == 404
    row = client.post(f"/mail-records/{theirs}/retry", data={"view": "row"}, headers=headers)
    assert row.status_code == 404
    assert MARKER not in row.text
    assert status_of(MailSendRecord, theirs) == "Pending"


# --- finding 11: platform-tier names ------------------------------------------------------------


def configs(acme: int) -> tuple[int, int, int, int]:
    """A platform-tier and an acme server and provider; the platform's names carry the marker."""
    platform_server = MailSendServerConfig(
        tenant_id=PLATFORM_TENANT_ID, name=f"{PLATFORM_MARKER} relay", host="127.0.0.1"
    )
    own_server = MailSendServerConfig(tenant_id=acme, name="acme relay", host="127.0.0.1")
    platform_provider = SmsProviderConfig(
        tenant_id=PLATFORM_TENANT_ID, name=f"{PLATFORM_MARKER} sms", provider="twilio"
    )
    own_provider = SmsProviderConfig(tenant_id=acme, name="acme sms", provider="twilio")
    db.session.add_all([platform_server, own_server, platform_provider, own_provider])
    db.session.commit()
    return platform_server.id, own_server.id, platform_provider.id, own_provider.id


@pytest.mark.parametrize("role", [ADMIN, SUPPORT])
def test_tenants_see_the_platform_service_never_its_config_names(
    app: Flask, tenants: tuple[int, int], role: str
) -> None:
    """Finding 11: record pages named the platform tier's server and provider to tenants."""
    acme, _ = tenants
    platform_server, own_server, platform_provider, own_provider = configs(acme)
    via_platform = mail(acme, server_config_id=platform_server, server_id=platform_server)
    via_own = mail(acme, server_config_id=own_server)
    sms_via_platform = sms(acme, provider_config_id=platform_provider, provider_kind="twilio")
    sms_via_own = sms(acme, provider_config_id=own_provider, provider_kind="twilio")
    client, _ = signed_in(app, role)

    page = client.get(f"/mail-records/{via_platform}").text
    assert PLATFORM_MARKER not in page
    assert "platform mail service" in page
    assert f"#{platform_server}" not in page
    page = client.get(f"/sms-records/{sms_via_platform}").text
    assert PLATFORM_MARKER not in page
    assert "platform SMS service" in page
    assert f"#{platform_provider}" not in page
    # Their own configs keep their names.
    assert "acme relay" in client.get(f"/mail-records/{via_own}").text
    assert "acme sms" in client.get(f"/sms-records/{sms_via_own}").text


def test_operators_see_the_platform_tiers_real_names(app: Flask, tenants: tuple[int, int]) -> None:
    acme, _ = tenants
    platform_server, _, platform_provider, _ = configs(acme)
    via_platform = mail(acme, server_config_id=platform_server)
    sms_via_platform = sms(acme, provider_config_id=platform_provider, provider_kind="twilio")
    client, _ = signed_in(app, OPERATOR, acme)
    assert f"{PLATFORM_MARKER} relay" in client.get(f"/mail-records/{via_platform}").text
    assert f"{PLATFORM_MARKER} sms" in client.get(f"/sms-records/{sms_via_platform}").text


# --- one safe_next --------------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["/\t/x", "/\\x", "//x", "https:x", "/%0d%0ax", "/%5c/x"])
def test_a_records_next_goes_through_the_one_safe_next(
    app: Flask, tenants: tuple[int, int], target: str
) -> None:
    acme, _ = tenants
    record = mail(acme)
    client, token = signed_in(app, SUPPORT)
    response = client.post(
        f"/mail-records/{record}/retry", data={"csrf_token": token, "next": target}
    )
    assert response.status_code == 302
    assert response.headers["Location"] == f"/mail-records/{record}"
    assert record_page.safe_next is security.safe_next  # no second copy


# --- audit rows -----------------------------------------------------------------------------------


def test_a_retry_from_the_record_page_is_audited(app: Flask, tenants: tuple[int, int]) -> None:
    acme, globex = tenants
    record = mail(acme)
    sent = mail(acme, status="Sent")
    theirs = mail(globex)
    client, token = signed_in(app, SUPPORT)
    client.post(f"/mail-records/{record}/retry", data={"csrf_token": token})
    client.post(f"/mail-records/{sent}/retry", data={"csrf_token": token})
    client.post(f"/mail-records/{theirs}/retry", data={"csrf_token": token})  # 404
    rows = audit_rows()
    assert [(r.action, r.tenant_id, r.target_type, r.target_id) for r in rows] == [
        ("retry", acme, "MailSendRecord", str(record)),
        ("retry", acme, "MailSendRecord", str(sent)),
    ]
    assert rows[0].actor_label == SUPPORT
    assert rows[0].actor_user_id is not None
    assert rows[0].remark == "requeued"
    assert rows[1].remark.startswith("not retried: already sent")


def test_a_bulk_retry_writes_one_row_with_the_count(app: Flask, tenants: tuple[int, int]) -> None:
    acme, globex = tenants
    failed = [sms(acme), sms(acme)]
    sent = sms(acme, status="Sent")
    theirs = sms(globex)
    client, token = signed_in(app, ADMIN)
    confirmed = ",".join(str(i) for i in [*failed, sent, theirs])
    response = client.post(
        "/sms-records/retry",
        data={"confirm": "yes", "confirmed": confirmed},
        headers=HX | {"X-CSRFToken": token},
    )
    assert response.status_code == 200
    [row] = audit_rows()
    assert (row.action, row.tenant_id, row.target_type) == ("bulk_retry", acme, "SmsSendRecord")
    assert row.remark.startswith("2 requeued, 2 skipped (")
    assert f"Requeued: {failed[0]}, {failed[1]}." in row.remark
    assert status_of(SmsSendRecord, theirs) == "Failed"


def test_a_bulk_cancel_writes_one_row_with_the_count(app: Flask, tenants: tuple[int, int]) -> None:
    acme, _ = tenants
    pending = mail(acme, status="Pending")
    sent = mail(acme, status="Sent")
    client, token = signed_in(app, SUPPORT)
    response = client.post(
        "/mail-records/cancel",
        data={"confirm": "yes", "confirmed": f"{pending}:0,{sent}", "csrf_token": token},
    )
    assert response.status_code == 302
    [row] = audit_rows()
    assert (row.action, row.tenant_id, row.target_type) == ("bulk_cancel", acme, "MailSendRecord")
    assert row.remark.startswith("1 cancelled, 1 skipped (")
    assert f"Cancelled: {pending}." in row.remark
    assert status_of(MailSendRecord, pending) == "Cancelled"


def test_an_operator_on_every_tenant_writes_one_row_per_tenant_touched(
    app: Flask, tenants: tuple[int, int]
) -> None:
    acme, globex = tenants
    ours, theirs = mail(acme), mail(globex)
    client, token = signed_in(app, OPERATOR, "all")
    client.post(
        "/mail-records/retry",
        data={"confirm": "yes", "confirmed": f"{ours},{theirs}", "csrf_token": token},
    )
    rows = {row.tenant_id: row for row in audit_rows()}
    assert set(rows) == {acme, globex}
    assert rows[acme].remark == f"1 requeued. Requeued: {ours}."
    assert rows[globex].remark == f"1 requeued. Requeued: {theirs}."
    assert {row.actor_label for row in rows.values()} == {OPERATOR}
