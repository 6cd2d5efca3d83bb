"""Quota and API key pages over HTTP (Flask's test client, real PostgreSQL): permissions per
role, tenant isolation, CSRF, validation, usage bars and history, and keys shown only once."""

from __future__ import annotations

import re
from typing import Any

import pytest
from flask import Flask
from sqlalchemy import func, select

from portal.extensions import db
from portal.messaging.sending.quota import current_month
from portal.models import ApiKey, TenantMessageQuota, TenantMessageUsage
from portal.models.tenant import hash_api_token
from portal.tenancy import PLATFORM_TENANT_ID
from tests.conftest import make_tenant
from tests.integration.test_portal_templates import ROLES, Portal, user


@pytest.fixture
def world(app: Flask) -> dict[str, Any]:
    acme, globex = make_tenant("acme"), make_tenant("globex")
    user("admin@acme.test", "tenant_admin", acme.id)
    user("support@acme.test", "support", acme.id)
    user("admin@globex.test", "tenant_admin", globex.id)
    user("operator@postroom.test", "platform_operator", PLATFORM_TENANT_ID)
    month = current_month()
    db.session.add_all(
        [
            TenantMessageQuota(tenant_id=acme.id, mail_monthly_limit=1000, sms_monthly_limit=None),
            TenantMessageUsage(tenant_id=acme.id, month=month, mail_count=250, sms_count=7),
            TenantMessageUsage(tenant_id=acme.id, month="2020-01", mail_count=12, sms_count=3),
            TenantMessageUsage(tenant_id=globex.id, month=month, mail_count=99, sms_count=1),
        ]
    )
    keys = {}
    for tenant_id, name in ((acme.id, "acme"), (globex.id, "globex"), (-1, "pf")):
        key = ApiKey(tenant_id=tenant_id, name=f"{name}-key")
        key.set_token(f"pk_{name}_0123456789abcdefghijklmnopqrstuvwxyz")
        db.session.add(key)
        db.session.flush()
        keys[name] = key.id
    db.session.commit()
    return {"acme": acme.id, "globex": globex.id, "keys": keys}


def count(model: Any) -> int:
    db.session.expire_all()
    return db.session.scalar(select(func.count()).select_from(model)) or 0


# --- quotas ---------------------------------------------------------------------------------

QUOTA_ROUTES = [
    # (method, url, operator, admin, support)
    ("GET", "/quotas/", 200, 200, 200),
    ("GET", "/quotas/{acme}", 200, 200, 200),
    ("GET", "/quotas/{globex}", 200, 404, 404),
    ("GET", "/quotas/-1", 200, 404, 404),
    ("GET", "/quotas/{acme}/edit", 200, 403, 403),
    ("POST", "/quotas/{acme}", 422, 403, 403),
    ("GET", "/quotas/999999/edit", 404, 403, 403),
    ("GET", f"/quotas/{2**70}", 404, 404, 404),
]


@pytest.mark.parametrize("role", list(ROLES))
def test_quota_routes_answer_each_role_as_its_permissions_say(
    app: Flask, world: dict[str, Any], role: str
) -> None:
    portal = Portal(app, ROLES[role])
    column = {"operator": 2, "admin": 3, "support": 4}.get(role)
    for route in QUOTA_ROUTES:
        method, url = route[0], route[1].format(**world)
        response = (
            portal.get(url) if method == "GET" else portal.post(url, {"mail_monthly_limit": "x"})
        )
        expected = 302 if column is None else route[column]
        assert response.status_code == expected, f"{role} {method} {url}: {response.status_code}"


def test_tenants_read_their_own_usage_with_bars_and_history(
    app: Flask, world: dict[str, Any]
) -> None:
    page = Portal(app, "support@acme.test").get("/quotas/")
    assert page.status_code == 200
    text = page.text
    assert "Quota of Acme" in text
    assert '<meter min="0" max="1000" value="250"' in text
    assert "of 1,000 mails · <strong>25%</strong>" in text
    assert "7</strong> SMS · no ceiling" in text
    assert "2020-01" in text
    assert "Globex" not in text
    assert "Edit the ceilings" not in text
    assert "style=" not in text  # the CSP forbids inline styles: bars are <meter>s


