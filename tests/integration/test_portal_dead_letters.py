"""The dead-letter pages through Flask's test client, on PostgreSQL: operators only, filters,
tenant scoping, the payload, the link to the record and its Retry, and triage with a remark."""

from __future__ import annotations

import re
from typing import Any

import pytest
from flask import Flask
from flask.testing import FlaskClient
from sqlalchemy import select

from portal.extensions import db
from portal.models import AppUser, DeadLetterMessage, MailSendRecord, SmsSendRecord
from tests.conftest import make_tenant
from tests.support.delivery import sendable

PASSWORD = "dead-letter-test-password-1"
OPERATOR = "operator@postroom.example.com"
HX = {"HX-Request": "true"}


class Client:
    """A test client whose every request runs in a fresh app context, so that ``g`` (the
    signed-in user, the CSRF token) never leaks between clients through the fixture's."""

    def __init__(self, app: Flask):
        self.app = app
        self.client: FlaskClient = app.test_client()

    def get(self, *args: Any, **kwargs: Any) -> Any:
        with self.app.app_context():
            return self.client.get(*args, **kwargs)

    def post(self, *args: Any, **kwargs: Any) -> Any:
        with self.app.app_context():
            return self.client.post(*args, **kwargs)


def signed_in(app: Flask, email: str, view_tenant: str | int = "all") -> tuple[Client, str]:
    client = Client(app)
    found = re.search(r'name="csrf_token" value="([^"]+)"', client.get("/auth/login").text)
    assert found is not None
    token = found.group(1)
    response = client.post(
        "/auth/login", data={"email": email, "password": PASSWORD, "csrf_token": token}
    )
    assert response.status_code == 302
    with client.client.session_transaction() as session:
        session["view_tenant"] = view_tenant
    return client, token


def letter(
    tenant_id: int, record_id: int | None, channel: str | None = "mail", **fields: Any
) -> int:
    row = DeadLetterMessage(
        tenant_id=tenant_id,
        source="SendExhausted",
        event_id=str(record_id) if record_id is not None else None,
        channel=channel,
        error_code="451 4.3.0",
        reason="try again later",
        attempts=6,
        payload={"recordId": record_id, "reason": "try again <later>", "attempts": 6},
    )
    for name, value in fields.items():
        setattr(row, name, value)
    db.session.add(row)
    db.session.commit()
    return row.id


