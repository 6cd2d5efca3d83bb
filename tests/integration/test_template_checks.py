"""A send's template is checked at acceptance (API, real PostgreSQL): unknown,
disabled and another tenant's codes and ids, missing variables (single and batch, with the
index), optional variables, empty values, strict off; the seed's test points after
acceptance; ``templateVersion`` on records; the per-process cache."""

from __future__ import annotations

import time
from typing import Any

import pytest
from flask import Flask
from flask.testing import FlaskClient
from sqlalchemy import update

from portal.extensions import db
from portal.messaging.records.retry import retry_records
from portal.messaging.templating import checks as template_checks
from portal.messaging.templating import rendering as templating
from portal.models import MailSendRecord, MailTemplate, SmsTemplate
from portal.tenancy import PLATFORM_TENANT_ID
from tests.conftest import make_api_key, make_tenant
from tests.support.delivery import drain, mail_server, record
from tests.support.smtp_server import ScriptedSmtpServer

TO = ["ann@example.com"]
PHONE = "+447911123456"
WELCOME = {
    "subject": "Welcome, {{ name }}",
    "html_body": (
        "<p>Welcome, {{ name }}. Your plan: {{ plan | upcase }}.</p>"
        "{% if vip %}<p>{{ perk }}</p>{% endif %}<p>{{ footer | default: 'Bye' }}</p>"
    ),
    "text_body": None,
}


@pytest.fixture
def client(app: Flask) -> FlaskClient:
    return app.test_client()


@pytest.fixture
def keys(app: Flask) -> dict[str, Any]:
    acme, globex = make_tenant("acme"), make_tenant("globex")
    values = {
        "acme": make_api_key(acme.id),
        "globex": make_api_key(globex.id),
        "acme_id": acme.id,
        "globex_id": globex.id,
    }
    db.session.commit()
    return values


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def mail_template(tenant_id: int, code: str = "welcome", **fields: Any) -> MailTemplate:
    row = MailTemplate(tenant_id=tenant_id, code=code, name=code, **(WELCOME | fields))
    db.session.add(row)
    db.session.commit()
    return row


def post(client: FlaskClient, token: str, body: dict[str, Any], path: str = "/api/v1/mail") -> Any:
    return client.post(path, json=body, headers=auth(token))


def error(response: Any) -> dict[str, Any]:
    assert response.status_code == 422, response.json
    body: dict[str, Any] = response.json["error"]
    return body


def test_a_new_template_is_strict_and_names_what_it_needs(keys: dict[str, Any]) -> None:
    assert mail_template(keys["acme_id"]).strict_variables is True
    needs = templating.variable_needs(
        [WELCOME["subject"], WELCOME["html_body"], "{% assign x = 'a' %}{{ x }}{{ user.name }}"]
    )
    # name and plan are output (plan through a filter), perk inside an if body; vip only in a
    # condition and footer only under default are optional; x is the template's own.
    assert needs.needed == ("name", "perk", "plan", "user")
    assert needs.optional == ("footer", "vip")


def test_unknown_code_is_refused_naming_template_code(
    client: FlaskClient, keys: dict[str, Any]
) -> None:
    for path, body in (
        ("/api/v1/mail", {"to": TO, "templateCode": "nope"}),
        ("/api/v1/sms", {"phoneNumber": PHONE, "templateCode": "nope"}),
    ):
        found = error(post(client, keys["acme"], body, path))
        assert (found["code"], found["field"]) == ("not_found", "templateCode")
        assert "nope" in found["message"]


def test_disabled_code_is_refused_but_a_disabled_id_is_sendable(
    client: FlaskClient, keys: dict[str, Any]
) -> None:
    row = mail_template(keys["acme_id"], enabled=False)
    variables = {"name": "Ann", "plan": "pro", "perk": "x"}
    by_code = error(
        post(client, keys["acme"], {"to": TO, "templateCode": "welcome", "variables": variables})
    )
    assert by_code["field"] == "templateCode"
    by_id = post(client, keys["acme"], {"to": TO, "templateId": row.id, "variables": variables})
    assert by_id.status_code == 202, by_id.json


def test_another_tenants_code_and_id_are_refused_as_unknown(
    client: FlaskClient, keys: dict[str, Any]
) -> None:
    theirs = mail_template(keys["globex_id"])
    platform = mail_template(PLATFORM_TENANT_ID, code="shared")
    variables = {"name": "Ann", "plan": "pro", "perk": "x"}
    for body, field in (
        ({"templateCode": "welcome"}, "templateCode"),
        ({"templateId": theirs.id}, "templateId"),
        ({"templateCode": "shared"}, "templateCode"),
        ({"templateId": platform.id}, "templateId"),
    ):
        found = error(post(client, keys["acme"], {"to": TO, "variables": variables} | body))
        assert (found["code"], found["field"]) == ("not_found", field)