def test_operators_see_every_tenant_and_the_platform_tier(
    app: Flask, world: dict[str, Any]
) -> None:
    page = Portal(app, "operator@postroom.test").get("/quotas/").text
    assert page.index("Platform tier") < page.index("Acme") < page.index("Globex")
    assert '<meter min="0" max="1000" value="250"' in page
    assert "99</strong> mails · no ceiling" in page


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("-1", "Mail per month must be a whole number from 0 to 2,147,483,647"),
        ("ten", "Mail per month must be a whole number from 0 to 2,147,483,647"),
        ("2147483648", "Mail per month must be a whole number from 0 to 2,147,483,647"),
        ("1.5", "Mail per month must be a whole number"),
    ],
)
def test_an_invalid_ceiling_is_422_with_the_field_named(
    app: Flask, world: dict[str, Any], value: str, message: str
) -> None:
    operator = Portal(app, "operator@postroom.test")
    response = operator.post(
        f"/quotas/{world['acme']}", {"mail_monthly_limit": value, "sms_monthly_limit": "5"}
    )
    assert response.status_code == 422
    assert message in response.text
    assert f'value="{value}"' in response.text
    quota = db.session.scalar(
        select(TenantMessageQuota).where(TenantMessageQuota.tenant_id == world["acme"])
    )
    assert quota is not None
    assert (quota.mail_monthly_limit, quota.sms_monthly_limit) == (1000, None)


def test_an_operator_sets_and_clears_ceilings(app: Flask, world: dict[str, Any]) -> None:
    operator = Portal(app, "operator@postroom.test")
    saved = operator.post(
        f"/quotas/{world['globex']}", {"mail_monthly_limit": "1,000", "sms_monthly_limit": "0"}
    )
    assert saved.status_code == 303
    quota = db.session.scalar(
        select(TenantMessageQuota).where(TenantMessageQuota.tenant_id == world["globex"])
    )
    assert quota is not None
    assert (quota.mail_monthly_limit, quota.sms_monthly_limit) == (1000, 0)
    assert quota.updated_by == "operator@postroom.test"
    assert "Quota of Globex saved." in operator.get("/quotas/").text
    cleared = operator.post(
        f"/quotas/{world['globex']}", {"mail_monthly_limit": "", "sms_monthly_limit": ""}
    )
    assert cleared.status_code == 303
    db.session.expire_all()
    assert (quota.mail_monthly_limit, quota.sms_monthly_limit) == (None, None)
    platform = operator.post("/quotas/-1", {"mail_monthly_limit": "5", "sms_monthly_limit": ""})
    assert platform.status_code == 303
    assert count(TenantMessageQuota) == 3


def test_quota_posts_without_the_csrf_token_are_refused(app: Flask, world: dict[str, Any]) -> None:
    operator = Portal(app, "operator@postroom.test")
    response = operator.post(f"/quotas/{world['acme']}", {"mail_monthly_limit": "1"}, csrf=False)
    assert response.status_code == 400
    quota = db.session.scalar(
        select(TenantMessageQuota).where(TenantMessageQuota.tenant_id == world["acme"])
    )
    assert quota is not None
    assert quota.mail_monthly_limit == 1000


# --- API keys --------------------------------------------------------------------------------

KEY_ROUTES = [
    ("GET", "/api-keys/", 200),
    ("POST", "/api-keys/", 422),
    # Revoking asks first; a POST without confirm=yes shows the confirm
    # page (200) instead of revoking (it was a 303 after revoking at once).
    ("GET", "/api-keys/{key}/delete", 200),
    ("POST", "/api-keys/{key}/delete", 200),
]


