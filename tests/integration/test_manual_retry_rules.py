"""Manual retry rules: a resend window starts again, an expired record needs
a new expiresAt, an Uncertain record is never retried (it can be sent as a new message), a
record with an ambiguous attempt is retried only after a confirm step, a record whose frozen
provider is gone is requeued with its error code kept; Twilio/Vonage configs default to hold."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from flask import Flask
from sqlalchemy import func, select

from portal.extensions import db
from portal.importer import import_config
from portal.messaging.records.retry import EXPIRED_REASON, retry_records
from portal.models import SmsProviderConfig, SmsSendRecord
from tests.conftest import make_api_key, make_tenant
from tests.integration.test_portal_records import cheap_passwords, signed_in, sms, user
from tests.support import sms_provider as fake
from tests.support.delivery import sendable
from tests.support.sms import UK, accept_sms, drain_sms
from tests.support.sms_provider import FakeSmsProvider

__all__ = ["cheap_passwords"]
PAST = datetime(2020, 1, 1, tzinfo=UTC)


def _row(rid: int) -> SmsSendRecord:
    db.session.expire_all()
    row = db.session.get(SmsSendRecord, rid)
    assert row is not None
    return row


def test_a_record_stopped_by_its_resend_window_starts_a_new_one(app: Flask) -> None:
    acme = make_tenant("acme").id
    db.session.commit()
    rid = sms(
        acme,
        error_code="RETRY_WINDOW_EXPIRED",
        first_claimed_at=datetime.now(UTC) - timedelta(days=2),
        retry_count=3,
    )
    report = retry_records(db.session(), SmsSendRecord, [rid], acme)
    db.session.commit()
    assert report.requeued == [rid]
    row = _row(rid)
    assert (row.status, row.retry_count, row.first_claimed_at) == ("Retry", 4, None)
    assert row.error_code == "RETRY_WINDOW_EXPIRED"  # the last error stays until the next one


def test_another_failure_starts_a_new_window_too(app: Flask) -> None:
    acme = make_tenant("acme").id
    db.session.commit()
    started = datetime.now(UTC) - timedelta(hours=1)
    rid = sms(
        acme, error_code="CONFIG_NOT_RESOLVABLE", first_claimed_at=started, prepared_at=started
    )
    assert retry_records(db.session(), SmsSendRecord, [rid], acme).requeued == [rid]
    db.session.commit()
    row = _row(rid)
    # The signal preparation re-chooses the provider by: Retry, the code kept, still prepared.
    assert (row.status, row.error_code) == ("Retry", "CONFIG_NOT_RESOLVABLE")
    assert row.prepared_at is not None
    # Pressing Retry is a new decision, whatever the error: the next claim starts the window.
    assert row.first_claimed_at is None


def test_the_api_refuses_an_expired_record_without_a_new_expiry(app: Flask) -> None:
    acme = make_tenant("acme").id
    key = make_api_key(acme)
    db.session.commit()
    rid = sms(acme, error_code="EXPIRED", expires_at=PAST)
    client = app.test_client()
    auth = {"Authorization": f"Bearer {key}"}
    refused = client.post(f"/SmsSendRecord/retry?id={rid}", headers=auth)
    assert refused.status_code == 409
    assert refused.json["error"]["code"] == "expired"
    past = client.post(
        f"/SmsSendRecord/retry?id={rid}", headers=auth, json={"expiresAt": "2021-01-01T00:00:00Z"}
    )
    assert past.status_code == 422
    assert _row(rid).status == "Failed"
    later = (datetime.now(UTC) + timedelta(hours=2)).replace(microsecond=0)
    ok = client.post(
        f"/SmsSendRecord/retry?id={rid}",
        headers=auth,
        json={"expiresAt": later.isoformat().replace("+00:00", "Z")},
    )
    assert ok.status_code == 200, ok.json
    row = _row(rid)
    assert (row.status, row.expires_at) == ("Retry", later)
    many = client.post(
        "/SmsSendRecord/retryByIds", headers=auth, json={"ids": [sms(acme, expires_at=PAST)]}
    )
    assert many.json["skipped"][0]["reason"] == EXPIRED_REASON


def test_the_api_shows_ambiguity_and_never_retries_an_uncertain_record(app: Flask) -> None:
    acme = make_tenant("acme").id
    key = make_api_key(acme)
    db.session.commit()
    rid = sms(acme, status="Uncertain", ambiguous_attempt=True)
    plain = sms(acme)
    client = app.test_client()
    auth = {"Authorization": f"Bearer {key}"}
    assert client.get(f"/api/v1/sms/{rid}", headers=auth).json["ambiguous"] is True
    assert client.get(f"/api/v1/sms/{plain}", headers=auth).json["ambiguous"] is False
    assert client.post(f"/SmsSendRecord/retry?id={rid}", headers=auth).status_code == 409
    # Resolving it as failed keeps the ambiguity on record.
    resolved = client.post(
        f"/api/v1/sms/{rid}/resolve", headers=auth, json={"outcome": "failed", "reason": "no"}
    )
    assert resolved.status_code == 200
    assert client.get(f"/api/v1/sms/{rid}", headers=auth).json["ambiguous"] is True


def test_the_portal_asks_before_retrying_an_ambiguous_or_expired_record(
    app: Flask, cheap_passwords: None
) -> None:
    acme = make_tenant("acme").id
    db.session.commit()
    sendable(acme)  # nothing else stops a retry: it asks only for the risk it names
    user("admin@acme.example.com", "tenant_admin", acme)
    ambiguous = sms(acme, ambiguous_attempt=True)
    stale = sms(acme, error_code="EXPIRED", expires_at=PAST)
    client, token = signed_in(app, "admin@acme.example.com")
    page = client.post(f"/sms-records/{ambiguous}/retry", data={"csrf_token": token})
    assert page.status_code == 200
    assert "delivered twice" in page.text
    assert _row(ambiguous).status == "Failed"  # nothing happened yet
    done = client.post(
        f"/sms-records/{ambiguous}/retry", data={"csrf_token": token, "confirm": "yes"}
    )
    assert done.status_code == 302
    assert _row(ambiguous).status == "Retry"

    asked = client.post(f"/sms-records/{stale}/retry", data={"csrf_token": token})
    assert 'name="expiresAt"' in asked.text
    bad = client.post(
        f"/sms-records/{stale}/retry",
        data={"csrf_token": token, "confirm": "yes", "expiresAt": "2020-01-01T00:00"},
    )
    assert bad.status_code == 422
    later = (datetime.now(UTC) + timedelta(days=1)).strftime("%Y-%m-%dT%H:%M")
    ok = client.post(
        f"/sms-records/{stale}/retry",
        data={"csrf_token": token, "confirm": "yes", "expiresAt": later},
    )
    assert ok.status_code == 302
    row = _row(stale)
    assert row.status == "Retry"
    assert row.expires_at is not None
    assert row.expires_at > datetime.now(UTC)


def test_an_uncertain_record_is_sent_again_as_a_new_message(
    app: Flask, cheap_passwords: None
) -> None:
    acme = make_tenant("acme").id
    db.session.commit()
    user("admin@acme.example.com", "tenant_admin", acme)
    user("support@acme.example.com", "support", acme)
    rid = accept_sms(app, acme, businessKey="order-7")
    db.session.execute(
        SmsSendRecord.__table__.update()
        .where(SmsSendRecord.id == rid)
        .values(status="Uncertain", ambiguous_attempt=True)
    )
    db.session.commit()
    client, token = signed_in(app, "admin@acme.example.com")
    shown = client.get(f"/sms-records/{rid}")
    assert "Send as a new message" in shown.text
    support, support_token = signed_in(app, "support@acme.example.com")
    assert (
        support.post(f"/sms-records/{rid}/resend", data={"csrf_token": support_token}).status_code
        == 403
    )
    asked = client.post(f"/sms-records/{rid}/resend", data={"csrf_token": token})
    assert asked.status_code == 200
    assert "twice" in asked.text
    assert db.session.scalar(select(func.count()).select_from(SmsSendRecord)) == 1
    done = client.post(f"/sms-records/{rid}/resend", data={"csrf_token": token, "confirm": "yes"})
    assert done.status_code == 303
    new_id = int(done.headers["Location"].rstrip("/").rsplit("/", 1)[1])
    new = _row(new_id)
    old = _row(rid)
    assert (new.status, new.phone_number, new.content) == ("Pending", old.phone_number, old.content)
    assert new.business_key != "order-7"
    assert new.business_key.startswith("order-7:resend-")
    assert (old.status, old.ambiguous_attempt) == ("Uncertain", True)


def test_new_twilio_and_vonage_providers_hold_and_keyed_ones_retry(
    app: Flask, cheap_passwords: None
) -> None:
    acme = make_tenant("acme").id
    db.session.commit()
    user("admin@acme.example.com", "tenant_admin", acme)
    client, token = signed_in(app, "admin@acme.example.com")
    for name, kind in (("tw", "twilio"), ("gw", "http_json")):
        response = client.post(
            "/sms-providers/",
            data={
                "csrf_token": token,
                "name": name,
                "provider": kind,
                "base_url": "http://127.0.0.1:9/",
                "enabled": "on",
            },
        )
        assert response.status_code in (302, 303), response.text[:2000]
    policies = dict(
        db.session.execute(select(SmsProviderConfig.name, SmsProviderConfig.uncertain_policy)).all()
    )
    assert policies == {"tw": "hold", "gw": "retry"}
    listed = client.get("/sms-providers/").text
    assert "No idempotency key" in listed
    assert "Dedupes by idempotency key" in listed

    config = {
        "smsProviders": [
            {"tenant": "acme", "name": "vn", "provider": "vonage"},
            {"tenant": "acme", "name": "tw2", "provider": "twilio", "uncertainPolicy": "retry"},
            {"tenant": "acme", "name": "gw2", "provider": "http_json", "baseUrl": "http://x/"},
        ]
    }
    import_config(db.session(), config)
    db.session.commit()
    policies = dict(
        db.session.execute(select(SmsProviderConfig.name, SmsProviderConfig.uncertain_policy)).all()
    )
    assert (policies["vn"], policies["tw2"], policies["gw2"]) == ("hold", "retry", "retry")


def test_a_twilio_provider_that_hangs_ends_uncertain_after_one_request(
    app: Flask, cheap_passwords: None
) -> None:
    acme = make_tenant("acme").id
    db.session.commit()
    user("admin@acme.example.com", "tenant_admin", acme)
    client, token = signed_in(app, "admin@acme.example.com")
    with FakeSmsProvider(hang_s=2.0) as server:
        # A new Twilio config from the portal, no policy chosen: it holds.
        response = client.post(
            "/sms-providers/",
            data={
                "csrf_token": token,
                "name": "twilio",
                "provider": "twilio",
                "base_url": server.base_url,
                "account_id": fake.TWILIO_SID,
                "secret": fake.TWILIO_TOKEN,
                "sender_id": "+15005550006",
                "is_default": "on",
                "enabled": "on",
            },
        )
        assert response.status_code in (302, 303), response.text[:2000]
        server.script(UK, "hang")
        rid = accept_sms(app, acme)
        drain_sms(app, read_timeout_s=0.3)
        row = _row(rid)
        assert (row.status, row.ambiguous_attempt) == ("Uncertain", True)
        assert len(server.requests) == 1
