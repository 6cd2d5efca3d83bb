"""The seed's operator endpoints over HTTP with API keys: manual retry (one and bulk) and quota
usage. Record statuses are set directly in the database: this tests the endpoints, not the
delivery engine that would normally move a record there."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from flask import Flask
from flask.testing import FlaskClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import select

from portal.extensions import db
from portal.messaging.sending import quota
from portal.models import (
    Channel,
    MailSendRecord,
    SendStatus,
    SmsSendRecord,
    TenantMessageQuota,
    TenantMessageUsage,
)
from portal.tenancy import PLATFORM_TENANT_ID
from tests.conftest import make_api_key, make_tenant
from tests.support.delivery import sendable
from tests.support.sweeps import examples

Model = type[MailSendRecord] | type[SmsSendRecord]
KINDS: dict[str, Model] = {"MailSendRecord": MailSendRecord, "SmsSendRecord": SmsSendRecord}
RETRYABLE = ["Pending", "Retry", "Failed", "DeadLetter"]
REFUSED = {
    "Sent": "already sent",
    "Sending": "being sent right now",
    "Cancelled": "cancelled",
    "Suppressed": "suppression list",
    "Uncertain": "outcome is uncertain",
}


@dataclass
class Env:
    client: FlaskClient
    acme_id: int
    globex_id: int
    acme: dict[str, str]
    globex: dict[str, str]


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def env(any_app: Flask) -> Env:
    acme, globex = make_tenant("acme"), make_tenant("globex")
    values = Env(
        client=any_app.test_client(),
        acme_id=acme.id,
        globex_id=globex.id,
        acme=auth(make_api_key(acme.id)),
        globex=auth(make_api_key(globex.id)),
    )
    db.session.commit()
    sendable(acme.id)  # a retry's diagnosis finds a server and a provider to prepare with
    sendable(globex.id)
    return values


def make_record(
    model: Model, tenant_id: int, status: str, *, retry_count: int = 2, version: int = 3
) -> int:
    """A record in ``status`` as the delivery engine would have left it."""
    later = datetime.now(UTC) + timedelta(hours=1)
    fields: dict[str, Any] = {
        "tenant_id": tenant_id,
        "scope": "TENANT",
        "status": status,
        "retry_count": retry_count,
        "version": version,
        "next_retry_at": later if status == "Retry" else None,
        "error_code": None if status in ("Pending", "Sending", "Sent") else "SMTP_TEMPORARY",
    }
    if model is MailSendRecord:
        record: MailSendRecord | SmsSendRecord = MailSendRecord(
            to_addrs=["ann@example.com"], subject="Hi", text_body="Hello", **fields
        )
    else:
        record = SmsSendRecord(phone_number="+447911123456", content="Hello", **fields)
    db.session.add(record)
    db.session.commit()
    return record.id


def state(model: Model, record_id: int) -> tuple[Any, ...]:
    db.session.expire_all()
    row = db.session.execute(
        select(
            model.status,
            model.retry_count,
            model.version,
            model.next_retry_at,
            model.updated_time,
        ).where(model.id == record_id)
    ).one()
    db.session.rollback()  # end the read (on SQLite every transaction holds the write lock)
    return tuple(row)


def everything() -> dict[str, list[tuple[Any, ...]]]:
    """Every record's queue columns: "nothing changed" means this is equal."""
    db.session.expire_all()
    rows = {
        name: [
            tuple(r)
            for r in db.session.execute(
                select(
                    model.id, model.status, model.retry_count, model.version, model.next_retry_at
                ).order_by(model.id)
            )
        ]
        for name, model in KINDS.items()
    }
    db.session.rollback()
    return rows


def error_of(response: Any) -> dict[str, Any]:
    body = response.json
    assert isinstance(body, dict), response.get_data(as_text=True)
    assert set(body) == {"error"}
    assert set(body["error"]) >= {"code", "field", "message"}
    error: dict[str, Any] = body["error"]
    return error


