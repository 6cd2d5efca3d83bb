"""Provider delivery events through the webhooks: signatures, replays, correlation by route,
provider id and recipient, outcomes that never downgrade, and events that come early."""

from __future__ import annotations

import json

from flask import Flask
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select

from portal.extensions import db
from portal.messaging.after_send import suppression
from portal.messaging.sending.outcomes import Claimed
from portal.messaging.sending.sent_write import record_sent
from portal.models import Channel, DeliveryEvent, SendStatus
from tests.conftest import make_tenant
from tests.support.after_send import (
    UK,
    mail_config,
    mail_row,
    post_generic,
    post_mail,
    post_twilio,
    sms_config,
    sms_row,
)
from tests.support.sms import sms_record
from tests.support.sweeps import examples


def _events() -> int:
    return db.session.scalar(select(func.count()).select_from(DeliveryEvent)) or 0


def test_a_twilio_callback_is_verified_and_records_delivery(app: Flask) -> None:
    tenant = make_tenant("acme")
    config = sms_config(tenant.id, "twilio")
    record = sms_row(tenant.id, config, provider_message_id="SM123")
    db.session.commit()
    client = app.test_client()
    params = {"MessageSid": "SM123", "MessageStatus": "delivered", "To": UK, "AccountSid": "AC1"}

    bad = post_twilio(client, config.id, params, token="wrong")
    assert bad.status_code == 401
    assert _events() == 0

    ok = post_twilio(client, config.id, params)
    assert ok.status_code == 200, ok.get_data(as_text=True)
    assert ok.json == {"stored": 1, "duplicates": 0, "matched": 1}
    row = sms_record(record.id)
    assert row.delivery_outcome == "delivered"
    assert row.status == SendStatus.SENT.value

    replay = post_twilio(client, config.id, params)
    assert replay.status_code == 200
    assert replay.json == {"stored": 0, "duplicates": 1, "matched": 0}
    assert _events() == 1


def test_unknown_configs_and_mismatched_providers_are_404(app: Flask) -> None:
    tenant = make_tenant("acme")
    config = sms_config(tenant.id, "http_json")
    db.session.commit()
    client = app.test_client()
    event = {"eventId": "e1", "messageId": "m1", "event": "delivered"}
    assert post_generic(client, "sms", "http_json", config.id + 1000, event).status_code == 404
    assert post_generic(client, "sms", "twilio", config.id, event).status_code == 404
    assert post_generic(client, "sms", "http_json", 2**70, event).status_code == 404
    assert post_generic(client, "mail", "other", config.id, event).status_code == 404
    assert post_generic(client, "sms", "http_json", config.id, event, "nope").status_code == 401


def test_an_unknown_message_id_is_kept_and_applied_when_the_id_is_written(app: Flask) -> None:
    tenant = make_tenant("acme")
    config = sms_config(tenant.id)
    record = sms_row(tenant.id, config, status="Sending", version=3)
    db.session.commit()
    client = app.test_client()
    early = {"eventId": "e-early", "messageId": "gw-77", "recipient": UK, "event": "delivered"}
    response = post_generic(client, "sms", "http_json", config.id, early)
    assert response.status_code == 200
    assert response.json == {"stored": 1, "duplicates": 0, "matched": 0}
    stored = db.session.scalar(select(DeliveryEvent))
    assert stored is not None
    assert stored.record_id is None

    claimed = Claimed(Channel.SMS, record.id, 3, tenant.id, 0, "http_json")
    assert record_sent(db.engine, claimed, "gw-77")
    row = sms_record(record.id)
    assert row.status == SendStatus.SENT.value
    assert row.delivery_outcome == "delivered"
    db.session.expire_all()
    stored = db.session.scalar(select(DeliveryEvent))
    assert stored is not None
    assert stored.record_id == record.id
    assert stored.applied_at is not None


def test_outcomes_never_downgrade_and_a_bounce_fails_and_suppresses(app: Flask) -> None:
    tenant = make_tenant("acme")
    config = mail_config(tenant.id)
    complained = mail_row(tenant.id, config, provider_message_id="<mail-1@x>")
    bounced = mail_row(
        tenant.id, config, provider_message_id="<mail-2@x>", to_addrs=["bob@example.com"]
    )
    db.session.commit()
    client = app.test_client()
    post = lambda e: post_mail(app, client, config.id, e)  # noqa: E731
    assert post({"eventId": "1", "messageId": "<mail-1@x>", "event": "complained"}).json == {
        "stored": 1,
        "duplicates": 0,
        "matched": 1,
    }
    post({"eventId": "2", "messageId": "<mail-1@x>", "event": "bounced", "code": "550 5.1.1"})
    post({"eventId": "3", "messageId": "<mail-1@x>", "event": "delivered"})
    db.session.expire_all()
    assert db.session.get(type(complained), complained.id).delivery_outcome == "complained"  # type: ignore[union-attr]
    assert suppression.active(db.session, tenant.id, Channel.MAIL, "ann@example.com") is not None

    post({"eventId": "4", "messageId": "<mail-2@x>", "event": "delivered"})
    post(
        {
            "eventId": "5",
            "messageId": "<mail-2@x>",
            "recipient": "Bob@Example.com",
            "event": "bounced",
            "bounceType": "permanent",
            "code": "550 5.1.1",
            "description": "user unknown",
        }
    )
    post({"eventId": "6", "messageId": "<mail-2@x>", "event": "delivered"})
    db.session.expire_all()
    row = db.session.get(type(bounced), bounced.id)
    assert row is not None
    assert (row.status, row.error_code, row.delivery_outcome) == ("Failed", "550 5.1.1", "bounced")
    assert row.bounce_code == "550 5.1.1"
    blocked = suppression.active(db.session, tenant.id, Channel.MAIL, "bob@example.com")
    assert blocked is not None
    assert blocked.reason == "hard_bounce"


