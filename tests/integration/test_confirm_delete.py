"""Deleting a mail server, an SMS provider, a bounce mailbox or a country route takes a confirm
step that works without JavaScript, and every configuration change
writes its audit row in the same transaction (real PostgreSQL; signed in through the form).

The confirm page of a server or provider counts the Pending/Retry records of its tenant that
are prepared for it and says what becomes of them (the pipeline's rule: a retry replays the
config frozen at preparation, and a missing one fails CONFIG_NOT_RESOLVABLE).
"""

from __future__ import annotations

import html
import re
from typing import Any

import pytest
from flask import Flask, g
from flask.testing import FlaskClient
from sqlalchemy import select
from werkzeug.test import TestResponse

from portal.extensions import db
from portal.models import (
    AppUser,
    AuditEvent,
    MailReceiveConfig,
    MailSendRecord,
    MailSendServerConfig,
    ReceivedMail,
    SmsProviderConfig,
    SmsProviderRegion,
    SmsSendRecord,
    db_now,
)
from tests.conftest import make_tenant

_CSRF = re.compile(r'name="csrf_token" value="([^"]+)"')
PASSWORD = "confirm-delete-password"
SMTP_PASSWORD = "smtp-secret-never-in-audit"


class Browser:
    """A test client signed in through the sign-in form (its CSRF token kept)."""

    def __init__(self, app: Flask, email: str):
        self.client: FlaskClient = app.test_client()
        self.token = self._token("/auth/login")
        signed_in = self.post("/auth/login", {"email": email, "password": PASSWORD})
        assert signed_in.status_code in (302, 303), signed_in.text
        self.token = self._token("/auth/login")

    def _token(self, url: str) -> str:
        found = _CSRF.search(self.get(url).text)
        assert found is not None
        return found.group(1)

    def get(self, url: str) -> TestResponse:
        g.pop("_login_user", None)  # requests share the test's app context: forget its user
        g.pop("csrf_token", None)
        return self.client.get(url)

    def post(self, url: str, data: dict[str, Any] | None = None) -> TestResponse:
        g.pop("_login_user", None)
        g.pop("csrf_token", None)
        return self.client.post(url, data={**(data or {}), "csrf_token": self.token})


def text_of(response: TestResponse) -> str:
    """The page's text with its markup's entities read (names are quoted: &#39;)."""
    return html.unescape(response.text)


@pytest.fixture
def world(app: Flask) -> dict[str, Any]:
    acme, globex = make_tenant("acme"), make_tenant("globex")
    admin = AppUser(email="admin@acme.test", role="tenant_admin", tenant_id=acme.id, name="A")
    admin.set_password(PASSWORD)
    db.session.add(admin)
    rows: dict[str, Any] = {"acme": acme.id, "globex": globex.id}
    for tier, prefix in ((acme.id, "acme"), (globex.id, "globex")):
        server = MailSendServerConfig(
            tenant_id=tier, name=f"{prefix}-smtp", host="127.0.0.1", port=1, security="plain",
            from_address=f"no-reply@{prefix}.example.com",
        )  # fmt: skip
        server.password = SMTP_PASSWORD
        provider = SmsProviderConfig(tenant_id=tier, name=f"{prefix}-sms", provider="test")
        box = MailReceiveConfig(
            tenant_id=tier, name=f"{prefix}-box", host="127.0.0.1", username="bounces"
        )
        db.session.add_all([server, provider, box])
        db.session.flush()
        route = SmsProviderRegion(
            tenant_id=tier, provider_id=provider.id, country_code="GB", priority=10
        )
        db.session.add(route)
        db.session.flush()
        rows[prefix + "_ids"] = {
            "server": server.id,
            "provider": provider.id,
            "box": box.id,
            "route": route.id,
        }
    db.session.commit()
    return rows


@pytest.fixture
def admin(app: Flask, world: dict[str, Any]) -> Browser:
    return Browser(app, "admin@acme.test")


def audit_rows(action: str) -> list[AuditEvent]:
    db.session.expire_all()
    return list(
        db.session.scalars(
            select(AuditEvent).where(AuditEvent.action == action).order_by(AuditEvent.id)
        )
    )


def mail(tenant_id: int, status: str, server_id: int, *, prepared: bool = True) -> MailSendRecord:
    return MailSendRecord(
        tenant_id=tenant_id,
        to_addrs=["someone@example.com"],
        status=status,
        server_config_id=server_id if prepared else None,
        prepared_at=db_now() if prepared else None,
    )


def sms(tenant_id: int, status: str, provider_id: int) -> SmsSendRecord:
    return SmsSendRecord(
        tenant_id=tenant_id,
        phone_number="+447911123456",
        status=status,
        provider_config_id=provider_id,
        prepared_at=db_now(),
    )


# --- the confirm step -------------------------------------------------------------------------