# --- authentication ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("post", "/MailSendRecord/retry?id={id}", None),
        ("post", "/SmsSendRecord/retry?id={id}", None),
        ("post", "/MailSendRecord/retryByIds", "ids"),
        ("post", "/SmsSendRecord/retryByIds", "ids"),
        ("get", "/TenantMessageQuota/usage?tenantId={tenant}", None),
    ],
)
@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer"}, {"Authorization": "Basic abc"}, auth("pk_not-a-real-key")],
    ids=["none", "empty-bearer", "basic", "unknown-key"],
)
def test_without_a_valid_key_is_401(
    env: Env, method: str, path: str, body: str | None, headers: dict[str, str]
) -> None:
    kind = "SmsSendRecord" if "Sms" in path else "MailSendRecord"
    record_id = make_record(KINDS[kind], env.acme_id, "Failed")
    before = everything()
    response = getattr(env.client, method)(
        path.format(id=record_id, tenant=env.acme_id),
        json={"ids": [record_id]} if body else None,
        headers=headers,
    )
    assert response.status_code == 401
    assert error_of(response)["code"] == "unauthorized"
    assert response.headers["WWW-Authenticate"].startswith("Bearer")
    assert everything() == before


# --- retry one --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("status", RETRYABLE)
def test_retry_requeues_a_retryable_record_due_now(env: Env, kind: str, status: str) -> None:
    model = KINDS[kind]
    record_id = make_record(model, env.acme_id, status, retry_count=2, version=3)
    _, _, _, _, updated_before = state(model, record_id)
    response = env.client.post(f"/{kind}/retry?id={record_id}", headers=env.acme)
    assert response.status_code == 200, response.json
    assert response.json == {
        "id": record_id,
        "status": "Retry",
        "requeued": 1,
        "wouldFailAgain": [],
    }
    status_after, retry_count, version, next_retry_at, updated = state(model, record_id)
    assert status_after == SendStatus.RETRY
    assert retry_count == 3
    assert version == 4  # a worker holding the old version can no longer write
    assert next_retry_at is not None
    assert next_retry_at <= datetime.now(UTC)  # due now, not after the old backoff
    assert updated >= updated_before


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("status", REFUSED)
def test_retry_refuses_sent_sending_and_final_states_with_409(
    env: Env, kind: str, status: str
) -> None:
    model = KINDS[kind]
    record_id = make_record(model, env.acme_id, status)
    before = everything()
    response = env.client.post(f"/{kind}/retry?id={record_id}", headers=env.acme)
    assert response.status_code == 409
    error = error_of(response)
    assert (error["code"], error["field"]) == ("not_retryable", "id")
    assert f"record {record_id} cannot be retried" in error["message"]
    assert REFUSED[status] in error["message"]
    assert everything() == before


@pytest.mark.parametrize("kind", KINDS)
def test_another_tenants_record_is_404_and_not_requeued(env: Env, kind: str) -> None:
    model = KINDS[kind]
    theirs = make_record(model, env.globex_id, "Failed")
    before = everything()
    response = env.client.post(f"/{kind}/retry?id={theirs}", headers=env.acme)
    assert response.status_code == 404
    assert error_of(response) == {"code": "not_found", "field": "id", "message": "no such record"}
    # Indistinguishable from an id that does not exist at all.
    unknown = env.client.post(f"/{kind}/retry?id={theirs + 100000}", headers=env.acme)
    assert (unknown.status_code, unknown.json) == (404, response.json)
    assert everything() == before
    # Its owner can retry it.
    assert env.client.post(f"/{kind}/retry?id={theirs}", headers=env.globex).status_code == 200


def test_retrying_mail_never_touches_sms_and_back(env: Env) -> None:
    mail_id = make_record(MailSendRecord, env.acme_id, "Failed")
    sms_id = make_record(SmsSendRecord, env.acme_id, "Failed")
    sms_before = state(SmsSendRecord, sms_id)
    env.client.post(f"/MailSendRecord/retry?id={mail_id}", headers=env.acme)
    assert state(SmsSendRecord, sms_id) == sms_before
    mail_before = state(MailSendRecord, mail_id)
    env.client.post(f"/SmsSendRecord/retry?id={sms_id}", headers=env.acme)
    assert state(MailSendRecord, mail_id) == mail_before


