"""The Messages API webhook's JWT, checked by PyJWT with HS256 pinned: tokens that name another
algorithm (none, HS512, RS256), lack a required claim, carry a hash of another body or an
``iat`` outside the leeway are refused with 401 and store nothing; a token that holds is
accepted (the webhook tests in test_webhooks_vonage.py cover the rest of the scheme)."""

from __future__ import annotations

import hashlib
import time
from typing import Any

import jwt as pyjwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from flask import Flask
from flask.testing import FlaskClient
from sqlalchemy import func, select

from portal.extensions import db
from portal.models import DeliveryEvent
from portal.web.machine.webhooks import VONAGE_MAX_SKEW_S, vonage_jwt_problem
from tests.conftest import make_tenant
from tests.integration.test_webhooks_vonage import b64url, claims_for, status_body
from tests.support.after_send import WEBHOOK_SECRET, sms_config, sms_row

# Vonage picks the secret's length; PyJWT's advice about short HMAC keys is not ours to act on.
pytestmark = pytest.mark.filterwarnings("ignore::jwt.InsecureKeyLengthWarning")

ACCOUNT = "abcd1234"


@pytest.fixture
def world(app: Flask) -> dict[str, Any]:
    tenant = make_tenant("acme")
    config = sms_config(tenant.id, "vonage")
    config.account_id = ACCOUNT
    sms_row(tenant.id, config, provider_message_id="0A00000012345678")
    db.session.commit()
    return {"config": config.id}


def token(claims: dict[str, Any], key: Any = WEBHOOK_SECRET, alg: str = "HS256") -> str:
    return pyjwt.encode(claims, key, algorithm=alg)


def post(client: FlaskClient, world: dict[str, Any], body: bytes, bearer: str) -> Any:
    return client.post(
        f"/webhooks/sms/vonage/{world['config']}",
        data=body,
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {bearer}"},
    )


def events() -> int:
    return db.session.scalar(select(func.count()).select_from(DeliveryEvent)) or 0


def rsa_pem() -> bytes:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def test_only_hs256_is_accepted(app: Flask, world: dict[str, Any]) -> None:
    body = status_body()
    claims = claims_for(body)
    client = app.test_client()
    none_header = b64url(b'{"alg":"none","typ":"JWT"}')
    unsigned = f"{none_header}.{token(claims).split('.')[1]}."
    for name, bearer in [
        ("alg none", token(claims, key=None, alg="none")),
        ("alg none, empty signature by hand", unsigned),
        ("HS512 with the right secret", token(claims, alg="HS512")),
        ("HS384 with the right secret", token(claims, alg="HS384")),
        ("RS256", token(claims, key=rsa_pem(), alg="RS256")),
    ]:
        response = post(client, world, body, bearer)
        assert response.status_code == 401, name
        assert response.json["error"]["field"] == "signature", name
    assert events() == 0
    assert post(client, world, body, token(claims)).status_code == 200


def test_an_hs256_signature_under_another_header_is_refused(
    app: Flask, world: dict[str, Any]
) -> None:
    """The HMAC of an HS256 token moved under a header that says HS512 (or none) fails."""
    body = status_body()
    _, payload, signature = token(claims_for(body)).split(".")
    for alg in ("HS512", "none", "RS256"):
        header = b64url(f'{{"alg":"{alg}","typ":"JWT"}}'.encode())
        response = post(app.test_client(), world, body, f"{header}.{payload}.{signature}")
        assert response.status_code == 401, alg
    assert events() == 0


@pytest.mark.parametrize(
    ("missing", "field"),
    [("iat", "timestamp"), ("payload_hash", "signature")],
)
def test_a_token_without_a_required_claim_is_refused(
    app: Flask, world: dict[str, Any], missing: str, field: str
) -> None:
    body = status_body()
    claims = {k: v for k, v in claims_for(body).items() if k != missing}
    response = post(app.test_client(), world, body, token(claims))
    assert response.status_code == 401
    assert response.json["error"]["field"] == field
    assert events() == 0


def test_a_tampered_payload_hash_is_refused(app: Flask, world: dict[str, Any]) -> None:
    body = status_body()
    client = app.test_client()
    other = hashlib.sha256(status_body("rejected")).hexdigest()
    for name, value in [
        ("another body's hash", other),
        ("one digit changed", hashlib.sha256(body).hexdigest()[:-1] + "0"),
        ("not a string", 12345),
        ("empty", ""),
    ]:
        response = post(client, world, body, token(claims_for(body, payload_hash=value)))
        assert response.status_code == 401, name
        assert response.json["error"]["field"] == "signature", name
    assert events() == 0


def test_iat_has_a_leeway_both_ways_and_no_more(app: Flask, world: dict[str, Any]) -> None:
    body = status_body()
    client = app.test_client()
    now = int(time.time())
    for name, iat in [
        ("an hour ahead", now + 3600),
        ("just past the leeway ahead", now + VONAGE_MAX_SKEW_S + 60),
        ("just past the leeway behind", now - VONAGE_MAX_SKEW_S - 60),
        ("not a number", "yesterday"),
    ]:
        response = post(client, world, body, token(claims_for(body, iat=iat)))
        assert response.status_code == 401, name
        assert response.json["error"]["field"] == "timestamp", name
    assert events() == 0
    # A clock a minute ahead of ours is within the leeway.
    assert post(client, world, body, token(claims_for(body, iat=now + 60))).status_code == 200


def test_the_account_and_expiry_are_checked_on_top() -> None:
    body = status_body()
    good = claims_for(body)
    assert vonage_jwt_problem(WEBHOOK_SECRET, token(good), body, ACCOUNT) is None
    assert vonage_jwt_problem(WEBHOOK_SECRET, f"  {token(good)} ", body, ACCOUNT) is None
    wrong = vonage_jwt_problem(WEBHOOK_SECRET, token(good | {"api_key": "x"}), body, ACCOUNT)
    assert wrong == "the token was signed for another Vonage account"
    expired = token(good | {"exp": int(time.time()) - VONAGE_MAX_SKEW_S - 60})
    assert vonage_jwt_problem(WEBHOOK_SECRET, expired, body, ACCOUNT) is not None
    # No secret stored: nothing verifies.
    assert vonage_jwt_problem(None, token(good), body, ACCOUNT) is not None
    assert vonage_jwt_problem("", token(good), body, ACCOUNT) is not None