@pytest.fixture
def world(app: Flask, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    acme, globex = make_tenant("acme").id, make_tenant("globex").id
    db.session.commit()
    sendable(acme)  # their records can be prepared: a retry's diagnosis finds a route
    sendable(globex)
    for email, role, tenant_id in [
        (OPERATOR, "platform_operator", -1),
        ("admin@acme.example.com", "tenant_admin", acme),
        ("support@acme.example.com", "support", acme),
    ]:
        user = AppUser(email=email, role=role, tenant_id=tenant_id)
        user.set_password(PASSWORD)
        db.session.add(user)
    mail = MailSendRecord(tenant_id=acme, status="DeadLetter", to_addrs=["ann@example.com"])
    sms = SmsSendRecord(tenant_id=globex, status="Sent", phone_number="+447911123456")
    db.session.add_all([mail, sms])
    db.session.commit()
    return {
        "acme": acme,
        "globex": globex,
        "mail": mail.id,
        "sms": sms.id,
        "mail_letter": letter(acme, mail.id),
        "sms_letter": letter(globex, sms.id, "sms", error_code="HTTP_503"),
        "poison": letter(acme, None, channel=None, source="BrokerPoison"),
    }


def triage_status(letter_id: int) -> tuple[str, str | None, str | None]:
    db.session.expire_all()
    row = db.session.get(DeadLetterMessage, letter_id)
    assert row is not None
    return row.status, row.remark, row.handled_by


@pytest.mark.parametrize("email", ["admin@acme.example.com", "support@acme.example.com"])
def test_only_operators_see_dead_letters(app: Flask, world: dict[str, int], email: str) -> None:
    client, token = signed_in(app, email, world["acme"])
    assert client.get("/dead-letters/").status_code == 403
    assert client.get(f"/dead-letters/{world['mail_letter']}").status_code == 403
    response = client.post(
        f"/dead-letters/{world['mail_letter']}",
        data={"decision": "Resolved", "remark": "x", "csrf_token": token},
    )
    assert response.status_code == 403
    assert triage_status(world["mail_letter"])[0] == "Pending"
    assert "/dead-letters/" not in client.get("/mail-records/").text  # not in the navigation


def test_the_list_filters_by_status_channel_code_and_tenant(
    app: Flask, world: dict[str, int]
) -> None:
    resolved = letter(world["acme"], world["mail"], status="Resolved")
    client, _ = signed_in(app, OPERATOR)

    def ids(query: str) -> set[int]:
        response = client.get(f"/dead-letters/?{query}")
        assert response.status_code == 200, query
        return {int(i) for i in re.findall(r'id="dead-letter-(\d+)"', response.text)}

    everything = {world["mail_letter"], world["sms_letter"], world["poison"], resolved}
    assert ids("") == everything
    assert ids("status=Resolved") == {resolved}
    assert ids("status=Pending&channel=sms") == {world["sms_letter"]}
    assert ids("code=HTTP_503") == {world["sms_letter"]}
    assert ids(f"tenant={world['globex']}") == {world["sms_letter"]}
    assert ids("tenant=-1") == set()
    page = client.get("/dead-letters/").text
    assert "Globex" in page
    assert 'id="dl-tenant"' in page


def test_an_operator_looking_at_one_tenant_sees_only_its_dead_letters(
    app: Flask, world: dict[str, int]
) -> None:
    client, token = signed_in(app, OPERATOR, world["acme"])
    page = client.get("/dead-letters/").text
    assert f'id="dead-letter-{world["mail_letter"]}"' in page
    assert f'id="dead-letter-{world["sms_letter"]}"' not in page
    assert 'id="dl-tenant"' not in page  # no tenant filter when looking at one tenant
    assert client.get(f"/dead-letters/{world['sms_letter']}").status_code == 404
    response = client.post(
        f"/dead-letters/{world['sms_letter']}",
        data={"decision": "Resolved", "remark": "x", "csrf_token": token},
    )
    assert response.status_code == 404
    assert triage_status(world["sms_letter"])[0] == "Pending"


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("status=Lost", "Choose Pending, Resolved or Discarded"),
        ("channel=fax", "Choose mail or SMS"),
        ("tenant=abc", "Choose a tenant"),
        ("code=" + "x" * 101, "at most 100 characters"),
        ("before=-3", "page link is broken"),
    ],
)
def test_bad_filters_are_422(app: Flask, world: dict[str, int], query: str, message: str) -> None:
    client, _ = signed_in(app, OPERATOR)
    response = client.get(f"/dead-letters/?{query}")
    assert response.status_code == 422
    assert message in response.text


def test_bad_ids_are_404(app: Flask, world: dict[str, int]) -> None:
    client, token = signed_in(app, OPERATOR)
    for path in ["/dead-letters/abc", "/dead-letters/99999999999999999999", "/dead-letters/0"]:
        assert client.get(path).status_code == 404, path
        assert client.post(path, data={"csrf_token": token}).status_code in (404, 405), path