# --- retry many -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_bulk_retry_requeues_and_skips_each_with_its_reason(env: Env, kind: str) -> None:
    model = KINDS[kind]
    pending = make_record(model, env.acme_id, "Pending")
    failed = make_record(model, env.acme_id, "Failed", retry_count=5)
    dead = make_record(model, env.acme_id, "DeadLetter", retry_count=5)
    sent = make_record(model, env.acme_id, "Sent")
    sending = make_record(model, env.acme_id, "Sending")
    theirs = make_record(model, env.globex_id, "Failed")
    unknown = max(pending, failed, dead, sent, sending, theirs) + 100000
    untouched = {i: state(model, i) for i in (sent, sending, theirs)}

    ids = [dead, sent, pending, theirs, unknown, sending, failed, pending]  # pending twice
    response = env.client.post(f"/{kind}/retryByIds", json={"ids": ids}, headers=env.acme)
    assert response.status_code == 200, response.json
    body = response.json
    assert body is not None
    assert body["requeued"] == 3
    assert body["requeuedIds"] == [dead, pending, failed]  # the caller's order, once each
    skipped = {item["id"]: item["reason"] for item in body["skipped"]}
    assert [item["id"] for item in body["skipped"]] == [sent, theirs, unknown, sending]
    assert "already sent" in skipped[sent]
    assert "being sent right now" in skipped[sending]
    assert skipped[unknown] == "no such record"
    assert skipped[theirs] == skipped[unknown]  # another tenant's record looks like no record

    for record_id, retries in ((pending, 3), (failed, 6), (dead, 6)):
        status, retry_count, _, next_retry_at, _ = state(model, record_id)
        assert (status, retry_count) == ("Retry", retries)
        assert next_retry_at is not None
        assert next_retry_at <= datetime.now(UTC)
    for record_id, before in untouched.items():
        assert state(model, record_id) == before


def test_bulk_retry_of_nothing(env: Env) -> None:
    response = env.client.post("/MailSendRecord/retryByIds", json={"ids": []}, headers=env.acme)
    assert response.status_code == 200
    assert response.json == {"requeued": 0, "requeuedIds": [], "skipped": [], "wouldFailAgain": []}


def test_retry_says_which_records_it_requeued_would_fail_again(env: Env) -> None:
    """The answer names the requeued records whose cause is still there (here acme's
    full quota, for the ones still to be prepared), as the portal's Retry says; another
    tenant's record is neither requeued nor named."""
    db.session.add(TenantMessageQuota(tenant_id=env.acme_id, mail_monthly_limit=5))
    db.session.add(
        TenantMessageUsage(tenant_id=env.acme_id, month=quota.current_month(), mail_count=5)
    )
    db.session.commit()
    blocked = make_record(MailSendRecord, env.acme_id, "Failed")  # not prepared: charged again
    prepared = make_record(MailSendRecord, env.acme_id, "Failed")
    record = db.session.get(MailSendRecord, prepared)
    assert record is not None
    record.prepared_at = datetime.now(UTC)
    db.session.commit()
    theirs = make_record(MailSendRecord, env.globex_id, "Failed")
    full = "the quota of Acme is full (5 of 5); raise it first"

    response = env.client.post(
        "/MailSendRecord/retryByIds", json={"ids": [prepared, blocked, theirs]}, headers=env.acme
    )
    assert response.status_code == 200, response.json
    body = response.json
    assert body is not None
    assert body["requeuedIds"] == [prepared, blocked]  # requeued all the same
    assert body["wouldFailAgain"] == [
        {"id": blocked, "code": "SMTP_TEMPORARY", "reasonCode": "QUOTA_FULL", "reason": full}
    ]
    assert [item["id"] for item in body["skipped"]] == [theirs]

    again = make_record(MailSendRecord, env.acme_id, "Failed")
    one = env.client.post(f"/MailSendRecord/retry?id={again}", headers=env.acme)
    assert one.status_code == 200, one.json
    assert one.json == {
        "id": again,
        "status": "Retry",
        "requeued": 1,
        "wouldFailAgain": [
            {"id": again, "code": "SMTP_TEMPORARY", "reasonCode": "QUOTA_FULL", "reason": full}
        ],
    }
    assert (
        env.client.post(f"/MailSendRecord/retry?id={theirs}", headers=env.acme).status_code == 404
    )


