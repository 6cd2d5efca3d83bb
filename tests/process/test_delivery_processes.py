"""DELIVERY_PROCESSES (processes where the GIL caps threads): ``python worker.py``
shares its send workers out among itself and N - 1 delivery children, supervised like its
chore children. One real worker with DELIVERY_PROCESSES=2: every record goes out exactly once,
both processes send (the attempts' worker names two pids, the worker's and its child's), and
SIGTERM stops both with exit code 0, leaving no process behind."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from flask import Flask
from sqlalchemy import func, select

from portal.config import ConfigError, Settings
from portal.delivery.process import split
from portal.extensions import db
from portal.models import MailSendRecord, SendAttempt
from tests.process.test_concurrency import accept
from tests.support.delivery import mail_server, tenant
from tests.support.smtp_server import ScriptedSmtpServer
from tests.support.workers import alive, children_of, stop, wait_for, worker_processes


def test_workers_are_shared_out_and_no_process_gets_none() -> None:
    assert split(4, 10, 1) == [(4, 10)]
    assert split(4, 10, 2) == [(2, 5), (2, 5)]
    assert split(3, 10, 4) == [(1, 3), (1, 3), (1, 2), (0, 2)]
    assert split(1, 0, 3) == [(1, 0)]  # never more processes than workers
    assert split(0, 0, 2) == []


def test_the_setting_is_read_and_checked() -> None:
    base = {"SECRET_KEY": "x" * 32}
    assert Settings.from_env(base).delivery_processes == 1
    assert Settings.from_env(base | {"DELIVERY_PROCESSES": "3"}).delivery_processes == 3
    for bad in ("0", "-1", "two"):
        with pytest.raises(ConfigError, match="DELIVERY_PROCESSES"):
            Settings.from_env(base | {"DELIVERY_PROCESSES": bad})


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_delivery_processes_send_every_record_once_and_stop_together(
    app: Flask, tmp_path: Path
) -> None:
    total = 300
    # A server that takes a few ms per message, so both processes find work waiting.
    with ScriptedSmtpServer(on_message=lambda _m: time.sleep(0.004)) as smtp:
        acme = tenant("acme").id
        mail_server(acme, smtp)
        db.session.commit()
        secret = app.config["SETTINGS"].secret_key
        with worker_processes(
            tmp_path,
            secret,
            n=1,
            DELIVERY_PROCESSES="2",
            MAIL_SEND_CONCURRENCY="2",
            SMS_SEND_CONCURRENCY="0",
        ) as (worker,):
            delivery_children = wait_for(
                lambda: [
                    pid
                    for pid, cmdline in children_of(worker.pid).items()
                    if "portal.delivery.process" in cmdline
                ],
                30,
                "the delivery child",
            )
            assert len(delivery_children) == 1, delivery_children
            # Both sending before the records come (on a slow machine the child took long
            # enough to start that the parent had sent them all).
            wait_for(
                lambda: (
                    worker.logged("delivery process started") and worker.logged("delivery started")
                ),
                60,
                "both delivery processes started",
            )
            accept(app, acme, total)

            def sent() -> bool:
                done = db.session.scalar(
                    select(func.count())
                    .select_from(MailSendRecord)
                    .where(MailSendRecord.tenant_id == acme, MailSendRecord.status == "Sent")
                )
                db.session.rollback()
                return done == total

            wait_for(sent, 90, "every record Sent")
            stop([worker])
            assert not alive(delivery_children[0])

        by_message_id = smtp.count_by_message_id()
        assert len(smtp.messages) == total
        assert all(n == 1 for n in by_message_id.values())
        workers = db.session.execute(
            select(SendAttempt.worker, func.count())
            .where(SendAttempt.tenant_id == acme)
            .group_by(SendAttempt.worker)
        ).all()
        pids = {name.rsplit(":", 1)[1]: n for name, n in workers}
        assert set(pids) == {str(worker.pid), str(delivery_children[0])}, pids
        assert sum(pids.values()) == total
