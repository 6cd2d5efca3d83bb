"""The status-callback pages over HTTP (Flask's test client, real PostgreSQL, a local
receiver): the secret shown once, a test event, resend, replay, edit, delete, the record's
callbacks, private URLs refused at save, and another tenant's endpoints never reached."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
from flask import Flask
from sqlalchemy import select

from portal.extensions import db
from portal.importer import ConfigImportError, import_config
from portal.models import CallbackDelivery, CallbackEndpoint
from portal.tenancy import PLATFORM_TENANT_ID
from tests.conftest import make_tenant
from tests.integration.test_portal_templates import Portal, user
from tests.support.callback_receiver import CallbackReceiver
from tests.support.delivery import accept_mail

MAIL_PAGES = "/mail-records"
SECRET = re.compile(r'value="(whsec_[A-Za-z0-9+/=]+)"')


@pytest.fixture
def receiver() -> Iterator[CallbackReceiver]:
    with CallbackReceiver() as server:
        yield server


@pytest.fixture
def world(app: Flask) -> dict[str, Any]:
    acme, globex = make_tenant("acme"), make_tenant("globex")
    user("admin@acme.test", "tenant_admin", acme.id)
    user("support@acme.test", "support", acme.id)
    user("admin@globex.test", "tenant_admin", globex.id)
    user("operator@postroom.test", "platform_operator", PLATFORM_TENANT_ID)
    db.session.commit()
    return {"acme": acme.id, "globex": globex.id}


def test_an_admin_adds_tests_and_replays_an_endpoint(
    app: Flask, world: dict[str, Any], receiver: CallbackReceiver
) -> None:
    admin = Portal(app, "admin@acme.test")
    page = admin.post("/callbacks/", {"name": "orders", "url": receiver.url(), "events": ["x"]})
    assert page.status_code == 422
    assert "Events must be among" in page.text
    page = admin.post(
        "/callbacks/",
        {"name": "orders", "url": receiver.url(), "events": ["mail.queued", "mail.sent"]},
    )
    assert page.status_code == 200
    secret = SECRET.search(page.text)
    assert secret is not None
    endpoint = db.session.scalar(select(CallbackEndpoint))
    assert endpoint is not None
    assert endpoint.secret == secret.group(1)
    assert secret.group(1) not in endpoint.secret_encrypted
    shown = admin.get(f"/callbacks/{endpoint.id}")
    assert shown.status_code == 200
    assert secret.group(1) not in shown.text
    # A test event, posted while the admin waits, verified by the receiver.
    answer = admin.post(f"/callbacks/{endpoint.id}/test")
    assert answer.status_code == 303
    assert [m["type"] for m in receiver.verified(secret.group(1))] == ["test"]
    assert "delivered" in admin.get(f"/callbacks/{endpoint.id}").text
    # A record's events land in the log and on the record's page.
    rid = accept_mail(app, world["acme"])
    (queued,) = db.session.scalars(
        select(CallbackDelivery).where(CallbackDelivery.record_id == rid)
    ).all()
    fragment = admin.get(f"/callbacks/records/mail/{rid}", headers={"HX-Request": "true"})
    assert fragment.status_code == 200
    assert "mail.queued" in fragment.text
    assert f"/callbacks/records/mail/{rid}" in admin.get(f"{MAIL_PAGES}/{rid}").text
    # Resend and replay keep the webhook-id.
    db.session.execute(
        CallbackDelivery.__table__.update()
        .where(CallbackDelivery.id == queued.id)
        .values(status="dead")
    )
    db.session.commit()
    assert admin.post(f"/callbacks/{endpoint.id}/deliveries/{queued.id}/resend").status_code == 303
    db.session.expire_all()
    assert db.session.get(CallbackDelivery, queued.id).status == "pending"  # type: ignore[union-attr]
    assert (
        admin.post(f"/callbacks/{endpoint.id}/replay", {"since": "2020-01-01T00:00"}).status_code
        == 303
    )
    assert admin.post(f"/callbacks/{endpoint.id}/replay", {"since": "soon"}).status_code == 303
    # Rotate: a new secret shown once.
    rotated = admin.post(f"/callbacks/{endpoint.id}/rotate")
    new = SECRET.search(rotated.text)
    assert new is not None
    assert new.group(1) != secret.group(1)
    # Edit and delete.
    edited = admin.post(
        f"/callbacks/{endpoint.id}/edit",
        {"name": "orders", "url": receiver.url("/v2"), "events": ["sms.sent"]},
    )
    assert edited.status_code == 303
    db.session.expire_all()
    assert endpoint.event_list == ["sms.sent"]
    assert endpoint.enabled is False  # the box was not ticked
    assert admin.post(f"/callbacks/{endpoint.id}/delete", {"confirm": "yes"}).status_code == 303
    assert db.session.scalar(select(CallbackEndpoint)) is None


def test_private_urls_are_refused_at_save(app: Flask, world: dict[str, Any]) -> None:
    app.config["SETTINGS"] = app.config["SETTINGS"].replace(callback_allow_private=False)
    try:
        admin = Portal(app, "admin@acme.test")
        for url in ("http://127.0.0.1:8080/", "http://[::1]/", "https://169.254.169.254/x"):
            page = admin.post("/callbacks/", {"name": "x", "url": url, "events": ["mail.sent"]})
            assert page.status_code == 422, url
            assert "private" in page.text
        with pytest.raises(ConfigImportError, match="private"):
            import_config(
                db.session(),
                {
                    "callbacks": [
                        {
                            "tenant": "acme",
                            "name": "x",
                            "url": "http://10.0.0.1/",
                            "events": ["mail.sent"],
                        }
                    ]
                },
            )
        db.session.rollback()
    finally:
        app.config["SETTINGS"] = app.config["SETTINGS"].replace(callback_allow_private=True)


def test_import_config_generates_a_secret_once(app: Flask, world: dict[str, Any]) -> None:
    entry = {"tenant": "acme", "name": "hook", "url": "http://127.0.0.1:9/", "events": ["sms.sent"]}
    report = import_config(db.session(), {"callbacks": [entry]})
    db.session.commit()
    assert any("whsec_" in note for note in report.notes)
    again = import_config(db.session(), {"callbacks": [entry]})
    db.session.commit()
    assert not again.notes
    with pytest.raises(ConfigImportError, match="events"):
        import_config(db.session(), {"callbacks": [entry | {"events": ["mail.accepted"]}]})
    db.session.rollback()


def test_other_tenants_and_support_are_kept_out(
    app: Flask, world: dict[str, Any], receiver: CallbackReceiver
) -> None:
    row = CallbackEndpoint(tenant_id=world["globex"], name="g", url=receiver.url())
    row.event_list = ["mail.queued"]
    row.secret = "whsec_" + "A" * 32
    db.session.add(row)
    db.session.commit()
    rid = accept_mail(app, world["globex"])
    (delivery,) = db.session.scalars(select(CallbackDelivery)).all()
    admin = Portal(app, "admin@acme.test")
    for url in (f"/callbacks/{row.id}", f"/callbacks/{row.id}/edit", f"/callbacks/{row.id}/delete"):
        assert admin.get(url).status_code == 404, url
    for url in (
        f"/callbacks/{row.id}/test",
        f"/callbacks/{row.id}/rotate",
        f"/callbacks/{row.id}/deliveries/{delivery.id}/resend",
        f"/callbacks/{row.id}/replay",
    ):
        assert admin.post(url, {"since": "2020-01-01T00:00"}).status_code == 404, url
    assert admin.get(f"/callbacks/records/mail/{rid}").status_code == 404
    assert "g" not in [
        e.name for e in db.session.scalars(select(CallbackEndpoint)) if e.tenant_id == world["acme"]
    ]
    support = Portal(app, "support@acme.test")
    assert support.get("/callbacks/").status_code == 403
    assert not receiver.received
