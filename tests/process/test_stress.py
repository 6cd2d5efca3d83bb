"""The one-statement Sent write and next claim under everything else that writes the same rows
(the speed must not cost correctness).

Two worker processes of 8 delivery threads each (16 in all) send to a real SMTP server for
until each chore has done its count of rounds (``STRESS_ROUNDS`` scales them; bounded by counts,
not by a clock, so a slow machine runs longer and a fast one shorter, both with the same
coverage) while this process keeps accepting mail and, against the
same rows, runs the stuck-send sweep, cancels Pending and Retry records, bulk-retries Failed
ones and applies delivery events to Sent ones (as the webhooks and the bounce reader do). Some
recipients are refused at RCPT (permanent, so Failed, then retried by hand, failing again), some
answered 451 (Retry). Afterwards: every record is in a final status, none entered two final
statuses, every Message-ID reached the server at most once unless the record is marked
ambiguous, no statement deadlocked (``pg_stat_database.deadlocks``) and no worker logged an
error.
"""

from __future__ import annotations

import os
import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from flask import Flask
from sqlalchemy import select, text
from sqlalchemy.orm import Session

from portal.extensions import db
from portal.messaging.after_send import events
from portal.messaging.records import acceptance, cancel, retry
from portal.messaging.sending import sweeper
from portal.models import Channel, MailSendRecord
from portal.tenancy import tenant_context
from tests.support.delivery import mail_server, tenant
from tests.support.smtp_server import ScriptedSmtpServer
from tests.support.workers import StatusAudit, stop, worker_processes

# Rounds each chore must have done before the run ends (accept: batches of 40 mails that went
# in; the others: runs that did their work), times STRESS_ROUNDS.
STRESS_ROUNDS = float(os.environ.get("STRESS_ROUNDS", "1"))
ROUNDS = {"accepted": 20, "cancel": 20, "retry": 15, "deliver": 20, "sweep": 10}
STRESS_LIMIT_S = 300.0  # a run that cannot reach its counts in this long fails
FINAL = {"Sent", "Failed", "Cancelled", "DeadLetter", "Suppressed", "Uncertain"}
UNFINISHED = ("Pending", "Sending", "Retry")
EXPECTED = ("send failed (failed)", "send failed (dead letter)", "send failed (dead_letter)")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(STRESS_LIMIT_S + 240)]


def _deadlocks(engine: Any) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                text("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()")
            ).scalar_one()
        )


