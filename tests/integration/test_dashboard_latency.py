"""A tenant's dashboard shows its own delivery: accepted-to-sent latency (p50, p95) of the last
hour and day, and the failure rate by server and stream, from its records alone, on PostgreSQL
and SQLite."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from flask import Flask

from portal.extensions import db
from portal.models import MailSendServerConfig
from portal.tenancy import PLATFORM_TENANT_ID
from portal.web.operations import dashboard
from portal.web.records.mail_records import MAIL
from tests.conftest import make_tenant
from tests.integration.test_portal_records import cheap_passwords, mail, signed_in, user

__all__ = ["cheap_passwords"]

ADMIN = "admin@latency.example.com"


def near(seconds: float) -> object:
    """SQLite's julianday arithmetic is within a few microseconds."""
    return pytest.approx(seconds, abs=1e-3)


def server(tenant: int, name: str) -> int:
    row = MailSendServerConfig(tenant_id=tenant, name=name, host="127.0.0.1", port=25)
    db.session.add(row)
    db.session.commit()
    return row.id


def sent(tenant: int, config: int, created: datetime, seconds: float, **fields: object) -> None:
    mail(
        tenant,
        status="Sent",
        server_config_id=config,
        created_time=created,
        sent_at=created + timedelta(seconds=seconds),
        **fields,
    )


@pytest.fixture
def world(any_app: Flask, cheap_passwords: None) -> dict[str, int]:
    dashboard._delivery.clear()
    acme, other = make_tenant("acme").id, make_tenant("globex").id
    db.session.commit()
    main, bulk = server(acme, "main"), server(acme, "bulk")
    theirs = server(other, "theirs")
    now = datetime.now(UTC)
    # In the order they were accepted, as ids follow acceptance. Not counted: two days ago.
    sent(acme, main, now - timedelta(days=2), 5000)
    # Earlier in the day: 10 broadcast through bulk, 100 to 1,000 seconds.
    for i in range(10):
        sent(acme, bulk, now - timedelta(hours=5), 100 * (i + 1), stream="broadcast")
    # Failures of the day: 1 before any server, 5 dead letters through bulk, 3 through main.
    mail(acme, "Failed", created_time=now - timedelta(hours=4))
    for _ in range(5):
        mail(
            acme,
            "DeadLetter",
            server_config_id=bulk,
            stream="broadcast",
            created_time=now - timedelta(hours=3),
        )
    for _ in range(3):
        mail(acme, "Failed", server_config_id=main, created_time=now - timedelta(hours=2))
    # The last hour: 20 sent through main, 1 to 20 seconds after they were accepted.
    for i in reversed(range(20)):
        sent(acme, main, now - timedelta(minutes=10 + i), i + 1)
    # Not counted: another tenant's, and one still pending.
    for i in range(4):
        sent(other, theirs, now - timedelta(minutes=5), 9000 + i)
    mail(other, "Failed", server_config_id=theirs, created_time=now - timedelta(minutes=5))
    mail(acme, "Pending", server_config_id=main, created_time=now - timedelta(minutes=1))
    return {"acme": acme, "other": other}


def test_latency_per_window_is_the_percentiles_of_accepted_to_sent(world: dict[str, int]) -> None:
    found = dashboard.delivery(MAIL, world["acme"], datetime.now(UTC))
    assert found is not None
    # percentile_cont: 1..20 s -> 10.5 and 19.05; with 100..1000 s -> 15.5 and 855.
    assert (found.hour.sent, found.hour.p50, found.hour.p95) == (20, near(10.5), near(19.05))
    assert (found.day.sent, found.day.p50, found.day.p95) == (30, near(15.5), near(855.0))


def test_failure_rate_by_server_and_stream(world: dict[str, int]) -> None:
    found = dashboard.delivery(MAIL, world["acme"], datetime.now(UTC))
    assert found is not None
    rows = [(r.config, r.stream, r.ended, r.failed) for r in found.routes]
    assert rows == [
        ("none chosen", "transactional", 1, 1),
        ("bulk", "broadcast", 15, 5),
        ("main", "transactional", 23, 3),
    ]
    assert found.routes[1].rate == pytest.approx(1 / 3)


def test_a_tenant_sees_only_its_own(world: dict[str, int], any_app: Flask) -> None:
    found = dashboard.delivery(MAIL, world["other"], datetime.now(UTC))
    assert found is not None
    assert (found.hour.sent, found.hour.p50) == (4, near(9001.5))
    assert [(r.config, r.ended, r.failed) for r in found.routes] == [("theirs", 5, 1)]
    assert dashboard.delivery(MAIL, None, datetime.now(UTC)) is None  # all tenants: none

    user(ADMIN, "tenant_admin", world["acme"])
    client, _ = signed_in(any_app, ADMIN)
    page = client.get("/").text
    table = page.split('id="failures-mail_records"', 1)[1].split("</table>", 1)[0]
    assert ">main<" in table
    assert "13.0%" in table  # 3 of 23
    assert "33.3%" in table  # 5 of 15
    assert "theirs" not in page
    latency = page.split('id="latency-mail_records"', 1)[1].split("</table>", 1)[0]
    assert '<td class="num">20</td>' in latency
    assert "9002" not in latency


def test_the_platform_tiers_servers_are_one_unnamed_line_for_a_tenant(
    world: dict[str, int],
) -> None:
    """A tenant's mail that fell back to the platform tier's servers is counted under
    "platform mail service", never under their names or as many lines as there are servers;
    an operator's read first (the figures are cached) changes nothing of that."""
    relays = [server(PLATFORM_TENANT_ID, name) for name in ("relay-one", "relay-two")]
    now = datetime.now(UTC)
    for i, relay in enumerate(relays):
        sent(world["acme"], relay, now - timedelta(minutes=30 + i), 2)
    mail(
        world["acme"],
        "Failed",
        server_config_id=relays[1],
        created_time=now - timedelta(hours=1, minutes=5),
    )

    seen_by_operator = dashboard.delivery(MAIL, world["acme"], now, operator=True)
    assert seen_by_operator is not None
    operator_rows = {(r.config, r.ended, r.failed) for r in seen_by_operator.routes}
    assert {("relay-one", 1, 0), ("relay-two", 2, 1)} <= operator_rows

    seen_by_tenant = dashboard.delivery(MAIL, world["acme"], now)
    assert seen_by_tenant is not None
    names = [r.config for r in seen_by_tenant.routes]
    assert not [n for n in names if n.startswith("relay-")], names
    platform = [r for r in seen_by_tenant.routes if r.config == "platform mail service"]
    assert [(r.ended, r.failed) for r in platform] == [(3, 1)]