def test_the_detail_shows_the_payload_and_links_the_record_with_its_retry(
    app: Flask, world: dict[str, int]
) -> None:
    client, token = signed_in(app, OPERATOR)
    page = client.get(f"/dead-letters/{world['mail_letter']}").text
    assert "&#34;reason&#34;: &#34;try again &lt;later&gt;&#34;" in page  # pretty JSON, escaped
    assert f'href="/mail-records/{world["mail"]}"' in page
    assert f'action="/mail-records/{world["mail"]}/retry"' in page
    assert f'name="next" value="/dead-letters/{world["mail_letter"]}"' in page
    # Retry from here comes back here; the dead letter itself is left as it is.
    response = client.post(
        f"/mail-records/{world['mail']}/retry",
        data={"csrf_token": token, "next": f"/dead-letters/{world['mail_letter']}"},
    )
    assert response.headers["Location"] == f"/dead-letters/{world['mail_letter']}"
    db.session.expire_all()
    assert db.session.scalar(select(MailSendRecord.status)) == "Retry"
    assert triage_status(world["mail_letter"])[0] == "Pending"
    # A Sent record's Retry is disabled with the reason; a poison message has no record.
    sent = client.get(f"/dead-letters/{world['sms_letter']}").text
    assert "Retry is not available — already sent" in sent
    poison = client.get(f"/dead-letters/{world['poison']}").text
    assert "there is no send record" in poison


def test_triage_needs_a_decision_and_a_remark(app: Flask, world: dict[str, int]) -> None:
    client, token = signed_in(app, OPERATOR)
    path = f"/dead-letters/{world['mail_letter']}"
    for data, message in [
        ({"decision": "Resolved", "remark": "  "}, "Write a remark"),
        ({"decision": "Deleted", "remark": "gone"}, "Choose Resolved or Discarded"),
        ({"remark": "gone"}, "Choose Resolved or Discarded"),
        ({"decision": "Pending", "remark": "gone"}, "Choose Resolved or Discarded"),
        ({"decision": "Discarded", "remark": "x" * 2001}, "Keep the remark to 2,000 characters"),
    ]:
        response = client.post(path, data=data | {"csrf_token": token})
        assert response.status_code == 422, data
        assert message in response.text
        assert "<html" in response.text  # the whole page again, with the error
        fragment = client.post(path, data=data | {"csrf_token": token}, headers=HX)
        assert fragment.status_code == 422
        assert fragment.text.lstrip().startswith('<section id="triage"')
        assert message in fragment.text
    assert triage_status(world["mail_letter"]) == ("Pending", None, None)


def test_triage_without_javascript(app: Flask, world: dict[str, int]) -> None:
    client, token = signed_in(app, OPERATOR)
    path = f"/dead-letters/{world['mail_letter']}"
    response = client.post(
        path, data={"decision": "Resolved", "remark": "server fixed", "csrf_token": token}
    )
    assert response.status_code == 302
    assert response.headers["Location"] == path
    page = client.get(path).text
    assert "marked Resolved" in page
    assert f"by {OPERATOR}" in page
    assert "server fixed" in page
    assert triage_status(world["mail_letter"]) == ("Resolved", "server fixed", OPERATOR)
    handled_at = db.session.get(DeadLetterMessage, world["mail_letter"])
    assert handled_at is not None
    assert handled_at.handled_at is not None


def test_triage_with_htmx_swaps_the_panel_and_cannot_be_done_twice(
    app: Flask, world: dict[str, int]
) -> None:
    client, token = signed_in(app, OPERATOR)
    path = f"/dead-letters/{world['sms_letter']}"
    headers = HX | {"X-CSRFToken": token}
    done = client.post(
        path, data={"decision": "Discarded", "remark": "test number"}, headers=headers
    )
    assert done.status_code == 200
    assert done.text.lstrip().startswith('<section id="triage"')
    assert "Discarded</span>" in done.text
    assert "test number" in done.text
    assert done.headers["Vary"].startswith("HX-Request")
    again = client.post(path, data={"decision": "Resolved", "remark": "oops"}, headers=headers)
    assert again.status_code == 422
    assert "already been handled" in again.text
    assert triage_status(world["sms_letter"]) == ("Discarded", "test number", OPERATOR)


def test_triage_refuses_a_missing_csrf_token(app: Flask, world: dict[str, int]) -> None:
    client, _ = signed_in(app, OPERATOR)
    response = client.post(
        f"/dead-letters/{world['mail_letter']}", data={"decision": "Resolved", "remark": "x"}
    )
    assert response.status_code == 400
    assert triage_status(world["mail_letter"])[0] == "Pending"
