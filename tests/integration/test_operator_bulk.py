"""Operators and bulk actions: the operator's all-tenants default, figures per
tenant where the viewed tenant has none, the tenant switcher on a page of one row, bulk retry
that says what would fail again (read from the causes, not the status) and leaves it out, the
all-tenants view's explicit choice before acting on everything matching, and bulk dead-letter
triage, audited and shown on the record page; none of it reaches another tenant's rows.
"""

from __future__ import annotations

from typing import Any

import pytest
from flask import Flask
from sqlalchemy import select

from portal.extensions import db
from portal.messaging.sending.quota import current_month
from portal.models import (
    AuditEvent,
    DeadLetterMessage,
    TenantMessageQuota,
    TenantMessageUsage,
)
from portal.models.enums import DeadLetterSource
from portal.tenancy import PLATFORM_TENANT_ID
from tests.conftest import make_tenant
from tests.integration.test_portal_records import HX, mail, signed_in, user
from tests.support.delivery import sendable

OPERATOR = "operator@postroom.example.com"
ADMIN = "admin@acme.example.com"
GLOBEX_ADMIN = "admin@globex.example.com"


@pytest.fixture
def tenants(app: Flask, monkeypatch: pytest.MonkeyPatch) -> tuple[int, int]:
    """acme (an admin) and globex (an admin), and the platform operator."""
    acme, globex = make_tenant("acme").id, make_tenant("globex").id
    db.session.commit()
    user(OPERATOR, "platform_operator", PLATFORM_TENANT_ID)
    user(ADMIN, "tenant_admin", acme)
    user(GLOBEX_ADMIN, "tenant_admin", globex)
    sendable(acme)  # their records can be prepared: a retry's diagnosis finds a route
    sendable(globex)
    return acme, globex


def dead_letter(tenant_id: int, record_id: int, code: str = "550") -> int:
    row = DeadLetterMessage(
        tenant_id=tenant_id,
        source=DeadLetterSource.SEND_EXHAUSTED.value,
        event_id=str(record_id),
        channel="mail",
        error_code=code,
        reason="retries used up",
        attempts=5,
    )
    db.session.add(row)
    db.session.commit()
    return row.id


def full_quota(tenant_id: int, used: int = 5, limit: int = 5) -> None:
    db.session.add(TenantMessageQuota(tenant_id=tenant_id, mail_monthly_limit=limit))
    db.session.add(TenantMessageUsage(tenant_id=tenant_id, month=current_month(), mail_count=used))
    db.session.commit()


def post(client: Any, token: str, path: str, data: dict[str, Any]) -> Any:
    return client.post(path, data=data, headers=HX | {"X-CSRFToken": token})


# --- the operator's view ---------------------------------------------------------------------


def test_an_operator_views_every_tenant_by_default(app: Flask, tenants: tuple[int, int]) -> None:
    _, globex = tenants
    failed = mail(globex, error_code="550")
    letter = dead_letter(globex, failed)
    client, _ = signed_in(app, OPERATOR)
    page = client.get("/").text
    assert 'value="all" selected' in page  # the switcher says so
    assert "Failures by tenant" in page
    assert "Globex" in page
    assert "No records yet" not in page.split('id="ch-sms_records"')[0]  # mail has one
    letters = client.get("/dead-letters/").text
    assert f'id="dead-letter-{letter}"' in letters
    assert "No dead letters match" not in letters
    assert "Waiting for triage, by tenant" in letters


def test_viewing_one_tier_still_says_what_other_tenants_have(
    app: Flask, tenants: tuple[int, int]
) -> None:
    _, globex = tenants
    dead_letter(globex, mail(globex, error_code="550"))
    client, _ = signed_in(app, OPERATOR, PLATFORM_TENANT_ID)
    page = client.get("/").text
    assert 'id="other-tenants"' in page
    assert "Globex (1 mail, 0 SMS failed, 1 dead letter)" in page
    letters = client.get("/dead-letters/").text
    assert "No dead letters match in Platform tier." in letters
    assert "Other tenants have dead letters waiting: Globex 1." in letters


def test_a_tenant_admin_sees_no_other_tenants_figures(app: Flask, tenants: tuple[int, int]) -> None:
    _, globex = tenants
    dead_letter(globex, mail(globex, error_code="550"))
    client, _ = signed_in(app, ADMIN)
    page = client.get("/").text
    assert "Globex" not in page
    assert 'id="other-tenants"' not in page
    assert "Failures by tenant" not in page


@pytest.mark.parametrize(
    ("next_url", "lands"),
    [
        ("/mail-servers/5/edit", "/mail-servers/"),
        ("/mail-records/123", "/mail-records/"),
        ("/dead-letters/7", "/dead-letters/"),
        ("/mail-records/?status=Failed", "/mail-records/?status=Failed"),
        ("/quotas/", "/quotas/"),
        ("/no-such-page/9", "/no-such-page/9"),
        ("https://evil.example/x", "/"),
    ],
)
def test_switching_tenant_on_a_page_of_one_row_lands_on_its_list(
    app: Flask, tenants: tuple[int, int], next_url: str, lands: str
) -> None:
    acme, _ = tenants
    client, token = signed_in(app, OPERATOR)
    response = client.post(
        "/tenants/view", data={"tenant": str(acme), "next": next_url, "csrf_token": token}
    )
    assert response.status_code == 302
    assert response.headers["Location"] == lands


def test_switching_to_an_id_too_large_is_a_404(app: Flask, tenants: tuple[int, int]) -> None:
    client, token = signed_in(app, OPERATOR)
    response = client.post("/tenants/view", data={"tenant": "9" * 30, "csrf_token": token})
    assert response.status_code == 404