def test_deleting_a_server_asks_first_and_deletes_only_on_the_confirm_pages_post(
    world: dict[str, Any], admin: Browser
) -> None:
    sid = world["acme_ids"]["server"]
    url = f"/mail-servers/{sid}/delete"
    # The edit page's Delete button only opens the confirm page (a GET form: no token needed).
    edit = admin.get(f"/mail-servers/{sid}/edit").text
    assert f'<form method="get" action="{url}">' in edit
    for asked in (admin.get(url), admin.post(url), admin.post(url, {"confirm": "no"})):
        assert asked.status_code == 200
        page = text_of(asked)
        assert "Delete mail server 'acme-smtp'?" in page
        assert "0 Pending or Retry mails of Acme are prepared for this server." in page
        assert 'name="confirm" value="yes"' in asked.text
        assert db.session.get(MailSendServerConfig, sid) is not None
    done = admin.post(url, {"confirm": "yes"})
    assert done.status_code == 303
    assert done.headers["Location"] == "/mail-servers/"
    db.session.expire_all()
    assert db.session.get(MailSendServerConfig, sid) is None
    [deleted] = audit_rows("config_delete")
    assert (deleted.tenant_id, deleted.target_type, deleted.target_id) == (
        world["acme"],
        "mail_server",
        str(sid),
    )
    assert deleted.actor_label == "admin@acme.test"
    assert "acme-smtp" in deleted.remark


def test_the_server_confirm_page_counts_its_tenants_prepared_pending_and_retry_mail(
    world: dict[str, Any], admin: Browser
) -> None:
    acme, sid = world["acme"], world["acme_ids"]["server"]
    db.session.add_all(
        [
            mail(acme, "Pending", sid),
            mail(acme, "Retry", sid),
            mail(acme, "Retry", sid),
            mail(acme, "Sent", sid),  # uses it, but is not waiting
            mail(acme, "Retry", sid, prepared=False),  # not prepared yet: a choice is to come
            # Another tenant's record naming acme's server id is not acme's to count.
            mail(world["globex"], "Retry", sid),
        ]
    )
    db.session.commit()
    page = admin.get(f"/mail-servers/{sid}/delete")
    assert page.status_code == 200
    text = text_of(page)
    assert "3 Pending or Retry mails of Acme are prepared for this server." in text
    assert "cannot be deleted" in text
    assert "CONFIG_NOT_RESOLVABLE" in text
    assert "replays the server chosen when the mail was prepared" in text
    assert 'name="confirm"' not in page.text  # nothing to confirm: it stays
    refused = admin.post(f"/mail-servers/{sid}/delete", {"confirm": "yes"})
    assert refused.status_code == 303
    db.session.expire_all()
    assert db.session.get(MailSendServerConfig, sid) is not None
    assert audit_rows("config_delete") == []


def test_another_tenants_records_neither_count_nor_block_a_servers_deletion(
    world: dict[str, Any], admin: Browser
) -> None:
    sid = world["acme_ids"]["server"]
    db.session.add(mail(world["globex"], "Retry", sid))
    db.session.commit()
    page = text_of(admin.get(f"/mail-servers/{sid}/delete"))
    assert "0 Pending or Retry mails of Acme are prepared" in page
    assert admin.post(f"/mail-servers/{sid}/delete", {"confirm": "yes"}).status_code == 303
    db.session.expire_all()
    assert db.session.get(MailSendServerConfig, sid) is None


def test_the_provider_confirm_page_counts_prepared_sms_and_says_what_happens(
    world: dict[str, Any], admin: Browser
) -> None:
    acme, pid = world["acme"], world["acme_ids"]["provider"]
    url = f"/sms-providers/{pid}/delete"
    free = admin.post(url)
    assert free.status_code == 200
    text = text_of(free)
    assert "Delete SMS provider 'acme-sms'?" in text
    assert "0 Pending or Retry SMS of Acme are prepared for this provider." in text
    assert "Its routes (GB)" in text
    assert db.session.get(SmsProviderConfig, pid) is not None

    db.session.add_all(
        [sms(acme, "Pending", pid), sms(acme, "Retry", pid), sms(world["globex"], "Retry", pid)]
    )
    db.session.commit()
    used = text_of(admin.get(url))
    assert "2 Pending or Retry SMS of Acme are prepared for this provider." in used
    assert "cannot be deleted" in used
    assert "Untick Enabled and they fail with CONFIG_NOT_RESOLVABLE" in used
    assert admin.post(url, {"confirm": "yes"}).status_code == 303
    db.session.expire_all()
    assert db.session.get(SmsProviderConfig, pid) is not None

    # One that nothing uses goes on the confirm page's POST, with its audit row.
    spare = SmsProviderConfig(tenant_id=acme, name="spare", provider="test")
    db.session.add(spare)
    db.session.commit()
    spare_id = spare.id
    assert admin.post(f"/sms-providers/{spare_id}/delete").status_code == 200
    assert admin.post(f"/sms-providers/{spare_id}/delete", {"confirm": "yes"}).status_code == 303
    db.session.expire_all()
    assert db.session.get(SmsProviderConfig, spare_id) is None
    [deleted] = audit_rows("config_delete")
    assert (deleted.target_type, deleted.target_id) == ("sms_provider", str(spare_id))


