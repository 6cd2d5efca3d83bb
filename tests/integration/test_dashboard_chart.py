"""The dashboard's 24-hour chart (bench/pages.py): over every tenant it counts from the
indexes (totals from created_time, failures down (status, updated_time)) and must give what the
per-tenant reading of the rows gives, on PostgreSQL and SQLite."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from flask import Flask
from sqlalchemy import update

from portal.extensions import db
from portal.models import MailSendRecord
from portal.web.operations import dashboard
from portal.web.records.mail_records import MAIL
from tests.conftest import make_tenant
from tests.integration.test_portal_records import mail


def test_the_all_tenants_chart_counts_what_each_tenant_chart_counts(
    any_app: Flask, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dashboard, "PAST_HOURS_S", 0.0)  # every call reads every hour
    tenants = [make_tenant(f"chart{i}").id for i in range(3)]
    db.session.commit()
    now = datetime.now(UTC)
    hour = now.replace(minute=0, second=0, microsecond=0)

    def record(tenant: int, status: str, created: datetime, updated: datetime) -> None:
        rid = mail(tenant, status=status)
        db.session.execute(
            update(MailSendRecord)
            .where(MailSendRecord.id == rid)
            .values(created_time=created, updated_time=updated)
        )
        db.session.commit()

    plan = [
        # (tenant, status, hours ago created, minutes after creation updated)
        (0, "Sent", 0, 1),
        (1, "Failed", 0, 5),
        (2, "DeadLetter", 3, 120),  # failed two hours after it was created
        (0, "Failed", 23, 30),  # the chart's first hour
        (1, "Sent", 23, 1),
        (2, "Failed", 5, -2),  # updated_time a little before created_time (a long transaction)
        (0, "Pending", 7, 0),
        (1, "Failed", 30, 600),  # created before the chart's first hour: not counted
        (2, "Sent", 48, 1),
    ]
    for index, status, ago, later in plan:
        created = hour - timedelta(hours=ago) + timedelta(minutes=1)
        record(tenants[index], status, created, created + timedelta(minutes=later))

    every = dashboard.hourly(MAIL, None, now)
    each = [dashboard.hourly(MAIL, t, now) for t in tenants]
    assert [(h.start, h.total, h.failed) for h in every] == [
        (h.start, sum(e[i].total for e in each), sum(e[i].failed for e in each))
        for i, h in enumerate(every)
    ]
    by_hours_ago = {23 - i: (h.total, h.failed) for i, h in enumerate(every) if h.total}
    assert by_hours_ago == {0: (2, 1), 3: (1, 1), 5: (1, 1), 7: (1, 0), 23: (2, 1)}


def test_the_hours_before_this_one_are_read_once_a_minute(
    app: Flask, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dashboard refresh reads this hour's records; the hours before it come from the
    last full read while it is under PAST_HOURS_S old (same hour, same engine and scope)."""
    tenant = make_tenant("cached").id
    db.session.commit()
    dashboard._past_hours.clear()
    now = datetime.now(UTC)
    hour = now.replace(minute=0, second=0, microsecond=0)

    def created(hours_ago: int, status: str = "Sent") -> None:
        rid = mail(tenant, status=status)
        when = hour - timedelta(hours=hours_ago) + timedelta(seconds=1)
        db.session.execute(
            update(MailSendRecord)
            .where(MailSendRecord.id == rid)
            .values(created_time=when, updated_time=when)
        )
        db.session.commit()

    def chart() -> dict[int, tuple[int, int]]:
        hours = dashboard.hourly(MAIL, tenant, now)
        return {23 - i: (h.total, h.failed) for i, h in enumerate(hours) if h.total}

    created(2)
    assert chart() == {2: (1, 0)}
    created(2, "Failed")  # an earlier hour, while the read of it is fresh: not yet
    created(0, "Failed")  # this hour: at once
    assert chart() == {2: (1, 0), 0: (1, 1)}
    monkeypatch.setattr(dashboard, "PAST_HOURS_S", 0.0)
    assert chart() == {2: (2, 1), 0: (1, 1)}
