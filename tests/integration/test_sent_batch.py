"""Sent writes that go to the database together (outcomes' group commit; the ``app`` fixture is
PostgreSQL's, where it runs): one
statement writes each record as its own write would, by version, with its attempt row, its
refused recipients and its look for waiting events, and claims the next records for the
workers that want one."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime

import psycopg
import pytest
from flask import Flask
from sqlalchemy import make_url, select, update

from portal.extensions import db
from portal.messaging.after_send import events
from portal.messaging.sending import claim, outcomes, sent_write
from portal.messaging.sending.outcomes import Attempt, Claimed
from portal.models import Channel, MailSendRecord, SendAttempt, SmsSendRecord
from tests.conftest import TEST_DATABASE_URL
from tests.support.delivery import accept_mail, mail_server, record, tenant, waiting_on_a_lock
from tests.support.sms import UK, accept_sms, sms_record
from tests.support.smtp_server import ScriptedSmtpServer


def claimed_of(row: MailSendRecord | SmsSendRecord, channel: Channel) -> Claimed:
    return Claimed(channel, row.id, row.version, row.tenant_id, row.retry_count)


def write(
    claimed: Claimed,
    pmid: str,
    *,
    refused: dict[str, list[str]] | None = None,
    attempt: Attempt | None = None,
    wants_next: bool = False,
) -> sent_write._SentWrite:
    params: dict[str, object] = {"rid": claimed.id, "ver": claimed.version, "pmid": pmid}
    if refused:
        params["refused"] = refused
    if attempt is not None:
        params |= attempt.params()
    request = claim.NextClaim(MailSendRecord, lambda: True) if wants_next else None
    return sent_write._SentWrite(db.engine, claimed, params, request)


def test_one_statement_writes_each_record_as_its_own_write_would(
    app: Flask, smtp: ScriptedSmtpServer
) -> None:
    acme = tenant("acme").id
    server = mail_server(acme, smtp, name="relay")
    db.session.commit()
    ids = [accept_mail(app, acme, to=[f"u{i}@example.com"]) for i in range(4)]
    later = [accept_mail(app, acme, to=[f"later{i}@example.com"]) for i in range(3)]
    held = claim.claim_due(db.engine, MailSendRecord, 4)
    assert sorted(r.id for r in held) == ids
    by_id = {r.id: r for r in held}
    # The records were prepared for the relay; an event for the third waits for its id.
    db.session.execute(
        update(MailSendRecord).where(MailSendRecord.id.in_(ids)).values(server_config_id=server.id)
    )
    waiting_event = events.store(
        db.session,
        Channel.MAIL,
        tenant_id=acme,
        config_id=server.id,
        provider="generic",
        event=events.ProviderEvent("ev-1", events.EventType.BOUNCED, "<m2@relay>", code="550"),
    )
    db.session.commit()
    started = datetime(2026, 12, 2, 9, 30, tzinfo=UTC)
    attempt = Attempt(started, 0.25, server.id, "relay", "250", "2.0.0 queued as X1")
    c0, c1, c2, c3 = (claimed_of(by_id[i], Channel.MAIL) for i in ids)
    batch = [
        write(c0, "<m0@relay>", attempt=attempt, wants_next=True),
        write(c1, "<m1@relay>", refused={"x@example.com": ["550", "no such user"]}),
        write(c2, "<m2@relay>", attempt=attempt, wants_next=True),
        # Lost its race: the sweep moved it on meanwhile (its version is one behind).
        write(Claimed(Channel.MAIL, c3.id, c3.version - 1, acme, 0), "<m3@relay>"),
    ]
    sent_write._flush_sent(batch)

    assert [(w.count, w.error) for w in batch] == [(1, None), (1, None), (1, None), (0, None)]
    assert [w.rows for w in batch] == [[(False,)], [(False,)], [(True,)], []]
    # The two that wanted a next record got one each, the oldest of the backlog first.
    assert batch[0].request is not None
    assert batch[2].request is not None
    assert batch[0].request.ran
    assert batch[2].request.ran
    handed = [w.request.records for w in (batch[0], batch[2]) if w.request]
    assert [[r.id for r in got] for got in handed] == [[later[0]], [later[1]]]
    assert all(r.status == "Sending" for got in handed for r in got)

    rows = {i: record(i) for i in ids}
    assert [rows[i].status for i in ids] == ["Sent", "Sent", "Sent", "Sending"]
    assert [rows[i].provider_message_id for i in ids[:3]] == [
        "<m0@relay>",
        "<m1@relay>",
        "<m2@relay>",
    ]
    assert [rows[i].version for i in ids] == [by_id[i].version + 1 for i in ids[:3]] + [
        by_id[ids[3]].version
    ]
    assert rows[ids[1]].refused_recipients == {"x@example.com": ["550", "no such user"]}
    assert rows[ids[0]].refused_recipients is None
    assert [rows[i].attempt_count for i in ids] == [1, 0, 1, 0]
    assert all(rows[i].sent_at is not None for i in ids[:3])
    assert record(later[2]).status == "Pending"

    db.session.expire_all()
    attempt_rows = db.session.scalars(select(SendAttempt).order_by(SendAttempt.record_id)).all()
    assert [(a.record_id, a.number, a.outcome) for a in attempt_rows] == [
        (ids[0], 1, "sent"),
        (ids[2], 1, "sent"),
    ]
    first = attempt_rows[0]
    assert (first.started_at, first.duration_ms, first.config_name) == (started, 250, "relay")
    assert (first.code, first.message, first.provider_message_id) == (
        "250",
        "2.0.0 queued as X1",
        "<m0@relay>",
    )
    assert first.worker == outcomes.worker_name()
    assert waiting_event.event_id is not None


def test_workers_writing_at_once_share_statements_and_each_record_is_written_once(
    app: Flask, smtp: ScriptedSmtpServer
) -> None:
    acme = tenant("acme").id
    mail_server(acme, smtp, name="relay")
    db.session.commit()
    total, threads_n = 120, 8
    ids = [accept_mail(app, acme, to=[f"u{i}@example.com"]) for i in range(total)]
    commit = sent_write._committer(db.engine, Channel.MAIL)
    batches_before, written_before = commit.batches, commit.written
    done: list[int] = []
    lock = threading.Lock()
    engine = db.engine

    def worker() -> None:
        (row,) = claim.claim_due(engine, MailSendRecord, 1) or (None,)
        while row is not None:
            claimed = claimed_of(row, Channel.MAIL)
            attempt = Attempt(datetime.now(UTC), 0.001, None, "relay", "250", "ok")
            with claim.claiming_next(MailSendRecord, lambda: True) as following:
                assert sent_write.record_sent(engine, claimed, f"<{row.id}@t>", attempt=attempt)
            with lock:
                done.append(row.id)
            row = following.records[0] if following.records else None
            if not following.ran:
                (row,) = claim.claim_due(engine, MailSendRecord, 1) or (None,)

    threads = [threading.Thread(target=worker) for _ in range(threads_n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(done) == ids  # each record once, none left out
    assert {record(i).status for i in ids} == {"Sent"}
    assert commit.written - written_before == total
    assert commit.batches - batches_before < total  # some writes went together
    db.session.expire_all()
    numbers = db.session.execute(select(SendAttempt.record_id, SendAttempt.number)).all()
    assert sorted(numbers) == [(i, 1) for i in ids]


def test_the_statement_writes_sms_records_too(app: Flask) -> None:
    # SMS writes go alone (sent_write.SENT_BATCH_CHANNELS: measured slower grouped); the
    # statement serves both channels, should that change.
    acme = tenant("acme").id
    db.session.commit()
    ids = [accept_sms(app, acme, phoneNumber=f"{UK[:-2]}{10 + i}") for i in range(3)]
    held = claim.claim_due(db.engine, SmsSendRecord, 3)
    batch = [
        sent_write._SentWrite(
            db.engine,
            claimed_of(row, Channel.SMS),
            {"rid": row.id, "ver": row.version, "pmid": f"SM-{row.id}"},
            None,
        )
        for row in held
    ]
    sent_write._flush_sent(batch)
    assert [w.count for w in batch] == [1, 1, 1]
    assert {(sms_record(i).status, sms_record(i).provider_message_id) for i in ids} == {
        ("Sent", f"SM-{i}") for i in ids
    }


def test_of_two_writes_of_one_record_in_a_batch_only_the_current_versions_counts(
    app: Flask, smtp: ScriptedSmtpServer
) -> None:
    # A worker whose send outlived the stuck-send threshold still holds the record at its old
    # version when another worker (same process) has claimed it again; both write Sent at once.
    acme = tenant("acme").id
    db.session.commit()
    rid = accept_mail(app, acme, to=["u@example.com"])
    (held,) = claim.claim_due(db.engine, MailSendRecord, 1)
    current = claimed_of(held, Channel.MAIL)
    stale = Claimed(Channel.MAIL, rid, current.version - 1, acme, 0)
    batch = [write(stale, "<old@relay>"), write(current, "<new@relay>")]
    sent_write._flush_sent(batch)
    assert [(w.count, w.error) for w in batch] == [(0, None), (1, None)]
    row = record(rid)
    assert (row.status, row.provider_message_id) == ("Sent", "<new@relay>")
    # And the lost race is not reported as a send.
    assert not sent_write.record_sent(db.engine, stale, "<old@relay>")


def test_a_row_the_statement_refuses_fails_only_its_own_record(
    app: Flask, smtp: ScriptedSmtpServer, caplog: pytest.LogCaptureFixture
) -> None:
    acme = tenant("acme").id
    db.session.commit()
    ids = [accept_mail(app, acme, to=[f"u{i}@example.com"]) for i in range(3)]
    later = accept_mail(app, acme, to=["later@example.com"])
    held = sorted(claim.claim_due(db.engine, MailSendRecord, 3), key=lambda r: r.id)
    c0, c1, c2 = (claimed_of(r, Channel.MAIL) for r in held)
    started = datetime(2026, 12, 2, 9, 30, tzinfo=UTC)
    bad = write(c1, "<m1@relay>", attempt=Attempt(started, 0.1, None, "relay", "250", "ok"))
    bad.params["a_message"] = "queued\x00"  # past Attempt.params: PostgreSQL refuses a NUL
    batch = [write(c0, "<m0@relay>"), bad, write(c2, "<m2@relay>", wants_next=True)]
    sent_write._flush_sent(batch)

    assert [w.count for w in batch] == [1, 0, 1]
    assert [w.error is None for w in batch] == [True, False, True]
    assert "written one by one" in caplog.text
    assert [record(i).status for i in ids] == ["Sent", "Sending", "Sent"]
    # The write that wanted a next record still got it, by itself.
    assert batch[2].request is not None
    assert [r.id for r in batch[2].request.records] == [later]


def test_a_reply_with_a_nul_is_kept_with_a_replacement_character(
    app: Flask, smtp: ScriptedSmtpServer
) -> None:
    acme = tenant("acme").id
    server = mail_server(acme, smtp, name="relay")
    db.session.commit()
    rid = accept_mail(app, acme, to=["u@example.com"])
    (held,) = claim.claim_due(db.engine, MailSendRecord, 1)
    claimed = claimed_of(held, Channel.MAIL)
    reply = "2.0.0 queued\x00 as X1"
    attempt = Attempt(datetime.now(UTC), 0.1, server.id, "relay\x00x", "250\x00", reply)
    refused = {"x@example.com": [550, "no\x00 such user"]}
    assert sent_write.record_sent(db.engine, claimed, "<m@relay>", refused=refused, attempt=attempt)
    row = record(rid)
    assert row.status == "Sent"
    assert row.refused_recipients == {"x@example.com": [550, "no\ufffd such user"]}
    db.session.expire_all()
    (kept,) = db.session.scalars(select(SendAttempt)).all()
    assert (kept.code, kept.message, kept.config_name) == (
        "250\ufffd",
        "2.0.0 queued\ufffd as X1",
        "relay\ufffdx",
    )


def test_a_write_stuck_at_the_database_holds_up_only_itself(
    app: Flask, smtp: ScriptedSmtpServer
) -> None:
    # One worker's Sent write waits on a row lock (a long transaction elsewhere); the other
    # workers' writes queue behind it for SENT_BATCH_WAIT_S, then go alone and are written.
    acme = tenant("acme").id
    db.session.commit()
    ids = [accept_mail(app, acme, to=[f"u{i}@example.com"]) for i in range(3)]
    held = sorted(claim.claim_due(db.engine, MailSendRecord, 3), key=lambda r: r.id)
    stuck, queued, later = (claimed_of(r, Channel.MAIL) for r in held)
    engine, wait_s = db.engine, 0.3
    commit = sent_write._committer(engine, Channel.MAIL)
    withdrawn = commit.withdrawn
    results: dict[int, bool] = {}

    def send(claimed: Claimed) -> None:
        results[claimed.id] = sent_write.record_sent(
            engine, claimed, f"<{claimed.id}@t>", batch_wait_s=wait_s
        )

    with psycopg.connect(driver_url()) as blocker:
        blocker.execute("SELECT 1 FROM mail_send_record WHERE id = %s FOR UPDATE", (stuck.id,))
        first = threading.Thread(target=send, args=(stuck,))
        first.start()
        deadline = time.monotonic() + 10
        while not waiting_on_a_lock("%UPDATE mail_send_record%") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert waiting_on_a_lock("%UPDATE mail_send_record%"), (
            "the first write is not waiting at the database"
        )
        started = time.monotonic()
        send(queued)  # queued behind the stuck statement, then alone
        assert wait_s <= time.monotonic() - started < 5
        started = time.monotonic()
        send(later)  # the statement has run longer than the wait: alone at once
        assert time.monotonic() - started < wait_s
        assert results == {queued.id: True, later.id: True}
        assert commit.withdrawn - withdrawn == 2
        assert first.is_alive()  # still stuck
    first.join(10)
    assert results == {stuck.id: True, queued.id: True, later.id: True}
    assert {record(i).status for i in ids} == {"Sent"}


def driver_url() -> str:
    return make_url(TEST_DATABASE_URL).set(drivername="postgresql").render_as_string(False)
