"""Bulk cancel on the record list pages (mail and SMS) through Flask's test client, on
PostgreSQL: the confirmation counts what can and cannot be cancelled, the cancel takes each
record at the version confirmed, a worker that claims a record in between wins and is reported,
permissions as the single cancel, tenant isolation, CSRF, and bad forms as 422."""

from __future__ import annotations

import re

import pytest
from argon2 import PasswordHasher
from flask import Flask
from sqlalchemy import select, update

from portal.extensions import db
from portal.messaging.records.retry import retry_records
from portal.messaging.sending.claim import claim
from portal.models import MailSendRecord, SmsSendRecord
from portal.models import tenant as tenant_model
from portal.web.records import bulk
from portal.web.records.filters import BULK_CAP
from tests.conftest import make_tenant
from tests.integration.test_portal_records import HX, mail, signed_in, sms, status_of, user

OPERATOR = "operator@postroom.example.com"
ADMIN = "admin@acme.example.com"
SUPPORT = "support@acme.example.com"


@pytest.fixture
def tenants(app: Flask, monkeypatch: pytest.MonkeyPatch) -> tuple[int, int]:
    """acme (admin, support), globex, the operator; argon2 at its cheapest (many sign-ins)."""
    monkeypatch.setattr(tenant_model, "_hasher", PasswordHasher(1, 8, 1))
    acme, globex = make_tenant("acme").id, make_tenant("globex").id
    db.session.commit()
    user(OPERATOR, "platform_operator", -1)
    user(ADMIN, "tenant_admin", acme)
    user(SUPPORT, "support", acme)
    return acme, globex


def version_of(model: type[MailSendRecord] | type[SmsSendRecord], record_id: int) -> int:
    db.session.expire_all()
    return int(db.session.scalar(select(model.version).where(model.id == record_id)) or 0)


def confirmed_of(text: str) -> str:
    found = re.search(r'name="confirmed" value="([^"]*)"', text)
    assert found is not None, text
    return found.group(1)


def test_confirm_counts_then_cancels_by_version_in_place(
    app: Flask, tenants: tuple[int, int]
) -> None:
    acme, globex = tenants
    pending = mail(acme, status="Pending")
    retrying = mail(acme, status="Retry", version=4)
    ambiguous = mail(acme, status="Retry", ambiguous_attempt=True)
    sent = mail(acme, status="Sent")
    failed = mail(acme, status="Failed")
    foreign = mail(globex, status="Pending")
    chosen = [pending, retrying, ambiguous, sent, failed, foreign]
    client, token = signed_in(app, ADMIN)
    headers = HX | {"X-CSRFToken": token}

    preview = client.post(
        "/mail-records/cancel",
        data={"ids": [str(i) for i in chosen], "scope": "selected"},
        headers=headers,
    )
    assert preview.status_code == 200, preview.text
    text = preview.text
    assert "<html" not in text  # a fragment
    assert "Cancel 6 mail records?" in text
    assert "<strong>2</strong> can be cancelled and <strong>4</strong> cannot" in text
    assert "Cancelled: never sent" in text
    assert "Not cancelled, already sent" in text
    assert "Not cancelled, an earlier attempt may have been accepted" in text
    assert "Not cancelled, already failed" in text
    assert "Not cancelled, no such record" in text  # another tenant's id, as if it did not exist
    assert "Confirm: cancel 2" in text
    confirmed = confirmed_of(text)
    assert f"{pending}:0" in confirmed.split(",")
    assert f"{retrying}:4" in confirmed.split(",")
    assert str(sent) in confirmed.split(",")  # reported, never cancelled
    # Counting changed nothing.
    assert status_of(MailSendRecord, pending) == "Pending"

    done = client.post(
        "/mail-records/cancel",
        data={"confirm": "yes", "confirmed": confirmed, "shown": [str(pending), str(sent)]},
        headers=headers,
    )
    assert done.status_code == 200, done.text
    assert "2 cancelled</strong>: they will not be sent" in done.text
    assert "1: already sent: the server or provider accepted it" in done.text
    assert "1: no such record" in done.text
    assert "worker claimed" not in done.text
    # The rows on the page come back out of band.
    assert f'<tr id="mail-records-row-{pending}" hx-swap-oob="true">' in done.text
    assert done.text.count("<template>") == 2
    assert [status_of(MailSendRecord, i) for i in chosen] == [
        "Cancelled",
        "Cancelled",
        "Retry",
        "Sent",
        "Failed",
        "Pending",
    ]
    db.session.expire_all()
    row = db.session.get(MailSendRecord, retrying)
    assert row is not None
    assert row.cancelled_at is not None
    assert row.version == 5


