"""Portal sessions end: at sign-out (every session of the user), when the user's password,
role, tenant or active flag changes (portal, import-config, CLI), after SESSION_IDLE_S without
a request and SESSION_MAX_S after sign-in; a remember cookie brings none back. Sign-in and the
tenant switcher never redirect off the site; sign-in, failures and sign-out are audited."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from flask import Flask, g, url_for
from flask.testing import FlaskClient
from flask_login.utils import encode_cookie
from sqlalchemy import select

from portal.extensions import db
from portal.models import AppUser, AuditAction, AuditEvent
from portal.web.access import Permission, requires, user
from portal.web.auth import SEEN_AT, SEEN_GRANULARITY_S, SIGNED_IN_AT, keep_session
from tests.conftest import TEST_DATABASE_URL, make_app, make_tenant

PASSWORD = "session-test-password-1"
NEW_PASSWORD = "session-test-password-2"


# Each test starts with no sign-in attempts counted (redis_client flushes its Redis db).
pytestmark = pytest.mark.usefixtures("redis_client")


def make_user(email: str, role: str = "tenant_admin", tenant_id: int | None = None) -> AppUser:
    if tenant_id is None:
        tenant_id = -1 if role == "platform_operator" else make_tenant(email.split("@")[0]).id
    found = AppUser(email=email, role=role, tenant_id=tenant_id)
    found.set_password(PASSWORD)
    db.session.add(found)
    db.session.commit()
    return found


def fresh_request() -> None:
    """The tests share the app context the fixture pushed, and with it ``g`` (the CSRF token,
    flask-login's user) and the ORM session; forget them as a new request would."""
    g.pop("csrf_token", None)
    g.pop("_login_user", None)
    db.session.commit()


def csrf(client: FlaskClient) -> str:
    fresh_request()
    page = client.get("/auth/login").text
    return re.search(r'name="csrf_token" value="([^"]+)"', page).group(1)  # type: ignore[union-attr]


def sign_in(
    app: Flask, email: str, password: str = PASSWORD, next_: str | None = None
) -> FlaskClient:
    client = app.test_client()
    response = client.post(
        "/auth/login",
        query_string={"next": next_} if next_ is not None else None,
        data={"email": email, "password": password, "csrf_token": csrf(client)},
    )
    assert response.status_code == 302, response.text
    client.last_login = response  # type: ignore[attr-defined]
    return client


def signed_in(client: FlaskClient) -> bool:
    """Whether the client's session opens a page behind sign-in."""
    fresh_request()
    response = client.get("/")
    if response.status_code == 200:
        return True
    assert response.status_code == 302
    assert "/auth/login" in response.headers["Location"]
    return False


def sign_out(client: FlaskClient) -> None:
    token = csrf(client)
    assert client.post("/auth/logout", data={"csrf_token": token}).status_code == 302


def session_cookie(client: FlaskClient) -> str:
    cookie = client.get_cookie("session")
    assert cookie is not None
    return cookie.value


# --- sign-out ------------------------------------------------------------------------------


def test_the_cookie_from_before_sign_out_no_longer_signs_in(app: Flask) -> None:
    make_user("ann@acme.example.com")
    client = sign_in(app, "ann@acme.example.com")
    assert signed_in(client)
    old = session_cookie(client)
    sign_out(client)
    assert not signed_in(client)
    client.set_cookie("session", old)
    assert not signed_in(client)


def test_sign_out_ends_the_users_sessions_in_every_browser_but_not_others(app: Flask) -> None:
    make_user("ann@acme.example.com")
    make_user("bob@bobco.example.com")
    laptop = sign_in(app, "ann@acme.example.com")
    phone = sign_in(app, "ann@acme.example.com")
    bob = sign_in(app, "bob@bobco.example.com")
    sign_out(laptop)
    assert not signed_in(phone)
    assert signed_in(bob)
    again = sign_in(app, "ann@acme.example.com")
    assert signed_in(again)


# --- changes to the user -------------------------------------------------------------------


def _change_password(found: AppUser) -> None:
    found.set_password(NEW_PASSWORD)


def _change_role(found: AppUser) -> None:
    found.role = "support"


def _change_tenant(found: AppUser) -> None:
    found.tenant_id = make_tenant("elsewhere").id


def _deactivate_and_reactivate(found: AppUser) -> None:
    found.is_active = False
    db.session.commit()
    found.is_active = True


@pytest.mark.parametrize(
    "change", [_change_password, _change_role, _change_tenant, _deactivate_and_reactivate]
)
def test_a_change_to_the_user_ends_their_sessions(app: Flask, change: object) -> None:
    found = make_user("ann@acme.example.com")
    client = sign_in(app, "ann@acme.example.com")
    assert signed_in(client)
    change(db.session.get(AppUser, found.id))  # type: ignore[operator]
    db.session.commit()
    assert not signed_in(client)


def test_saving_unchanged_values_keeps_sessions(app: Flask) -> None:
    found = make_user("ann@acme.example.com")
    client = sign_in(app, "ann@acme.example.com")
    same = db.session.get(AppUser, found.id)
    assert same is not None
    same.role, same.tenant_id, same.is_active = same.role, same.tenant_id, True
    same.name = "Ann"
    db.session.commit()
    assert signed_in(client)


@pytest.fixture
def own_password_app(app: Flask) -> Flask:
    """An app with one extra view that changes the signed-in user's own password, as the
    users page does: the change ends every session of the user, keep_session keeps this one."""
    other = make_app(TEST_DATABASE_URL)

    @requires(Permission.OWN_ACCOUNT)
    def own_password() -> str:
        me = user()
        me.set_password(NEW_PASSWORD)
        keep_session(me)
        db.session.commit()
        return "changed"

    other.add_url_rule("/test-own-password", "own_password", own_password, methods=["POST"])
    return other


def test_a_password_change_keeps_the_session_that_made_it(own_password_app: Flask) -> None:
    make_user("ann@acme.example.com")
    acting = sign_in(own_password_app, "ann@acme.example.com")
    other = sign_in(own_password_app, "ann@acme.example.com")
    response = acting.post("/test-own-password", headers={"X-CSRFToken": csrf(acting)})
    assert response.status_code == 200
    assert signed_in(acting)
    assert not signed_in(other)


def test_import_config_ends_the_sessions_of_a_user_it_changes(app: Flask, tmp_path: Path) -> None:
    entry = {"email": "ann@acme.example.com", "role": "tenant_admin", "tenant": "acme"}
    config = {
        "tenants": [{"slug": "acme", "name": "Acme"}],
        "users": [entry | {"password": PASSWORD}],
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    runner = app.test_cli_runner()
    assert runner.invoke(args=["import-config", str(path)]).exit_code == 0
    client = sign_in(app, "ann@acme.example.com")
    # The same file again changes nothing: the session lives on.
    assert runner.invoke(args=["import-config", str(path)]).exit_code == 0
    assert signed_in(client)
    config["users"] = [entry | {"role": "support"}]
    path.write_text(json.dumps(config))
    result = runner.invoke(args=["import-config", str(path)])
    assert result.exit_code == 0, result.output
    assert not signed_in(client)


def test_cli_end_sessions_ends_one_users_or_everyones_sessions(app: Flask) -> None:
    make_user("ann@acme.example.com")
    make_user("bob@bobco.example.com")
    ann, bob = sign_in(app, "ann@acme.example.com"), sign_in(app, "bob@bobco.example.com")
    runner = app.test_cli_runner()
    result = runner.invoke(args=["end-sessions", "--email", "Ann@acme.example.com"])
    assert result.exit_code == 0, result.output
    assert not signed_in(ann)
    assert signed_in(bob)
    ann = sign_in(app, "ann@acme.example.com")
    result = runner.invoke(args=["end-sessions", "--all"])
    assert result.exit_code == 0, result.output
    assert not signed_in(ann)
    assert not signed_in(bob)
    assert runner.invoke(args=["end-sessions"]).exit_code != 0
    assert runner.invoke(args=["end-sessions", "--email", "nobody@x.example"]).exit_code != 0


# --- idle and maximum age ------------------------------------------------------------------


def test_a_session_ends_after_the_idle_time_without_a_request(app: Flask) -> None:
    idle = app.config["SETTINGS"].session_idle_s
    make_user("ann@acme.example.com")
    client = sign_in(app, "ann@acme.example.com")
    with client.session_transaction() as sess:
        sess[SEEN_AT] -= idle - 60  # a request a minute before the end keeps it going
    assert signed_in(client)
    with client.session_transaction() as sess:
        sess[SEEN_AT] -= idle + 1
    assert not signed_in(client)


def test_the_last_seen_time_is_written_back_at_most_once_a_minute(app: Flask) -> None:
    # Each write re-sends the session cookie, which overwrites what a concurrent request set:
    # a flash message after a POST was lost to the inbox poll in flight beside it.
    make_user("ann@acme.example.com")
    client = sign_in(app, "ann@acme.example.com")
    fresh_request()
    assert "Set-Cookie" not in client.get("/").headers
    with client.session_transaction() as sess:
        sess[SEEN_AT] -= SEEN_GRANULARITY_S
    fresh_request()
    assert "Set-Cookie" in client.get("/").headers


def test_the_inbox_poll_neither_keeps_a_session_alive_nor_writes_its_cookie(app: Flask) -> None:
    idle = app.config["SETTINGS"].session_idle_s
    make_user("ann@acme.example.com")
    client = sign_in(app, "ann@acme.example.com")
    with client.session_transaction() as sess:
        sess[SEEN_AT] -= idle - 60
    fresh_request()
    polled = client.get("/inbox/bell")
    assert polled.status_code == 200
    assert "Set-Cookie" not in polled.headers
    with client.session_transaction() as sess:
        sess[SEEN_AT] -= 61  # a tab left open, polling, past the idle time
    assert not signed_in(client)


def test_a_session_ends_at_its_maximum_age_even_when_busy(app: Flask) -> None:
    longest = app.config["SETTINGS"].session_max_s
    make_user("ann@acme.example.com")
    client = sign_in(app, "ann@acme.example.com")
    with client.session_transaction() as sess:
        sess[SIGNED_IN_AT] -= longest - 60
    assert signed_in(client)
    with client.session_transaction() as sess:
        sess[SIGNED_IN_AT] -= 61
    assert not signed_in(client)


def test_a_remember_cookie_signs_nobody_in(app: Flask) -> None:
    found = make_user("ann@acme.example.com")
    client = app.test_client()
    # What flask-login would accept as "remember me" (we never set one): it must not sign in.
    client.set_cookie("remember_token", encode_cookie(str(found.id)))
    assert not signed_in(client)


# --- redirects -----------------------------------------------------------------------------

OFF_SITE = [
    "/\t/evil.example",
    "/\\evil.example",
    "//evil.example",
    "https:evil.example",
    "https://evil.example",
    "/%0d%0aevil.example",
    "/\r\nLocation: https://evil.example",
    "/\n/evil.example",
]


def dashboard(app: Flask) -> str:
    with app.test_request_context():
        return url_for("dashboard.index")


@pytest.mark.parametrize("target", OFF_SITE)
def test_sign_in_never_redirects_off_the_site(app: Flask, target: str) -> None:
    make_user("ann@acme.example.com")
    client = sign_in(app, "ann@acme.example.com", next_=target)
    assert client.last_login.headers["Location"] == dashboard(app)  # type: ignore[attr-defined]


@pytest.mark.parametrize("target", OFF_SITE)
def test_the_tenant_switcher_never_redirects_off_the_site(app: Flask, target: str) -> None:
    make_user("olive@postroom.example.com", "platform_operator")
    client = sign_in(app, "olive@postroom.example.com")
    response = client.post(
        "/tenants/view", data={"tenant": "-1", "next": target, "csrf_token": csrf(client)}
    )
    assert response.status_code == 302
    assert response.headers["Location"] == dashboard(app)


def test_same_site_next_urls_are_followed(app: Flask) -> None:
    make_user("olive@postroom.example.com", "platform_operator")
    client = sign_in(app, "olive@postroom.example.com", next_="/mail-records/?status=Failed")
    assert client.last_login.headers["Location"] == "/mail-records/?status=Failed"  # type: ignore[attr-defined]
    response = client.post(
        "/tenants/view",
        data={"tenant": "all", "next": "/sms-records/?page=2", "csrf_token": csrf(client)},
    )
    assert response.headers["Location"] == "/sms-records/?page=2"


# --- audit ---------------------------------------------------------------------------------


def audit_rows() -> list[AuditEvent]:
    db.session.expire_all()
    return list(db.session.scalars(select(AuditEvent).order_by(AuditEvent.id)))


def test_sign_in_failures_and_sign_out_are_audited_without_the_password(app: Flask) -> None:
    found = make_user("ann@acme.example.com")
    client = app.test_client()
    for email in ("ann@acme.example.com", "nobody@acme.example.com"):
        response = client.post(
            "/auth/login",
            data={"email": email, "password": "wrong-secret-xyz", "csrf_token": csrf(client)},
        )
        assert response.status_code == 422
    client = sign_in(app, "Ann@Acme.example.com")
    sign_out(client)
    rows = audit_rows()
    assert [(r.action, r.tenant_id, r.actor_label, r.actor_user_id) for r in rows] == [
        (AuditAction.SIGN_IN_FAILED, found.tenant_id, "ann@acme.example.com", None),
        (AuditAction.SIGN_IN_FAILED, None, "nobody@acme.example.com", None),
        (AuditAction.SIGN_IN, found.tenant_id, "ann@acme.example.com", found.id),
        (AuditAction.SIGN_OUT, found.tenant_id, "ann@acme.example.com", found.id),
    ]
    assert all("127.0.0.1" in r.remark for r in rows)
    for row in rows:
        text = " ".join(str(v) for v in vars(row).values())
        assert "wrong-secret-xyz" not in text
        assert PASSWORD not in text


def test_the_front_door_opens_on_the_sign_in_page_without_a_complaint(app: Flask) -> None:
    client = app.test_client()
    door = client.get("/")
    assert door.status_code == 302
    assert door.headers["Location"].endswith("/auth/login")
    assert "Sign in to see that page" not in client.get(door.headers["Location"]).text
    deep = client.get("/mail-records/?status=Failed")
    assert deep.status_code == 302
    assert "next=" in deep.headers["Location"]
    page = client.get(deep.headers["Location"])
    assert "Sign in to see that page" in page.text


def test_every_page_names_its_icon(app: Flask) -> None:
    client = app.test_client()
    assert 'rel="icon"' in client.get("/auth/login").text
    icon = client.get("/static/favicon.svg")
    assert icon.status_code == 200
    assert icon.mimetype == "image/svg+xml"