def test_missing_variables_are_refused_with_their_names(
    client: FlaskClient, keys: dict[str, Any]
) -> None:
    mail_template(keys["acme_id"])
    found = error(
        post(client, keys["acme"], {"to": TO, "templateCode": "welcome", "variables": {"x": 1}})
    )
    assert found["code"] == "missing_variables"
    assert found["field"] == "variables"
    assert found["missing"] == ["name", "perk", "plan"]
    assert "name" in found["message"]
    # No variables at all: the same.
    found = error(post(client, keys["acme"], {"to": TO, "templateCode": "welcome"}))
    assert found["missing"] == ["name", "perk", "plan"]


def test_sms_missing_variables(client: FlaskClient, keys: dict[str, Any]) -> None:
    db.session.add(SmsTemplate(tenant_id=keys["acme_id"], code="otp", content="Code {{ code }}"))
    db.session.commit()
    found = error(
        post(client, keys["acme"], {"phoneNumber": PHONE, "templateCode": "otp"}, "/api/v1/sms")
    )
    assert (found["code"], found["missing"]) == ("missing_variables", ["code"])
    ok = post(
        client,
        keys["acme"],
        {"phoneNumber": PHONE, "templateCode": "otp", "variables": {"code": "1"}},
        "/api/v1/sms",
    )
    assert ok.status_code == 202, ok.json
    # Content of its own: the template is not rendered, so nothing is needed.
    own = post(
        client,
        keys["acme"],
        {"phoneNumber": PHONE, "templateCode": "otp", "content": "Hi"},
        "/api/v1/sms",
    )
    assert own.status_code == 202, own.json


def test_a_batch_is_refused_whole_with_the_index_of_the_first_bad_item(
    client: FlaskClient, keys: dict[str, Any]
) -> None:
    mail_template(keys["acme_id"])
    good = {"to": TO, "templateCode": "welcome", "variables": {"name": "A", "plan": "p", "perk": 1}}
    bad = {"to": TO, "templateCode": "welcome", "variables": {"name": "A"}}
    response = post(client, keys["acme"], {"items": [good, good, bad, bad]}, "/api/v1/mail/batch")
    found = error(response)
    assert (found["code"], found["index"], found["missing"]) == (
        "missing_variables",
        2,
        ["perk", "plan"],
    )
    assert db.session.query(MailSendRecord).count() == 0
    unknown = {"to": TO, "templateCode": "nope"}
    found = error(post(client, keys["acme"], {"items": [good, unknown]}, "/api/v1/mail/batch"))
    assert (found["field"], found["index"]) == ("templateCode", 1)


def test_optional_empty_and_extra_variables_are_accepted(
    client: FlaskClient, keys: dict[str, Any]
) -> None:
    mail_template(keys["acme_id"])
    # vip (a condition) and footer (under default) left out; an empty name counts as given;
    # an unknown extra is fine.
    variables = {"name": "", "plan": "pro", "perk": None, "extra": "ignored"}
    response = post(
        client, keys["acme"], {"to": TO, "templateCode": "welcome", "variables": variables}
    )
    assert response.status_code == 202, response.json


def test_strict_off_keeps_todays_blanks(client: FlaskClient, keys: dict[str, Any]) -> None:
    mail_template(keys["acme_id"], strict_variables=False)
    response = post(client, keys["acme"], {"to": TO, "templateCode": "welcome"})
    assert response.status_code == 202, response.json


def test_a_request_with_its_own_subject_and_body_needs_nothing_of_the_template(
    client: FlaskClient, keys: dict[str, Any]
) -> None:
    mail_template(keys["acme_id"], subject="Hi {{ only_subject }}")
    own_subject = {"to": TO, "templateCode": "welcome", "subject": "Hello"}
    found = error(post(client, keys["acme"], own_subject))
    assert found["missing"] == ["name", "perk", "plan"]  # the bodies still render
    own_all = own_subject | {"text": "Body"}
    assert post(client, keys["acme"], own_all).status_code == 202


