"""The configs a worker reads at every send, cached by the configuration epoch (see
``portal.messaging.sending.configcache``, migration 0016): read once while nothing changes, read
afresh at the first send after any change, whoever made it (here plain SQL)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from flask import Flask
from sqlalchemy import text

from portal.extensions import db
from portal.messaging.sending import pipeline, preparation
from tests.support.delivery import tenant
from tests.support.sms import accept_sms, drain_sms, provider, sms_record
from tests.support.sms_provider import FakeSmsProvider


@pytest.fixture
def server() -> Iterator[FakeSmsProvider]:
    with FakeSmsProvider() as running:
        yield running


class Counted:
    """Counts the calls of a function of the delivery path (it still runs for real)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> None:
        self.calls = 0
        real = getattr(owner, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)


def _epoch() -> int | None:
    return db.session.execute(text("SELECT epoch FROM config_epoch WHERE id = 1")).scalar()


def test_every_change_to_a_cached_table_changes_the_epoch(
    app: Flask, server: FakeSmsProvider
) -> None:
    acme = tenant("acme")
    db.session.commit()
    gateway = provider(acme.id, "http_json", server, name="gw")
    db.session.commit()
    seen = [_epoch()]
    for sql in (
        "UPDATE sms_provider_config SET sender_id = 'X' WHERE id = :id",
        "INSERT INTO sms_provider_region (tenant_id, provider_id, country_code, priority) "
        "VALUES (:tenant, :id, 'FR', 1)",
        "DELETE FROM sms_provider_region WHERE provider_id = :id",
        "UPDATE mail_send_server_config SET port = port WHERE false",  # even no row
    ):
        db.session.execute(text(sql), {"id": gateway.id, "tenant": acme.id})
        db.session.commit()
        seen.append(_epoch())
    assert None not in seen
    assert len(set(seen)) == len(seen), seen  # a new value every time, never one seen before


def test_an_sms_reads_its_provider_once_until_a_change_then_at_once(
    app: Flask, server: FakeSmsProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    acme = tenant("acme")
    db.session.commit()
    provider(acme.id, "http_json", server, name="gw")
    db.session.commit()
    reads = Counted(monkeypatch, pipeline, "_read_provider")
    routes = Counted(monkeypatch, preparation, "sms_candidates")

    first = [accept_sms(app, acme.id, content=f"hello {i}") for i in range(5)]
    drain_sms(app)
    assert [sms_record(r).status for r in first] == ["Sent"] * 5
    assert (reads.calls, routes.calls) == (1, 1)

    # Disabled by plain SQL (no ORM event): the very next send sees it.
    db.session.execute(text("UPDATE sms_provider_config SET enabled = false"))
    db.session.commit()
    after = accept_sms(app, acme.id, content="after")
    drain_sms(app)
    row = sms_record(after)
    assert (row.status, row.error_code) == ("Failed", "CONFIG_NOT_RESOLVABLE"), row.error_message
    assert routes.calls == 2
    assert len(server.requests) == 5
