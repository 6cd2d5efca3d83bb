"""Bad input refused at the door (real PostgreSQL): SMS provider fields with CR/LF or control
characters refused alike by import-config and the portal's form (one rule, nothing half
imported); an API send that could never be sent answers 422 naming the field, single and in a
batch (accepted exactly when preparation could render it); a chunked body over the size limit
answers 413 through a real HTTP server, as one with a Content-Length does."""

from __future__ import annotations

import http.client
import itertools
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from flask import Flask
from flask.testing import FlaskClient
from sqlalchemy import func, select
from werkzeug.serving import BaseWSGIServer, make_server

from portal.extensions import db
from portal.messaging.sending import preparation
from portal.messaging.sending.classify import MarkerCode
from portal.models import (
    MailSendRecord,
    MailTemplate,
    SmsProviderConfig,
    SmsSendRecord,
    SmsTemplate,
    Tenant,
)
from tests.conftest import make_api_key, make_tenant
from tests.integration.test_portal_templates import Portal, user

TO = ["ann@example.com"]
PHONE = "+447911123456"


def count(model: Any) -> int:
    db.session.expire_all()
    return db.session.scalar(select(func.count()).select_from(model)) or 0


# --- import-config and the SMS provider form: one rule for text fields ---------------------------

# (form field, import-config field, a good value): the SMS provider's text fields.
PROVIDER_FIELDS = [
    ("name", "name", "acme-sms"),
    ("base_url", "baseUrl", "https://sms.example.com/v1"),
    ("account_id", "accountId", "AC123"),
    ("secret", "secret", "token-0001"),
    ("webhook_secret", "webhookSecret", "hook-0002"),
    ("sender_id", "senderId", "Acme"),
]
# Inside the value: the form trims what surrounds a typed value, so both see these as they are.
BAD = [
    ("\r\nX-Injected: 1", "must be one line"),
    ("\nsecond line", "must be one line"),
    ("\rcarriage", "must be one line"),
    ("\x07bell", "must not contain control characters"),
    ("\x00nul", "must not contain control characters"),
    ("\x1bescape", "must not contain control characters"),
    ("\x7fdelete", "must not contain control characters"),
]


def provider_file(**changes: str) -> dict[str, Any]:
    provider = {"tenant": "acme", "provider": "http_json"} | {
        field: good for _, field, good in PROVIDER_FIELDS
    }
    return {
        "tenants": [{"slug": "acme", "name": "Acme"}],
        "smsProviders": [provider | changes],
    }


def import_file(app: Flask, tmp_path: Path, data: dict[str, Any]) -> Any:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    return app.test_cli_runner().invoke(args=["import-config", str(path)])


@pytest.fixture
def admin(app: Flask) -> Portal:
    tenant = make_tenant("existing")
    user("admin@existing.test", "tenant_admin", tenant.id)
    db.session.commit()
    return Portal(app, "admin@existing.test")


@pytest.mark.parametrize(("form_field", "file_field", "good"), PROVIDER_FIELDS)
@pytest.mark.parametrize(("bad", "problem"), BAD)
def test_import_config_refuses_what_the_sms_provider_form_refuses_and_writes_nothing(
    app: Flask,
    tmp_path: Path,
    admin: Portal,
    form_field: str,
    file_field: str,
    good: str,
    bad: str,
    problem: str,
) -> None:
    value = good + bad
    result = import_file(app, tmp_path, provider_file(**{file_field: value}))
    assert result.exit_code != 0
    assert f"smsProviders[0]: {file_field} {problem}" in result.output
    assert "nothing was written" in result.output
    # All or nothing: the valid tenant listed before the bad provider is not written either.
    assert db.session.scalar(select(Tenant).where(Tenant.slug == "acme")) is None
    assert count(SmsProviderConfig) == 0

    form = {name: good for name, _, good in PROVIDER_FIELDS} | {
        "provider": "http_json",
        "enabled": "on",
        "uncertain_policy": "",
        form_field: value,
    }
    response = admin.post("/sms-providers/", form)
    assert response.status_code == 422
    assert problem in response.text
    assert count(SmsProviderConfig) == 0


def test_the_good_values_pass_both_and_a_tab_is_no_control_character(
    app: Flask, tmp_path: Path, admin: Portal
) -> None:
    result = import_file(app, tmp_path, provider_file(senderId="Acme\tLtd"))
    assert result.exit_code == 0, result.output
    assert db.session.scalar(select(SmsProviderConfig.sender_id)) == "Acme\tLtd"
    form = {name: good for name, _, good in PROVIDER_FIELDS} | {
        "provider": "http_json",
        "enabled": "on",
        "name": "second",
        "sender_id": "Acme\tLtd",
    }
    assert admin.post("/sms-providers/", form).status_code == 303
    assert count(SmsProviderConfig) == 2


