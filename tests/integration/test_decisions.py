"""The "needs a decision" list: every Uncertain record and every Failed,
DeadLetter or Suppressed one with an unresolved ambiguous attempt, mail and SMS, of the viewed
tenant only (operators: every tenant); the dashboard counts them."""

from __future__ import annotations

from flask import Flask

from portal.extensions import db
from tests.conftest import make_tenant
from tests.integration.test_portal_records import cheap_passwords, mail, signed_in, sms, user

__all__ = ["cheap_passwords"]


def test_the_list_holds_what_needs_a_decision_and_nothing_else(
    app: Flask, cheap_passwords: None
) -> None:
    acme, globex = make_tenant("acme").id, make_tenant("globex").id
    db.session.commit()
    user("support@acme.example.com", "support", acme)
    user("operator@postroom.example.com", "platform_operator", -1)
    listed = {
        "uncertain-sms": f"sms-records/{sms(acme, status='Uncertain', ambiguous_attempt=True)}",
        "failed-mail": f"mail-records/{mail(acme, status='Failed', ambiguous_attempt=True)}",
        "dead-sms": f"sms-records/{sms(acme, status='DeadLetter', ambiguous_attempt=True)}",
        "suppressed": f"mail-records/{mail(acme, status='Suppressed', ambiguous_attempt=True)}",
    }
    left_out = {
        "plain-failed": f"sms-records/{sms(acme, status='Failed')}",
        "retrying": f"mail-records/{mail(acme, status='Retry', ambiguous_attempt=True)}",
        "sent": f"sms-records/{sms(acme, status='Sent', ambiguous_attempt=True)}",
        "resolved": "sms-records/"
        + str(sms(acme, status="Failed", ambiguous_attempt=True, resolution="failed")),
    }
    other = f"sms-records/{sms(globex, status='Uncertain', ambiguous_attempt=True)}"
    client, _ = signed_in(app, "support@acme.example.com")
    page = client.get("/decisions/")
    assert page.status_code == 200
    for rid in listed.values():
        assert f'/{rid}"' in page.text
    for rid in [*left_out.values(), other]:
        assert f'/{rid}"' not in page.text
    assert "Needs a decision" in page.text  # in the navigation
    dashboard = client.get("/").text
    assert "4</strong> messages need a decision" in dashboard

    operator, _ = signed_in(app, "operator@postroom.example.com", view_tenant="all")
    everyone = operator.get("/decisions/").text
    assert f'/{other}"' in everyone
    assert operator.get("/decisions/?channel=fax").status_code == 422
    only_sms = operator.get("/decisions/?channel=sms").text
    assert f'/{listed["failed-mail"]}"' not in only_sms