def test_bulk_retry_accepts_exactly_the_maximum(env: Env) -> None:
    record_id = make_record(MailSendRecord, env.acme_id, "Failed")
    ids = [record_id, *range(record_id + 1_000_000, record_id + 1_000_999)]
    assert len(ids) == 1000
    response = env.client.post("/MailSendRecord/retryByIds", json={"ids": ids}, headers=env.acme)
    assert response.status_code == 200
    assert response.json["requeuedIds"] == [record_id]  # type: ignore[index]
    assert len(response.json["skipped"]) == 999  # type: ignore[index]


# --- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("query", "status", "code"),
    [
        ("", 422, "invalid"),
        ("?id=", 422, "invalid"),
        ("?id=abc", 422, "invalid"),
        ("?id=-{id}", 422, "invalid"),
        ("?id={id}.0", 422, "invalid"),
        ("?id=+{id}", 422, "invalid"),
        ("?id=%20{id}", 422, "invalid"),
        ("?id=0x{id}", 422, "invalid"),
        ("?id=99999999999999999999", 422, "invalid"),
        ("?id=0", 404, "not_found"),
        ("?ID={id}", 422, "invalid"),
    ],
    ids=[
        "missing",
        "empty",
        "word",
        "negative",
        "decimal",
        "plus-sign",
        "space",
        "hex",
        "too-long",
        "zero",
        "wrong-name",
    ],
)
def test_retry_bad_id_is_4xx_and_changes_nothing(
    env: Env, kind: str, query: str, status: int, code: str
) -> None:
    record_id = make_record(KINDS[kind], env.acme_id, "Failed")
    before = everything()
    response = env.client.post(f"/{kind}/retry{query.format(id=record_id)}", headers=env.acme)
    assert response.status_code == status
    error = error_of(response)
    # A misspelt parameter is named itself: it is not a parameter this endpoint takes.
    field = "ID" if query.startswith("?ID=") else "id"
    assert (error["code"], error["field"]) == (code, field)
    assert everything() == before


def test_retry_superscript_digit_is_422(env: Env) -> None:
    response = env.client.post("/MailSendRecord/retry?id=%C2%B2", headers=env.acme)  # '²'
    assert response.status_code == 422


def test_retry_non_ascii_digits_are_422(env: Env) -> None:
    response = env.client.post("/MailSendRecord/retry?id=%D9%A3", headers=env.acme)  # '٣'
    assert response.status_code == 422


BadBody = Any  # a JSON-able value, or a function of a real record id giving one


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({}, 422, "invalid"),
        ({"ids": None}, 422, "invalid"),
        ({"ids": "1"}, 422, "invalid"),
        ({"ids": 1}, 422, "invalid"),
        ({"ids": {"0": 1}}, 422, "invalid"),
        (lambda i: [i], 422, "invalid"),
        (lambda i: {"ids": [i, str(i)]}, 422, "invalid"),
        (lambda i: {"ids": [str(i)]}, 422, "invalid"),
        (lambda i: {"ids": [i, True]}, 422, "invalid"),
        ({"ids": [True]}, 422, "invalid"),
        (lambda i: {"ids": [float(i)]}, 422, "invalid"),
        (lambda i: {"ids": [i, None]}, 422, "invalid"),
        (lambda i: {"ids": [i, 0]}, 422, "invalid"),
        (lambda i: {"ids": [i, -1]}, 422, "invalid"),
        (lambda i: {"ids": [i, 2**63]}, 422, "invalid"),
        (lambda i: {"ids": [i, [i]]}, 422, "invalid"),
        (lambda i: {"ids": [i] * 1001}, 422, "too_large"),
        (lambda i: {"ids": [i, *range(i + 1, i + 1001)]}, 422, "too_large"),
    ],
    ids=[
        "no-ids",
        "null",
        "string",
        "number",
        "object",
        "bare-list",
        "string-among-ints",
        "string-only",
        "bool-among-ints",
        "bool-only",
        "float",
        "null-among-ints",
        "zero",
        "negative",
        "beyond-bigint",
        "nested-list",
        "1001-same",
        "1001-distinct",
    ],
)
def test_bulk_retry_bad_ids_are_422_and_change_nothing(
    env: Env, kind: str, body: BadBody, status: int, code: str
) -> None:
    record_id = make_record(KINDS[kind], env.acme_id, "Failed")
    before = everything()
    payload = body(record_id) if callable(body) else body
    response = env.client.post(f"/{kind}/retryByIds", json=payload, headers=env.acme)
    assert response.status_code == status
    error = error_of(response)
    assert error["code"] == code
    if status == 422:
        assert error["field"] == "ids"
    assert everything() == before


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("data", "content_type", "status", "code"),
    [
        ('{"ids": [{id}', "application/json", 400, "malformed_json"),
        ("{ids: [{id}]}", "application/json", 400, "malformed_json"),
        ("", "application/json", 400, "malformed_json"),
        ("null", "application/json", 422, "invalid"),  # valid JSON, not an object
        ('{"ids": [{id}]}', "text/plain", 415, "unsupported_media_type"),
        ("ids={id}", "application/x-www-form-urlencoded", 415, "unsupported_media_type"),
        ('{"ids": [{id}]}', None, 415, "unsupported_media_type"),
    ],
    ids=["truncated", "unquoted-key", "empty", "null", "text-plain", "form", "no-content-type"],
)
def test_bulk_retry_malformed_body_or_wrong_type_changes_nothing(
    env: Env, kind: str, data: str, content_type: str | None, status: int, code: str
) -> None:
    record_id = make_record(KINDS[kind], env.acme_id, "Failed")
    before = everything()
    headers = env.acme | ({"Content-Type": content_type} if content_type else {})
    response = env.client.post(
        f"/{kind}/retryByIds", data=data.replace("{id}", str(record_id)), headers=headers
    )
    assert response.status_code == status
    assert error_of(response)["code"] == code
    assert everything() == before