class Chores:
    """Threads of this process that write the records while the workers send them."""

    def __init__(self, app: Flask, tenant_id: int, smtp: ScriptedSmtpServer) -> None:
        self.app = app
        self.smtp = smtp
        self.tenant_id = tenant_id
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.counts: Counter[str] = Counter()
        self.threads: list[threading.Thread] = []
        self.rng = random.Random(17)

    def every(self, name: str, pause_s: float, body: Callable[[Session], None]) -> None:
        def run() -> None:
            with self.app.app_context():
                loop()

        def loop() -> None:
            while not self.stop.is_set():
                try:
                    with Session(db.engine) as session:
                        body(session)
                    self.counts[name] += 1
                except Exception as exc:  # recorded, asserted on at the end
                    self.errors.append(f"{name}: {type(exc).__name__}: {exc}")
                self.stop.wait(pause_s)

        thread = threading.Thread(target=run, name=name, daemon=True)
        self.threads.append(thread)
        thread.start()

    def ids(self, session: Session, status: str, n: int) -> list[int]:
        rows = session.scalars(
            select(MailSendRecord.id)
            .where(MailSendRecord.tenant_id == self.tenant_id, MailSendRecord.status == status)
            .order_by(MailSendRecord.updated_time.desc())
            .limit(n * 4)
        ).all()
        return self.rng.sample(list(rows), min(n, len(rows)))

    def accept(self, session: Session) -> None:
        """40 more mails while fewer than 200 wait: the point is contention on the same
        rows, not a backlog that grows with the machine's load."""
        waiting = session.scalar(
            text(
                "SELECT count(*) FROM (SELECT 1 FROM mail_send_record WHERE status = 'Pending' "
                "AND tenant_id = :t LIMIT 200) w"
            ),
            {"t": self.tenant_id},
        )
        if waiting is not None and waiting >= 200:
            return
        n = self.counts["accept"]
        items = []
        for i in range(40):
            who = ("refused", "later", "user", "user", "user", "user")[(n + i) % 6]
            address = f"{who}{n}-{i}@example.com"
            if who == "refused":  # for good: Failed, and again after each manual retry
                self.smtp.script(address, "550 5.1.1 no such user")
            elif who == "later":  # every time: Retry, then DeadLetter
                self.smtp.script(address, "451 4.3.0 try again later")
            items.append({"to": [address], "subject": "S", "text": "T"})
        with tenant_context(self.tenant_id):
            acceptance.send_mail_batch(session, items, settings=self.app.config["SETTINGS"])
        session.commit()
        self.counts["accepted"] += 1

    def done(self) -> bool:
        """Every chore has done its rounds."""
        return all(self.counts[name] >= n * STRESS_ROUNDS for name, n in ROUNDS.items())

    def cancel(self, session: Session) -> None:
        ids = self.ids(session, "Pending", 3) + self.ids(session, "Retry", 2)
        cancel.cancel_records(session, MailSendRecord, ids, self.tenant_id)
        session.commit()

    def retry(self, session: Session) -> None:
        ids = self.ids(session, "Failed", 10)
        retry.retry_records(session, MailSendRecord, ids, self.tenant_id)
        session.commit()

    def deliver(self, session: Session, config_id: int) -> None:
        rows = session.execute(
            select(MailSendRecord.provider_message_id)
            .where(MailSendRecord.tenant_id == self.tenant_id, MailSendRecord.status == "Sent")
            .order_by(MailSendRecord.updated_time.desc())
            .limit(10)
        ).all()
        for (pmid,) in rows:
            event = events.ProviderEvent(
                dedup_key=f"stress-{uuid.uuid4()}",
                event_type=events.EventType.DELIVERED,
                provider_message_id=pmid,
                occurred_at=datetime.now(UTC),
            )
            events.store(
                session,
                Channel.MAIL,
                tenant_id=self.tenant_id,
                config_id=config_id,
                provider="smtp",
                event=event,
            )
        session.commit()

    def sweep(self, _session: Session) -> None:
        sweeper.sweep_stuck_sends(db.engine, self.app.config["SETTINGS"])

    def end(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(30)


def test_sixteen_threads_with_sweeps_cancels_retries_and_events_end_each_record_once(
    app: Flask, tmp_path: Path
) -> None:
    audit = StatusAudit(db.engine)
    audit.install()
    with ScriptedSmtpServer() as smtp:
        acme = tenant("acme")
        server = mail_server(acme.id, smtp, name="acme-smtp")
        db.session.commit()
        tenant_id, config_id = acme.id, server.id
        deadlocks_before = _deadlocks(db.engine)
        chores = Chores(app, tenant_id, smtp)
        try:
            with worker_processes(
                tmp_path,
                app.config["SETTINGS"].secret_key,
                MAIL_SEND_CONCURRENCY="8",
                BACKOFF_BASE_S="0.2",
                MAX_RETRIES="2",
            ) as workers:
                chores.every("accept", 0.1, chores.accept)
                chores.every("cancel", 0.2, chores.cancel)
                chores.every("retry", 0.5, chores.retry)
                chores.every("deliver", 0.2, lambda s: chores.deliver(s, config_id))
                chores.every("sweep", 0.5, chores.sweep)
                deadline = time.monotonic() + STRESS_LIMIT_S
                while not chores.done() and time.monotonic() < deadline and not chores.errors:
                    time.sleep(0.2)
                chores.end()
                assert chores.done(), f"rounds not reached in {STRESS_LIMIT_S} s: {chores.counts}"
                print(f"\n[stress] chores {dict(chores.counts)}", flush=True)
                assert not chores.errors, chores.errors[:10]
                _wait_until_finished(tenant_id)
                stop(workers)
                # A send the server refused is logged at ERROR by design; anything else is not.
                errors = {
                    w.name: [e for e in w.errors() if not _expected(str(e.get("msg")))]
                    for w in workers
                }
                errors = {name: found for name, found in errors.items() if found}
        finally:
            chores.end()
        deadlocks = _deadlocks(db.engine) - deadlocks_before
        rows = db.session.execute(
            select(
                MailSendRecord.id,
                MailSendRecord.status,
                MailSendRecord.error_code,
                MailSendRecord.message_id_header,
                MailSendRecord.ambiguous_attempt,
            ).where(MailSendRecord.tenant_id == tenant_id)
        ).all()
        by_message_id = smtp.count_by_message_id()
        histories = _histories(db.engine)
        db.session.rollback()  # its snapshot's lock would keep DROP TRIGGER waiting
    audit.remove()

    statuses = Counter(r.status for r in rows)
    print(
        f"\n[stress x{STRESS_ROUNDS:g}] {len(rows)} records {dict(statuses)}; chores "
        f"{dict(chores.counts)}; {len(by_message_id)} Message-IDs at the server; "
        f"deadlocks {deadlocks}"
    )
    assert not chores.errors, chores.errors[:10]
    assert not errors, errors
    assert deadlocks == 0
    assert statuses["Sent"] > 100, statuses
    assert statuses["Cancelled"], statuses
    assert statuses["Failed"], statuses
    assert set(statuses) <= FINAL, statuses
    assert not [r for r in rows if r.error_code == "DATABASE_ERROR"]
    ambiguous = {r.message_id_header for r in rows if r.ambiguous_attempt}
    repeated = {m: n for m, n in by_message_id.items() if n > 1 and m not in ambiguous}
    assert not repeated, repeated
    # Nothing leaves Sent or Cancelled, and nothing reaches one of them twice.
    for record_id, history in histories.items():
        for final in ("Sent", "Cancelled"):
            if final in history:
                assert history.count(final) == 1, (record_id, history)
                assert history[-1] == final, (record_id, history)


def _expected(message: str) -> bool:
    """A refused send (ERROR by design), or rq reporting a job a killed earlier worker left
    behind (its registry lives in Redis, not in this test)."""
    return message.startswith(EXPECTED) or "AbandonedJobError" in message


def _wait_until_finished(tenant_id: int, limit_s: float = 120.0) -> None:
    deadline = time.monotonic() + limit_s
    counts: dict[str, int] = {}
    while time.monotonic() < deadline:
        counts = dict(
            db.session.execute(
                text(
                    "SELECT status, count(*) FROM mail_send_record WHERE tenant_id = :t "
                    "GROUP BY status"
                ),
                {"t": tenant_id},
            ).all()
        )
        db.session.rollback()
        if not any(counts.get(s) for s in UNFINISHED):
            return
        time.sleep(0.5)
    raise AssertionError(f"not finished after {limit_s} s: {counts}")


def _histories(engine: Any) -> dict[int, list[str]]:
    """Each record's statuses in order, repeats collapsed (from the audit trigger)."""
    out: dict[int, list[str]] = {}
    with engine.connect() as conn:
        for record_id, status in conn.execute(
            text("SELECT record_id, status FROM test_status_audit ORDER BY seq")
        ):
            seen = out.setdefault(record_id, [])
            if not seen or seen[-1] != status:
                seen.append(status)
    return out
