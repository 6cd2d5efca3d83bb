"""The worker through a local PgBouncer in transaction mode:
DATABASE_POOLER=transaction turns prepared statements off, and LISTEN goes to
DATABASE_DIRECT_URL, so a NOTIFY still wakes the worker long before its poll."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from flask import Flask

from portal.config import ConfigError, Settings
from portal.extensions import db
from tests.conftest import TEST_DATABASE_URL
from tests.support.delivery import accept_mail, mail_server, record, tenant
from tests.support.pgbouncer import pgbouncer
from tests.support.smtp_server import ScriptedSmtpServer
from tests.support.workers import worker_group


def test_the_pooler_setting_is_checked() -> None:
    env = {"SECRET_KEY": "x", "DATABASE_POOLER": "transaction"}
    assert Settings.from_env(env).database_pooler == "transaction"
    assert Settings.from_env({"SECRET_KEY": "x"}).database_pooler is None
    with pytest.raises(ConfigError, match="DATABASE_POOLER"):
        Settings.from_env({"SECRET_KEY": "x", "DATABASE_POOLER": "statement"})


@pytest.mark.slow
def test_a_worker_behind_pgbouncer_delivers_and_wakes_on_notify(
    app: Flask, smtp: ScriptedSmtpServer, tmp_path: Path
) -> None:
    acme = tenant("acme").id
    mail_server(acme, smtp)
    db.session.commit()
    with (
        pgbouncer(TEST_DATABASE_URL) as pooled,
        worker_group(
            tmp_path,
            app.config["SETTINGS"].secret_key,
            DATABASE_URL=pooled,
            DATABASE_POOLER="transaction",
            DATABASE_DIRECT_URL=TEST_DATABASE_URL,
            POLL_INTERVAL_S="30",  # only a NOTIFY can wake it in time
            MAIL_SEND_CONCURRENCY="4",
        ) as group,
    ):
        worker = group.start()
        worker.wait_ready(90)
        time.sleep(1.0)  # LISTEN is connected and the start-up poll has passed
        first = accept_mail(app, acme)
        deadline = time.monotonic() + 10
        while record(first).status != "Sent" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert record(first).status == "Sent"
        # More than five sends of each statement: psycopg would have prepared them by now.
        ids = [accept_mail(app, acme) for _ in range(12)]
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(record(i).status != "Sent" for i in ids):
            time.sleep(0.05)
        assert [record(i).status for i in ids] == ["Sent"] * 12
        assert "prepared statement" not in worker.stderr.read_text()
