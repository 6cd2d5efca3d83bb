"""Edges of tenant isolation that a review found: a shared platform route
naming another tenant's record, operators' addresses shown to tenants, the invitation link's
host, the API showing platform-tier ids, a deactivated tenant's people, and three 500s."""

from __future__ import annotations

from typing import Any

import pytest
from flask import Flask
from sqlalchemy import select

from portal.extensions import db
from portal.models import ApiKey, MailSendRecord, MailSendServerConfig, Tenant
from portal.tenancy import PLATFORM_TENANT_ID
from tests.conftest import make_api_key, make_tenant
from tests.integration.test_portal_records import signed_in, user
from tests.integration.test_portal_templates import Portal
from tests.support.after_send import mail_row

OPERATOR = "hidden-operator@postroom.test"
ADMIN = "admin@acme.test"


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def world(app: Flask) -> dict[str, Any]:
    acme, globex = make_tenant("acme").id, make_tenant("globex").id
    server = MailSendServerConfig(
        tenant_id=PLATFORM_TENANT_ID, name="platform-relay", host="127.0.0.1", port=1
    )
    db.session.add(server)
    db.session.flush()
    keys = {"acme": make_api_key(acme, "acme-app"), "platform": make_api_key(PLATFORM_TENANT_ID)}
    db.session.commit()
    user(OPERATOR, "platform_operator", PLATFORM_TENANT_ID)
    user(ADMIN, "tenant_admin", acme)
    return {"acme": acme, "globex": globex, "server": server.id, "keys": keys}


def test_a_shared_platform_route_never_names_another_tenants_record(
    app: Flask, world: dict[str, Any]
) -> None:
    """Both records went out through the platform tier's server: a clash of provider ids
    is refused without naming (or confirming) the other tenant's record."""
    server = db.session.get(MailSendServerConfig, world["server"])
    theirs = mail_row(world["globex"], server, provider_message_id="globex-pid", scope="PLATFORM")
    mine = mail_row(world["acme"], server, provider_message_id="acme-pid", scope="PLATFORM")
    uncertain = mail_row(world["acme"], server, status="Uncertain", ambiguous_attempt=True)
    db.session.commit()
    client = app.test_client()
    for pid, own in (("globex-pid", False), ("acme-pid", True)):
        answer = client.post(
            f"/api/v1/mail/{uncertain.id}/resolve",
            json={"outcome": "accepted", "providerMessageId": pid},
            headers=auth(world["keys"]["acme"]),
        )
        assert answer.status_code == 409, answer.json
        message = answer.json["error"]["message"]  # type: ignore[index]
        assert str(theirs.id) not in message.replace(f"record {mine.id}", "")
        assert (f"record {mine.id}" in message) is own


def test_a_resolve_with_a_nul_character_is_422_naming_the_field(
    app: Flask, world: dict[str, Any]
) -> None:
    uncertain = mail_row(world["acme"], None, status="Uncertain", ambiguous_attempt=True)
    db.session.commit()
    for body, field in (
        ({"outcome": "failed", "reason": "a\u0000b"}, "reason"),
        ({"outcome": "accepted", "providerMessageId": "p\u0000"}, "providerMessageId"),
    ):
        answer = app.test_client().post(
            f"/api/v1/mail/{uncertain.id}/resolve", json=body, headers=auth(world["keys"]["acme"])
        )
        assert answer.status_code == 422, answer.json
        assert answer.json["error"]["field"] == field  # type: ignore[index]
    db.session.expire_all()
    assert db.session.get(MailSendRecord, uncertain.id).status == "Uncertain"  # type: ignore[union-attr]


def test_the_api_shows_a_tenant_no_platform_tier_ids(app: Flask, world: dict[str, Any]) -> None:
    server = db.session.get(MailSendServerConfig, world["server"])
    record = mail_row(world["acme"], server, scope="PLATFORM")
    db.session.commit()
    client = app.test_client()
    seen = client.get(f"/api/v1/mail/{record.id}", headers=auth(world["keys"]["acme"])).json
    assert seen is not None
    assert seen["serverId"] is None
    assert seen["templateId"] is None
    as_platform = client.get(
        f"/api/v1/mail/{record.id}?tenantId={world['acme']}",
        headers=auth(world["keys"]["platform"]),
    ).json
    assert as_platform is not None
    assert as_platform["serverId"] == world["server"]


def test_an_operators_address_never_reaches_a_tenants_pages(
    app: Flask, world: dict[str, Any]
) -> None:
    """A key and a suppression an operator made while viewing acme name "a platform
    operator" to acme's admin; the operator still sees the address."""
    operator = Portal(app, OPERATOR)
    chosen = operator.post("/tenants/view", {"tenant": str(world["acme"])})
    assert chosen.status_code == 302
    created = operator.post("/api-keys/", {"name": "made-by-op", "scope": ["send", "read"]})
    assert created.status_code == 200, created.text
    key = db.session.scalar(select(ApiKey).where(ApiKey.name == "made-by-op"))
    assert key is not None
    assert key.created_by == OPERATOR
    admin = Portal(app, ADMIN)
    page = admin.get("/api-keys/").text
    assert "made-by-op" in page
    assert OPERATOR not in page
    assert "a platform operator" in page
    assert OPERATOR in operator.get("/api-keys/").text