def test_import_config_keeps_line_breaks_in_template_bodies_only(
    app: Flask, tmp_path: Path
) -> None:
    tenant = {"slug": "acme", "name": "Acme"}
    body = {"tenant": "acme", "code": "w", "subject": "Hi", "text": "Hello,\r\nAnn\n"}
    ok = import_file(app, tmp_path, {"tenants": [tenant], "mailTemplates": [body]})
    assert ok.exit_code == 0, ok.output
    sms = {"tenant": "acme", "code": "otp", "content": "Code:\n{{ code }}"}
    assert import_file(app, tmp_path, {"smsTemplates": [sms]}).exit_code == 0
    split = import_file(app, tmp_path, {"mailTemplates": [body | {"subject": "Hi\r\nBcc: x"}]})
    assert split.exit_code != 0
    assert "mailTemplates[0]: subject must be one line" in split.output


# --- a send that could never be sent is refused ------------------------------------------------

ABSENT = object()  # the field left out of the request (null reads the same)
VALUES = [ABSENT, "", " \n\t ", "Words"]


@pytest.fixture
def client(app: Flask) -> FlaskClient:
    return app.test_client()


@pytest.fixture
def acme(app: Flask) -> dict[str, Any]:
    tenant = make_tenant("acme")
    token = make_api_key(tenant.id)
    db.session.add_all(
        [
            MailTemplate(
                tenant_id=tenant.id,
                code="welcome",
                name="welcome",
                subject="Welcome",
                html_body="<p>Welcome</p>",
                text_body="Welcome",
                strict_variables=False,
            ),
            SmsTemplate(
                tenant_id=tenant.id,
                code="otp",
                name="otp",
                content="Your code",
                strict_variables=False,
            ),
        ]
    )
    db.session.commit()
    return {"id": tenant.id, "headers": {"Authorization": f"Bearer {token}"}}


def _given(**fields: Any) -> dict[str, Any]:
    return {name: value for name, value in fields.items() if value is not ABSENT}


def _content_fails(build: Any) -> bool:
    """Whether preparation refuses the record's content (its other failures here, such as no
    server or provider in the test, say nothing about the request)."""
    try:
        build()
    except preparation.PreparationFailed as exc:
        return exc.code == MarkerCode.CONTENT_INVALID
    return False


def _check(client: FlaskClient, headers: dict[str, str], path: str, item: dict[str, Any]) -> int:
    """Post ``item`` alone and second in a batch; both answer alike (422 naming the subject
    or a body, with the batch's index). Returns the status."""
    single = client.post(path, json=item, headers=headers)
    good = {"to": TO, "templateCode": "welcome"} if "mail" in path else {"phoneNumber": PHONE}
    good |= {} if "mail" in path else {"templateCode": "otp"}
    batch = client.post(f"{path}/batch", json={"items": [good, item]}, headers=headers)
    assert single.status_code in (202, 422), single.text
    if single.status_code == 202:
        assert batch.status_code == 202, (item, batch.text)
        return 202
    error = single.json["error"]  # type: ignore[index]
    assert error["field"] in ("subject", "html", "text", "content"), (item, error)
    assert batch.status_code == 422, (item, batch.text)
    assert batch.json["error"]["index"] == 1  # type: ignore[index]
    assert batch.json["error"]["field"] == error["field"]  # type: ignore[index]
    return 422


@pytest.mark.parametrize("template", [None, "welcome"])
def test_a_mail_is_accepted_exactly_when_its_subject_and_body_can_be_prepared(
    app: Flask, client: FlaskClient, acme: dict[str, Any], template: str | None
) -> None:
    settings = app.config["SETTINGS"]
    wrong = []
    for subject, html, text in itertools.product(VALUES, repeat=3):
        item = {"to": TO} | _given(
            templateCode=template or ABSENT, subject=subject, html=html, text=text
        )
        record = MailSendRecord(
            tenant_id=acme["id"],
            scope="TENANT",
            template_code=template,
            subject=item.get("subject"),
            html_body=item.get("html"),
            text_body=item.get("text"),
            to_addrs=TO,
        )
        fails = _content_fails(lambda r=record: preparation.build_mail(db.engine, r, settings))
        status = _check(client, acme["headers"], "/api/v1/mail", item)
        if (status == 422) != fails:
            wrong.append((item, status))
    assert not wrong, wrong
    # The review's case by name: an empty text in place of the template's body.
    refused = client.post(
        "/api/v1/mail",
        json={"to": TO, "templateCode": "welcome", "text": ""},
        headers=acme["headers"],
    )
    assert refused.status_code == 422
    assert refused.json["error"]["field"] == "text"  # type: ignore[index]
    db.session.rollback()