def test_deeply_nested_json_is_400(env: Env) -> None:
    response = env.client.post(
        "/MailSendRecord/retryByIds",
        data="[" * 100_000,
        headers=env.acme | {"Content-Type": "application/json"},
    )
    assert response.status_code == 400


# --- quota usage ------------------------------------------------------------------------------


def _usage_rows(any_app: Flask, env: Env) -> None:
    db.session.add(
        TenantMessageQuota(tenant_id=env.acme_id, mail_monthly_limit=100, sms_monthly_limit=10)
    )
    db.session.add(TenantMessageUsage(tenant_id=env.acme_id, month="1999-12", mail_count=99))
    db.session.add(
        TenantMessageUsage(
            tenant_id=env.globex_id, month=quota.current_month(), mail_count=7, sms_count=7
        )
    )
    db.session.commit()
    settings_ = any_app.config["SETTINGS"]
    for channel in (Channel.MAIL, Channel.MAIL, Channel.MAIL, Channel.SMS):
        assert quota.charge(db.engine, env.acme_id, channel, settings_)


def test_quota_usage_of_own_tenant_this_month(any_app: Flask, env: Env) -> None:
    _usage_rows(any_app, env)
    expected = {
        "tenantId": env.acme_id,
        "month": quota.current_month(),
        "mail": {"used": 3, "limit": 100},
        "sms": {"used": 1, "limit": 10},
    }
    explicit = env.client.get(f"/TenantMessageQuota/usage?tenantId={env.acme_id}", headers=env.acme)
    assert explicit.status_code == 200
    assert explicit.json == expected
    implicit = env.client.get("/TenantMessageQuota/usage", headers=env.acme)
    assert implicit.json == expected


def test_quota_usage_without_quota_or_usage(env: Env) -> None:
    response = env.client.get(
        f"/TenantMessageQuota/usage?tenantId={env.globex_id}", headers=env.globex
    )
    assert response.status_code == 200
    assert response.json == {
        "tenantId": env.globex_id,
        "month": quota.current_month(),
        "mail": {"used": 0, "limit": None},
        "sms": {"used": 0, "limit": None},
    }


@pytest.mark.parametrize(
    "tenant", ["globex", "platform", "unknown", "huge"], ids=lambda t: f"tenant-{t}"
)
def test_quota_usage_of_another_tenant_is_404(any_app: Flask, env: Env, tenant: str) -> None:
    _usage_rows(any_app, env)
    tenant_id = {
        "globex": str(env.globex_id),
        "platform": str(PLATFORM_TENANT_ID),
        "unknown": str(env.globex_id + 1000),
        "huge": "99999999999999999999",
    }[tenant]
    response = env.client.get(f"/TenantMessageQuota/usage?tenantId={tenant_id}", headers=env.acme)
    assert response.status_code == 404
    assert error_of(response) == {
        "code": "not_found",
        "field": "tenantId",
        "message": "no such quota bucket",
    }