def test_an_ambiguous_record_that_ended_unsent_is_resolved_from_the_list_once(
    app: Flask, cheap_passwords: None
) -> None:
    """Resolve applies to everything the list holds: "not sent" keeps a dead letter's status
    and error and takes it off the list; "accepted" makes an ambiguous Failed record Sent;
    a record without an ambiguous attempt, or one decided already, is 409."""
    from portal.models import MailSendRecord, SmsSendRecord
    from tests.conftest import make_api_key

    acme = make_tenant("acme").id
    token = make_api_key(acme)
    db.session.commit()
    user("admin@acme.example.com", "tenant_admin", acme)
    dead = sms(acme, status="DeadLetter", ambiguous_attempt=True, error_code="503")
    failed = mail(acme, status="Failed", ambiguous_attempt=True, error_code="421")
    plain = mail(acme, status="Failed", error_code="550")
    db.session.commit()
    client, _ = signed_in(app, "admin@acme.example.com")
    page = client.get(f"/sms-records/{dead}").text
    assert "It was not sent" in page  # the resolve forms are offered on the record page

    headers = {"Authorization": f"Bearer {token}"}
    answer = app.test_client().post(
        f"/api/v1/sms/{dead}/resolve",
        json={"outcome": "failed", "reason": "not in the provider's log"},
        headers=headers,
    )
    assert answer.status_code == 200, answer.json
    db.session.expire_all()
    row = db.session.get(SmsSendRecord, dead)
    assert row is not None
    assert (row.status, row.error_code, row.resolution) == ("DeadLetter", "503", "failed")
    assert row.ambiguous_attempt
    assert f'/sms-records/{dead}"' not in client.get("/decisions/").text
    again = app.test_client().post(
        f"/api/v1/sms/{dead}/resolve",
        json={"outcome": "failed", "reason": "twice"},
        headers=headers,
    )
    assert again.status_code == 409

    accepted = app.test_client().post(
        f"/api/v1/mail/{failed}/resolve",
        json={"outcome": "accepted", "providerMessageId": "pm-77"},
        headers=headers,
    )
    assert accepted.status_code == 200, accepted.json
    db.session.expire_all()
    sent = db.session.get(MailSendRecord, failed)
    assert sent is not None
    assert (sent.status, sent.provider_message_id, sent.resolution) == ("Sent", "pm-77", "accepted")

    refused = app.test_client().post(
        f"/api/v1/mail/{plain}/resolve",
        json={"outcome": "failed", "reason": "x"},
        headers=headers,
    )
    assert refused.status_code == 409


def test_the_count_and_the_list_read_only_the_records_that_need_a_decision(app: Flask) -> None:
    """A tenant with 5,000 plain failures and three records needing a decision: the count's
    and the list's plans walk the partial index (migration 0018) and touch only those three,
    not the failures (EXPLAIN ANALYZE of the statements the page runs)."""
    import json

    from sqlalchemy import text

    from portal.web.records import decisions
    from portal.web.records.mail_records import MAIL

    acme = make_tenant("acme").id
    db.session.commit()
    db.session.execute(
        text(
            "INSERT INTO mail_send_record (tenant_id, scope, status, version, retry_count, "
            "to_addrs, subject, text_body, created_time, updated_time) "
            "SELECT :t, 'TENANT', 'Failed', 3, 0, '[\"a@example.com\"]', 'S', 'T', now(), now() "
            "FROM generate_series(1, 5000)"
        ),
        {"t": acme},
    )
    needing = [
        mail(acme, status="Failed", ambiguous_attempt=True),
        mail(acme, status="DeadLetter", ambiguous_attempt=True),
        mail(acme, status="Uncertain", ambiguous_attempt=True),
    ]
    db.session.commit()
    db.session.execute(text("ANALYZE mail_send_record"))
    assert decisions.count(MAIL, acme) == (3, False)
    assert [r.id for r in decisions.section(MAIL, acme, None).rows] == sorted(needing)[::-1]

    statements: list[str] = []

    from sqlalchemy import event

    def capture(_c: object, _cur: object, statement: str, params: object, *_: object) -> None:
        statements.append(statement % {k: repr(v) for k, v in dict(params or {}).items()})  # type: ignore[call-overload]

    event.listen(db.engine, "before_cursor_execute", capture)
    try:
        decisions.count(MAIL, acme)
        decisions.section(MAIL, acme, None)
    finally:
        event.remove(db.engine, "before_cursor_execute", capture)
    for sql in statements:
        if "mail_send_record" not in sql:
            continue  # the rows' diagnoses: read by the listed rows' own ids and addresses
        plan = db.session.execute(text(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}")).scalar_one()
        db.session.rollback()
        nodes, stack = [], [plan[0]["Plan"]]
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.get("Plans", []))
        assert any(n.get("Index Name") == "idx_mail_send_needs_decision" for n in nodes), sql
        for node in nodes:
            assert node["Node Type"] != "Seq Scan", json.dumps(plan)[:1500]
            assert node.get("Actual Rows", 0) <= 10, json.dumps(plan)[:1500]
            assert node.get("Rows Removed by Filter", 0) <= 10, json.dumps(plan)[:1500]
