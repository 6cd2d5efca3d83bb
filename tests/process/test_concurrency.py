"""Two real worker processes against one database: every record goes out exactly once, the
claims really contend, and a burst against a monthly quota is counted exactly.

The workers are ``python worker.py`` subprocesses configured only by environment variables, as
in production; the SMTP server is a ScriptedSmtpServer in the test process that counts what
arrives. Which process sent which record comes from each worker's JSON log lines ("sent",
with ``record_id``), so no product code is touched to observe the contention.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from flask import Flask
from sqlalchemy import func, select

from portal.extensions import db
from portal.messaging.records import acceptance, validation
from portal.models import MailSendRecord, TenantMessageQuota, TenantMessageUsage
from portal.tenancy import tenant_context
from tests.support.delivery import mail_server, tenant
from tests.support.smtp_server import ScriptedSmtpServer
from tests.support.workers import Worker, stop, worker_processes

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(180),
    # AUTH over plain text on purpose: the workers must decrypt the stored password.
    pytest.mark.filterwarnings("ignore:Requiring AUTH while not requiring TLS:UserWarning"),
]

SMTP_USER, SMTP_PASSWORD = "relay", "s3cret-relay-password"
WAIT_LIMIT_S = 90.0
POLL_S = 0.2
UNFINISHED = ("Pending", "Sending", "Retry")


# --- database helpers ------------------------------------------------------------------------


def status_counts(tenant_id: int) -> Counter[str]:
    rows = db.session.execute(
        select(MailSendRecord.status, func.count())
        .where(MailSendRecord.tenant_id == tenant_id)
        .group_by(MailSendRecord.status)
    ).all()
    db.session.rollback()  # hold no transaction (or snapshot) between polls
    return Counter({status: n for status, n in rows})


def wait_until_finished(
    tenant_id: int, total: int, workers: list[Worker]
) -> tuple[float, Counter[str]]:
    """Poll every 0.2 s until none of the tenant's ``total`` records is unfinished."""
    started = time.monotonic()
    deadline = started + WAIT_LIMIT_S
    counts: Counter[str] = Counter()
    while time.monotonic() < deadline:
        counts = status_counts(tenant_id)
        assert sum(counts.values()) == total, counts
        if not any(counts[s] for s in UNFINISHED):
            return time.monotonic() - started, counts
        dead = {w.name: w.process.returncode for w in workers if w.process.poll() is not None}
        assert not dead, f"worker(s) exited early: {dead}; statuses {dict(counts)}"
        time.sleep(POLL_S)
    raise AssertionError(f"not finished after {WAIT_LIMIT_S} s: {dict(counts)}")


def accept(app: Flask, tenant_id: int, n: int) -> list[int]:
    """Accept ``n`` mails in batches of 500 (one transaction, one NOTIFY per batch)."""
    settings = app.config["SETTINGS"]
    ids: list[int] = []
    for start in range(0, n, validation.MAX_BATCH):
        items = [
            {"to": [f"user{i}@example.com"], "subject": f"Load {i}", "text": f"Message {i}"}
            for i in range(start, min(n, start + validation.MAX_BATCH))
        ]
        with tenant_context(tenant_id):
            accepted = acceptance.send_mail_batch(db.session, items, settings=settings)
        db.session.commit()
        ids += [a.id for a in accepted]
    assert len(set(ids)) == n
    return ids


def usage_count(tenant_id: int) -> int:
    # Summed over the tenant's months, so a run across midnight at a month's end still adds up.
    value = db.session.scalar(
        select(func.coalesce(func.sum(TenantMessageUsage.mail_count), 0)).where(
            TenantMessageUsage.tenant_id == tenant_id
        )
    )
    return int(value or 0)


@pytest.fixture
def smtp() -> Iterator[ScriptedSmtpServer]:
    with ScriptedSmtpServer(
        auth_users={SMTP_USER: SMTP_PASSWORD}, auth_require_tls=False
    ) as server:
        yield server