@pytest.mark.parametrize("template", [None, "otp"])
def test_an_sms_is_accepted_exactly_when_its_content_can_be_prepared(
    client: FlaskClient, acme: dict[str, Any], template: str | None
) -> None:
    wrong = []
    for content in VALUES:
        item = {"phoneNumber": PHONE} | _given(templateCode=template or ABSENT, content=content)
        if template is None and content is ABSENT:
            continue  # neither: refused as before, naming content
        record = SmsSendRecord(
            tenant_id=acme["id"],
            scope="TENANT",
            template_code=template,
            content=item.get("content"),
            phone_number=PHONE,
            country_code="GB",
        )
        fails = _content_fails(lambda r=record: preparation.build_sms(db.session(), r))
        status = _check(client, acme["headers"], "/api/v1/sms", item)
        if (status == 422) != fails:
            wrong.append((item, status))
    assert not wrong, wrong
    db.session.rollback()


def test_the_openapi_document_says_an_empty_subject_is_refused(client: FlaskClient) -> None:
    schemas = client.get("/api/v1/openapi.json").json["components"]["schemas"]  # type: ignore[index]
    mail = schemas["MailRequest"]["properties"]
    assert mail["subject"]["minLength"] == 1
    for name in ("subject", "html", "text"):
        assert "template" in mail[name]["description"]
    assert "White space only" in schemas["SmsRequest"]["properties"]["content"]["description"]


# --- a chunked body over the limit is 413 -------------------------------------------------------

LIMIT = 4096


@pytest.fixture
def server(app: Flask, monkeypatch: pytest.MonkeyPatch) -> Iterator[BaseWSGIServer]:
    """The app behind werkzeug's real HTTP server (which ends a chunked body at its last
    chunk, as gunicorn does), with a small size limit."""
    monkeypatch.setitem(app.config, "MAX_CONTENT_LENGTH", LIMIT)
    running = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=running.serve_forever, daemon=True)
    thread.start()
    yield running
    running.shutdown()
    thread.join()


def _body(size: int) -> bytes:
    """A valid mail request of exactly ``size`` bytes."""
    head = {"to": TO, "subject": "Sized", "text": ""}
    padding = size - len(json.dumps(head).encode())
    body = json.dumps(head | {"text": "x" * padding}).encode()
    assert len(body) == size
    return body


def _post(
    server: BaseWSGIServer, token: str, body: bytes, chunked: bool
) -> tuple[int, dict[str, Any]]:
    connection = http.client.HTTPConnection("127.0.0.1", server.server_port, timeout=10)
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    try:
        if chunked:
            pieces = [body[i : i + 1000] for i in range(0, len(body), 1000)]
            connection.request(
                "POST", "/api/v1/mail", body=iter(pieces), headers=headers, encode_chunked=True
            )
        else:
            connection.request("POST", "/api/v1/mail", body=body, headers=headers)
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def test_a_chunked_body_over_the_limit_is_413_as_one_with_a_length_is(
    app: Flask, server: BaseWSGIServer
) -> None:
    token = make_api_key(make_tenant("acme").id)
    db.session.commit()
    for chunked in (True, False):
        for size in (LIMIT + 1, LIMIT + 3000):
            status, answer = _post(server, token, _body(size), chunked)
            assert status == 413, (chunked, size, answer)
            assert answer["error"]["code"] == "request_entity_too_large"
    assert count(MailSendRecord) == 0
    for chunked in (True, False):
        for size in (LIMIT, LIMIT - 1, 200):
            status, answer = _post(server, token, _body(size), chunked)
            assert status == 202, (chunked, size, answer)
    assert count(MailSendRecord) == 6
    # A chunked body that is not JSON at all is still 400, not 413.
    connection = http.client.HTTPConnection("127.0.0.1", server.server_port, timeout=10)
    connection.request(
        "POST",
        "/api/v1/mail",
        body=iter([b"{not json"]),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        encode_chunked=True,
    )
    response = connection.getresponse()
    assert response.status == 400
    assert json.loads(response.read())["error"]["code"] == "malformed_json"
    connection.close()