def test_a_worker_that_claims_a_record_after_the_confirmation_wins(
    app: Flask, tenants: tuple[int, int]
) -> None:
    acme, _ = tenants
    claimed_now = mail(acme, status="Pending")
    tried_meanwhile = mail(acme, status="Pending")
    untouched = mail(acme, status="Pending")
    retried_by_hand = mail(acme, status="Failed")
    client, token = signed_in(app, SUPPORT)
    headers = HX | {"X-CSRFToken": token}
    ids = [claimed_now, tried_meanwhile, untouched, retried_by_hand]
    preview = client.post(
        "/mail-records/cancel",
        data={"ids": [str(i) for i in ids], "scope": "selected"},
        headers=headers,
    )
    assert "<strong>3</strong> can be cancelled and <strong>1</strong> cannot" in preview.text
    confirmed = confirmed_of(preview.text)

    # Between the confirmation and the click: a worker claims one (Sending) and another
    # (claimed, failed, back in Retry: cancellable again, but not the record confirmed), and
    # someone retries the Failed one by hand.
    claim(db.session, MailSendRecord, [claimed_now, tried_meanwhile], 2)
    db.session.commit()
    db.session.execute(
        update(MailSendRecord)
        .where(MailSendRecord.id == tried_meanwhile)
        .values(status="Retry", version=MailSendRecord.version + 1)
    )
    retry_records(db.session, MailSendRecord, [retried_by_hand], acme)
    db.session.commit()

    done = client.post(
        "/mail-records/cancel",
        data={"confirm": "yes", "confirmed": confirmed},
        headers=headers,
    )
    assert done.status_code == 200
    text = done.text
    assert "1 cancelled" in text
    assert "2 not cancelled: a worker claimed them first." in text
    assert f"Record {claimed_now}</a>: being sent: a worker claimed it first" in text
    assert f"Record {tried_meanwhile}</a>: a worker claimed it first: it changed after" in text
    assert "1: it was not cancellable when you confirmed; look at it again" in text
    assert [status_of(MailSendRecord, i) for i in ids] == [
        "Sending",
        "Retry",
        "Cancelled",
        "Retry",
    ]


