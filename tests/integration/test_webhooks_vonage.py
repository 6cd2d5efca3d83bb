"""Vonage's own signed webhooks, with signatures computed here the way Vonage computes them:
SMS API delivery receipts signed with ``sig`` (MD5 hash or an HMAC, with a signed timestamp
that must be recent), sent as a GET, a form POST or a JSON POST; and Messages API status
webhooks signed with an HS256 JWT bearing the body's SHA-256. Tampered, unsigned, wrongly
keyed and stale requests are refused with 401 and store nothing."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from typing import Any
from urllib.parse import urlencode

import pytest
from flask import Flask
from flask.testing import FlaskClient
from sqlalchemy import func, select

from portal.extensions import db
from portal.messaging.after_send import suppression
from portal.models import Channel, DeliveryEvent
from portal.web.machine.webhooks import VONAGE_MAX_SKEW_S, vonage_signature
from tests.conftest import make_tenant
from tests.support.after_send import UK, WEBHOOK_SECRET, sms_config, sms_row
from tests.support.sms import sms_record

PARAMS = {"a": "1", "b": "2", "timestamp": "1461605396"}


@pytest.mark.parametrize(
    ("method", "expected"),
    [
        # Vonage's own SDK's vectors (secret "secret").
        ("md5hash", "6af838ef94998832dbfc29020b564830"),
        ("md5", "c15c21ced558c93a226c305f58f902f2"),
        ("sha1", "3e19a4e6880fdc2c1426bfd0587c98b9532f0210"),
        ("sha256", "a321e824b9b816be7c3f28859a31749a098713d39f613c80d455bbaffae1cd24"),
        (
            "sha512",
            "812a18f76680fa0fe1b8bd9ee1625466ceb1bd96242e4d050d2cfd9a7b40166c"
            "63ed26ec9702168781b6edcf1633db8ff95af9341701004eec3fcf9550572ee8",
        ),
    ],
)
def test_the_sig_is_vonages(method: str, expected: str) -> None:
    assert vonage_signature("secret", PARAMS, method) == expected
    # "sig" itself is never signed, and & and = in values are signed as _.
    assert vonage_signature("secret", PARAMS | {"sig": "x"}, method) == expected
    odd = vonage_signature("secret", {"text": "a&b=c"}, method)
    assert odd == vonage_signature("secret", {"text": "a_b_c"}, method)


# --- SMS API delivery receipts ------------------------------------------------------------------


def receipt(message_id: str, status: str = "delivered", **fields: str) -> dict[str, str]:
    """A delivery receipt as the SMS API sends it (before signing)."""
    return {
        "msisdn": UK.lstrip("+"),
        "to": "Acme",
        "network-code": "23410",
        "messageId": message_id,
        "price": "0.03330000",
        "status": status,
        "scts": "2601011200",
        "err-code": "0",
        "api-key": "abcd1234",
        "message-timestamp": "2026-01-01 12:00:00",
    } | fields


def signed(
    params: dict[str, str],
    method: str = "sha256",
    secret: str = WEBHOOK_SECRET,
    at: float | None = None,
    upper: bool = False,
) -> dict[str, str]:
    """``params`` with a timestamp and nonce, signed as Vonage signs them."""
    stamped = params | {
        "timestamp": str(int(time.time() if at is None else at)),
        "nonce": hashlib.sha1(str(time.time_ns()).encode()).hexdigest()[:16],
    }
    sig = vonage_signature(secret, stamped, method)
    return stamped | {"sig": sig.upper() if upper else sig}


def events() -> int:
    db.session.expire_all()
    return db.session.scalar(select(func.count()).select_from(DeliveryEvent)) or 0


@pytest.fixture
def vonage(app: Flask) -> dict[str, Any]:
    tenant = make_tenant("acme")
    config = sms_config(tenant.id, "vonage")
    config.account_id = "abcd1234"  # the Vonage API key
    record = sms_row(tenant.id, config, provider_message_id="0A00000012345678")
    db.session.commit()
    return {"tenant": tenant.id, "config": config.id, "record": record.id}


def url(world: dict[str, Any]) -> str:
    return f"/webhooks/sms/vonage/{world['config']}"


def post_form(client: FlaskClient, world: dict[str, Any], params: dict[str, str]) -> Any:
    return client.post(url(world), data=params)


@pytest.mark.parametrize("method", ["md5hash", "md5", "sha1", "sha256", "sha512"])
def test_a_signed_receipt_is_accepted_whatever_the_dashboards_method(
    app: Flask, vonage: dict[str, Any], method: str
) -> None:
    client = app.test_client()
    response = post_form(client, vonage, signed(receipt("0A00000012345678"), method, upper=True))
    assert response.status_code == 200, response.get_data(as_text=True)
    assert response.json == {"stored": 1, "duplicates": 0, "matched": 1}
    row = sms_record(vonage["record"])
    assert row.delivery_outcome == "delivered"


def test_a_receipt_as_a_get_or_as_json_is_checked_the_same_way(
    app: Flask, vonage: dict[str, Any]
) -> None:
    client = app.test_client()
    query = urlencode(signed(receipt("0A00000012345678", status="accepted"), "md5hash"))
    got = client.get(f"{url(vonage)}?{query}")
    assert got.status_code == 200, got.get_data(as_text=True)
    assert got.json == {"stored": 1, "duplicates": 0, "matched": 1}
    body = signed(receipt("0A00000012345678"), "sha512")
    posted = client.post(url(vonage), json=body)
    assert posted.status_code == 200, posted.get_data(as_text=True)
    assert posted.json == {"stored": 1, "duplicates": 0, "matched": 1}
    assert sms_record(vonage["record"]).delivery_outcome == "delivered"
    # A tampered GET is refused like a tampered POST.
    tampered = signed(receipt("0A00000012345678", status="failed"), "md5hash")
    tampered["err-code"] = "9"
    assert client.get(f"{url(vonage)}?{urlencode(tampered)}").status_code == 401
    assert events() == 2


def test_tampered_unsigned_and_wrongly_keyed_receipts_are_refused(
    app: Flask, vonage: dict[str, Any]
) -> None:
    client = app.test_client()
    good = signed(receipt("0A00000012345678"))
    for name, params in [
        ("tampered status", good | {"status": "failed"}),
        ("tampered message id", good | {"messageId": "0A00000099999999"}),
        ("added field", good | {"err-code": "9"}),
        ("sig removed", {k: v for k, v in good.items() if k != "sig"}),
        ("sig empty", good | {"sig": ""}),
        ("sig of the wrong length", good | {"sig": good["sig"][:-2]}),
        ("another secret", signed(receipt("0A00000012345678"), secret="not-the-secret")),
    ]:
        response = post_form(client, vonage, params)
        assert response.status_code == 401, name
        assert response.json["error"]["field"] == "signature", name
    assert client.post(url(vonage), json=good | {"status": "failed"}).status_code == 401
    junk = client.post(url(vonage), data=b"\xff\xfe\x00", content_type="text/plain")
    assert junk.status_code == 401
    assert events() == 0
    assert sms_record(vonage["record"]).delivery_outcome is None


def test_a_stale_or_missing_timestamp_is_refused_even_when_the_sig_holds(
    app: Flask, vonage: dict[str, Any]
) -> None:
    client = app.test_client()
    now = time.time()
    for at in (now - VONAGE_MAX_SKEW_S - 60, now - 86_400, now + VONAGE_MAX_SKEW_S + 60):
        response = post_form(client, vonage, signed(receipt("0A00000012345678"), at=at))
        assert response.status_code == 401
        assert response.json["error"]["field"] == "timestamp"
        assert "seconds from now" in response.json["error"]["message"]
    # Signed without a timestamp at all: the signature holds, but it could be replayed forever.
    bare = receipt("0A00000012345678")
    bare["sig"] = vonage_signature(WEBHOOK_SECRET, bare, "sha256")
    response = post_form(client, vonage, bare)
    assert response.status_code == 401
    assert response.json["error"]["message"] == "the signed timestamp is missing"
    # Within the window: accepted.
    recent = signed(receipt("0A00000012345678"), at=now - VONAGE_MAX_SKEW_S + 30)
    assert post_form(client, vonage, recent).status_code == 200
    assert events() == 1


def test_a_receipt_sent_again_is_stored_once(app: Flask, vonage: dict[str, Any]) -> None:
    client = app.test_client()
    first = post_form(client, vonage, signed(receipt("0A00000012345678")))
    assert first.json == {"stored": 1, "duplicates": 0, "matched": 1}
    # Vonage retries with a new timestamp, nonce and so sig: still the same receipt.
    again = post_form(client, vonage, signed(receipt("0A00000012345678")))
    assert again.json == {"stored": 0, "duplicates": 1, "matched": 0}
    assert events() == 1


def test_a_signed_receipt_for_a_dead_number_fails_the_record_and_suppresses_it(
    app: Flask, vonage: dict[str, Any]
) -> None:
    params = signed(receipt("0A00000012345678", status="failed", **{"err-code": "9"}), "md5")
    response = post_form(app.test_client(), vonage, params)
    assert response.json == {"stored": 1, "duplicates": 0, "matched": 1}
    row = sms_record(vonage["record"])
    assert (row.status, row.delivery_outcome, row.error_code) == ("Failed", "bounced", "9")
    assert suppression.active(db.session, vonage["tenant"], Channel.SMS, UK) is not None


def test_another_configs_secret_does_not_sign_for_this_one(
    app: Flask, vonage: dict[str, Any]
) -> None:
    other_tenant = make_tenant("globex")
    other = sms_config(other_tenant.id, "vonage", name="globex-vonage")
    other.webhook_secret = "globex-signature-secret"
    db.session.commit()
    params = signed(receipt("0A00000012345678"), secret="globex-signature-secret")
    assert post_form(app.test_client(), vonage, params).status_code == 401
    # Accepted on its own config, where it matches nothing of acme's.
    response = app.test_client().post(f"/webhooks/sms/vonage/{other.id}", data=params)
    assert response.json == {"stored": 1, "duplicates": 0, "matched": 0}
    assert sms_record(vonage["record"]).delivery_outcome is None


def test_a_config_without_a_signature_secret_accepts_nothing(app: Flask) -> None:
    tenant = make_tenant("acme")
    config = sms_config(tenant.id, "vonage")
    config.webhook_secret = None
    db.session.commit()
    params = signed(receipt("0A00000012345678"))
    response = app.test_client().post(f"/webhooks/sms/vonage/{config.id}", data=params)
    assert response.status_code == 401


# --- Messages API: a JWT in the Authorization header -------------------------------------------


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def jwt(claims: dict[str, Any], secret: str = WEBHOOK_SECRET, alg: str = "HS256") -> str:
    header = b64url(json.dumps({"alg": alg, "typ": "JWT"}).encode())
    payload = b64url(json.dumps(claims).encode())
    signature = hmac.new(secret.encode(), f"{header}.{payload}".encode(), hashlib.sha256).digest()
    return f"{header}.{payload}.{b64url(signature)}"


def status_body(status: str = "delivered") -> bytes:
    return json.dumps(
        {
            "message_uuid": "0A00000012345678",
            "to": UK.lstrip("+"),
            "from": "Acme",
            "timestamp": "2026-01-01T12:00:00.000Z",
            "status": status,
            "channel": "sms",
        }
    ).encode()


def claims_for(body: bytes, **changes: Any) -> dict[str, Any]:
    return {
        "iat": int(time.time()),
        "jti": "c2b1f2b0-8f0e-4a4e-9f57-3d2a3c1e5b11",
        "iss": "Vonage",
        "payload_hash": hashlib.sha256(body).hexdigest(),
        "api_key": "abcd1234",
        "application_id": "aaaaaaaa-bbbb-cccc-dddd-0123456789ab",
    } | changes


def post_jwt(client: FlaskClient, world: dict[str, Any], body: bytes, token: str) -> Any:
    return client.post(
        url(world),
        data=body,
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
    )


def test_a_messages_api_status_signed_with_a_jwt_is_accepted(
    app: Flask, vonage: dict[str, Any]
) -> None:
    body = status_body()
    response = post_jwt(app.test_client(), vonage, body, jwt(claims_for(body)))
    assert response.status_code == 200, response.get_data(as_text=True)
    assert response.json == {"stored": 1, "duplicates": 0, "matched": 1}
    assert sms_record(vonage["record"]).delivery_outcome == "delivered"


def test_a_bad_jwt_is_refused(app: Flask, vonage: dict[str, Any]) -> None:
    client = app.test_client()
    body = status_body()
    stale = int(time.time()) - VONAGE_MAX_SKEW_S - 60
    for name, token, sent, field in [
        ("tampered body", jwt(claims_for(body)), status_body("rejected"), "signature"),
        ("another secret", jwt(claims_for(body), secret="nope"), body, "signature"),
        ("alg none", jwt(claims_for(body), alg="none"), body, "signature"),
        ("no payload hash", jwt(claims_for(body, payload_hash=None)), body, "signature"),
        ("another account", jwt(claims_for(body, api_key="zzzz9999")), body, "signature"),
        ("stale", jwt(claims_for(body, iat=stale)), body, "timestamp"),
        ("no iat", jwt(claims_for(body, iat=None)), body, "timestamp"),
        ("not a jwt", "abc.def", body, "signature"),
        ("junk", "a.b.c", body, "signature"),
    ]:
        response = post_jwt(client, vonage, sent, token)
        assert response.status_code == 401, name
        assert response.json["error"]["field"] == field, name
    # A signature made over the header and payload cannot be moved onto other claims.
    good = jwt(claims_for(body)).split(".")
    other = jwt(claims_for(status_body("rejected"))).split(".")
    spliced = f"{good[0]}.{other[1]}.{good[2]}"
    assert post_jwt(client, vonage, status_body("rejected"), spliced).status_code == 401
    assert events() == 0
