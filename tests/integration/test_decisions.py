"""The "needs a decision" list (issue 13, part 4): every Uncertain record and every Failed,
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