def setup_tenant(slug: str, smtp: ScriptedSmtpServer, monthly_limit: int | None = None) -> int:
    row = tenant(slug)
    server = mail_server(row.id, smtp, name=f"{slug}-smtp", username=SMTP_USER)
    server.password = SMTP_PASSWORD  # stored encrypted with the test app's SECRET_KEY
    if monthly_limit is not None:
        db.session.add(TenantMessageQuota(tenant_id=row.id, mail_monthly_limit=monthly_limit))
    db.session.commit()
    assert SMTP_PASSWORD not in (server.password_encrypted or "")
    return row.id


# --- tests -----------------------------------------------------------------------------------


def test_two_worker_processes_send_every_record_exactly_once(
    app: Flask, smtp: ScriptedSmtpServer, tmp_path: Path
) -> None:
    total = 2000
    acme = setup_tenant("acme", smtp)
    ids = accept(app, acme, total)
    secret = app.config["SETTINGS"].secret_key

    # ROUTE_WAIT_S: see the quota burst below.
    with worker_processes(tmp_path, secret, ROUTE_WAIT_S="30") as workers:
        elapsed, counts = wait_until_finished(acme, total, workers)
        stop(workers)

        assert counts == Counter({"Sent": total}), counts
        rows = db.session.execute(
            select(
                MailSendRecord.id,
                MailSendRecord.version,
                MailSendRecord.retry_count,
                MailSendRecord.message_id_header,
                MailSendRecord.first_claimed_at,
                MailSendRecord.sent_at,
            ).where(MailSendRecord.tenant_id == acme)
        ).all()
        assert sorted(r.id for r in rows) == sorted(ids)
        versions = Counter((r.version, r.retry_count) for r in rows)
        # Claim, write-back, sent; a record whose worker found the pool's other senders all
        # still busy with the server after a second (SERVER_BUSY, on a slow machine at start-
        # up) was deferred once without using a retry and claimed again: two writes more.
        busy = {
            entry["record_id"]
            for w in workers
            for entry in w.log_lines()
            if entry.get("error_code") == "SERVER_BUSY"
        }
        again = {r.id for r in rows if (r.version, r.retry_count) == (5, 0)}
        assert again <= busy, (versions, sorted(again - busy))
        assert len(again) <= total // 100, versions
        assert versions == +Counter({(3, 0): total - len(again), (5, 0): len(again)})

        # Every Message-ID arrived exactly once, and they are exactly the records' ids.
        by_message_id = smtp.count_by_message_id()
        repeated = {mid: n for mid, n in by_message_id.items() if n != 1}
        assert not repeated, f"{len(repeated)} Message-IDs arrived more than once: {repeated}"
        assert len(smtp.messages) == total
        assert set(by_message_id) == {r.message_id_header for r in rows}
        record_headers = Counter(m.message["X-Postroom-Record"] for m in smtp.messages)
        assert set(record_headers) == {str(i) for i in ids}
        # The password was decrypted by the workers (one login per SMTP connection).
        assert smtp.logins
        assert set(smtp.logins) == {SMTP_USER}
        assert len(smtp.logins) == smtp.connection_count

        # The claims contended: both processes sent records, no record by both, none missing.
        per_worker = {w.name: w.sent_ids() for w in workers}
        for name, sent in per_worker.items():
            assert len(sent) == len(set(sent)), f"{name} logged a record as sent twice"
        sets = {name: set(sent) for name, sent in per_worker.items()}
        a, b = sets.values()
        sizes = {name: len(s) for name, s in sets.items()}
        assert a, sizes
        assert b, sizes
        assert not a & b, f"records sent by both processes: {sorted(a & b)[:20]}"
        assert a | b == set(ids)
        # ... at the same time: each process's sending window overlaps the other's.
        windows = {w.name: (min(w.sent_times()), max(w.sent_times())) for w in workers}
        (a0, a1), (b0, b1) = windows.values()
        assert a0 < b1, windows
        assert b0 < a1, windows
        errors = {w.name: w.errors() for w in workers if w.errors()}
        assert not errors, errors

        spans = {n: f"{w[0]:%H:%M:%S.%f}-{w[1]:%H:%M:%S.%f}" for n, w in windows.items()}
        first_claim = min(r.first_claimed_at for r in rows)
        last_sent = max(r.sent_at for r in rows)
        busy_s = (last_sent - first_claim).total_seconds()
        print(
            f"\n[two workers] {total} records sent in {busy_s:.2f} s of delivery "
            f"({total / busy_s:.0f} records/s; {elapsed:.2f} s wall clock from worker start "
            f"including process start-up, {total / elapsed:.0f} records/s); "
            f"per process: { {n: len(s) for n, s in sets.items()} }; "
            f"SMTP connections: {smtp.connection_count}; "
            f"sending windows: {spans}"
        )


