"""The fast acceptance paths: one statement on PostgreSQL (in the caller's transaction, or in
autocommit for the API's single sends), the plain ORM path elsewhere, the same records either
way; business keys under real concurrency; NOTIFY after the commit; the email fast path; the
API key cache."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from email_validator import EmailNotValidError, validate_email
from flask import Flask
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from portal.extensions import db
from portal.messaging.records import acceptance, validation
from portal.messaging.records.validation import AcceptanceError, BusinessKeyConflict
from portal.models import (
    ApiKey,
    MailSendRecipient,
    MailSendRecord,
    MailTemplate,
    SendStatus,
    SmsSendRecord,
    Tenant,
)
from portal.tenancy import tenant_context
from tests.conftest import make_api_key, make_tenant
from tests.support.sweeps import examples

MAIL = {"to": ["ann@example.com"], "subject": "Hello", "text": "Hi Ann"}
FULL_MAIL = {
    "to": ["Ann@Example.COM", "bob@example.com"],
    "cc": ["carol@example.com", "CAROL@example.com"],
    "bcc": ["dave@example.com"],
    "replyTo": "support@example.com",
    "subject": "Your order",
    "html": "<p>Hi {{ name }}</p>",
    "text": "Hi {{ name }}",
    "templateCode": "order",
    "variables": {"name": "Ann", "items": [1, 2.5, None, True, {"a": "ü"}], "emoji": "😀"},
    "priority": 2,
    "attachments": [{"name": "a.txt", "contentType": "text/plain", "content": "aGk="}],
    "expiresAt": "2031-05-04T10:11:12.123456+02:00",
}
SMS = {"phoneNumber": "+447911123456", "content": "Your code is 1234"}

REQUEST_COLUMNS = [
    "tenant_id",
    "scope",
    "status",
    "version",
    "retry_count",
    "trace_id",
    "business_key",
    "request_hash",
    "template_id",
    "template_code",
    "variables",
    "expires_at",
    "next_retry_at",
    "prepared_at",
    "ambiguous_attempt",
]
MAIL_COLUMNS = [
    *REQUEST_COLUMNS,
    "to_addrs",
    "cc_addrs",
    "bcc_addrs",
    "reply_to",
    "subject",
    "html_body",
    "text_body",
    "server_id",
    "priority",
    "attachments",
    "read_receipt",
]
SMS_COLUMNS = [*REQUEST_COLUMNS, "phone_number", "country_code", "content"]


def cfg(app: Flask) -> Any:
    return app.config["SETTINGS"]


def count(model: Any) -> int:
    return db.session.scalar(select(func.count()).select_from(model)) or 0


def columns(record: Any, names: list[str]) -> dict[str, Any]:
    return {name: getattr(record, name) for name in names}


def recipients(record_id: int) -> list[tuple[str, str, int]]:
    rows = db.session.execute(
        select(
            MailSendRecipient.kind, MailSendRecipient.address, MailSendRecipient.tenant_id
        ).where(MailSendRecipient.record_id == record_id)
    )
    return sorted((kind, address, tenant) for kind, address, tenant in rows)


@pytest.fixture
def acme(app: Flask) -> int:
    tenant = make_tenant("acme")
    db.session.commit()
    return tenant.id


# --- the same records on every path ---------------------------------------------------------


def test_pg_statement_writes_what_the_orm_path_writes(app: Flask, acme: int) -> None:
    """The one-statement insert and the ORM path store the same columns and recipients."""
    # A send by templateCode needs an enabled template with that code.
    db.session.add(MailTemplate(tenant_id=acme, code="order", subject="Order", text_body="x"))
    db.session.commit()
    with tenant_context(acme, trace_id="trace0001"):
        req = validation.validate_mail(FULL_MAIL, cfg(app), acme)
        sms = validation.validate_sms(SMS | {"businessKey": "s1"}, cfg(app), acme)
        (orm,) = acceptance._write_orm(
            db.session,
            MailSendRecord,
            [req],
            acceptance._mail_record,
            acceptance._mail_recipients,
            "trace0001",
        )
        (orm_sms,) = acceptance._write_orm(
            db.session, SmsSendRecord, [sms], acceptance._sms_record, None, "trace0001"
        )
        db.session.commit()
        fast = acceptance.send_mail(db.session, FULL_MAIL, settings=cfg(app))
        db.session.commit()
        now = acceptance.send_mail_committed(db.session, FULL_MAIL, settings=cfg(app))
        fast_sms = acceptance.send_sms(db.session, SMS | {"businessKey": "s2"}, settings=cfg(app))
        db.session.commit()
    db.session.expire_all()
    records = [db.session.get(MailSendRecord, r.id) for r in (orm, fast, now)]
    assert all(r is not None for r in records)
    want = columns(records[0], MAIL_COLUMNS)
    assert want["to_addrs"] == ["Ann@example.com", "bob@example.com"]
    assert want["expires_at"].isoformat() == "2031-05-04T08:11:12.123456+00:00"
    assert want["variables"] == FULL_MAIL["variables"]
    first = records[0]
    assert first is not None
    for record in records[1:]:
        assert record is not None
        assert columns(record, MAIL_COLUMNS) == want
        assert record.created_time.tzinfo is not None
        assert recipients(record.id) == recipients(first.id)
    assert recipients(orm.id) == [
        ("bcc", "dave@example.com", acme),
        ("cc", "carol@example.com", acme),
        ("to", "ann@example.com", acme),
        ("to", "bob@example.com", acme),
    ]
    sms_records = [db.session.get(SmsSendRecord, r.id) for r in (orm_sms, fast_sms)]
    got = [columns(r, SMS_COLUMNS) for r in sms_records]
    assert got[0] | {"business_key": "s2", "request_hash": got[1]["request_hash"]} == got[1]
    assert got[1]["status"] == SendStatus.PENDING


def test_committed_send_commits_on_both_dialects(any_app: Flask) -> None:
    tenant = make_tenant("acme")
    db.session.commit()
    with tenant_context(tenant.id):
        mail = acceptance.send_mail_committed(db.session, MAIL, settings=cfg(any_app))
        sms = acceptance.send_sms_committed(db.session, SMS, settings=cfg(any_app))
        with pytest.raises(AcceptanceError) as caught:
            acceptance.send_mail_committed(db.session, MAIL | {"to": ["x"]}, settings=cfg(any_app))
    assert caught.value.field == "to[0]"
    db.session.rollback()  # nothing of the caller's to undo: the records are committed
    assert db.session.get(MailSendRecord, mail.id) is not None
    assert db.session.get(SmsSendRecord, sms.id) is not None
    assert recipients(mail.id) == [("to", "ann@example.com", tenant.id)]
    assert count(MailSendRecord) == 1


def test_committed_send_checks_template_and_server_in_the_tier(app: Flask, acme: int) -> None:
    with tenant_context(acme):
        for field in ("templateId", "serverId"):
            body = MAIL | {field: 123456}
            with pytest.raises(AcceptanceError) as caught:
                acceptance.send_mail_committed(db.session, body, settings=cfg(app))
            assert (caught.value.code, caught.value.field) == ("not_found", field)
    assert count(MailSendRecord) == 0


def test_nul_characters_are_refused_by_name(any_app: Flask) -> None:
    tenant = make_tenant("acme")
    db.session.commit()
    with tenant_context(tenant.id), pytest.raises(AcceptanceError) as caught:
        acceptance.send_mail(db.session, MAIL | {"subject": "a\x00b"}, settings=cfg(any_app))
    assert caught.value.field == "subject"


# --- business keys under concurrency ----------------------------------------------------------


@pytest.fixture
def holder(app: Flask, acme: int) -> Iterator[Session]:
    """A second session that can hold a business key uncommitted while a caller inserts."""
    own = Session(db.engine)
    yield own
    own.rollback()
    own.close()


def _in_thread(fn: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # returned to the test
            out.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def _hold_key(app: Flask, own: Session, acme: int, body: dict[str, Any]) -> acceptance.Accepted:
    with tenant_context(acme):
        return acceptance.send_mail(own, body, settings=cfg(app))


def _waiting(thread: threading.Thread) -> None:
    time.sleep(0.3)
    assert thread.is_alive()  # blocked on the unique index, as the ON CONFLICT waits


@pytest.mark.parametrize("path", ["transaction", "autocommit"])
def test_a_key_committed_meanwhile_makes_a_duplicate(
    app: Flask, acme: int, holder: Session, path: str
) -> None:
    keyed = MAIL | {"businessKey": "race"}
    first = _hold_key(app, holder, acme, keyed)

    def caller() -> acceptance.Accepted:
        with app.app_context(), tenant_context(acme):
            own = Session(db.engine)
            try:
                if path == "autocommit":
                    return acceptance.send_mail_committed(own, keyed, settings=cfg(app))
                result = acceptance.send_mail(own, keyed, settings=cfg(app))
                own.commit()
                return result
            finally:
                own.close()

    thread, out = _in_thread(caller)
    _waiting(thread)
    holder.commit()
    thread.join(20)
    assert out == [acceptance.Accepted(first.id, duplicate=True)]
    assert count(MailSendRecord) == 1


@pytest.mark.parametrize("path", ["transaction", "autocommit"])
def test_a_key_committed_meanwhile_for_another_request_is_a_conflict_writing_nothing(
    app: Flask, acme: int, holder: Session, path: str
) -> None:
    _hold_key(app, holder, acme, MAIL | {"businessKey": "race"})
    other = MAIL | {"businessKey": "race", "subject": "Something else"}

    def caller() -> Any:
        with app.app_context(), tenant_context(acme):
            own = Session(db.engine)
            try:
                own.add(Tenant(slug="callers-own-work", name="Caller"))
                own.flush()
                if path == "autocommit":
                    own.commit()
                    return acceptance.send_mail_committed(own, other, settings=cfg(app))
                try:
                    # A batch: its first item goes in, then the second's key is lost.
                    acceptance.send_mail_batch(
                        own, [MAIL | {"businessKey": "fresh"}, other], settings=cfg(app)
                    )
                except BusinessKeyConflict as exc:
                    own.commit()  # the caller's transaction is still usable
                    return exc
                return None
            finally:
                own.close()

    thread, out = _in_thread(caller)
    _waiting(thread)
    holder.commit()
    thread.join(20)
    assert len(out) == 1
    assert isinstance(out[0], BusinessKeyConflict), out
    assert out[0].field == "businessKey"
    assert out[0].index == (1 if path == "transaction" else None)
    keys = db.session.scalars(select(MailSendRecord.business_key)).all()
    assert keys == ["race"]  # the batch's first item was taken back
    assert count(MailSendRecipient) == 1
    assert db.session.scalar(select(Tenant.id).where(Tenant.slug == "callers-own-work"))


def test_a_key_released_by_a_rollback_is_ours(app: Flask, acme: int, holder: Session) -> None:
    keyed = MAIL | {"businessKey": "race"}
    _hold_key(app, holder, acme, keyed)

    def caller() -> acceptance.Accepted:
        with app.app_context(), tenant_context(acme):
            own = Session(db.engine)
            try:
                return acceptance.send_mail_committed(own, keyed, settings=cfg(app))
            finally:
                own.close()

    thread, out = _in_thread(caller)
    _waiting(thread)
    holder.rollback()
    thread.join(20)
    assert len(out) == 1
    assert out[0].duplicate is False
    assert db.session.get(MailSendRecord, out[0].id) is not None


def test_many_racing_api_callers_get_one_record(app: Flask, acme: int) -> None:
    keyed = MAIL | {"businessKey": "stampede"}
    barrier = threading.Barrier(6, timeout=20)

    def caller() -> acceptance.Accepted:
        with app.app_context(), tenant_context(acme):
            own = Session(db.engine)
            try:
                barrier.wait()
                return acceptance.send_mail_committed(own, keyed, settings=cfg(app))
            finally:
                own.close()

    runs = [_in_thread(caller) for _ in range(6)]
    for thread, _ in runs:
        thread.join(30)
    results = [out[0] for _, out in runs]
    assert all(isinstance(r, acceptance.Accepted) for r in results), results
    assert len({r.id for r in results}) == 1
    assert sorted(r.duplicate for r in results) == [False] + [True] * 5
    assert count(MailSendRecord) == 1


# --- NOTIFY after the commit ------------------------------------------------------------------


@pytest.fixture
def listener(app: Flask) -> Iterator[psycopg.Connection[Any]]:
    url = db.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"LISTEN {acceptance.NOTIFY_CHANNEL['mail']}")
        time.sleep(2 * acceptance.NOTIFY_INTERVAL_S)
        list(conn.notifies(timeout=0.2))  # anything left over from earlier tests
        yield conn


def _notified(conn: psycopg.Connection[Any], within: float) -> bool:
    return any(True for _ in conn.notifies(timeout=within, stop_after=1))


def test_notify_goes_out_after_the_commit_never_after_a_rollback(
    app: Flask, acme: int, listener: psycopg.Connection[Any]
) -> None:
    with tenant_context(acme):
        acceptance.send_mail(db.session, MAIL, settings=cfg(app))
        time.sleep(0.2)
        assert not _notified(listener, 0.1)  # not before the commit
        db.session.commit()
    assert _notified(listener, 2.0)
    with tenant_context(acme):
        acceptance.send_mail(db.session, MAIL, settings=cfg(app))
        db.session.rollback()
    assert not _notified(listener, 0.3)
    with tenant_context(acme):
        acceptance.send_mail_committed(db.session, MAIL, settings=cfg(app))
    assert _notified(listener, 2.0)


def test_notify_is_folded_under_load(app: Flask, acme: int) -> None:
    before = acceptance.NOTIFIER.sent
    with tenant_context(acme):
        for _ in range(60):
            acceptance.send_mail_committed(db.session, MAIL, settings=cfg(app))
    time.sleep(0.2)
    sent = acceptance.NOTIFIER.sent - before
    assert 1 <= sent < 60


# --- the email fast path ----------------------------------------------------------------------

ADDRESSES = [
    "ann@example.com",
    "Ann.Lee+tag@Example.COM",
    "POSTMASTER@example.com",
    "abuse@EXAMPLE.org",
    "a@xn--bcher-kva.example",
    "a@bücher.example",
    "jörg@example.com",
    '"quoted local"@example.com',
    "a@localhost",
    "a@nodot",
    "a@example.invalid",
    "a@123.456",
    "a..b@example.com",
    ".a@example.com",
    "a@-example.com",
    "a@example.com.",
    "Ann <ann@example.com>",
    "a@[127.0.0.1]",
    "x" * 64 + "@example.com",
    "x" * 65 + "@example.com",
    "x" * 200 + "@" + "d" * 50 + ".com",
    "a@" + ("d" * 63 + ".") * 3 + "com",
    "@example.com",
    "a@",
    "a@b@example.com",
]


def _reference(address: str) -> str | None:
    try:
        return validate_email(address, check_deliverability=False).normalized
    except EmailNotValidError:
        return None


def _ours(address: str) -> str | None:
    try:
        return validation._email(address, "to")
    except AcceptanceError:
        return None


@pytest.mark.parametrize("address", ADDRESSES)
def test_email_fast_path_agrees_with_email_validator(address: str) -> None:
    assert _ours(address) == (_reference(address) if len(address) <= 320 else None)


@settings(max_examples=examples(300), deadline=None)
@given(address=st.emails() | st.from_regex(r"\A[a-zA-Z0-9.+_-]{1,70}@[a-zA-Z0-9.-]{1,40}\Z"))
def test_email_fast_path_agrees_with_email_validator_on_generated_addresses(
    address: str,
) -> None:
    assert _ours(address) == (_reference(address) if len(address) <= 320 else None)


# --- the API key cache ------------------------------------------------------------------------


def test_a_revoked_key_stops_at_once_in_this_process(app: Flask, acme: int) -> None:
    token = make_api_key(acme)
    db.session.commit()
    client = app.test_client()
    headers = {"Authorization": f"Bearer {token}"}
    assert client.post("/api/v1/mail", json=MAIL, headers=headers).status_code == 202
    key = db.session.scalar(select(ApiKey).where(ApiKey.tenant_id == acme))
    assert key is not None
    key.revoked_at = func.now()  # as the portal's API keys page does
    db.session.commit()
    assert client.post("/api/v1/mail", json=MAIL, headers=headers).status_code == 401


def test_a_key_revoked_elsewhere_stops_within_the_cache_interval(app: Flask, acme: int) -> None:
    original = app.config["SETTINGS"]
    app.config["SETTINGS"] = original.replace(api_key_cache_s=0.5)
    try:
        token = make_api_key(acme)
        db.session.commit()
        client = app.test_client()
        headers = {"Authorization": f"Bearer {token}"}
        assert client.post("/api/v1/mail", json=MAIL, headers=headers).status_code == 202
        # Another process (no ORM event here): a bulk UPDATE of the row.
        db.session.execute(
            update(ApiKey).where(ApiKey.tenant_id == acme).values(revoked_at=func.now())
        )
        db.session.commit()
        assert client.post("/api/v1/mail", json=MAIL, headers=headers).status_code == 202
        time.sleep(0.6)
        assert client.post("/api/v1/mail", json=MAIL, headers=headers).status_code == 401
        db.session.execute(update(Tenant).where(Tenant.id == acme).values(is_active=False))
        db.session.commit()
        # off: every request asks the database
        app.config["SETTINGS"] = original.replace(api_key_cache_s=0)
        other = make_api_key(make_tenant("globex").id)
        db.session.commit()
        again = {"Authorization": f"Bearer {other}"}
        assert client.post("/api/v1/mail", json=MAIL, headers=again).status_code == 202
        db.session.execute(update(Tenant).where(Tenant.slug == "globex").values(is_active=False))
        db.session.commit()
        assert client.post("/api/v1/mail", json=MAIL, headers=again).status_code == 401
    finally:
        app.config["SETTINGS"] = original


@pytest.mark.parametrize("number", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_numbers_in_variables_are_refused_by_name(any_app: Flask, number: float) -> None:
    tenant = make_tenant("acme")
    db.session.commit()
    body = MAIL | {"variables": {"x": [number]}}
    with tenant_context(tenant.id), pytest.raises(AcceptanceError) as caught:
        acceptance.send_mail(db.session, body, settings=cfg(any_app))
    assert caught.value.field == "variables"


def test_a_request_between_a_revocation_and_its_commit_does_not_keep_the_key(
    app: Flask, acme: int
) -> None:
    """The portal sets revoked_at, an API request on another thread reads the still-valid row
    (and would cache it), then the revocation commits: the next request must be refused."""
    token = make_api_key(acme)
    db.session.commit()
    client = app.test_client()
    headers = {"Authorization": f"Bearer {token}"}
    assert client.post("/api/v1/mail", json=MAIL, headers=headers).status_code == 202
    with Session(db.engine) as revoker:
        key = revoker.scalar(select(ApiKey).where(ApiKey.tenant_id == acme))
        assert key is not None
        key.revoked_at = func.now()
        revoker.flush()  # sent, not committed: other requests still see the key valid
        assert client.post("/api/v1/mail", json=MAIL, headers=headers).status_code == 202
        revoker.commit()
    assert client.post("/api/v1/mail", json=MAIL, headers=headers).status_code == 401


@pytest.mark.parametrize(
    "body",
    [
        {"variables": {"a": "\x00"}},
        {"variables": {"\x00": 1}},
        {"variables": {"a": ["ok", {"b": "\ud800"}]}},
        {"text": "\ud800"},
        {"subject": "x\x00"},
    ],
    ids=["nul-value", "nul-name", "surrogate-nested", "surrogate-text", "nul-subject"],
)
def test_text_postgresql_cannot_hold_is_refused_by_field(
    app: Flask, acme: int, body: dict[str, Any]
) -> None:
    token = make_api_key(acme)
    db.session.commit()
    client = app.test_client()
    response = client.post(
        "/api/v1/mail",
        data=json.dumps(MAIL | body),  # json.dumps escapes them; Flask's test JSON would too
        content_type="application/json",
        headers={"Authorization": f"Bearer {token}"},
    )
    assert response.status_code == 422, response.get_data(as_text=True)
    assert response.get_json()["error"]["field"] == next(iter(body))
    assert db.session.scalar(select(func.count(MailSendRecord.id))) == 0


def test_batches_holding_the_same_keys_in_opposite_orders_do_not_deadlock(
    app: Flask, acme: int
) -> None:
    """Rows go in by business key, so two batches take the key locks in one order."""
    token = make_api_key(acme)
    db.session.commit()
    headers = {"Authorization": f"Bearer {token}"}
    statuses: list[int] = []
    for round_ in range(3):
        items = [MAIL | {"businessKey": f"r{round_}-k{i:03d}"} for i in range(200)]
        orders = [items, list(reversed(items))]
        barrier = threading.Barrier(2)

        def post(batch: list[dict[str, Any]], barrier: threading.Barrier = barrier) -> None:
            client = app.test_client()
            barrier.wait()
            response = client.post("/api/v1/mail/batch", json={"items": batch}, headers=headers)
            statuses.append(response.status_code)

        threads = [threading.Thread(target=post, args=(batch,)) for batch in orders]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert statuses == [202] * 6
    assert db.session.scalar(select(func.count(MailSendRecord.id))) == 600