def test_removing_a_route_asks_first(world: dict[str, Any], admin: Browser) -> None:
    ids = world["acme_ids"]
    url = f"/sms-providers/{ids['provider']}/routes/{ids['route']}/delete"
    asked = admin.post(url)
    assert asked.status_code == 200
    assert "Remove the route for GB through 'acme-sms'?" in text_of(asked)
    assert db.session.get(SmsProviderRegion, ids["route"]) is not None
    assert admin.get(url).status_code == 200
    assert admin.post(url, {"confirm": "yes"}).status_code == 303
    db.session.expire_all()
    assert db.session.get(SmsProviderRegion, ids["route"]) is None
    [deleted] = audit_rows("config_delete")
    assert (deleted.target_type, deleted.target_id) == ("sms_route", str(ids["route"]))
    assert "GB" in deleted.remark


def test_deleting_a_mailbox_asks_first_and_one_with_messages_is_only_disabled(
    world: dict[str, Any], admin: Browser
) -> None:
    acme, box_id = world["acme"], world["acme_ids"]["box"]
    url = f"/mail-receivers/{box_id}/delete"
    db.session.add(
        ReceivedMail(tenant_id=acme, config_id=box_id, folder="INBOX", uid=1, dedup_key="x")
    )
    db.session.commit()
    asked = admin.post(url)
    assert asked.status_code == 200
    text = text_of(asked)
    assert "1 message read from this mailbox is stored" in text
    assert "Disable this mailbox" in text
    box = db.session.get(MailReceiveConfig, box_id)
    assert box is not None
    assert box.enabled is True  # asking changed nothing
    assert admin.post(url, {"confirm": "yes"}).status_code == 303
    db.session.expire_all()
    box = db.session.get(MailReceiveConfig, box_id)
    assert box is not None
    assert box.enabled is False
    [disabled] = audit_rows("config_update")
    assert (disabled.target_type, disabled.target_id) == ("mail_receiver", str(box_id))
    assert "disabled" in disabled.remark

    spare = MailReceiveConfig(tenant_id=acme, name="spare", host="127.0.0.1", username="u")
    db.session.add(spare)
    db.session.commit()
    spare_id = spare.id
    assert "Delete bounce mailbox 'spare'?" in text_of(
        admin.get(f"/mail-receivers/{spare_id}/delete")
    )
    assert db.session.get(MailReceiveConfig, spare_id) is not None
    gone = admin.post(f"/mail-receivers/{spare_id}/delete", {"confirm": "yes"})
    assert gone.headers["Location"] == "/mail-receivers/"
    db.session.expire_all()
    assert db.session.get(MailReceiveConfig, spare_id) is None


def test_another_tenants_ids_are_404_on_the_confirm_pages(
    world: dict[str, Any], admin: Browser
) -> None:
    other = world["globex_ids"]
    for url in (
        f"/mail-servers/{other['server']}/delete",
        f"/sms-providers/{other['provider']}/delete",
        f"/sms-providers/{other['provider']}/routes/{other['route']}/delete",
        f"/sms-providers/{world['acme_ids']['provider']}/routes/{other['route']}/delete",
        f"/mail-receivers/{other['box']}/delete",
    ):
        assert admin.get(url).status_code == 404, url
        assert admin.post(url, {"confirm": "yes"}).status_code == 404, url
        assert "globex" not in admin.get(url).text


# --- audit rows of configuration changes -------------------------------------------------------


def test_config_changes_write_audit_rows_naming_the_changed_fields_never_a_secret(
    world: dict[str, Any], admin: Browser
) -> None:
    form = {
        "name": "relay",
        "host": "smtp.example.com",
        "port": "587",
        "security": "starttls",
        "verify_tls": "on",
        "from_address": "news@example.com",
        "enabled": "on",
        "uncertain_policy": "retry",
    }
    created = admin.post("/mail-servers/", form)
    assert created.status_code == 303, created.text
    server = db.session.scalar(
        select(MailSendServerConfig).where(MailSendServerConfig.name == "relay")
    )
    assert server is not None
    changed = form | {"port": "465", "security": "ssl", "password": "brand-new-secret-value"}
    assert admin.post(f"/mail-servers/{server.id}", changed).status_code == 303
    [added] = audit_rows("config_create")
    [updated] = audit_rows("config_update")
    for row in (added, updated):
        assert (row.tenant_id, row.target_type, row.target_id) == (
            world["acme"],
            "mail_server",
            str(server.id),
        )
        assert row.actor_label == "admin@acme.test"
    assert "'relay'" in added.remark
    assert "Port" in updated.remark
    assert "Security" in updated.remark
    assert "Password" in updated.remark
    assert "Host" not in updated.remark  # unchanged fields are not named
    every = repr([(e.remark, e.target_id) for e in audit_rows("config_update")])
    assert "brand-new-secret-value" not in every
    assert SMTP_PASSWORD not in every

    # A route added through the portal has its row too.
    pid = world["acme_ids"]["provider"]
    assert admin.post(f"/sms-providers/{pid}/routes", {"country": "FR"}).status_code == 303
    route_rows = [e for e in audit_rows("config_create") if e.target_type == "sms_route"]
    assert len(route_rows) == 1
    assert "FR" in route_rows[0].remark
