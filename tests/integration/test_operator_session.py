"""The operator endpoints with a portal session instead of an API key: the Retry permission
decides, and the CSRF token is required (a session is an ambient credential)."""

from __future__ import annotations

import re

import pytest
from flask import Flask
from flask.testing import FlaskClient

from portal.extensions import db
from portal.models import AppUser, MailSendRecord
from tests.conftest import make_tenant
from tests.support.delivery import accept_mail, record

PASSWORD = "session-test-password-1"


def signed_in(app: Flask, role: str, tenant_id: int) -> tuple[FlaskClient, str]:
    user = AppUser(email=f"{role}@example.com", role=role, tenant_id=tenant_id)
    user.set_password(PASSWORD)
    db.session.add(user)
    db.session.commit()
    client = app.test_client()
    page = client.get("/auth/login").text
    token = re.search(r'name="csrf_token" value="([^"]+)"', page).group(1)  # type: ignore[union-attr]
    response = client.post(
        "/auth/login", data={"email": user.email, "password": PASSWORD, "csrf_token": token}
    )
    assert response.status_code == 302
    return client, token


@pytest.mark.parametrize("role", ["support", "tenant_admin"])
def test_a_session_with_retry_permission_retries_with_the_csrf_token(app: Flask, role: str) -> None:
    acme = make_tenant("acme").id
    other = make_tenant("other").id
    db.session.commit()
    mine = accept_mail(app, acme)
    theirs = accept_mail(app, other)
    db.session.execute(MailSendRecord.__table__.update().values(status="Failed"))
    db.session.commit()
    client, token = signed_in(app, role, acme)
    refused = client.post(f"/MailSendRecord/retry?id={mine}")
    assert refused.status_code == 400  # no CSRF token
    assert record(mine).status == "Failed"
    ok = client.post(f"/MailSendRecord/retry?id={mine}", headers={"X-CSRFToken": token})
    assert ok.status_code == 200
    assert record(mine).status == "Retry"
    hidden = client.post(f"/MailSendRecord/retry?id={theirs}", headers={"X-CSRFToken": token})
    assert hidden.status_code == 404
    assert record(theirs).status == "Failed"
    usage = client.get(f"/TenantMessageQuota/usage?tenantId={other}")
    assert usage.status_code == 404


def test_without_a_key_or_a_session_it_is_401(app: Flask) -> None:
    assert app.test_client().post("/MailSendRecord/retry?id=1").status_code == 401
