"""The bounce mailbox pages over HTTP (Flask's test client, real PostgreSQL and a real IMAP
server, Debian's Dovecot): permissions per role, tenant isolation, CSRF, validation naming the
field, the write-only password encrypted at rest, Test connection (read-only), the watermark,
enable / disable, and delete versus disable."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest
from flask import Flask
from sqlalchemy import func, select

from portal.extensions import db
from portal.messaging.after_send.receiving.fetch import FetchLimits, fetch_all
from portal.models import MailReceiveConfig, MailReceiveState, ReceivedMail
from portal.tenancy import PLATFORM_TENANT_ID
from tests.conftest import TEST_DATABASE_URL, make_tenant, settings_for_tests
from tests.integration.test_portal_templates import ROLES, Portal, user
from tests.support.imap_server import DovecotServer, ImapUser

MAILBOX_PASSWORD = "imap-Pa55word-plain-0003"
LOCAL = settings_for_tests(TEST_DATABASE_URL)  # tenants' mailboxes may be on 127.0.0.1
BOUNCE = (
    b"From: MAILER-DAEMON@example.com\r\nTo: bounces@acme.test\r\n"
    b"Subject: Undelivered Mail Returned to Sender\r\nMessage-ID: <b-%d@example.com>\r\n\r\n"
    b"Sorry.\r\n"
)


@pytest.fixture(scope="module")
def dovecot() -> Iterator[DovecotServer]:
    with DovecotServer(users=20) as server:
        yield server


@pytest.fixture
def world(app: Flask) -> dict[str, Any]:
    acme, globex = make_tenant("acme"), make_tenant("globex")
    user("admin@acme.test", "tenant_admin", acme.id)
    user("support@acme.test", "support", acme.id)
    user("admin@globex.test", "tenant_admin", globex.id)
    user("operator@postroom.test", "platform_operator", PLATFORM_TENANT_ID)
    rows: dict[str, Any] = {"acme_id": acme.id, "globex_id": globex.id}
    for tier, prefix in ((acme.id, "acme"), (globex.id, "globex"), (PLATFORM_TENANT_ID, "pf")):
        box = MailReceiveConfig(
            tenant_id=tier, name=f"{prefix}-bounces", host="127.0.0.1", port=1,
            security="plain", verify_tls=False, username=f"bounces@{prefix}.test",
            folder="INBOX", enabled=True,
        )  # fmt: skip
        box.secret = MAILBOX_PASSWORD
        db.session.add(box)
        db.session.flush()
        rows[prefix] = {"box": box.id}
    db.session.commit()
    return rows


@pytest.fixture
def admin(app: Flask, world: dict[str, Any]) -> Portal:
    return Portal(app, "admin@acme.test")


def box_form(**changes: str | None) -> dict[str, str]:
    base: dict[str, str | None] = {
        "name": "bounces",
        "host": "imap.example.com",
        "port": "993",
        "security": "ssl",
        "verify_tls": "on",
        "username": "bounces@acme.test",
        "password": "",
        "folder": "INBOX",
        "enabled": "on",
    } | changes
    return {k: v for k, v in base.items() if v is not None}


def count(model: Any) -> int:
    db.session.expire_all()
    return db.session.scalar(select(func.count()).select_from(model)) or 0


def get_box(box_id: int) -> MailReceiveConfig:
    db.session.expire_all()
    box = db.session.get(MailReceiveConfig, box_id)
    assert box is not None
    return box


def point_at(box_id: int, mailbox: ImapUser, security: str = "plain", **fields: Any) -> None:
    """Aim a saved config at a real Dovecot mailbox."""
    box = get_box(box_id)
    box.host = "127.0.0.1"
    box.port = mailbox.server.imaps_port if security == "ssl" else mailbox.server.imap_port
    box.security = security
    box.username = mailbox.name
    box.secret = mailbox.password
    for name, value in fields.items():
        setattr(box, name, value)
    db.session.commit()


# --- permissions, tenancy, CSRF ---------------------------------------------------------------

ROUTES = [
    ("GET", "/mail-receivers/", 200),
    ("GET", "/mail-receivers/new", 200),
    ("POST", "/mail-receivers/", 422),
    ("GET", "/mail-receivers/{box}/edit", 200),
    ("POST", "/mail-receivers/{box}", 422),
    ("POST", "/mail-receivers/{box}/test", 200),
    ("POST", "/mail-receivers/{box}/enabled", 303),
    ("GET", "/mail-receivers/{box}/delete", 200),
    ("POST", "/mail-receivers/{box}/delete", 200),  # without confirm=yes: the confirm page
]


@pytest.mark.parametrize("role", list(ROLES))
def test_every_route_answers_each_role_as_its_permissions_say(
    app: Flask, world: dict[str, Any], role: str
) -> None:
    portal = Portal(app, ROLES[role])
    if role == "operator":
        portal.view(world["acme_id"])
    for method, template, permitted in ROUTES:
        url = template.format(**world["acme"])
        response = portal.get(url) if method == "GET" else portal.post(url, {"name": ""})
        expected = {"anonymous": 302, "support": 403}.get(role, permitted)
        assert response.status_code == expected, f"{role} {method} {url}: {response.status_code}"


def test_the_page_is_in_the_navigation_of_those_who_may_edit_config(
    app: Flask, world: dict[str, Any]
) -> None:
    link = 'href="/mail-receivers/"'
    assert link in Portal(app, "admin@acme.test").get("/mail-servers/").text
    assert link in Portal(app, "operator@postroom.test").get("/").text
    assert link not in Portal(app, "support@acme.test").get("/").text
    for endpoint, view in app.view_functions.items():
        if endpoint.startswith("mail_receivers."):
            assert getattr(view, "required_permission", None) == "edit_config", endpoint


def test_another_tenants_ids_are_404_on_every_route(
    app: Flask, world: dict[str, Any], admin: Portal
) -> None:
    for other in ("globex", "pf"):
        for method, template, _ in ROUTES:
            if "{" not in template:
                continue
            url = template.format(**world[other])
            response = admin.get(url) if method == "GET" else admin.post(url, box_form())
            assert response.status_code == 404, f"{method} {url}: {response.status_code}"
    assert admin.get(f"/mail-receivers/{2**63}/edit").status_code == 404
    assert admin.post("/mail-receivers/0/test").status_code == 404
    assert count(MailReceiveConfig) == 3
    assert get_box(world["globex"]["box"]).enabled is True
    listing = admin.get("/mail-receivers/").text
    assert "acme-bounces" in listing
    assert "globex" not in listing
    assert "pf-bounces" not in listing
    # The operator edits the platform tier's by default, and a tenant's when viewing it.
    operator = Portal(app, "operator@postroom.test")
    assert "pf-bounces" in operator.get("/mail-receivers/").text
    assert operator.get(f"/mail-receivers/{world['acme']['box']}/edit").status_code == 404
    operator.view(world["acme_id"])
    assert operator.get(f"/mail-receivers/{world['acme']['box']}/edit").status_code == 200


def test_unsafe_requests_without_the_csrf_token_are_refused(
    app: Flask, world: dict[str, Any], admin: Portal
) -> None:
    box_id = world["acme"]["box"]
    for url, data in (
        ("/mail-receivers/", box_form(password="x")),
        (f"/mail-receivers/{box_id}", box_form(name="renamed")),
        (f"/mail-receivers/{box_id}/enabled", {"enabled": ""}),
        (f"/mail-receivers/{box_id}/delete", {}),
        (f"/mail-receivers/{box_id}/test", {}),
    ):
        response = admin.post(url, data, csrf=False)
        assert response.status_code == 400, url
    assert count(MailReceiveConfig) == 3
    box = get_box(box_id)
    assert (box.name, box.enabled) == ("acme-bounces", True)


# --- the form --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"name": ""}, "Name is required"),
        ({"name": "x" * 201}, "Name must be at most 200 characters"),
        ({"host": ""}, "Host is required"),
        ({"host": "imap example.com"}, "Host must be a host name or IP address"),
        ({"host": "imap.example.com:993"}, "Host must be a host name or IP address"),
        ({"port": "0"}, "Port must be a whole number from 1 to 65,535"),
        ({"port": "imap"}, "Port must be a whole number from 1 to 65,535"),
        ({"security": "tls13"}, "Security must be one of"),
        ({"username": ""}, "Username is required"),
        ({"username": "u\x00ser"}, "Username must not contain control characters"),
        ({"folder": "f" * 201}, "Folder must be at most 200 characters"),
        ({"folder": "Bounces\r\nA1 DELETE INBOX"}, "Folder must be one line"),
        ({"password": "p" * 501}, "Password must be at most 500 characters"),
    ],
)
def test_an_invalid_mailbox_is_422_with_the_field_named(
    app: Flask, world: dict[str, Any], admin: Portal, changes: dict[str, str], message: str
) -> None:
    for url in ("/mail-receivers/", f"/mail-receivers/{world['acme']['box']}"):
        response = admin.post(url, box_form(password="typed-secret-1") | changes)
        assert response.status_code == 422, url
        assert message in response.text, url
        assert "typed-secret-1" not in response.text  # not even what was just typed
    assert count(MailReceiveConfig) == 3
    assert get_box(world["acme"]["box"]).name == "acme-bounces"


def test_a_new_mailbox_needs_a_password_and_a_unique_name(
    app: Flask, world: dict[str, Any], admin: Portal
) -> None:
    missing = admin.post("/mail-receivers/", box_form())
    assert missing.status_code == 422
    assert "Password is required" in missing.text
    clash = admin.post("/mail-receivers/", box_form(name="acme-bounces", password="pw"))
    assert clash.status_code == 422
    assert "Name &#39;acme-bounces&#39; is already used by another bounce mailbox" in clash.text
    # Another tenant's name is no clash.
    ok = admin.post("/mail-receivers/", box_form(name="globex-bounces", password="pw"))
    assert ok.status_code == 303
    assert count(MailReceiveConfig) == 4


def test_create_then_the_password_is_write_only_and_encrypted_at_rest(
    app: Flask, world: dict[str, Any], admin: Portal
) -> None:
    created = admin.post(
        "/mail-receivers/",
        box_form(password=MAILBOX_PASSWORD + "-new", security="starttls", port="", folder=""),
    )
    assert created.status_code == 303
    box = db.session.scalar(select(MailReceiveConfig).where(MailReceiveConfig.name == "bounces"))
    assert box is not None
    assert box.tenant_id == world["acme_id"]
    assert (box.port, box.folder, box.security) == (143, "INBOX", "starttls")  # defaults
    assert created.headers["Location"] == f"/mail-receivers/{box.id}/edit"
    stored = box.secret_encrypted
    assert stored
    assert MAILBOX_PASSWORD not in stored  # encrypted, not encoded
    assert box.secret == MAILBOX_PASSWORD + "-new"

    forbidden = [MAILBOX_PASSWORD, stored, get_box(world["acme"]["box"]).secret_encrypted]
    responses = [
        admin.get("/mail-receivers/"),
        admin.get(f"/mail-receivers/{box.id}/edit"),
        admin.post(f"/mail-receivers/{box.id}", box_form(port="x")),
        admin.post(f"/mail-receivers/{box.id}/test", htmx=True),
        admin.post(f"/mail-receivers/{world['acme']['box']}/test"),
    ]
    for response in responses:
        for secret in forbidden:
            assert secret
            assert secret not in response.get_data(as_text=True), response.request.path
    edit = responses[1].text
    assert 'type="password" value=""' in edit
    assert "A value is stored. Leave this blank to keep it." in edit

    # A blank password keeps the stored one; a typed one replaces it; it cannot be removed.
    keep = box_form(name="bounces", host="imap2.example.com", password="")
    assert admin.post(f"/mail-receivers/{box.id}", keep).status_code == 303
    box = get_box(box.id)
    assert (box.host, box.secret_encrypted) == ("imap2.example.com", stored)
    assert (
        admin.post(f"/mail-receivers/{box.id}", keep | {"password": "rotated"}).status_code == 303
    )
    assert get_box(box.id).secret == "rotated"
    removed = admin.post(f"/mail-receivers/{box.id}", keep | {"remove_password": "on"})
    assert removed.status_code == 422
    assert "Password cannot be removed" in removed.text
    assert get_box(box.id).secret == "rotated"


def test_enable_disable_and_delete_versus_disable(
    app: Flask, world: dict[str, Any], admin: Portal
) -> None:
    box_id = world["acme"]["box"]
    off = admin.post(f"/mail-receivers/{box_id}/enabled", {"enabled": ""})
    assert off.status_code == 303
    assert off.headers["Location"] == "/mail-receivers/"
    assert get_box(box_id).enabled is False
    assert "it is no longer read" in admin.get("/mail-receivers/").text
    back = f"/mail-receivers/{box_id}/edit"
    on = admin.post(f"/mail-receivers/{box_id}/enabled", {"enabled": "on", "next": back})
    assert on.headers["Location"] == back
    assert get_box(box_id).enabled is True
    # Elsewhere than its own page, "next" is ignored (no open redirect).
    away = admin.post(f"/mail-receivers/{box_id}/enabled", {"enabled": "on", "next": "//evil"})
    assert away.headers["Location"] == "/mail-receivers/"

    # A mailbox with stored messages is disabled, not deleted.
    db.session.add(
        ReceivedMail(
            tenant_id=world["acme_id"], config_id=box_id, folder="INBOX", uid=1, dedup_key="x"
        )
    )
    db.session.commit()
    kept = admin.post(f"/mail-receivers/{box_id}/delete", {"confirm": "yes"})
    assert kept.status_code == 303
    assert kept.headers["Location"] == back
    assert "cannot be deleted" in admin.get(back).text
    assert get_box(box_id).enabled is False

    created = admin.post("/mail-receivers/", box_form(name="spare", password="pw"))
    spare = int(created.headers["Location"].split("/")[2])
    gone = admin.post(f"/mail-receivers/{spare}/delete", {"confirm": "yes"})
    assert gone.headers["Location"] == "/mail-receivers/"
    assert db.session.get(MailReceiveConfig, spare) is None
    assert count(MailReceiveConfig) == 3


# --- Test connection and the watermark, against Dovecot ---------------------------------------


@pytest.mark.parametrize("security", ["plain", "starttls", "ssl"])
def test_test_connection_logs_in_read_only_and_reports_the_folder(
    app: Flask, world: dict[str, Any], admin: Portal, dovecot: DovecotServer, security: str
) -> None:
    mailbox = dovecot.add_user()
    mailbox.append_many([BOUNCE % 1, BOUNCE % 2])
    box_id = world["acme"]["box"]
    point_at(box_id, mailbox, security)
    before = mailbox.flags()

    fragment = admin.post(f"/mail-receivers/{box_id}/test", htmx=True)
    assert fragment.status_code == 200
    text = fragment.text
    assert "<html" not in text
    assert "connection-good" in text
    assert "Logged in and opened INBOX read-only." in text
    assert "It holds 2 messages." in text
    assert f"UIDVALIDITY {mailbox.uidvalidity()}" in text
    assert "HX-Request" in fragment.headers["Vary"]
    assert mailbox.flags() == before  # nothing marked \Seen
    page = admin.post(f"/mail-receivers/{box_id}/test")
    assert "<html" in page.text
    assert "It holds 2 messages." in page.text


def test_the_watermark_shows_whether_the_mailbox_is_being_read(
    app: Flask, world: dict[str, Any], admin: Portal, dovecot: DovecotServer
) -> None:
    mailbox = dovecot.add_user()
    box_id = world["acme"]["box"]
    point_at(box_id, mailbox)
    for other in ("globex", "pf"):  # only acme's mailbox is read in this test
        get_box(world[other]["box"]).enabled = False
    db.session.commit()
    edit = admin.get(f"/mail-receivers/{box_id}/edit").text
    assert "Not read yet" in edit
    assert "Never" in admin.get("/mail-receivers/").text

    uids = mailbox.append_many([BOUNCE % 1, BOUNCE % 2, b"\x00\xff not a message"])
    report = fetch_all(db.engine, FetchLimits(timeout_s=5, settings=LOCAL))
    assert report.mailboxes[0].error is None, report.as_dict()
    state = db.session.scalar(select(MailReceiveState).where(MailReceiveState.config_id == box_id))
    assert state is not None
    assert state.last_uid == uids[-1]

    edit = admin.get(f"/mail-receivers/{box_id}/edit").text
    assert f"read up to UID {uids[-1]} (UIDVALIDITY {mailbox.uidvalidity()})" in edit
    assert "Last read (UTC)" in edit
    assert "Messages stored</dt><dd>3" in edit
    listing = admin.get("/mail-receivers/").text
    assert "Never" not in listing
    read_once = state.updated_time

    # A run with nothing new still moves "last read".
    fetch_all(db.engine, FetchLimits(timeout_s=5, settings=LOCAL))
    db.session.expire_all()
    state = db.session.get(MailReceiveState, state.id)
    assert state is not None
    assert state.updated_time > read_once
    assert state.last_uid == uids[-1]

    # A message that could not be applied is shown with its error.
    db.session.add(
        ReceivedMail(
            tenant_id=world["acme_id"], config_id=box_id, folder="INBOX", uid=99,
            dedup_key="uid:broken", error="ValueError: no usable headers",
        )
    )  # fmt: skip
    db.session.commit()
    edit = admin.get(f"/mail-receivers/{box_id}/edit").text
    assert "1 message could not be read or applied." in edit
    assert "(UID 99)" in edit
    assert "ValueError: no usable headers" in edit
    assert "1 unreadable" in admin.get("/mail-receivers/").text


def test_test_connection_says_plainly_what_is_wrong(
    app: Flask, world: dict[str, Any], admin: Portal, dovecot: DovecotServer
) -> None:
    mailbox = dovecot.add_user()
    box_id = world["acme"]["box"]
    point_at(box_id, mailbox, folder="NoSuchFolder")
    missing = admin.post(f"/mail-receivers/{box_id}/test", htmx=True).text
    assert "connection-bad" in missing
    assert "Logged in, but the folder &#39;NoSuchFolder&#39; cannot be opened" in missing

    point_at(box_id, mailbox, "ssl", verify_tls=True)
    untrusted = admin.post(f"/mail-receivers/{box_id}/test", htmx=True).text
    assert "TLS certificate was not accepted" in untrusted

    with socket.socket() as sock:  # a port with nothing listening
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    point_at(box_id, mailbox, port=closed)
    refused = admin.post(f"/mail-receivers/{box_id}/test", htmx=True).text
    assert f"Nothing answers at 127.0.0.1:{closed}" in refused

    box = get_box(box_id)
    box.secret_encrypted = "not-a-fernet-token"
    db.session.commit()
    undecryptable = admin.post(f"/mail-receivers/{box_id}/test", htmx=True).text
    assert "The stored password cannot be decrypted: enter it again and save." in undecryptable

    # Typing a password again replaces the unreadable one. Last, and in the last test: Dovecot
    # slows down logins from an address that failed one.
    form = box_form(
        name="acme-bounces", host="127.0.0.1", port=str(mailbox.server.imap_port),
        security="plain", username=mailbox.name, password="wrong-password",
    )  # fmt: skip
    assert admin.post(f"/mail-receivers/{box_id}", form).status_code == 303
    assert get_box(box_id).secret == "wrong-password"
    wrong = admin.post(f"/mail-receivers/{box_id}/test", htmx=True).text
    assert "connection-bad" in wrong
    assert "The server refused the username or password" in wrong


def test_a_run_that_cannot_log_in_shows_on_the_page_until_one_can(
    app: Flask, world: dict[str, Any], admin: Portal
) -> None:
    # Its own server: Dovecot slows every login from an address after a failed one.
    with DovecotServer(users=1) as server:
        mailbox = server.add_user()
        box_id = world["acme"]["box"]
        point_at(box_id, mailbox)
        for other in ("globex", "pf"):  # only acme's mailbox is read in this test
            get_box(world[other]["box"]).enabled = False
            db.session.commit()
        get_box(box_id).secret = "not-the-password"
        db.session.commit()
        mailbox.append(BOUNCE % 1)

        (run,) = fetch_all(db.engine, FetchLimits(timeout_s=10, settings=LOCAL)).mailboxes
        assert run.config_id == box_id
        db.session.expire_all()
        state = db.session.scalar(
            select(MailReceiveState).where(MailReceiveState.config_id == box_id)
        )
        assert state is not None  # created by the failure: the folder was never opened
        assert state.last_error is not None
        assert state.last_error.startswith("Login failed. The server refused the username")
        assert "not-the-password" not in state.last_error
        assert state.last_run_at is not None
        assert state.uidvalidity is None
        edit = admin.get(f"/mail-receivers/{box_id}/edit").text
        assert "The last run could not read this mailbox" in edit
        assert "Login failed. The server refused the username or password" in edit
        assert "Never read: no run has opened the folder yet." in edit
        assert "Last run (UTC)" in edit
        assert "read up to UID" not in edit  # no watermark to show yet
        listing = admin.get("/mail-receivers/").text
        assert "Failed</span>" in listing
        assert "Login failed." in listing

        # The right password: the next run reads the folder and clears the error.
        form = box_form(
            name="acme-bounces", host="127.0.0.1", port=str(server.imap_port),
            security="plain", username=mailbox.name, password=mailbox.password,
        )  # fmt: skip
        assert admin.post(f"/mail-receivers/{box_id}", form).status_code == 303
        (run,) = fetch_all(db.engine, FetchLimits(timeout_s=10, settings=LOCAL)).mailboxes
        assert (run.error, run.stored) == (None, 1)
        db.session.expire_all()
        state = db.session.get(MailReceiveState, state.id)
        assert state is not None
        assert (state.last_error, state.last_error_at) == (None, None)
        assert state.last_run_at is not None
        assert state.uidvalidity == mailbox.uidvalidity()
        edit = admin.get(f"/mail-receivers/{box_id}/edit").text
        assert "could not read this mailbox" not in edit
        assert "Login failed" not in edit
        assert f"read up to UID 1 (UIDVALIDITY {mailbox.uidvalidity()})" in edit
        assert "Last run (UTC)" in edit
        listing = admin.get("/mail-receivers/").text
        assert "Login failed" not in listing
        assert "Never" not in listing