def test_a_temporary_bounce_is_recorded_only(app: Flask) -> None:
    tenant = make_tenant("acme")
    config = mail_config(tenant.id)
    record = mail_row(tenant.id, config, provider_message_id="<mail-9@x>")
    db.session.commit()
    event = {"eventId": "t", "messageId": "<mail-9@x>", "event": "bounced", "bounceType": "soft"}
    assert post_mail(app, app.test_client(), config.id, event).status_code == 200
    db.session.expire_all()
    row = db.session.get(type(record), record.id)
    assert row is not None
    assert row.status == "Sent"
    assert row.delivery_outcome is None
    assert suppression.active(db.session, tenant.id, Channel.MAIL, "ann@example.com") is None


def test_correlation_needs_the_route_and_the_recipient(app: Flask) -> None:
    tenant = make_tenant("acme")
    config, other = sms_config(tenant.id), sms_config(tenant.id, name="other")
    record = sms_row(tenant.id, config, provider_message_id="gw-1")
    db.session.commit()
    client = app.test_client()
    wrong_route = {"eventId": "a", "messageId": "gw-1", "event": "delivered"}
    assert post_generic(client, "sms", "http_json", other.id, wrong_route).json["matched"] == 0
    wrong_to = {"eventId": "b", "messageId": "gw-1", "event": "delivered", "recipient": "+15"}
    assert post_generic(client, "sms", "http_json", config.id, wrong_to).json["matched"] == 0
    assert sms_record(record.id).delivery_outcome is None
    batch = [
        {"eventId": "c", "messageId": "gw-1", "event": "delivered", "recipient": UK},
        {"eventId": "d", "messageId": "nobody", "event": "delivered"},
    ]
    assert post_generic(client, "sms", "http_json", config.id, batch).json == {
        "stored": 2,
        "duplicates": 0,
        "matched": 1,
    }
    assert sms_record(record.id).delivery_outcome == "delivered"


def test_a_vonage_receipt_for_a_dead_number_fails_and_suppresses_it(app: Flask) -> None:
    tenant = make_tenant("acme")
    config = sms_config(tenant.id, "vonage")
    record = sms_row(tenant.id, config, provider_message_id="0A0000001")
    db.session.commit()
    receipt = {
        "messageId": "0A0000001",
        "msisdn": UK.lstrip("+"),
        "status": "failed",
        "err-code": "9",
        "message-timestamp": "2026-01-01 12:00:00",
    }
    response = post_generic(app.test_client(), "sms", "vonage", config.id, receipt)
    assert response.json == {"stored": 1, "duplicates": 0, "matched": 1}
    row = sms_record(record.id)
    assert (row.status, row.delivery_outcome, row.error_code) == ("Failed", "bounced", "9")
    assert suppression.active(db.session, tenant.id, Channel.SMS, UK) is not None


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.sampled_from(
                ["eventId", "messageId", "event", "recipient", "timestamp", "status", "msisdn", "x"]
            ),
            inner,
            max_size=6,
        )
    ),
    max_leaves=12,
).map(lambda v: json.dumps(v).encode())


def test_junk_is_never_a_500(app: Flask) -> None:
    tenant = make_tenant("junk")
    configs = {kind: sms_config(tenant.id, kind).id for kind in ("http_json", "vonage", "twilio")}
    mail = mail_config(tenant.id).id
    db.session.commit()
    client = app.test_client()

    @given(body=st.one_of(st.binary(max_size=300), _JSON))
    @settings(max_examples=examples(150), deadline=None, suppress_health_check=list(HealthCheck))
    def check(body: bytes) -> None:
        for provider, config_id in configs.items():
            signed = post_generic(client, "sms", provider, config_id, body)
            assert signed.status_code < 500, signed.get_data(as_text=True)
            unsigned = client.post(f"/webhooks/sms/{provider}/{config_id}", data=body)
            assert unsigned.status_code == 401
        assert post_mail(app, client, mail, body).status_code < 500

    check()