@pytest.mark.parametrize("limit", [150, None], ids=["limit-150", "no-limit"])
def test_quota_burst_from_two_processes_is_counted_exactly(
    app: Flask, smtp: ScriptedSmtpServer, tmp_path: Path, limit: int | None
) -> None:
    total = 400
    acme = setup_tenant("acme", smtp, monthly_limit=limit)
    ids = accept(app, acme, total)
    secret = app.config["SETTINGS"].secret_key

    # Each record is handled by one process only: no SERVER_BUSY deferral (the last free
    # worker giving up on a server all the others are sending to) may hand one to the other
    # process, as one did on a slow machine whose 20 workers each took over 1 s to start.
    with worker_processes(tmp_path, secret, ROUTE_WAIT_S="30") as workers:
        elapsed, counts = wait_until_finished(acme, total, workers)
        stop(workers)

        expected_sent = total if limit is None else limit
        assert set(counts) <= {"Sent", "Failed"}, counts
        assert counts["Sent"] == expected_sent, counts
        assert usage_count(acme) == counts["Sent"] == expected_sent
        failed = db.session.execute(
            select(MailSendRecord.error_code, func.count())
            .where(MailSendRecord.tenant_id == acme, MailSendRecord.status == "Failed")
            .group_by(MailSendRecord.error_code)
        ).all()
        assert dict(failed) == ({} if limit is None else {"MONTHLY_QUOTA_EXCEEDED": total - limit})
        sent_ids = set(
            db.session.scalars(
                select(MailSendRecord.id).where(
                    MailSendRecord.tenant_id == acme, MailSendRecord.status == "Sent"
                )
            )
        )
        assert sent_ids <= set(ids)
        # What arrived is what was recorded Sent, each once.
        assert len(smtp.messages) == expected_sent
        arrived = Counter(int(m.message["X-Postroom-Record"]) for m in smtp.messages)
        assert set(arrived) == sent_ids
        assert set(arrived.values()) == {1}
        per_worker = {w.name: len(w.sent_ids()) for w in workers}
        assert sum(per_worker.values()) == expected_sent, per_worker
        handled = {w.name: w.handled_ids() for w in workers}
        h0, h1 = handled.values()
        sizes = {n: len(h) for n, h in handled.items()}
        assert h0, sizes
        assert h1, sizes
        assert not h0 & h1, sorted(h0 & h1)[:20]
        assert h0 | h1 == set(ids)
        print(
            f"\n[quota {limit}] {total} records finished in {elapsed:.2f} s wall clock: "
            f"{dict(counts)}; usage {usage_count(acme)}; sent per process {per_worker}; "
            f"handled per process { {n: len(h) for n, h in handled.items()} }"
        )


def test_workers_shut_down_cleanly_on_sigterm(
    app: Flask, smtp: ScriptedSmtpServer, tmp_path: Path
) -> None:
    """SIGTERM: exit 0, every thread ends without an exception, logs stay one JSON a line."""
    acme = setup_tenant("acme", smtp)
    accept(app, acme, 40)
    secret = app.config["SETTINGS"].secret_key

    with worker_processes(tmp_path, secret) as workers:
        wait_until_finished(acme, 40, workers)
        for w in workers:  # one may have sent nothing and still be starting: this is a stop of
            w.wait_ready()  # running workers (a signal during start-up is handled, not tested here)
        stop(workers)
        for w in workers:
            stderr = w.stderr.read_text(errors="replace").splitlines()
            # Thread exceptions: "Exception in thread ...:" and the exception's last line.
            raised = [ln for ln in stderr if ln[:1] not in ("{", " ", "T") and ln.strip()]
            assert not any("Traceback" in ln for ln in stderr), (
                f"{w.name} wrote tracebacks while stopping: {raised[:6]}"
            )
            not_json = [ln for ln in stderr if not ln.startswith("{")]
            assert not not_json, not_json[:10]
            assert any(e.get("msg") == "worker stopped" for e in w.log_lines())