@pytest.mark.parametrize("role", list(ROLES))
def test_api_key_routes_answer_each_role_as_its_permissions_say(
    app: Flask, world: dict[str, Any], role: str
) -> None:
    portal = Portal(app, ROLES[role])
    if role == "operator":
        portal.view(world["acme"])
    for method, template, permitted in KEY_ROUTES:
        url = template.format(key=world["keys"]["acme"])
        response = portal.get(url) if method == "GET" else portal.post(url, {"name": ""})
        expected = {"anonymous": 302, "support": 403}.get(role, permitted)
        assert response.status_code == expected, f"{role} {method} {url}: {response.status_code}"


def test_a_new_key_is_shown_once_and_works_until_revoked(app: Flask, world: dict[str, Any]) -> None:
    admin = Portal(app, "admin@acme.test")
    created = admin.post("/api-keys/", {"name": "billing", "scope": ["send", "read"]})
    assert created.status_code == 200
    match = re.search(
        r'id="new-token" class="token mono" type="text" value="(pk_[^"]+)"', created.text
    )
    assert match is not None
    token = match.group(1)
    key = db.session.scalar(select(ApiKey).where(ApiKey.name == "billing"))
    assert key is not None
    assert (key.tenant_id, key.token_hash, key.created_by) == (
        world["acme"],
        hash_api_token(token),
        "admin@acme.test",
    )
    index = admin.get("/api-keys/").text
    assert "billing" in index
    assert key.prefix in index
    assert token not in index
    assert token[len(key.prefix) :] not in index
    mail = {"to": ["ann@example.com"], "subject": "Hi", "text": "Hi"}
    api = app.test_client()
    accepted = api.post("/api/v1/mail", json=mail, headers={"Authorization": f"Bearer {token}"})
    assert accepted.status_code == 202
    assert admin.post(f"/api-keys/{key.id}/delete", {"confirm": "yes"}).status_code == 303
    db.session.expire_all()
    assert key.revoked_at is not None
    assert "Revoked" in admin.get("/api-keys/").text
    refused = api.post("/api/v1/mail", json=mail, headers={"Authorization": f"Bearer {token}"})
    assert refused.status_code == 401


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("", "Name is required"),
        ("x" * 201, "Name must be at most 200 characters"),
        ("acme-key", "Name &#39;acme-key&#39; is already the name of a key"),
    ],
)
def test_an_invalid_key_name_is_422(
    app: Flask, world: dict[str, Any], name: str, message: str
) -> None:
    admin = Portal(app, "admin@acme.test")
    response = admin.post("/api-keys/", {"name": name})
    assert response.status_code == 422
    assert message in response.text
    assert "pk_" not in response.text.replace("pk_acme", "")
    assert count(ApiKey) == 3


def test_keys_are_tenant_scoped(app: Flask, world: dict[str, Any]) -> None:
    admin = Portal(app, "admin@acme.test")
    index = admin.get("/api-keys/").text
    assert "acme-key" in index
    assert "globex-key" not in index
    assert "pf-key" not in index
    for other in ("globex", "pf"):
        assert admin.post(f"/api-keys/{world['keys'][other]}/delete").status_code == 404
    assert admin.post(f"/api-keys/{2**64}/delete").status_code == 404
    db.session.expire_all()
    assert db.session.scalar(select(func.count()).where(ApiKey.revoked_at.is_not(None))) == 0
    operator = Portal(app, "operator@postroom.test")
    assert "pf-key" in operator.get("/api-keys/").text  # the platform tier's, by default
    assert operator.post(f"/api-keys/{world['keys']['acme']}/delete").status_code == 404


def test_key_posts_without_the_csrf_token_are_refused(app: Flask, world: dict[str, Any]) -> None:
    admin = Portal(app, "admin@acme.test")
    assert admin.post("/api-keys/", {"name": "x"}, csrf=False).status_code == 400
    assert admin.post(f"/api-keys/{world['keys']['acme']}/delete", csrf=False).status_code == 400
    assert count(ApiKey) == 3
    db.session.expire_all()
    assert db.session.scalar(select(func.count()).where(ApiKey.revoked_at.is_not(None))) == 0