def test_disabled_after_acceptance_fails_at_preparation_and_retry_after_enabling_sends(
    app: Flask, client: FlaskClient, keys: dict[str, Any], smtp: ScriptedSmtpServer
) -> None:
    acme = keys["acme_id"]
    mail_server(acme, smtp)
    row = mail_template(acme)
    variables = {"name": "Ann", "plan": "pro", "perk": "x"}
    response = post(
        client, keys["acme"], {"to": TO, "templateCode": "welcome", "variables": variables}
    )
    assert response.status_code == 202
    rid = response.json["id"]
    row.enabled = False
    db.session.commit()
    drain(app)
    assert (record(rid).status, record(rid).error_code) == ("Failed", "TEMPLATE_NOT_RESOLVABLE")
    assert (
        client.get(f"/api/v1/mail/{rid}", headers=auth(keys["acme"])).json["templateVersion"]
        is None
    )
    row.enabled = True
    db.session.commit()
    assert retry_records(db.session, MailSendRecord, [rid], acme).requeued == [rid]
    db.session.commit()
    drain(app)
    assert record(rid).status == "Sent"
    shown = client.get(f"/api/v1/mail/{rid}", headers=auth(keys["acme"])).json
    assert shown["templateVersion"] == row.version
    assert shown["test"] is False


def test_empty_render_fails_content_invalid(
    app: Flask, client: FlaskClient, keys: dict[str, Any], smtp: ScriptedSmtpServer
) -> None:
    mail_server(keys["acme_id"], smtp)
    mail_template(keys["acme_id"], subject="Hi", html_body="{{ nothing }}")
    response = post(
        client,
        keys["acme"],
        {"to": TO, "templateCode": "welcome", "variables": {"nothing": ""}},
    )
    assert response.status_code == 202, response.json
    drain(app)
    assert record(response.json["id"]).error_code == "CONTENT_INVALID"


def test_a_version_saved_after_acceptance_that_needs_more_fails_then_retry_prepares_afresh(
    app: Flask, client: FlaskClient, keys: dict[str, Any], smtp: ScriptedSmtpServer
) -> None:
    acme = keys["acme_id"]
    mail_server(acme, smtp)
    row = mail_template(acme, subject="Hi", html_body="<p>{{ name }}</p>")
    response = post(
        client, keys["acme"], {"to": TO, "templateCode": "welcome", "variables": {"name": "A"}}
    )
    rid = response.json["id"]
    db.session.execute(
        update(MailTemplate)
        .where(MailTemplate.id == row.id)
        .values(html_body="<p>{{ name }} {{ coupon }}</p>", version=MailTemplate.version + 1)
    )
    db.session.commit()
    drain(app)
    failed = record(rid)
    assert (failed.status, failed.error_code) == ("Failed", "TEMPLATE_NOT_RESOLVABLE")
    assert "coupon" in (failed.error_message or "")
    db.session.execute(
        update(MailTemplate)
        .where(MailTemplate.id == row.id)
        .values(html_body="<p>{{ name }}</p>", version=MailTemplate.version + 1)
    )
    db.session.commit()
    assert retry_records(db.session, MailSendRecord, [rid], acme).requeued == [rid]
    db.session.commit()
    drain(app)
    sent = record(rid)
    assert (sent.status, sent.template_version) == ("Sent", 3)


def test_the_cache_keeps_a_found_code_at_most_a_second_and_never_a_miss(
    app: Flask, keys: dict[str, Any]
) -> None:
    acme = keys["acme_id"]
    calls: list[str] = []

    def fetch(sql: str, params: tuple[Any, ...]) -> tuple[Any, ...] | None:
        calls.append(sql)
        connection = db.session.connection()
        found = connection.exec_driver_sql(sql, params).fetchone()
        return None if found is None else tuple(found)

    template_checks.forget()
    assert template_checks.by_code(fetch, "mail", acme, "welcome") is None
    assert template_checks.by_code(fetch, "mail", acme, "welcome") is None
    assert len(calls) == 2  # a miss is never kept
    row = mail_template(acme)  # saved in this process: the kept look-ups are dropped
    first = template_checks.by_code(fetch, "mail", acme, "welcome")
    assert first is not None
    assert first.version == row.version
    count = len(calls)
    assert template_checks.by_code(fetch, "mail", acme, "welcome") == first
    assert len(calls) == count  # kept
    # Saved by another process (no ORM event here): seen within a second.
    db.session.execute(
        update(MailTemplate).where(MailTemplate.id == row.id).values(version=5, enabled=False)
    )
    db.session.commit()
    deadline = time.monotonic() + template_checks.FRESH_S + 0.5
    while (found := template_checks.by_code(fetch, "mail", acme, "welcome")) == first:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert found is not None
    assert (found.version, found.enabled) == (5, False)