def test_everything_matching_a_filter_is_capped_and_every_page_counts(
    app: Flask, tenants: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    acme, globex = tenants
    monkeypatch.setattr(bulk, "BULK_CAP", 3)  # what matching_ids cuts at
    queued = [mail(acme, status="Pending", subject=f"p{i}") for i in range(4)]
    other = mail(globex, status="Pending")
    client, token = signed_in(app, ADMIN)
    headers = HX | {"X-CSRFToken": token}
    preview = client.post(
        "/mail-records/cancel",
        data={"scope": "filter", "status": "Pending", "before": str(min(queued))},
        headers=headers,
    )
    assert "More than 3 records match this filter" in preview.text
    newest = sorted(queued, reverse=True)[:3]
    assert confirmed_of(preview.text) == ",".join(f"{i}:0" for i in newest)
    client.post(
        "/mail-records/cancel",
        data={"confirm": "yes", "confirmed": confirmed_of(preview.text)},
        headers=headers,
    )
    assert [status_of(MailSendRecord, i) for i in queued].count("Cancelled") == 3
    assert status_of(MailSendRecord, other) == "Pending"


def test_bulk_cancel_without_javascript(app: Flask, tenants: tuple[int, int]) -> None:
    acme, _ = tenants
    pending = mail(acme, status="Pending")
    sent = mail(acme, status="Sent")
    client, token = signed_in(app, ADMIN)
    preview = client.post(
        "/mail-records/cancel",
        data={
            "ids": [str(pending), str(sent)],
            "scope": "selected",
            "status": "",
            "template": "welcome",
            "csrf_token": token,
        },
    )
    assert preview.status_code == 200
    assert "<html" in preview.text
    assert "Confirm: cancel 1" in preview.text
    assert '<input type="hidden" name="template" value="welcome">' in preview.text
    done = client.post(
        "/mail-records/cancel",
        data={
            "confirm": "yes",
            "confirmed": confirmed_of(preview.text),
            "template": "welcome",
            "csrf_token": token,
        },
    )
    assert done.status_code == 302
    assert done.headers["Location"] == "/mail-records/?template=welcome"
    page = client.get(done.headers["Location"]).text
    assert "1 cancelled; 1 not cancellable (1: already sent" in page
    assert status_of(MailSendRecord, pending) == "Cancelled"
    keep = client.post(
        "/mail-records/cancel",
        data={"confirm": "no", "confirmed": f"{sent}", "csrf_token": token},
    )
    assert keep.status_code == 302


def test_sms_bulk_cancel(app: Flask, tenants: tuple[int, int]) -> None:
    acme, _ = tenants
    queued = sms(acme, status="Pending")
    sent = sms(acme, status="Sent")
    client, token = signed_in(app, SUPPORT)
    headers = HX | {"X-CSRFToken": token}
    preview = client.post(
        "/sms-records/cancel",
        data={"ids": [str(queued), str(sent)], "scope": "selected"},
        headers=headers,
    )
    assert "Cancel 2 text message records?" in preview.text
    done = client.post(
        "/sms-records/cancel",
        data={"confirm": "yes", "confirmed": confirmed_of(preview.text), "shown": str(queued)},
        headers=headers,
    )
    assert f'<tr id="sms-records-row-{queued}" hx-swap-oob="true">' in done.text
    assert status_of(SmsSendRecord, queued) == "Cancelled"
    assert status_of(SmsSendRecord, sent) == "Sent"


def test_the_list_offers_cancel_to_whoever_may_retry(app: Flask, tenants: tuple[int, int]) -> None:
    acme, _ = tenants
    mail(acme, status="Pending")
    for email in (ADMIN, SUPPORT):
        client, _ = signed_in(app, email)
        page = client.get("/mail-records/?status=Pending").text
        assert 'formaction="/mail-records/cancel">Cancel selected</button>' in page
        assert "Cancel all matching this filter" in page
    anonymous, token = signed_in(app, None)
    response = anonymous.post(
        "/mail-records/cancel", data={"ids": "1", "scope": "selected", "csrf_token": token}
    )
    assert response.status_code == 302
    assert "/auth/login" in response.headers["Location"]


def test_another_tenants_records_cannot_be_cancelled_even_with_a_forged_confirmation(
    app: Flask, tenants: tuple[int, int]
) -> None:
    _, globex = tenants
    foreign = mail(globex, status="Pending")
    foreign_sms = sms(globex, status="Pending")
    client, token = signed_in(app, ADMIN)
    for path, record_id in (
        ("/mail-records/cancel", foreign),
        ("/sms-records/cancel", foreign_sms),
    ):
        done = client.post(
            path,
            data={"confirm": "yes", "confirmed": f"{record_id}:0"},
            headers=HX | {"X-CSRFToken": token},
        )
        assert done.status_code == 200
        assert "0 cancelled" in done.text
        assert "1: no such record" in done.text
    assert status_of(MailSendRecord, foreign) == "Pending"
    assert status_of(SmsSendRecord, foreign_sms) == "Pending"
    # The operator looking at every tenant may.
    operator, token = signed_in(app, OPERATOR, "all")
    done = operator.post(
        "/mail-records/cancel",
        data={"confirm": "yes", "confirmed": f"{foreign}:0", "csrf_token": token},
    )
    assert done.status_code == 302
    assert status_of(MailSendRecord, foreign) == "Cancelled"


def test_posts_without_the_csrf_token_are_refused(app: Flask, tenants: tuple[int, int]) -> None:
    acme, _ = tenants
    pending = mail(acme, status="Pending")
    client, _ = signed_in(app, ADMIN)
    for data in (
        {"ids": str(pending), "scope": "selected"},
        {"confirm": "yes", "confirmed": f"{pending}:0"},
    ):
        response = client.post("/mail-records/cancel", data=data)
        assert response.status_code == 400
        assert "Your form expired" in response.text
        forged = client.post("/sms-records/cancel", data=data, headers={"X-CSRFToken": "forged"})
        assert forged.status_code == 400
    assert status_of(MailSendRecord, pending) == "Pending"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"scope": "selected"}, "Select at least one record to cancel."),
        ({"scope": "selected", "ids": "abc"}, "record ids are not valid"),
        ({"scope": "selected", "ids": "99999999999999999999"}, "record ids are not valid"),
        ({"scope": "filter", "status": "Lost"}, "Choose a status from the list."),
        ({"scope": "filter", "status": "Sent"}, "No records match this filter."),
        ({"confirm": "yes", "confirmed": ""}, "Nothing to cancel."),
        ({"confirm": "yes", "confirmed": "1:x"}, "That confirmation is not valid"),
        ({"confirm": "yes", "confirmed": "1:99999999999"}, "That confirmation is not valid"),
        ({"confirm": "yes", "confirmed": "-1:0"}, "That confirmation is not valid"),
    ],
)
def test_bad_bulk_cancel_forms_are_422_with_a_message(
    app: Flask, tenants: tuple[int, int], data: dict[str, str], message: str
) -> None:
    client, token = signed_in(app, ADMIN)
    response = client.post("/mail-records/cancel", data=data, headers=HX | {"X-CSRFToken": token})
    assert response.status_code == 422, response.text
    assert message in response.text


def test_too_many_ids_are_refused(app: Flask, tenants: tuple[int, int]) -> None:
    client, token = signed_in(app, ADMIN)
    ids = ",".join(f"{i}:0" for i in range(1, BULK_CAP + 2))
    response = client.post(
        "/mail-records/cancel",
        data={"confirm": "yes", "confirmed": ids},
        headers=HX | {"X-CSRFToken": token},
    )
    assert response.status_code == 422
    assert f"at most {BULK_CAP:,} records" in response.text