def test_an_invitation_link_uses_the_public_base_url_not_the_requests_host(
    pg_app: Flask, world: dict[str, Any]
) -> None:
    settings = pg_app.config["SETTINGS"]
    pg_app.config["SETTINGS"] = settings.replace(public_base_url="https://portal.example.com")
    try:
        admin = Portal(pg_app, ADMIN)
        # The same browser session, sent to a Host header the client chose.
        cookie = admin.client.get_cookie("session")
        assert cookie is not None
        admin.client.set_cookie("session", cookie.value, domain="evil.example")
        answer = admin.client.post(
            "/users/",
            data={"email": "new@acme.example.com", "role": "support", "csrf_token": admin.token},
            base_url="http://evil.example",
        )
        assert answer.status_code == 200, answer.text
        assert "https://portal.example.com/users/accept/" in answer.text
        assert "evil.example" not in answer.text
        invitation = db.session.scalar(
            select(MailSendRecord).where(MailSendRecord.tenant_id == PLATFORM_TENANT_ID)
        )
        assert invitation is not None
        assert "https://portal.example.com/users/accept/" in (invitation.text_body or "")
        assert "evil.example" not in (invitation.text_body or "")
    finally:
        pg_app.config["SETTINGS"] = settings


def test_an_operators_invitation_mail_does_not_name_the_operator(
    app: Flask, world: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = app.config["SETTINGS"].replace(public_base_url="https://portal.example.com")
    monkeypatch.setitem(app.config, "SETTINGS", settings)
    operator = Portal(app, OPERATOR)
    operator.post("/tenants/view", {"tenant": str(world["acme"])})
    answer = operator.post("/users/", {"email": "newbie@acme.example.com", "role": "support"})
    assert answer.status_code == 200, answer.text
    invitation = db.session.scalar(
        select(MailSendRecord).where(MailSendRecord.tenant_id == PLATFORM_TENANT_ID)
    )
    assert invitation is not None
    assert OPERATOR not in (invitation.text_body or "")
    assert "A platform operator has invited you" in (invitation.text_body or "")


def test_a_deactivated_tenants_people_are_signed_out_and_cannot_sign_in(
    app: Flask, world: dict[str, Any]
) -> None:
    client, _token = signed_in(app, ADMIN)
    assert client.get("/").status_code == 200
    tenant = db.session.get(Tenant, world["acme"])
    assert tenant is not None
    tenant.is_active = False
    db.session.commit()
    assert client.get("/").status_code == 302
    with pytest.raises(AssertionError):
        signed_in(app, ADMIN)  # its sign-in is refused like a wrong password (422, not 302)


@pytest.mark.parametrize(
    "url",
    [
        "/audit/?to=9999-12-31",
        "/audit/?from=9999-12-31&to=9999-12-31",
        "/mail-records/?to=9999-12-31",
    ],
)
def test_the_last_day_of_the_calendar_is_a_date_like_any_other(
    app: Flask, world: dict[str, Any], url: str
) -> None:
    client, _token = signed_in(app, ADMIN)
    assert client.get(url).status_code == 200


def test_a_nul_in_the_sign_in_address_is_a_422_with_nothing_checked(
    app: Flask, world: dict[str, Any]
) -> None:
    client, token = signed_in(app, None)
    answer = client.post(
        "/auth/login", data={"email": "admin\x00@acme.test", "password": "x", "csrf_token": token}
    )
    assert answer.status_code == 422


def test_signing_out_clears_the_whole_session(app: Flask, world: dict[str, Any]) -> None:
    client, token = signed_in(app, ADMIN)
    with client.session_transaction() as session:
        session["view_tenant"] = world["globex"]  # anything a session carries
    assert client.post("/auth/logout", data={"csrf_token": token}).status_code == 302
    with client.session_transaction() as session:
        assert set(session.keys()) <= {"_remember", "_flashes"}


def test_a_query_parameter_the_api_does_not_take_is_refused_naming_it(
    app: Flask, world: dict[str, Any]
) -> None:
    """A misspelt ``tenantID`` must not quietly act on the caller's own tenant."""
    record = mail_row(world["acme"], None)
    db.session.commit()
    client = app.test_client()
    headers = auth(world["keys"]["platform"])
    answer = client.get(f"/api/v1/mail/{record.id}?tenantID={world['acme']}", headers=headers)
    assert answer.status_code == 422
    assert answer.json["error"]["field"] == "tenantID"  # type: ignore[index]
    right = client.get(f"/api/v1/mail/{record.id}?tenantId={world['acme']}", headers=headers)
    assert right.status_code == 200
    sent = client.post("/api/v1/mail?dryRun=1", json={"to": ["a@example.com"]}, headers=headers)
    assert sent.status_code == 422
    assert sent.json["error"]["field"] == "dryRun"  # type: ignore[index]
