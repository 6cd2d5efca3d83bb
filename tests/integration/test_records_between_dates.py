"""A records list between dates is newest first by creation time and pages by keyset on it
(bench/pages.py: "a week two months ago" walked the primary key back from today),
on PostgreSQL: every record of the dates once, in creation order, none from outside them;
another tenant's record as the cursor positions nothing."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

import pytest
from flask import Flask
from sqlalchemy import update

from portal.extensions import db
from portal.models import MailSendRecord
from portal.web.records import listing
from tests.integration.test_portal_records import (
    SUPPORT,
    World,
    cheap_passwords,
    mail,
    signed_in,
    world,
)

__all__ = ["cheap_passwords", "world"]  # fixtures, imported for pytest

DAY = datetime(2026, 3, 10, 12, tzinfo=UTC)


def _created(record_id: int, when: datetime) -> None:
    db.session.execute(
        update(MailSendRecord).where(MailSendRecord.id == record_id).values(created_time=when)
    )


def test_between_dates_newest_first_by_creation_time_in_keyset_pages(
    app: Flask, world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(listing, "PAGE_SIZE", 3)
    # Ids and creation times disagree, as when a long transaction commits after a short one;
    # two share a creation time (one transaction's batch).
    minutes = [50, 10, 40, 40, 30, 20, 0]
    ids = [mail(world.acme, status="Sent", to=f"r{i}@example.com") for i in range(7)]
    outside = [mail(world.acme, status="Sent", to="x@example.com") for _ in range(2)]
    for record_id, minute in zip(ids, minutes, strict=True):
        _created(record_id, DAY + timedelta(minutes=minute))
    _created(outside[0], DAY - timedelta(days=2))
    _created(outside[1], DAY + timedelta(days=2))
    db.session.commit()
    client, _ = signed_in(app, SUPPORT)
    seen: list[int] = []
    url = "/mail-records/?from=2026-03-10&to=2026-03-10"
    for _ in range(5):
        page = client.get(url)
        assert page.status_code == 200
        seen += [int(i) for i in re.findall(r'href="/mail-records/(\d+)"', page.text)]
        older = re.search(r'href="([^"]*before=\d+[^"]*)" rel="next"', page.text)
        if older is None:
            break
        url = older.group(1).replace("&amp;", "&")
    wanted = sorted(ids, key=lambda i: (minutes[ids.index(i)], i), reverse=True)
    assert seen == wanted


def test_another_tenants_record_as_the_cursor_positions_nothing(app: Flask, world: World) -> None:
    mine = mail(world.acme, status="Sent", to="a@example.com")
    _created(mine, DAY)
    _created(world.mail_other, DAY + timedelta(hours=1))  # globex's, later the same day
    db.session.commit()
    client, _ = signed_in(app, SUPPORT)
    page = client.get(
        "/mail-records/",
        query_string={"from": "2026-03-10", "to": "2026-03-10", "before": world.mail_other},
    )
    assert page.status_code == 200
    assert f'href="/mail-records/{mine}"' not in page.text
