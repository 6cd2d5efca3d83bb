"""The messages API's lists (GET /api/v1/mail and /api/v1/sms): filters,
keyset pages, 422s naming the parameter, the tenant's own records only, a per-key rate limit."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from flask import Flask
from flask.testing import FlaskClient
from sqlalchemy import update

from portal.extensions import db
from portal.models import MailSendRecord, SmsSendRecord
from portal.tenancy import PLATFORM_TENANT_ID
from tests.conftest import make_api_key, make_tenant


@pytest.fixture
def world(app: Flask) -> dict[str, Any]:
    acme, globex = make_tenant("acme"), make_tenant("globex")
    values = {
        "acme": make_api_key(acme.id),
        "globex": make_api_key(globex.id),
        "ops": make_api_key(PLATFORM_TENANT_ID, "ops"),
        "acme_id": acme.id,
        "globex_id": globex.id,
    }
    db.session.commit()
    return values


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def send(client: FlaskClient, token: str, channel: str, **body: Any) -> int:
    base: dict[str, Any] = (
        {"to": ["ann@example.com"], "subject": "Hi", "text": "Hello"}
        if channel == "mail"
        else {"phoneNumber": "+447812345678", "content": "Hello"}
    )
    response = client.post(f"/api/v1/{channel}", json=base | body, headers=auth(token))
    assert response.status_code == 202, response.text
    return int(response.get_json()["id"])


def ids(client: FlaskClient, token: str, channel: str, **query: Any) -> list[int]:
    response = client.get(f"/api/v1/{channel}", query_string=query, headers=auth(token))
    assert response.status_code == 200, response.text
    return [item["id"] for item in response.get_json()["items"]]


def test_newest_first_in_pages_with_a_cursor(app: Flask, world: dict[str, Any]) -> None:
    client = app.test_client()
    sent = [send(client, world["acme"], "mail", to=[f"p{i}@example.com"]) for i in range(7)]
    seen: list[int] = []
    cursor = None
    pages = 0
    while True:
        query: dict[str, Any] = {"limit": 3} | ({"cursor": cursor} if cursor else {})
        body = client.get("/api/v1/mail", query_string=query, headers=auth(world["acme"]))
        page = body.get_json()
        assert len(page["items"]) <= 3
        seen += [item["id"] for item in page["items"]]
        pages += 1
        cursor = page["nextCursor"]
        if cursor is None:
            break
    assert seen == sorted(sent, reverse=True)
    assert pages == 3
    first = client.get("/api/v1/mail", headers=auth(world["acme"])).get_json()["items"][0]
    assert first["to"] == ["p6@example.com"]
    assert "attempts" not in first  # the record shape of GET one, without attempts


def test_each_filter(app: Flask, world: dict[str, Any]) -> None:
    client = app.test_client()
    token = world["acme"]
    carol = send(client, token, "mail", to=["Carol@Example.com"], businessKey="order-1")
    dave = send(client, token, "mail", to=["dave@example.org"], stream="broadcast")
    sms = send(client, token, "sms", phoneNumber="+447812345678")
    other = send(client, token, "sms", phoneNumber="+33612345678")
    db.session.execute(
        update(MailSendRecord)
        .where(MailSendRecord.id == dave)
        .values(
            status="Sent",
            created_time=datetime.now(UTC) - timedelta(days=3),
            updated_time=datetime.now(UTC) - timedelta(days=2),
        )
    )
    db.session.commit()
    assert ids(client, token, "mail", to="carol@example.com") == [carol]
    assert ids(client, token, "mail", toPrefix="car") == [carol]
    assert ids(client, token, "mail", toPrefix="dave@example") == [dave]
    assert ids(client, token, "mail", status="Sent") == [dave]
    assert ids(client, token, "mail", status="Pending") == [carol]
    assert ids(client, token, "mail", businessKey="order-1") == [carol]
    assert ids(client, token, "mail", stream="broadcast") == [dave]
    yesterday = (datetime.now(UTC) - timedelta(days=1)).isoformat().replace("+00:00", "Z")
    assert ids(client, token, "mail", createdFrom=yesterday) == [carol]
    assert ids(client, token, "mail", createdTo=yesterday) == [dave]
    assert ids(client, token, "mail", updatedFrom=yesterday) == [carol]
    assert ids(client, token, "sms", to="+447812345678") == [sms]
    assert ids(client, token, "sms", toPrefix="4478") == [sms]
    assert ids(client, token, "sms", toPrefix="+336") == [other]
    assert ids(client, token, "mail", templateCode="nothing") == []
    assert ids(client, token, "mail", toPrefix="100%") == []  # a LIKE wildcard is just text


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ({"limit": "501"}, "limit"),
        ({"limit": "0"}, "limit"),
        ({"limit": "ten"}, "limit"),
        ({"cursor": "not a cursor"}, "cursor"),
        ({"cursor": "eDE"}, "cursor"),
        ({"status": "Delivered"}, "status"),
        ({"stream": "bulk"}, "stream"),
        ({"to": "not-an-address"}, "to"),
        ({"toPrefix": "ab"}, "toPrefix"),
        ({"createdFrom": "yesterday"}, "createdFrom"),
        ({"updatedFrom": "2026-13-01"}, "updatedFrom"),
        ({"templateCode": "x" * 101}, "templateCode"),
        ({"tenantID": "1"}, "tenantID"),
    ],
)
def test_a_bad_parameter_is_a_422_naming_it(
    app: Flask, world: dict[str, Any], query: dict[str, str], field: str
) -> None:
    response = app.test_client().get(
        "/api/v1/mail", query_string=query, headers=auth(world["acme"])
    )
    assert response.status_code == 422, response.text
    assert response.get_json()["error"]["field"] == field


def test_a_key_sees_only_its_tenant_and_an_operator_key_picks_one(
    app: Flask, world: dict[str, Any]
) -> None:
    client = app.test_client()
    mine = send(client, world["acme"], "sms")
    theirs = send(client, world["globex"], "sms")
    assert ids(client, world["acme"], "sms") == [mine]
    assert ids(client, world["globex"], "sms") == [theirs]
    assert ids(client, world["acme"], "sms", to="+447812345678") == [mine]
    refused = client.get(
        "/api/v1/sms",
        query_string={"tenantId": world["globex_id"]},
        headers=auth(world["acme"]),
    )
    assert refused.status_code == 404
    assert ids(client, world["ops"], "sms", tenantId=world["globex_id"]) == [theirs]
    assert db.session.get(SmsSendRecord, theirs) is not None


def test_a_key_that_lists_too_often_is_told_to_wait(app: Flask, world: dict[str, Any]) -> None:
    settings = app.config["SETTINGS"]
    app.config["SETTINGS"] = settings.replace(api_list_per_minute=3)
    try:
        client = app.test_client()
        answers = [
            client.get("/api/v1/mail", headers=auth(world["acme"])).status_code for _ in range(5)
        ]
        assert answers[:3] == [200, 200, 200]
        limited = client.get("/api/v1/mail", headers=auth(world["acme"]))
        assert limited.status_code == 429
        assert 1 <= int(limited.headers["Retry-After"]) <= 60
        # Another key has its own count.
        assert client.get("/api/v1/mail", headers=auth(world["globex"])).status_code == 200
    finally:
        app.config["SETTINGS"] = settings
