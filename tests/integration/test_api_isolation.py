"""Isolation on the JSON API and the operator endpoints (Flask's test client, real PostgreSQL):
whose records a key or a session reaches, no 500 for bad input, a key's last
use, key scopes, the confirm page before a key is revoked, and the audit rows of the
actions."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from flask import Flask
from sqlalchemy import func, select

from portal.extensions import db
from portal.models import ApiKey, AuditEvent, MailSendRecord, SmsSendRecord
from portal.models.tenant import new_api_token
from portal.tenancy import PLATFORM_TENANT_ID
from portal.web.machine.openapi import openapi_document
from tests.conftest import make_api_key, make_tenant
from tests.integration.test_portal_templates import Portal, user
from tests.support.after_send import mail_row, sms_row

MAIL = {"to": ["ann@example.com"], "subject": "Hello", "text": "Hi"}
SMS = {"phoneNumber": "+447911123456", "content": "Hi"}
MODELS: dict[str, type[MailSendRecord] | type[SmsSendRecord]] = {
    "mail": MailSendRecord,
    "sms": SmsSendRecord,
}
KIND = {"mail": "MailSendRecord", "sms": "SmsSendRecord"}


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def scoped_key(tenant_id: int, scopes: str, name: str) -> str:
    token = new_api_token()
    key = ApiKey(tenant_id=tenant_id, name=name, scopes=scopes)
    key.set_token(token)
    db.session.add(key)
    db.session.flush()
    return token


def row(channel: str, tenant_id: int, status: str, **fields: Any) -> int:
    make = mail_row if channel == "mail" else sms_row
    return make(tenant_id, None, status=status, **fields).id


@pytest.fixture
def world(app: Flask) -> dict[str, Any]:
    acme, globex = make_tenant("acme").id, make_tenant("globex").id
    user("admin@acme.test", "tenant_admin", acme)
    user("support@acme.test", "support", acme)
    user("operator@postroom.test", "platform_operator", PLATFORM_TENANT_ID)
    keys = {
        "acme": make_api_key(acme, "acme-app"),
        "globex": make_api_key(globex, "globex-app"),
        "platform": make_api_key(PLATFORM_TENANT_ID, "platform-app"),
        "acme_read": scoped_key(acme, "read", "acme-reader"),
        "acme_send": scoped_key(acme, "send", "acme-sender"),
    }
    records: dict[str, dict[str, int]] = {}
    for channel in ("mail", "sms"):
        records[channel] = {
            "uncertain": row(channel, acme, "Uncertain", ambiguous_attempt=True),
            "failed": row(channel, acme, "Failed", error_code="X"),
            "pending": row(channel, acme, "Pending"),
        }
    db.session.commit()
    return {"acme": acme, "globex": globex, "keys": keys, "records": records}


def status_of(channel: str, record_id: int) -> str:
    db.session.expire_all()
    record = db.session.get(MODELS[channel], record_id)
    assert record is not None
    return record.status


def audit_rows(action: str) -> list[AuditEvent]:
    db.session.expire_all()
    return list(
        db.session.scalars(
            select(AuditEvent).where(AuditEvent.action == action).order_by(AuditEvent.id)
        )
    )


RESOLVE = {"outcome": "failed", "reason": "not in the provider's log"}


# --- finding 2: whose records ------------------------------------------------------------


@pytest.mark.parametrize("channel", ["mail", "sms"])
def test_a_platform_key_reaches_a_tenants_record_only_with_tenant_id(
    app: Flask, world: dict[str, Any], channel: str
) -> None:
    client = app.test_client()
    platform = auth(world["keys"]["platform"])
    rid = world["records"][channel]["uncertain"]
    # Without tenantId: the platform tier's records only; GET and resolve both 404.
    assert client.get(f"/api/v1/{channel}/{rid}", headers=platform).status_code == 404
    refused = client.post(f"/api/v1/{channel}/{rid}/resolve", json=RESOLVE, headers=platform)
    assert refused.status_code == 404
    assert refused.json["error"]["code"] == "not_found"  # type: ignore[index]
    assert status_of(channel, rid) == "Uncertain"
    # With tenantId of another tenant: still 404 (the record is acme's).
    other = f"?tenantId={world['globex']}"
    assert client.get(f"/api/v1/{channel}/{rid}{other}", headers=platform).status_code == 404
    assert (
        client.post(
            f"/api/v1/{channel}/{rid}/resolve{other}", json=RESOLVE, headers=platform
        ).status_code
        == 404
    )
    chosen = f"?tenantId={world['acme']}"
    shown = client.get(f"/api/v1/{channel}/{rid}{chosen}", headers=platform)
    assert shown.status_code == 200
    assert shown.json["id"] == rid  # type: ignore[index]
    done = client.post(f"/api/v1/{channel}/{rid}/resolve{chosen}", json=RESOLVE, headers=platform)
    assert done.status_code == 200, done.text
    assert status_of(channel, rid) == "Failed"


@pytest.mark.parametrize("channel", ["mail", "sms"])
def test_a_tenant_key_reaches_only_its_own_records_whatever_tenant_id_says(
    app: Flask, world: dict[str, Any], channel: str
) -> None:
    client = app.test_client()
    globex = auth(world["keys"]["globex"])
    records = world["records"][channel]
    before = {rid: status_of(channel, rid) for rid in records.values()}
    for suffix in ("", f"?tenantId={world['acme']}", "?tenantId=-1"):
        requests = [
            ("GET", f"/api/v1/{channel}/{records['uncertain']}{suffix}", None),
            ("POST", f"/api/v1/{channel}/{records['uncertain']}/resolve{suffix}", RESOLVE),
            ("POST", f"/api/v1/{channel}/{records['pending']}/cancel{suffix}", None),
            ("POST", f"/{KIND[channel]}/retry?id={records['failed']}&{suffix[1:]}", None),
        ]
        for method, url, body in requests:
            response = client.open(url, method=method, json=body, headers=globex)
            assert response.status_code == 404, (url, response.text)
            assert response.json["error"]["code"] == "not_found"  # type: ignore[index]
            assert str(world["acme"]) not in response.text.replace(url, "")
        many = client.post(
            f"/api/v1/{channel}/cancel{suffix}", json={"ids": [records["pending"]]}, headers=globex
        )
        assert many.status_code == (200 if not suffix else 404)
        by_ids = client.post(
            f"/{KIND[channel]}/retryByIds{suffix}",
            json={"ids": [records["failed"]]},
            headers=globex,
        )
        assert by_ids.status_code == (200 if not suffix else 404)
    assert {rid: status_of(channel, rid) for rid in records.values()} == before
    # acme's own key, naming its own tenant, is fine.
    acme = auth(world["keys"]["acme"])
    own = client.get(
        f"/api/v1/{channel}/{records['uncertain']}?tenantId={world['acme']}", headers=acme
    )
    assert own.status_code == 200


def test_a_bad_tenant_id_is_422_naming_it(app: Flask, world: dict[str, Any]) -> None:
    client = app.test_client()
    rid = world["records"]["mail"]["uncertain"]
    for raw in ("abc", "", "1.5", "%C2%B2"):
        response = client.get(
            f"/api/v1/mail/{rid}?tenantId={raw}", headers=auth(world["keys"]["platform"])
        )
        assert response.status_code == 422, raw
        assert response.json["error"]["field"] == "tenantId"  # type: ignore[index]


def test_an_operator_session_acts_on_the_tenant_it_views(app: Flask, world: dict[str, Any]) -> None:
    rid = world["records"]["sms"]["uncertain"]
    failed = world["records"]["sms"]["failed"]
    operator = Portal(app, "operator@postroom.test")
    operator.view(world["globex"])
    assert operator.post(f"/api/v1/sms/{rid}/resolve", RESOLVE).status_code == 404
    assert operator.post(f"/SmsSendRecord/retry?id={failed}").status_code == 404
    # tenantId cannot widen a session's view.
    widened = f"/api/v1/sms/{rid}/resolve?tenantId={world['acme']}"
    assert operator.post(widened, RESOLVE).status_code == 404
    usage = operator.get(f"/TenantMessageQuota/usage?tenantId={world['acme']}")
    assert usage.status_code == 404
    assert status_of("sms", rid) == "Uncertain"
    assert status_of("sms", failed) == "Failed"
    operator.view(world["acme"])
    assert operator.post(f"/api/v1/sms/{rid}/resolve", RESOLVE).status_code == 200
    assert operator.post(f"/SmsSendRecord/retry?id={failed}").status_code == 200
    assert status_of("sms", rid) == "Failed"
    assert status_of("sms", failed) == "Retry"


def test_tenant_admins_resolve_their_own_records_and_support_may_not(
    app: Flask, world: dict[str, Any]
) -> None:
    rid = world["records"]["mail"]["uncertain"]
    support = Portal(app, "support@acme.test")
    assert support.post(f"/api/v1/mail/{rid}/resolve", RESOLVE).status_code == 403
    admin = Portal(app, "admin@acme.test")
    assert admin.post(f"/api/v1/mail/{rid}/resolve", RESOLVE, csrf=False).status_code == 400
    assert status_of("mail", rid) == "Uncertain"
    done = admin.post(f"/api/v1/mail/{rid}/resolve", RESOLVE, htmx=True)
    assert done.status_code == 204
    assert status_of("mail", rid) == "Failed"


def test_a_tenant_key_resolves_its_own_uncertain_record(app: Flask, world: dict[str, Any]) -> None:
    rid = world["records"]["sms"]["uncertain"]
    response = app.test_client().post(
        f"/api/v1/sms/{rid}/resolve",
        json={"outcome": "accepted", "providerMessageId": "gw-1"},
        headers=auth(world["keys"]["acme"]),
    )
    assert response.status_code == 200, response.text
    assert response.json == {"id": rid, "status": "Sent", "providerMessageId": "gw-1"}


def test_tenant_id_is_documented_wherever_it_is_accepted() -> None:
    paths = openapi_document()["paths"]
    with_tenant = [
        ("get", "/api/v1/mail/{id}"),
        ("get", "/api/v1/sms/{id}"),
        ("post", "/api/v1/mail/{id}/cancel"),
        ("post", "/api/v1/sms/{id}/cancel"),
        ("post", "/api/v1/mail/cancel"),
        ("post", "/api/v1/sms/cancel"),
        ("post", "/api/v1/mail/{id}/resolve"),
        ("post", "/api/v1/sms/{id}/resolve"),
        ("post", "/MailSendRecord/retry"),
        ("post", "/SmsSendRecord/retry"),
        ("post", "/MailSendRecord/retryByIds"),
        ("post", "/SmsSendRecord/retryByIds"),
        ("get", "/TenantMessageQuota/usage"),
    ]
    for method, path in with_tenant:
        names = {(p["name"], p["in"]) for p in paths[path][method]["parameters"]}
        assert ("tenantId", "query") in names, path
    assert ("id", "query") in {
        (p["name"], p["in"]) for p in paths["/MailSendRecord/retry"]["post"]["parameters"]
    }


# --- finding 7: no 500 for bad input -----------------------------------------------------


@pytest.mark.parametrize("channel", ["mail", "sms"])
@pytest.mark.parametrize("items", [None, 1, 1.5, True, False, "x", {}, {"to": "x"}, []])
def test_batch_items_that_are_not_a_list_of_items_are_422_on_items(
    app: Flask, world: dict[str, Any], channel: str, items: Any
) -> None:
    response = app.test_client().post(
        f"/api/v1/{channel}/batch", json={"items": items}, headers=auth(world["keys"]["acme"])
    )
    assert response.status_code == 422, response.text
    error = response.json["error"]  # type: ignore[index]
    assert (error["code"], error["field"]) == ("invalid", "items")


@pytest.mark.parametrize("channel", ["mail", "sms"])
@pytest.mark.parametrize(
    "expires",
    ["9999-12-31T23:59:59-14:00", "0001-01-01T00:00:00+14:00", "9999-12-31T23:59:59.999999-00:01"],
)
def test_an_expiry_outside_the_calendar_is_422_naming_expires_at(
    app: Flask, world: dict[str, Any], channel: str, expires: str
) -> None:
    client = app.test_client()
    headers = auth(world["keys"]["acme"])
    body = (MAIL if channel == "mail" else SMS) | {"expiresAt": expires}
    single = client.post(f"/api/v1/{channel}", json=body, headers=headers)
    assert single.status_code == 422, single.text
    assert single.json["error"]["field"] == "expiresAt"  # type: ignore[index]
    batch = client.post(f"/api/v1/{channel}/batch", json={"items": [body]}, headers=headers)
    assert batch.status_code == 422, batch.text
    assert batch.json["error"]["field"] == "expiresAt"  # type: ignore[index]
    assert batch.json["error"]["index"] == 0  # type: ignore[index]


@pytest.mark.parametrize(
    "path",
    [
        "/api/v1/mail",
        "/api/v1/sms",
        "/api/v1/mail/batch",
        "/api/v1/sms/batch",
        "/api/v1/mail/cancel",
        "/MailSendRecord/retryByIds",
    ],
)
def test_a_json_null_body_is_422_invalid_on_body(
    app: Flask, world: dict[str, Any], path: str
) -> None:
    response = app.test_client().post(
        path,
        data="null",
        headers=auth(world["keys"]["acme"]) | {"Content-Type": "application/json"},
    )
    assert response.status_code == 422
    error = response.json["error"]  # type: ignore[index]
    assert (error["code"], error["field"]) == ("invalid", "body")
    assert "must be a JSON object" in error["message"]


def test_a_405_says_which_methods_are_allowed(app: Flask, world: dict[str, Any]) -> None:
    client = app.test_client()
    api = client.get("/api/v1/mail/batch", headers=auth(world["keys"]["acme"]))
    assert api.status_code == 405
    assert set(api.headers["Allow"].replace(" ", "").split(",")) >= {"POST"}
    assert api.json["error"]["code"] == "method_not_allowed"  # type: ignore[index]
    assert api.mimetype == "application/json"
    page = client.put("/auth/login")
    assert page.status_code == 405
    assert "GET" in page.headers["Allow"]
    assert page.mimetype == "text/html"


WRONG_VALUES: list[Any] = [
    None,
    True,
    0,
    -1,
    2**64,
    1.5,
    "",
    "x",
    "\x00",
    "\ud800",
    [],
    [None],
    [1],
    {},
    {"a": None},
    "9999-12-31T23:59:59-14:00",
]
MAIL_FIELDS = [
    "to",
    "cc",
    "bcc",
    "replyTo",
    "subject",
    "html",
    "text",
    "templateId",
    "templateCode",
    "variables",
    "serverId",
    "priority",
    "scope",
    "businessKey",
    "expiresAt",
    "attachments",
]
SMS_FIELDS = ["phoneNumber", "content", "templateCode", "variables", "scope", "businessKey"]
SMS_FIELDS += ["expiresAt"]


@pytest.mark.parametrize("channel", ["mail", "sms"])
def test_a_wrong_type_in_any_field_of_a_single_or_batch_item_is_never_a_500(
    app: Flask, world: dict[str, Any], channel: str
) -> None:
    client = app.test_client()
    headers = auth(world["keys"]["acme"]) | {"Content-Type": "application/json"}
    base = MAIL if channel == "mail" else SMS
    fields = MAIL_FIELDS if channel == "mail" else SMS_FIELDS
    seen: dict[int, int] = {}
    for field in fields:
        for value in WRONG_VALUES:
            body = base | {field: value}
            for path, payload in (
                (f"/api/v1/{channel}", body),
                (f"/api/v1/{channel}/batch", {"items": [base, body]}),
            ):
                # json.dumps keeps a lone surrogate escaped, as a client's JSON would carry it.
                response = client.post(path, data=json.dumps(payload), headers=headers)
                seen[response.status_code] = seen.get(response.status_code, 0) + 1
                assert response.status_code < 500, (path, field, value, response.text)
                if response.status_code >= 400:
                    assert set(response.json["error"]) >= {"code", "field", "message"}  # type: ignore[index]
    assert 422 in seen


# --- finding 8: last used ----------------------------------------------------------------


def test_last_used_is_written_once_a_minute_off_the_request_and_shown(
    app: Flask, world: dict[str, Any]
) -> None:
    from portal.web.machine.endpoint import KEY_USES

    client = app.test_client()
    headers = auth(world["keys"]["acme"])
    key = db.session.scalar(select(ApiKey).where(ApiKey.name == "acme-app"))
    assert key is not None
    assert key.last_used_at is None
    written = KEY_USES.written
    assert client.post("/api/v1/mail", json=MAIL, headers=headers).status_code == 202
    KEY_USES.flush()
    db.session.expire_all()
    first = key.last_used_at
    assert first is not None
    assert KEY_USES.written == written + 1
    for _ in range(5):
        client.post("/api/v1/mail", json=MAIL, headers=headers)
        client.get("/api/v1/mail/1", headers=headers)
    KEY_USES.flush()
    db.session.expire_all()
    assert KEY_USES.written == written + 1  # within the minute: no statement at all
    assert key.last_used_at == first
    page = Portal(app, "admin@acme.test").get("/api-keys/").text
    assert first.strftime("%Y-%m-%d %H:%M") in page


def test_a_key_used_by_another_process_within_the_minute_is_not_written_again(
    app: Flask, world: dict[str, Any]
) -> None:
    from portal.web.machine.endpoint import KEY_USES, KeyUses

    headers = auth(world["keys"]["acme"])
    app.test_client().post("/api/v1/mail", json=MAIL, headers=headers)
    KEY_USES.flush()
    db.session.expire_all()
    key = db.session.scalar(select(ApiKey).where(ApiKey.name == "acme-app"))
    assert key is not None
    first = key.last_used_at
    other = KeyUses()  # another gunicorn worker: its own memory, the same database
    with app.test_request_context():
        other.used((0, "digest"), key.id)
    other.flush()
    db.session.expire_all()
    assert key.last_used_at == first


# --- scopes ------------------------------------------------------------------------------


def test_a_key_without_the_scope_is_403_naming_it(app: Flask, world: dict[str, Any]) -> None:
    client = app.test_client()
    reader, sender = auth(world["keys"]["acme_read"]), auth(world["keys"]["acme_send"])
    rid = world["records"]["mail"]["pending"]
    refusals = [
        (client.post("/api/v1/mail", json=MAIL, headers=reader), "send"),
        (client.post("/api/v1/sms/batch", json={"items": [SMS]}, headers=reader), "send"),
        (client.post(f"/api/v1/mail/{rid}/cancel", headers=reader), "send"),
        (client.post(f"/api/v1/mail/{rid}/resolve", json=RESOLVE, headers=reader), "send"),
        (client.post(f"/MailSendRecord/retry?id={rid}", headers=reader), "send"),
        (client.get(f"/api/v1/mail/{rid}", headers=sender), "read"),
        (client.get("/TenantMessageQuota/usage", headers=sender), "read"),
    ]
    for response, scope in refusals:
        assert response.status_code == 403, response.request.path
        error = response.json["error"]  # type: ignore[index]
        assert error["code"] == "insufficient_scope"
        assert f"the {scope} scope" in error["message"]
        assert f'scope="{scope}"' in response.headers["WWW-Authenticate"]
    assert status_of("mail", rid) == "Pending"
    assert db.session.scalar(select(func.count()).select_from(MailSendRecord)) == 3
    assert client.get(f"/api/v1/mail/{rid}", headers=reader).status_code == 200
    assert client.post("/api/v1/mail", json=MAIL, headers=sender).status_code == 202


def test_the_keys_page_chooses_scopes_and_lists_them(app: Flask, world: dict[str, Any]) -> None:
    admin = Portal(app, "admin@acme.test")
    index = admin.get("/api-keys/").text
    for scope in ("send", "read"):
        assert re.search(rf'name="scope" type="checkbox" value="{scope}" checked', index)
    none = admin.post("/api-keys/", {"name": "nothing"})
    assert none.status_code == 422
    assert "Scopes need at least one" in none.text
    bad = admin.post("/api-keys/", {"name": "bad", "scope": ["send", "admin"]})
    assert bad.status_code == 422
    created = admin.post("/api-keys/", {"name": "reporting", "scope": ["read"]})
    assert created.status_code == 200
    key = db.session.scalar(select(ApiKey).where(ApiKey.name == "reporting"))
    assert key is not None
    assert key.scopes == "read"
    token = re.search(r'value="(pk_[^"]+)"', created.text).group(1)  # type: ignore[union-attr]
    api = app.test_client()
    assert api.post("/api/v1/mail", json=MAIL, headers=auth(token)).status_code == 403
    listed = admin.get("/api-keys/").text
    row_html = listed[listed.index("reporting") :].split("</tr>")[0]
    assert '<span class="pill">read</span>' in row_html
    assert "send</span>" not in row_html
    (created_row,) = audit_rows("key_create")
    assert (created_row.tenant_id, created_row.target_id) == (world["acme"], str(key.id))
    assert created_row.actor_label == "admin@acme.test"
    assert created_row.remark == "reporting (scopes: read)"


# --- finding 9 for keys: revoking asks first ----------------------------------------------


def test_revoking_a_key_asks_first_without_javascript(app: Flask, world: dict[str, Any]) -> None:
    from portal.web.machine.endpoint import KEY_USES

    key = db.session.scalar(select(ApiKey).where(ApiKey.name == "acme-app"))
    assert key is not None
    admin = Portal(app, "admin@acme.test")
    index = admin.get("/api-keys/").text
    assert f'href="/api-keys/{key.id}/delete"' in index
    page = admin.get(f"/api-keys/{key.id}/delete")
    assert page.status_code == 200
    assert "Revoke API key “acme-app”?" in page.text
    assert "never been used" in page.text
    assert 'name="confirm" value="yes"' in page.text
    unconfirmed = admin.post(f"/api-keys/{key.id}/delete")
    assert unconfirmed.status_code == 200
    assert "Revoke API key" in unconfirmed.text
    db.session.expire_all()
    assert key.revoked_at is None
    assert audit_rows("key_revoke") == []
    assert app.test_client().get("/api/v1/mail/1", headers=auth(world["keys"]["acme"])).status_code
    KEY_USES.flush()
    used = admin.get(f"/api-keys/{key.id}/delete").text
    assert "It was last used" in used
    done = admin.post(f"/api-keys/{key.id}/delete", {"confirm": "yes"})
    assert done.status_code == 303
    db.session.expire_all()
    assert key.revoked_at is not None
    (revoked,) = audit_rows("key_revoke")
    assert (revoked.tenant_id, revoked.target_id, revoked.remark) == (
        world["acme"],
        str(key.id),
        "acme-app",
    )
    refused = app.test_client().post("/api/v1/mail", json=MAIL, headers=auth(world["keys"]["acme"]))
    assert refused.status_code == 401
    assert "already revoked" in admin.get(f"/api-keys/{key.id}/delete").text
    support = Portal(app, "support@acme.test")
    assert support.get(f"/api-keys/{key.id}/delete").status_code == 403


# --- audit rows of the API's actions -----------------------------------------------------


def test_api_actions_write_one_audit_row_each_naming_the_key(
    app: Flask, world: dict[str, Any]
) -> None:
    client = app.test_client()
    acme = auth(world["keys"]["acme"])
    mail, sms = world["records"]["mail"], world["records"]["sms"]
    assert client.post(f"/api/v1/mail/{mail['pending']}/cancel", headers=acme).status_code == 200
    many = client.post("/api/v1/sms/cancel", json={"ids": [sms["pending"], 999]}, headers=acme)
    assert many.json["cancelled"] == 1  # type: ignore[index]
    assert (
        client.post(f"/MailSendRecord/retry?id={mail['failed']}", headers=acme).status_code == 200
    )
    by_ids = client.post(
        "/SmsSendRecord/retryByIds", json={"ids": [sms["failed"], sms["pending"]]}, headers=acme
    )
    assert by_ids.json["requeued"] == 1  # type: ignore[index]
    resolved = client.post(
        f"/api/v1/mail/{mail['uncertain']}/resolve",
        json={"outcome": "accepted", "providerMessageId": "pm-1"},
        headers=acme,
    )
    assert resolved.status_code == 200
    # Refusals write nothing.
    client.post(f"/api/v1/mail/{mail['pending']}/cancel", headers=acme)  # already cancelled
    client.post(
        f"/MailSendRecord/retry?id={mail['pending']}", headers=auth(world["keys"]["globex"])
    )
    expected = {
        "cancel": ("MailSendRecord", str(mail["pending"]), ""),
        "bulk_cancel": ("SmsSendRecord", str(sms["pending"]), "1 cancelled, 1 skipped"),
        "retry": ("MailSendRecord", str(mail["failed"]), ""),
        "bulk_retry": ("SmsSendRecord", str(sms["failed"]), "1 requeued, 1 skipped"),
        "resolve": ("MailSendRecord", str(mail["uncertain"]), "accepted as pm-1"),
    }
    db.session.expire_all()
    rows = db.session.scalars(select(AuditEvent).order_by(AuditEvent.id)).all()
    assert [r.action for r in rows] == list(expected)
    for audit_row in rows:
        assert (audit_row.target_type, audit_row.target_id, audit_row.remark) == expected[
            audit_row.action
        ]
        assert audit_row.tenant_id == world["acme"]
        assert audit_row.actor_label == "API key acme-app"
        assert audit_row.actor_key_id is not None


def test_a_sessions_resolve_is_audited_with_its_user(app: Flask, world: dict[str, Any]) -> None:
    rid = world["records"]["sms"]["uncertain"]
    admin = Portal(app, "admin@acme.test")
    assert admin.post(f"/api/v1/sms/{rid}/resolve", RESOLVE).status_code == 200
    (resolved,) = audit_rows("resolve")
    assert (resolved.actor_label, resolved.tenant_id, resolved.target_id) == (
        "admin@acme.test",
        world["acme"],
        str(rid),
    )
    assert resolved.remark == "failed: not in the provider's log"
