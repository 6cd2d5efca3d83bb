"""The users page, invitations and password changes over HTTP (Flask's test client, real
PostgreSQL): who manages whom, the one-time set-password link, generic answers that leak no
other tenant's addresses, sessions ended by each change, and an audit row with each action."""

from __future__ import annotations

import hashlib
import re
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from flask import Flask, g
from flask.testing import FlaskClient
from redis import Redis
from sqlalchemy import func, select
from werkzeug.test import TestResponse

from portal.extensions import db
from portal.models import AppUser, AuditEvent, MailSendRecord
from portal.tenancy import PLATFORM_TENANT_ID
from tests.conftest import make_tenant

PASSWORD = "users-test-password-1"
_CSRF = re.compile(r'name="csrf_token" value="([^"]+)"')
_LINK = re.compile(r'value="(http://[^"]+/users/accept/([A-Za-z0-9_-]+))"')


class Client:
    """A browser stand-in that signs in through the real sign-in form and carries the CSRF
    token of its session."""

    def __init__(self, app: Flask, email: str | None = None, password: str = PASSWORD):
        self.client: FlaskClient = app.test_client()
        self.token = self._token("/auth/login")
        if email is not None:
            response = self.post("/auth/login", {"email": email, "password": password})
            assert response.status_code == 302, f"{email} could not sign in"
            self.token = self._token("/auth/login")

    def _token(self, url: str) -> str:
        found = _CSRF.search(self.get(url).text)
        assert found is not None
        return found.group(1)

    @staticmethod
    def _fresh() -> None:
        """Requests share the test's app context, where flask-login caches the signed-in user
        and Flask-WTF the CSRF token: forget both, so each request loads its own client's;
        and drop the test's session, so the next read sees what the request committed."""
        g.pop("_login_user", None)
        g.pop("csrf_token", None)
        db.session.remove()

    def get(self, url: str) -> TestResponse:
        self._fresh()
        return self.client.get(url)

    def post(
        self, url: str, data: dict[str, str] | None = None, *, csrf: bool = True
    ) -> TestResponse:
        form = dict(data or {})
        if csrf:
            form["csrf_token"] = self.token
        self._fresh()
        response = self.client.post(url, data=form)
        db.session.remove()
        return response


def make_user(email: str, role: str, tenant_id: int, password: str = PASSWORD) -> int:
    row = AppUser(email=email, role=role, tenant_id=tenant_id, name=email.split("@")[0])
    row.set_password(password)
    db.session.add(row)
    db.session.flush()
    return row.id


