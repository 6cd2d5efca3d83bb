"""A changed template is first rendered against the variables of its recent
sends (counts of renders, refusals with the missing names, failures with the first errors,
samples beside the current version), then saved on confirmation; a template with no sends
saves at once; the same check is a button that saves nothing."""

from __future__ import annotations

from typing import Any

import pytest
from flask import Flask

from portal.extensions import db
from portal.messaging.templating import dry_run as template_dry_run
from portal.models import MailSendRecord, MailTemplate
from tests.integration.test_portal_templates import Portal, mail_form, world

__all__ = ["world"]


@pytest.fixture
def admin(app: Flask, world: dict[str, Any]) -> Portal:
    return Portal(app, "admin@acme.test")


def sends(tenant_id: int, variables: list[dict[str, Any]]) -> None:
    for v in variables:
        db.session.add(
            MailSendRecord(
                tenant_id=tenant_id,
                to_addrs=["a@example.com"],
                template_code="welcome",
                variables=v,
            )
        )
    db.session.commit()


def template(template_id: int) -> MailTemplate:
    db.session.expire_all()
    row = db.session.get(MailTemplate, template_id)
    assert row is not None
    return row


def test_a_change_is_checked_against_recent_sends_before_it_is_saved(
    admin: Portal, world: dict[str, Any]
) -> None:
    tid = world["acme"]["mail"]
    sends(world["acme_id"], [{"name": "Ann", "plan": "pro"}] * 3 + [{"name": "Bob"}] * 2)
    before = template(tid)
    version = before.version
    changed = mail_form(before, html_body="<p>Hi {{ name }}, {{ plan | upcase }}</p>")
    shown = admin.post(f"/mail-templates/{tid}", changed)
    assert shown.status_code == 200, shown.text[:500]
    assert 'id="dry-run-confirm"' in shown.text
    assert "Checked 5 of 5 recent sends" in shown.text
    assert 'id="dry-run-rendered">3<' in shown.text
    assert 'id="dry-run-refused">2<' in shown.text
    assert "plan</span> (2)" in shown.text
    assert shown.text.count('<tr><td class="mono"><pre>') == 3  # three samples
    assert "Hi Ann, PRO" in shown.text
    assert template(tid).version == version  # not saved yet
    saved = admin.post(f"/mail-templates/{tid}", changed | {"dry_run_seen": "yes"})
    assert saved.status_code == 303
    assert template(tid).version == version + 1


def test_failures_are_counted_with_the_first_errors(admin: Portal, world: dict[str, Any]) -> None:
    tid = world["acme"]["mail"]
    sends(world["acme_id"], [{"name": "Ann", "n": "x"}])
    changed = mail_form(
        template(tid), html_body="<p>{{ name }}{{ n | divided_by: 0 }}</p>", strict_variables=""
    )
    shown = admin.post(f"/mail-templates/{tid}", changed)
    assert shown.status_code == 200
    assert 'id="dry-run-failed">1<' in shown.text
    assert 'id="dry-run-errors"' in shown.text


def test_a_template_without_sends_saves_at_once_and_a_non_content_change_too(
    admin: Portal, world: dict[str, Any]
) -> None:
    tid = world["acme"]["mail"]
    saved = admin.post(f"/mail-templates/{tid}", mail_form(template(tid), subject="New {{ name }}"))
    assert saved.status_code == 303
    sends(world["acme_id"], [{}])
    renamed = admin.post(f"/mail-templates/{tid}", mail_form(template(tid), name="Renamed"))
    assert renamed.status_code == 303


def test_the_check_button_saves_nothing(admin: Portal, world: dict[str, Any]) -> None:
    tid = world["acme"]["mail"]
    sends(world["acme_id"], [{"name": "Ann"}])
    before = template(tid).version
    checked = admin.post(
        f"/mail-templates/{tid}/dry-run",
        mail_form(template(tid), subject="Hey {{ name }}"),
        htmx=True,
    )
    assert checked.status_code == 200
    assert checked.text.lstrip().startswith('<section id="dry-run"')
    assert "Checked 1 of 1 recent send" in checked.text
    assert "Hey Ann" in checked.text
    assert 'id="dry-run-confirm"' not in checked.text
    assert template(tid).version == before
    bad = admin.post(f"/mail-templates/{tid}/dry-run", mail_form(template(tid), subject=""))
    assert bad.status_code == 422


def test_the_budget_stops_the_run_and_says_how_far_it_got(world: dict[str, Any]) -> None:
    sends(world["acme_id"], [{"name": "Ann"}] * 5)
    row = template(world["acme"]["mail"])
    result = template_dry_run.run(
        db.session, row, ("Hi {{ name }}", "<p>x</p>", None), strict=True, budget_s=0
    )
    assert (result.found, result.complete) == (5, False)
    assert result.checked < 5


def test_with_no_sends_the_check_uses_the_sample_variables(
    admin: Portal, world: dict[str, Any]
) -> None:
    tid = world["acme"]["mail"]
    checked = admin.post(
        f"/mail-templates/{tid}/dry-run",
        mail_form(template(tid), subject="Hey {{ name }} {{ plan }}", variables='{"name": "Ann"}'),
        htmx=True,
    )
    assert checked.status_code == 200
    assert "checked against the sample variables" in checked.text
    assert 'id="dry-run-refused">1<' in checked.text