@pytest.mark.parametrize("raw", ["abc", "", "1.5", "%20"])
def test_quota_usage_bad_tenant_id_is_422(env: Env, raw: str) -> None:
    response = env.client.get(f"/TenantMessageQuota/usage?tenantId={raw}", headers=env.acme)
    assert response.status_code == 422
    assert error_of(response)["field"] == "tenantId"


def test_platform_key_reads_any_bucket(any_app: Flask, env: Env) -> None:
    _usage_rows(any_app, env)
    platform = auth(make_api_key(PLATFORM_TENANT_ID))
    db.session.commit()
    response = env.client.get(f"/TenantMessageQuota/usage?tenantId={env.acme_id}", headers=platform)
    assert response.status_code == 200
    assert response.json["mail"] == {"used": 3, "limit": 100}  # type: ignore[index]


def test_platform_key_huge_tenant_id_is_4xx(env: Env) -> None:
    platform = auth(make_api_key(PLATFORM_TENANT_ID))
    db.session.commit()
    response = env.client.get(
        "/TenantMessageQuota/usage?tenantId=99999999999999999999", headers=platform
    )
    assert 400 <= response.status_code < 500


# --- arbitrary JSON ---------------------------------------------------------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=12,
)


@pytest.fixture
def bulk_env(app: Flask) -> dict[str, Any]:
    acme, globex = make_tenant("acme"), make_tenant("globex")
    token = make_api_key(acme.id)
    db.session.commit()
    ours = [make_record(MailSendRecord, acme.id, s) for s in ("Failed", "Sent", "Sending")]
    theirs = make_record(MailSendRecord, globex.id, "Failed")
    sms_theirs = make_record(SmsSendRecord, globex.id, "Failed")
    return {
        "client": app.test_client(),
        "headers": auth(token),
        "ids": [*ours, theirs, sms_theirs],
        "theirs": (theirs, sms_theirs),
    }


@settings(
    max_examples=examples(150),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    body=json_values
    | st.fixed_dictionaries(
        {"ids": st.lists(st.integers(min_value=-5, max_value=2**64) | json_values, max_size=6)}
    )
    | st.fixed_dictionaries({"ids": st.lists(st.integers(min_value=1, max_value=10**6))}),
    pick=st.lists(st.integers(min_value=0, max_value=4), max_size=5),
)
def test_arbitrary_json_to_retry_by_ids_never_500(
    bulk_env: dict[str, Any], body: Any, pick: list[int]
) -> None:
    client: FlaskClient = bulk_env["client"]
    if isinstance(body, dict) and isinstance(body.get("ids"), list):
        body["ids"] += [bulk_env["ids"][i] for i in pick]  # real ids, some not ours
    headers = bulk_env["headers"] | {"Content-Type": "application/json"}
    for kind, model in KINDS.items():
        # Serialised by hand, so that None is posted as the JSON document null.
        response = client.post(f"/{kind}/retryByIds", data=json.dumps(body), headers=headers)
        assert response.status_code in (200, 400, 422), (kind, body, response.json)
        if response.status_code == 200:
            result = response.json
            assert result is not None
            assert result["requeued"] == len(result["requeuedIds"])
            requeued_or_skipped = set(result["requeuedIds"]) | {s["id"] for s in result["skipped"]}
            assert requeued_or_skipped == set(body["ids"])
        else:
            error_of(response)
        theirs = bulk_env["theirs"][0 if model is MailSendRecord else 1]
        assert state(model, theirs)[0] == "Failed"  # another tenant's record is never requeued


def test_malformed_json_bytes_never_500(app: Flask) -> None:
    """Raw bytes that are not JSON at all (a quick, non-random companion to the above)."""
    acme = make_tenant("acme")
    headers = auth(make_api_key(acme.id)) | {"Content-Type": "application/json"}
    db.session.commit()
    client = app.test_client()
    for data in (b"\xff\xfe", b"{", b"[1,]", b'{"ids": [1e999]}', json.dumps({"ids": [1]}) + "x"):
        response = client.post("/MailSendRecord/retryByIds", data=data, headers=headers)
        assert response.status_code in (400, 422), data
        error_of(response)
