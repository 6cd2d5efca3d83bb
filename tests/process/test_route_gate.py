"""At most pool size - 1 workers are in flight to any one server, so a
hanging server cannot hold the whole pool. A real worker process with 4 mail workers: tenant
A's server takes seconds to answer each mail; tenant B's mail, accepted after A's, is sent
before any of A's (order, not wall time), and A's surplus record waited as SERVER_BUSY
without using a retry. (With a healthy server the last worker gets its place within ms and
nothing waits: the two-process exactly-once test in test_concurrency checks that.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from flask import Flask
from sqlalchemy import select

from portal.extensions import db
from portal.models import MailSendRecord
from tests.support.delivery import accept_mail, mail_server, tenant
from tests.support.smtp_server import ScriptedSmtpServer
from tests.support.workers import wait_for, worker_group

A_MAILS = 6
HANG_S = 3.0


@pytest.fixture
def smtp() -> Iterator[ScriptedSmtpServer]:
    with ScriptedSmtpServer(hang_s=HANG_S) as server:
        yield server


def test_a_hanging_server_leaves_a_worker_for_other_servers(
    app: Flask, smtp: ScriptedSmtpServer, tmp_path: Path
) -> None:
    a, b = tenant("slow-co"), tenant("quick-co")
    mail_server(a.id, smtp, name="slow-relay")
    mail_server(b.id, smtp, name="quick-relay")
    db.session.commit()
    secret = app.config["SETTINGS"].secret_key
    env = {
        "MAIL_SEND_CONCURRENCY": "4",
        "SMTP_READ_TIMEOUT_S": "20",
        "STUCK_SEND_THRESHOLD_S": "60",
    }
    with worker_group(tmp_path, secret, **env) as group:
        worker = group.start()
        worker.wait_ready()
        slow = [accept_mail(app, a.id, to=[f"hang@slow{n}.example.com"]) for n in range(A_MAILS)]
        quick = accept_mail(app, b.id, to=["ann@quick.example.com"])

        def all_sent() -> bool:
            db.session.rollback()
            statuses = db.session.scalars(select(MailSendRecord.status)).all()
            return len(statuses) == A_MAILS + 1 and set(statuses) == {"Sent"}

        wait_for(all_sent, 60, "every mail sent")
        deferred = worker.logged("send deferred, no retry used")

    db.session.rollback()
    rows = {
        r.id: r
        for r in db.session.scalars(
            select(MailSendRecord).execution_options(populate_existing=True)
        )
    }
    first_slow = min(rows[i].sent_at for i in slow if rows[i].sent_at)
    assert rows[quick].sent_at is not None
    assert rows[quick].sent_at < first_slow, "B's mail waited behind the hanging server"
    assert all(rows[i].retry_count == 0 for i in slow), "a busy server cost a retry"
    busy = [e for e in deferred if e.get("error_code") == "SERVER_BUSY"]
    assert busy, "no record waited for a free sender"
    assert {e["record_id"] for e in busy} <= set(slow)