# --- bulk dead-letter triage ---------------------------------------------------------------------


def triage_state(letter_id: int) -> tuple[str, str | None]:
    db.session.expire_all()
    row = db.session.get(DeadLetterMessage, letter_id)
    assert row is not None
    return row.status, row.remark


def test_bulk_triage_marks_the_selected_with_one_remark_audited(
    app: Flask, tenants: tuple[int, int]
) -> None:
    acme, globex = tenants
    records = [mail(acme, status="DeadLetter") for _ in range(2)]
    letters = [dead_letter(acme, r) for r in records]
    other = dead_letter(globex, mail(globex, status="DeadLetter"))
    client, token = signed_in(app, OPERATOR, "all")
    missing = client.post(
        "/dead-letters/triage",
        data={
            "letter_ids": [str(i) for i in letters],
            "decision": "Resolved",
            "remark": " ",
            "scope": "selected",
            "csrf_token": token,
        },
    )
    assert missing.status_code == 422
    assert "Write a remark" in missing.text
    assert triage_state(letters[0]) == ("Pending", None)

    done = client.post(
        "/dead-letters/triage",
        data={
            "letter_ids": [str(i) for i in letters],
            "decision": "Resolved",
            "remark": "customer re-sent by hand",
            "scope": "selected",
            "csrf_token": token,
        },
    )
    assert done.status_code == 303
    for letter in letters:
        assert triage_state(letter) == ("Resolved", "customer re-sent by hand")
    assert triage_state(other) == ("Pending", None)
    audits = db.session.scalars(
        select(AuditEvent).where(AuditEvent.action == "dead_letter_triage")
    ).all()
    assert sorted(int(a.target_id or 0) for a in audits) == sorted(letters)
    assert {a.tenant_id for a in audits} == {acme}
    assert {a.remark for a in audits} == {"Resolved: customer re-sent by hand"}

    shown = client.get(f"/mail-records/{records[0]}").text
    assert 'id="dead-letter-triage"' in shown
    assert "customer re-sent by hand" in shown
    assert "Resolved by operator@postroom.example.com" in shown
    # A tenant admin sees the state too, and the operator only as "a platform operator".
    admin, _ = signed_in(app, ADMIN)
    theirs = admin.get(f"/mail-records/{records[0]}").text
    assert "Resolved by a platform operator" in theirs


def test_bulk_triage_of_everything_matching_across_tenants_needs_the_choice(
    app: Flask, tenants: tuple[int, int]
) -> None:
    acme, globex = tenants
    ours = dead_letter(acme, mail(acme, status="DeadLetter"), code="550")
    theirs = dead_letter(globex, mail(globex, status="DeadLetter"), code="550")
    handled = dead_letter(globex, mail(globex, status="DeadLetter"), code="550")
    db.session.get(DeadLetterMessage, handled).status = "Discarded"  # type: ignore[union-attr]
    db.session.commit()
    client, token = signed_in(app, OPERATOR, "all")
    form = {
        "scope": "filter",
        "code": "550",
        "decision": "Discarded",
        "remark": "test traffic",
        "csrf_token": token,
    }
    refused = client.post("/dead-letters/triage", data=form)
    assert refused.status_code == 422
    assert "This marks dead letters of 2 tenants" in refused.text
    assert triage_state(ours)[0] == triage_state(theirs)[0] == "Pending"

    done = client.post("/dead-letters/triage", data=form | {"all_tenants": "yes"})
    assert done.status_code == 303
    assert triage_state(ours) == triage_state(theirs) == ("Discarded", "test traffic")
    assert triage_state(handled) == ("Discarded", None)  # already handled: left as it was

    # Filtered to one tenant, everything matching needs no choice.
    again = dead_letter(acme, mail(acme, status="DeadLetter"), code="551")
    one = client.post(
        "/dead-letters/triage",
        data=form | {"code": "551", "tenant": str(acme)},
    )
    assert one.status_code == 303
    assert triage_state(again)[0] == "Discarded"


def test_bulk_triage_never_reaches_another_tenants_dead_letters(
    app: Flask, tenants: tuple[int, int]
) -> None:
    acme, globex = tenants
    theirs = dead_letter(globex, mail(globex, status="DeadLetter"))
    # An operator viewing acme: globex's id finds nothing.
    client, token = signed_in(app, OPERATOR, acme)
    response = client.post(
        "/dead-letters/triage",
        data={
            "letter_ids": str(theirs),
            "decision": "Resolved",
            "remark": "x",
            "scope": "selected",
            "csrf_token": token,
        },
    )
    assert response.status_code == 422
    assert triage_state(theirs) == ("Pending", None)
    # Filter by globex while viewing acme: the view wins.
    client.post(
        "/dead-letters/triage",
        data={
            "tenant": str(globex),
            "decision": "Resolved",
            "remark": "x",
            "scope": "filter",
            "all_tenants": "yes",
            "csrf_token": token,
        },
    )
    assert triage_state(theirs) == ("Pending", None)
    # A tenant admin may not triage at all.
    admin, admin_token = signed_in(app, GLOBEX_ADMIN)
    denied = admin.post(
        "/dead-letters/triage",
        data={
            "letter_ids": str(theirs),
            "decision": "Resolved",
            "remark": "x",
            "scope": "selected",
            "csrf_token": admin_token,
        },
    )
    assert denied.status_code == 403
    assert triage_state(theirs) == ("Pending", None)
