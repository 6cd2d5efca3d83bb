"""The JSON API over HTTP (Flask's test client, real PostgreSQL): auth, tenancy, errors."""

from __future__ import annotations

import json
from typing import Any

import pytest
from flask import Flask
from flask.testing import FlaskClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select

from portal.extensions import db
from portal.models import ApiKey, MailSendRecord, SmsSendRecord
from tests.conftest import make_api_key, make_tenant
from tests.support.sweeps import examples

MAIL = {"to": ["ann@example.com"], "subject": "Hello", "text": "Hi"}


@pytest.fixture
def client(app: Flask) -> FlaskClient:
    return app.test_client()


@pytest.fixture
def keys(app: Flask) -> dict[str, Any]:
    acme, globex = make_tenant("acme"), make_tenant("globex")
    values = {
        "acme": make_api_key(acme.id),
        "globex": make_api_key(globex.id),
        "acme_id": acme.id,
        "globex_id": globex.id,
    }
    db.session.commit()
    return values


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def records() -> int:
    return db.session.scalar(select(func.count()).select_from(MailSendRecord)) or 0


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer"}, {"Authorization": "Basic abc"}, auth("pk_not-a-real-key")],
)
def test_without_a_valid_key_is_401(
    client: FlaskClient, keys: dict[str, Any], headers: dict[str, str]
) -> None:
    response = client.post("/api/v1/mail", json=MAIL, headers=headers)
    assert response.status_code == 401
    assert response.json["error"]["code"] == "unauthorized"  # type: ignore[index]
    assert response.headers["WWW-Authenticate"].startswith("Bearer")
    assert records() == 0


def test_revoked_key_is_401(client: FlaskClient, keys: dict[str, Any]) -> None:
    key = db.session.scalar(select(ApiKey).where(ApiKey.tenant_id == keys["acme_id"]))
    assert key is not None
    key.revoked_at = func.now()
    db.session.commit()
    assert client.post("/api/v1/mail", json=MAIL, headers=auth(keys["acme"])).status_code == 401


def test_accept_mail_and_read_it_back(client: FlaskClient, keys: dict[str, Any]) -> None:
    response = client.post(
        "/api/v1/mail", json=MAIL | {"businessKey": "b1"}, headers=auth(keys["acme"])
    )
    assert response.status_code == 202
    body = response.json
    assert body is not None
    assert body["duplicate"] is False
    again = client.post(
        "/api/v1/mail", json=MAIL | {"businessKey": "b1"}, headers=auth(keys["acme"])
    )
    assert again.json == {"id": body["id"], "duplicate": True}
    shown = client.get(f"/api/v1/mail/{body['id']}", headers=auth(keys["acme"]))
    assert shown.status_code == 200
    assert shown.json["status"] == "Pending"  # type: ignore[index]
    assert shown.json["to"] == ["ann@example.com"]  # type: ignore[index]
    record = db.session.get(MailSendRecord, body["id"])
    assert record is not None
    assert record.tenant_id == keys["acme_id"]


def test_another_tenants_record_is_404(client: FlaskClient, keys: dict[str, Any]) -> None:
    mail_id = client.post("/api/v1/mail", json=MAIL, headers=auth(keys["acme"])).json["id"]  # type: ignore[index]
    sms_id = client.post(
        "/api/v1/sms",
        json={"phoneNumber": "+447911123456", "content": "hi"},
        headers=auth(keys["acme"]),
    ).json["id"]  # type: ignore[index]
    for path in (
        f"/api/v1/mail/{mail_id}",
        f"/api/v1/sms/{sms_id}",
        "/api/v1/mail/999999999",
        "/api/v1/mail/99999999999999999999999",
    ):
        response = client.get(path, headers=auth(keys["globex"]))
        assert response.status_code == 404, path
        assert response.json["error"]["code"] == "not_found"  # type: ignore[index]
    assert client.get(f"/api/v1/sms/{sms_id}", headers=auth(keys["acme"])).status_code == 200


def test_business_key_reused_for_another_request_is_409(
    client: FlaskClient, keys: dict[str, Any]
) -> None:
    client.post("/api/v1/mail", json=MAIL | {"businessKey": "k"}, headers=auth(keys["acme"]))
    response = client.post(
        "/api/v1/mail",
        json=MAIL | {"businessKey": "k", "subject": "Changed"},
        headers=auth(keys["acme"]),
    )
    assert response.status_code == 409
    assert response.json["error"]["field"] == "businessKey"  # type: ignore[index]
    assert records() == 1