@pytest.fixture
def world(app: Flask, redis_client: Redis, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Two tenants (admin and support in acme, an admin in globex) and an operator (Redis
    emptied: the sign-in throttle counts there, and these tests sign in often); the portal's
    address configured, as invitations need it."""
    settings = app.config["SETTINGS"].replace(public_base_url="http://portal.test")
    monkeypatch.setitem(app.config, "SETTINGS", settings)
    acme, globex = make_tenant("acme"), make_tenant("globex")
    ids = {
        "acme": acme.id,
        "globex": globex.id,
        "admin": make_user("admin@acme.example.com", "tenant_admin", acme.id),
        "support": make_user("support@acme.example.com", "support", acme.id),
        "globex_admin": make_user("admin@globex.example.com", "tenant_admin", globex.id),
        "operator": make_user(
            "operator@postroom.example.com", "platform_operator", PLATFORM_TENANT_ID
        ),
    }
    db.session.commit()
    return ids


def account(email: str) -> AppUser:
    db.session.expire_all()
    found = db.session.scalar(select(AppUser).where(AppUser.email == email))
    assert found is not None
    return found


def audit_rows(action: str) -> list[AuditEvent]:
    db.session.expire_all()
    return list(
        db.session.scalars(
            select(AuditEvent).where(AuditEvent.action == action).order_by(AuditEvent.id)
        )
    )


def count(model: Any) -> int:
    db.session.expire_all()
    return db.session.scalar(select(func.count()).select_from(model)) or 0


def invite(client: Client, email: str, role: str = "support", name: str = "") -> TestResponse:
    return client.post("/users/", {"email": email, "role": role, "name": name})


def invitation_link(response: TestResponse) -> tuple[str, str]:
    """(the link as shown, its path) from the page that answers an invitation."""
    found = _LINK.search(response.text)
    assert found is not None, response.text
    link = found.group(1)
    return link, link[link.index("/users/accept/") :]


# --- the list ---------------------------------------------------------------------------------


def test_a_tenant_admin_sees_only_their_tenants_users(app: Flask, world: dict[str, Any]) -> None:
    page = Client(app, "admin@acme.example.com").get("/users/")
    assert page.status_code == 200
    assert "admin@acme.example.com" in page.text
    assert "support@acme.example.com" in page.text
    assert "globex" not in page.text.lower()
    assert "operator@postroom.example.com" not in page.text


def test_support_may_change_their_password_but_not_manage_users(
    app: Flask, world: dict[str, Any]
) -> None:
    support = Client(app, "support@acme.example.com")
    assert support.get("/users/").status_code == 403
    assert invite(support, "new@acme.example.com").status_code == 403
    assert support.post(f"/users/{world['admin']}/deactivate").status_code == 403
    assert support.get("/users/password").status_code == 200
    assert count(AppUser) == 4


def test_anonymous_visitors_are_sent_to_sign_in_except_for_an_invitation_link(
    app: Flask, world: dict[str, Any]
) -> None:
    anonymous = Client(app)
    assert anonymous.get("/users/").status_code == 302
    assert anonymous.get("/users/password").status_code == 302
    unknown = anonymous.get("/users/accept/not-a-token")
    assert unknown.status_code == 404
    assert "This link cannot be used" in unknown.text


@pytest.mark.parametrize("action", ["role", "deactivate", "activate"])
@pytest.mark.parametrize("target", ["globex_admin", "operator"])
def test_a_tenant_admin_gets_404_for_other_tenants_users_and_operators(
    app: Flask, world: dict[str, Any], action: str, target: str
) -> None:
    before = {
        (u.id, u.role, u.is_active, u.session_generation)
        for u in db.session.scalars(select(AppUser))
    }
    admin = Client(app, "admin@acme.example.com")
    response = admin.post(f"/users/{world[target]}/{action}", {"role": "support"})
    assert response.status_code == 404
    for big in (0, 2**63, 2**70):
        assert admin.post(f"/users/{big}/{action}", {"role": "support"}).status_code == 404
    db.session.expire_all()
    after = {
        (u.id, u.role, u.is_active, u.session_generation)
        for u in db.session.scalars(select(AppUser))
    }
    assert after == before
    for action in ("user_role_change", "user_deactivate", "user_activate"):
        assert audit_rows(action) == []


def test_posts_without_the_csrf_token_are_refused(app: Flask, world: dict[str, Any]) -> None:
    admin = Client(app, "admin@acme.example.com")
    assert (
        admin.post(
            "/users/", {"email": "x@acme.example.com", "role": "support"}, csrf=False
        ).status_code
        == 400
    )
    assert admin.post(f"/users/{world['support']}/deactivate", csrf=False).status_code == 400
    assert account("support@acme.example.com").is_active
    assert count(AppUser) == 4


# --- inviting ---------------------------------------------------------------------------------


def test_an_invitation_shows_its_link_once_and_mails_it_on_the_platform_tier(
    app: Flask, world: dict[str, Any]
) -> None:
    admin = Client(app, "admin@acme.example.com")
    response = invite(admin, "New.Person@Acme.example.com", role="tenant_admin", name="New Person")
    assert response.status_code == 200  # the page itself, not a redirect
    link, path = invitation_link(response)
    token = path.rsplit("/", 1)[1]
    assert len(token) >= 40
    assert "queued for mailing to new.person@acme.example.com" in response.text

    invited = account("new.person@acme.example.com")
    assert invited.tenant_id == world["acme"]
    assert invited.role == "tenant_admin"
    assert invited.name == "New Person"
    assert invited.password_token_hash == hashlib.sha256(token.encode()).hexdigest()
    assert invited.password_token_expires_at is not None
    left = invited.password_token_expires_at - datetime.now(UTC)
    assert timedelta(hours=47, minutes=59) < left <= timedelta(hours=48, seconds=5)
    assert not invited.check_password("")  # no usable password until the link is used

    (mail,) = db.session.scalars(select(MailSendRecord))
    assert mail.tenant_id == PLATFORM_TENANT_ID
    assert mail.scope == "PLATFORM"
    assert mail.status == "Pending"
    assert mail.to_addrs == ["new.person@acme.example.com"]
    assert link in (mail.text_body or "")
    assert "admin@acme.example.com has invited you" in (mail.text_body or "")

    (row,) = audit_rows("user_invite")
    assert (row.tenant_id, row.actor_user_id, row.target_id) == (
        world["acme"],
        world["admin"],
        str(invited.id),
    )
    assert row.remark == "new.person@acme.example.com as tenant_admin"

    # Shown once: the list never carries it again, and the answer was no redirect.
    listing = admin.get("/users/")
    assert token not in listing.text
    assert "Invited, link valid until" in listing.text
    assert token not in str(response.headers)


def test_an_address_that_has_an_account_anywhere_gets_one_generic_answer(
    app: Flask, world: dict[str, Any]
) -> None:
    admin = Client(app, "admin@acme.example.com")
    answers = []
    for taken in (
        "admin@globex.example.com",
        "ADMIN@globex.example.com",
        "operator@postroom.example.com",
        "support@acme.example.com",
    ):
        response = invite(admin, taken)
        assert response.status_code == 422
        assert "Email address cannot be invited" in response.text
        assert "globex" not in response.text.lower().replace(taken.lower(), "")
        answers.append(response.text.replace(taken, "ADDRESS"))
    # The same words whoever holds the address (the typed value aside).
    error = re.compile(r'<p class="field-error" id="f-email-error">([^<]+)</p>')
    assert len({error.search(a).group(1) for a in answers}) == 1  # type: ignore[union-attr]
    assert count(AppUser) == 4
    assert count(MailSendRecord) == 0
    assert audit_rows("user_invite") == []


@pytest.mark.parametrize(
    ("data", "field", "message"),
    [
        ({"email": "", "role": "support"}, "email", "Email address is required"),
        ({"email": "not an address", "role": "support"}, "email", "Email address is not a valid"),
        (
            {"email": "x@acme.example.com", "role": "platform_operator"},
            "role",
            "Role must be one of",
        ),
        ({"email": "x@acme.example.com", "role": "owner"}, "role", "Role must be one of"),
        (
            {"email": "x@acme.example.com", "role": "support", "name": "a\nb"},
            "name",
            "Name must be one line",
        ),
    ],
)
def test_an_invalid_invitation_is_422_naming_the_field_with_nothing_written(
    app: Flask, world: dict[str, Any], data: dict[str, str], field: str, message: str
) -> None:
    response = Client(app, "admin@acme.example.com").post("/users/", data)
    assert response.status_code == 422
    assert f'id="f-{field}-error"' in response.text
    assert message in response.text
    assert count(AppUser) == 4
    assert count(MailSendRecord) == 0
    assert audit_rows("user_invite") == []


# --- the invitation link ----------------------------------------------------------------------


def test_an_invitation_link_sets_a_password_once_then_the_user_signs_in(
    app: Flask, world: dict[str, Any]
) -> None:
    _, path = invitation_link(invite(Client(app, "admin@acme.example.com"), "new@acme.example.com"))
    visitor = Client(app)
    form = visitor.get(path)
    assert form.status_code == 200
    assert "Set your password" in form.text
    assert "new@acme.example.com" in form.text

    short = visitor.post(path, {"password": "short", "confirm": "short"})
    assert short.status_code == 422
    assert "New password must be at least 8 characters" in short.text
    mismatch = visitor.post(path, {"password": "a-good-password", "confirm": "a-good-passw0rd"})
    assert mismatch.status_code == 422
    assert "New password again does not match" in mismatch.text
    assert "a-good-password" not in mismatch.text  # typed passwords are never echoed
    assert account("new@acme.example.com").password_token_hash is not None  # nothing half-written

    done = visitor.post(path, {"password": "a-good-password", "confirm": "a-good-password"})
    assert done.status_code == 303
    assert done.headers["Location"].endswith("/auth/login")
    invited = account("new@acme.example.com")
    assert invited.password_token_hash is None
    assert invited.password_token_expires_at is None
    assert invited.check_password("a-good-password")
    (row,) = audit_rows("password_set")
    assert (row.actor_user_id, row.actor_label, row.tenant_id, row.target_id) == (
        invited.id,
        "new@acme.example.com",
        world["acme"],
        str(invited.id),
    )

    signed_in = Client(app, "new@acme.example.com", password="a-good-password")
    assert signed_in.get("/users/password").status_code == 200

    # Single use: the same link now gets the page every unusable link gets.
    again = visitor.get(path)
    assert again.status_code == 404
    assert "This link cannot be used" in again.text
    reuse = visitor.post(path, {"password": "another-password", "confirm": "another-password"})
    assert reuse.status_code == 404
    assert account("new@acme.example.com").check_password("a-good-password")


def test_expired_withdrawn_and_made_up_links_get_one_page_naming_no_address(
    app: Flask, world: dict[str, Any]
) -> None:
    admin = Client(app, "admin@acme.example.com")
    _, expired = invitation_link(invite(admin, "late@acme.example.com"))
    _, withdrawn = invitation_link(invite(admin, "gone@acme.example.com"))
    late = account("late@acme.example.com")
    late.password_token_expires_at = datetime.now(UTC) - timedelta(seconds=1)
    db.session.commit()
    assert admin.post(f"/users/{account('gone@acme.example.com').id}/deactivate").status_code == 303

    visitor = Client(app)
    pages = []
    for path in (expired, withdrawn, "/users/accept/" + "A" * 43, "/users/accept/" + "x" * 500):
        for response in (
            visitor.get(path),
            visitor.post(path, {"password": "a-good-password", "confirm": "a-good-password"}),
        ):
            assert response.status_code == 404
            assert "This link cannot be used" in response.text
            assert "@" not in response.text.split("<main", 1)[1]
            pages.append(response.text.split("<main", 1)[1])
    assert len(set(pages)) == 1
    assert not account("late@acme.example.com").check_password("a-good-password")
    assert audit_rows("password_set") == []


# --- changing a user --------------------------------------------------------------------------


def test_changing_a_role_ends_that_users_sessions_and_is_audited(
    app: Flask, world: dict[str, Any]
) -> None:
    before = account("support@acme.example.com").session_generation
    support = Client(app, "support@acme.example.com")
    assert support.get("/users/password").status_code == 200
    admin = Client(app, "admin@acme.example.com")
    response = admin.post(f"/users/{world['support']}/role", {"role": "tenant_admin"})
    assert response.status_code == 303
    assert support.get("/users/password").status_code == 302  # signed out
    changed = account("support@acme.example.com")
    assert changed.role == "tenant_admin"
    assert changed.session_generation > before
    (row,) = audit_rows("user_role_change")
    assert (row.actor_user_id, row.tenant_id, row.target_id, row.remark) == (
        world["admin"],
        world["acme"],
        str(world["support"]),
        "support -> tenant_admin",
    )
    assert "is now tenant admin" in admin.get("/users/").text


@pytest.mark.parametrize("role", ["platform_operator", "", "root"])
def test_a_tenant_admin_cannot_make_anyone_an_operator(
    app: Flask, world: dict[str, Any], role: str
) -> None:
    response = Client(app, "admin@acme.example.com").post(
        f"/users/{world['support']}/role", {"role": role}
    )
    assert response.status_code == 422
    assert "Role must be one of support, tenant_admin" in response.text
    assert account("support@acme.example.com").role == "support"
    assert audit_rows("user_role_change") == []


def test_an_admin_can_neither_deactivate_nor_re_role_themselves(
    app: Flask, world: dict[str, Any]
) -> None:
    admin = Client(app, "admin@acme.example.com")
    generation = account("admin@acme.example.com").session_generation
    off = admin.post(f"/users/{world['admin']}/deactivate")
    assert off.status_code == 422
    assert "You cannot deactivate your own account" in off.text
    demote = admin.post(f"/users/{world['admin']}/role", {"role": "support"})
    assert demote.status_code == 422
    assert "Role of your own account cannot be changed by you" in demote.text
    me = account("admin@acme.example.com")
    assert (me.is_active, me.role, me.session_generation) == (True, "tenant_admin", generation)


def test_deactivating_ends_sessions_and_sign_in_until_reactivated(
    app: Flask, world: dict[str, Any]
) -> None:
    before = account("support@acme.example.com").session_generation
    support = Client(app, "support@acme.example.com")
    admin = Client(app, "admin@acme.example.com")
    assert admin.post(f"/users/{world['support']}/deactivate").status_code == 303
    assert support.get("/users/password").status_code == 302  # signed out
    off = account("support@acme.example.com")
    assert not off.is_active
    assert off.session_generation > before
    assert "Deactivated" in admin.get("/users/").text
    refused = Client(app).post(
        "/auth/login", {"email": "support@acme.example.com", "password": PASSWORD}
    )
    assert refused.status_code == 422

    assert admin.post(f"/users/{world['support']}/activate").status_code == 303
    assert account("support@acme.example.com").is_active
    Client(app, "support@acme.example.com")  # signs in again
    (gone,) = audit_rows("user_deactivate")
    (back,) = audit_rows("user_activate")
    for row in (gone, back):
        assert (row.actor_user_id, row.tenant_id, row.target_id) == (
            world["admin"],
            world["acme"],
            str(world["support"]),
        )


def test_operators_manage_every_tenants_users_and_invite_operators(
    app: Flask, world: dict[str, Any]
) -> None:
    operator = Client(app, "operator@postroom.example.com")
    # An operator views all tenants by default; the platform tier shows its operators.
    assert operator.post("/tenants/view", {"tenant": "-1", "next": "/users/"}).status_code == 302
    platform = operator.get("/users/")
    assert "operator@postroom.example.com" in platform.text
    assert "admin@globex.example.com" not in platform.text
    assert "Platform operator" in platform.text
    response = invite(operator, "second@postroom.example.com", role="platform_operator")
    assert response.status_code == 200
    made = account("second@postroom.example.com")
    assert (made.tenant_id, made.role) == (PLATFORM_TENANT_ID, "platform_operator")
    assert invite(operator, "third@postroom.example.com", role="support").status_code == 422

    assert operator.post("/tenants/view", {"tenant": "all", "next": "/users/"}).status_code == 302
    everyone = operator.get("/users/").text
    for email in (
        "admin@acme.example.com",
        "admin@globex.example.com",
        "second@postroom.example.com",
    ):
        assert email in everyone
    assert (
        operator.post(f"/users/{world['globex_admin']}/role", {"role": "support"}).status_code
        == 303
    )
    assert operator.post(f"/users/{world['globex_admin']}/deactivate").status_code == 303
    assert operator.post(f"/users/{made.id}/deactivate").status_code == 303
    assert operator.post(f"/users/{world['operator']}/deactivate").status_code == 422
    globex_admin = account("admin@globex.example.com")
    assert (globex_admin.role, globex_admin.is_active) == ("support", False)
    assert not account("second@postroom.example.com").is_active

    # Viewing acme, an operator acts on acme's users only, like every other page.
    assert (
        operator.post("/tenants/view", {"tenant": str(world["acme"]), "next": "/"}).status_code
        == 302
    )
    assert operator.post(f"/users/{world['globex_admin']}/activate").status_code == 404
    viewing = operator.get("/users/").text
    assert "admin@acme.example.com" in viewing
    assert "admin@globex.example.com" not in viewing
    assert invite(operator, "new@acme.example.com", role="tenant_admin").status_code == 200
    assert account("new@acme.example.com").tenant_id == world["acme"]


# --- one's own password -----------------------------------------------------------------------


def test_changing_ones_password_needs_the_current_one_and_ends_other_sessions(
    app: Flask, world: dict[str, Any]
) -> None:
    support = Client(app, "support@acme.example.com")
    elsewhere = Client(app, "support@acme.example.com")  # the same account in another browser
    before = account("support@acme.example.com").session_generation
    cases = [
        ({"current_password": "", "password": "new-password-1", "confirm": "new-password-1"},
         "Current password is required"),
        ({"current_password": "wrong", "password": "new-password-1", "confirm": "new-password-1"},
         "Current password is not right"),
        ({"current_password": PASSWORD, "password": "short", "confirm": "short"},
         "New password must be at least 8 characters"),
        ({"current_password": PASSWORD, "password": "new-password-1", "confirm": "other"},
         "New password again does not match"),
    ]  # fmt: skip
    for data, message in cases:
        response = support.post("/users/password", data)
        assert response.status_code == 422, message
        assert message in response.text
        assert "new-password-1" not in response.text
        assert PASSWORD not in response.text
    assert account("support@acme.example.com").session_generation == before
    assert audit_rows("password_change") == []

    done = support.post(
        "/users/password",
        {"current_password": PASSWORD, "password": "new-password-1", "confirm": "new-password-1"},
    )
    assert done.status_code == 303
    changed = account("support@acme.example.com")
    assert changed.check_password("new-password-1")
    assert not changed.check_password(PASSWORD)
    assert changed.session_generation > before
    (row,) = audit_rows("password_change")
    assert (row.actor_user_id, row.tenant_id, row.target_id) == (
        world["support"],
        world["acme"],
        str(world["support"]),
    )
    # This session stays signed in; a new sign-in needs the new password.
    assert support.get("/users/password").status_code == 200
    assert elsewhere.get("/users/password").status_code == 302
    assert (
        Client(app)
        .post("/auth/login", {"email": "support@acme.example.com", "password": PASSWORD})
        .status_code
        == 422
    )
    Client(app, "support@acme.example.com", password="new-password-1")