@pytest.mark.parametrize(
    ("body", "status", "code", "field"),
    [
        ({"to": "x"}, 422, "invalid", "to[0]"),
        ({"to": ["a@example.com"], "subject": "s"}, 422, "required", "html"),
        ({"to": ["a@example.com"], "subject": 3, "text": "t"}, 422, "invalid", "subject"),
        ({"to": ["a@example.com"], "templateId": "7"}, 422, "invalid", "templateId"),
        ({"to": ["a@example.com"], "templateId": 7}, 422, "not_found", "templateId"),
        (
            {"to": ["a@example.com"], "templateCode": "w", "scope": "PLATFORM"},
            422,
            "forbidden",
            "scope",
        ),
        (["not", "an", "object"], 422, "invalid", "body"),
    ],
)
def test_validation_errors_name_the_field(
    client: FlaskClient, keys: dict[str, Any], body: Any, status: int, code: str, field: str
) -> None:
    response = client.post("/api/v1/mail", json=body, headers=auth(keys["acme"]))
    assert response.status_code == status
    assert response.json["error"]["code"] == code  # type: ignore[index]
    assert response.json["error"]["field"] == field  # type: ignore[index]
    assert records() == 0


def test_batch_rejection_names_the_index_and_writes_nothing(
    client: FlaskClient, keys: dict[str, Any]
) -> None:
    items = [MAIL, MAIL | {"to": ["nope"]}]
    response = client.post("/api/v1/mail/batch", json={"items": items}, headers=auth(keys["acme"]))
    assert response.status_code == 422
    assert response.json["error"]["index"] == 1  # type: ignore[index]
    assert records() == 0
    ok = client.post("/api/v1/mail/batch", json={"items": [MAIL, MAIL]}, headers=auth(keys["acme"]))
    assert ok.status_code == 202
    assert [i["duplicate"] for i in ok.json["items"]] == [False, False]  # type: ignore[index]
    sms = client.post(
        "/api/v1/sms/batch",
        json={"items": [{"phoneNumber": "+447911123456", "content": "a"}]},
        headers=auth(keys["acme"]),
    )
    assert sms.status_code == 202
    for bad in ({}, {"items": "x"}, {"items": [], "extra": 1}, {"items": []}):
        response = client.post("/api/v1/mail/batch", json=bad, headers=auth(keys["acme"]))
        assert response.status_code == 422, bad


def test_malformed_json_wrong_type_and_oversize_never_500(
    app: Flask, client: FlaskClient, keys: dict[str, Any]
) -> None:
    headers = auth(keys["acme"])
    bad = client.post(
        "/api/v1/mail", data="{not json", headers=headers | {"Content-Type": "application/json"}
    )
    assert bad.status_code == 400
    assert bad.json["error"]["code"] == "malformed_json"  # type: ignore[index]
    form = client.post("/api/v1/mail", data="to=a", headers=headers)
    assert form.status_code == 415
    huge = json.dumps(MAIL | {"text": "x" * (app.config["MAX_CONTENT_LENGTH"] + 10)})
    too_big = client.post(
        "/api/v1/mail", data=huge, headers=headers | {"Content-Type": "application/json"}
    )
    assert too_big.status_code == 413
    assert too_big.json["error"]["code"] == "request_entity_too_large"  # type: ignore[index]
    unknown = client.get("/api/v1/nothing-here", headers=headers)
    assert unknown.status_code == 404
    assert "error" in unknown.json  # type: ignore[operator]
    assert records() == 0


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=12,
)
mail_like = st.fixed_dictionaries(
    {},
    optional={
        "to": json_values | st.lists(st.emails(), max_size=3),
        "subject": json_values,
        "text": json_values,
        "html": json_values,
        "templateCode": json_values,
        "templateId": json_values,
        "variables": json_values,
        "attachments": json_values,
        "priority": json_values,
        "businessKey": json_values,
        "scope": json_values,
    },
)


@settings(
    max_examples=examples(150),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(body=json_values | mail_like)
def test_arbitrary_json_bodies_never_500(
    client: FlaskClient, keys: dict[str, Any], body: Any
) -> None:
    for path in ("/api/v1/mail", "/api/v1/sms", "/api/v1/mail/batch", "/api/v1/sms/batch"):
        response = client.post(path, json=body, headers=auth(keys["acme"]))
        assert response.status_code in (202, 400, 409, 413, 415, 422), (path, body, response.json)
        if response.status_code != 202:
            assert set(response.json["error"]) >= {"code", "field", "message"}  # type: ignore[index]


def test_sms_record_counts(client: FlaskClient, keys: dict[str, Any]) -> None:
    client.post(
        "/api/v1/sms",
        json={"phoneNumber": "+447911123456", "content": "a"},
        headers=auth(keys["globex"]),
    )
    assert db.session.scalar(select(func.count()).select_from(SmsSendRecord)) == 1
