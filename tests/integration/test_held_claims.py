"""A worker that claims several records in its Sent write (``NextClaim.k``; the pool asks
for more while its claims come back full): each record claimed keeps its own status and
version; the group commit hands every worker its own k; and after a kill -9 the records a
worker held and had not begun are swept as a retry of a record never prepared (never
resent as ambiguous), while the one it had prepared is swept as ambiguous as before.

The product claims one at a time (``claim.NEXT_CLAIM_MAX`` is 1: holding did not pay); these
tests run the mechanism at 4, so that raising the constant stays one change away."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from flask import Flask
from sqlalchemy import update

from portal.delivery.pool import ChannelPool, ChannelSpec
from portal.delivery.service import DeliveryService
from portal.extensions import db
from portal.messaging.sending import claim, sent_write
from portal.messaging.sending.claim import claim_due, claiming_next
from portal.messaging.sending.outcomes import Claimed
from portal.messaging.sending.sent_write import record_sent
from portal.messaging.sending.sweeper import sweep_stuck_sends
from portal.models import Channel, MailSendRecord, db_now
from tests.support.delivery import accept_mail, mail_server, record, tenant
from tests.support.smtp_server import ScriptedSmtpServer

NEXT_CLAIM_MAX = 4


@pytest.fixture(autouse=True)
def holding_up_to_four(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(claim, "NEXT_CLAIM_MAX", NEXT_CLAIM_MAX)


@pytest.fixture
def smtp() -> Iterator[ScriptedSmtpServer]:
    with ScriptedSmtpServer() as server:
        yield server


def claimed_of(row: MailSendRecord) -> Claimed:
    return Claimed(Channel.MAIL, row.id, row.version, row.tenant_id, row.retry_count)


def test_a_sent_write_claims_as_many_as_asked_each_with_its_own_version(app: Flask) -> None:
    acme = tenant("acme").id
    ids = [accept_mail(app, acme, to=[f"u{i}@example.com"]) for i in range(6)]
    (first,) = claim_due(db.engine, MailSendRecord, 1)
    with claiming_next(MailSendRecord, lambda: 3) as following:
        assert record_sent(db.engine, claimed_of(first), "<a@example.com>")
    assert following.ran
    assert following.k == 3
    assert sorted(r.id for r in following.records) == ids[1:4]  # the oldest due, in turn
    for held in following.records:
        row = record(held.id)
        assert (row.status, row.version, row.first_claimed_at) == (
            "Sending",
            held.version,
            held.first_claimed_at,
        )
    assert record(ids[4]).status == "Pending"

    # More than the backlog: what is due, no more; and never more than NEXT_CLAIM_MAX.
    last = following.records[-1]
    with claiming_next(MailSendRecord, lambda: 100) as following:
        assert record_sent(db.engine, claimed_of(last), "<b@example.com>")
    assert following.k == NEXT_CLAIM_MAX
    assert sorted(r.id for r in following.records) == ids[4:]


def test_the_group_commit_hands_each_worker_its_own_k(app: Flask) -> None:
    acme = tenant("acme").id
    ids = [accept_mail(app, acme, to=[f"u{i}@example.com"]) for i in range(10)]
    held = claim_due(db.engine, MailSendRecord, 3)
    writes = []
    for row, k in zip(held, (2, 0, 3), strict=True):
        params = {"rid": row.id, "ver": row.version, "pmid": f"<{row.id}@example.com>"}
        request = None
        if k:
            request = claim.NextClaim(MailSendRecord, lambda: True, k=k)
        writes.append(sent_write._SentWrite(db.engine, claimed_of(row), params, request))
    sent_write._flush_sent(writes)
    assert [w.count for w in writes] == [1, 1, 1]
    got = [len(w.request.records) if w.request else None for w in writes]
    assert got == [2, None, 3]
    handed = [r.id for w in writes if w.request for r in w.request.records]
    assert sorted(handed) == ids[3:8]
    assert {record(i).status for i in handed} == {"Sending"}
    assert {record(i).status for i in ids[8:]} == {"Pending"}


def test_after_a_kill_the_records_held_and_not_begun_are_swept_as_never_prepared(
    app: Flask,
) -> None:
    """The worst case after kill -9: a worker held the records of its last claim. The one it
    had prepared (its attempt begun) is swept as ambiguous and resent with the same
    Message-ID, as before; the others were never prepared, so the sweep makes them plain
    retries: never sent, never sent twice."""
    acme = tenant("acme").id
    settings = app.config["SETTINGS"].replace(stuck_send_threshold_s=0.0)
    ids = [accept_mail(app, acme, to=[f"u{i}@example.com"]) for i in range(5)]
    (first,) = claim_due(db.engine, MailSendRecord, 1)
    with claiming_next(MailSendRecord, lambda: 4) as following:
        assert record_sent(db.engine, claimed_of(first), "<a@example.com>")
    began, *not_begun = sorted(following.records, key=lambda r: r.id)
    # The worker prepared the first it held (preparation's write-back), then was killed.
    db.session.execute(
        update(MailSendRecord)
        .where(MailSendRecord.id == began.id)
        .values(prepared_at=db_now(), version=MailSendRecord.version + 1)
    )
    db.session.commit()
    sweep_stuck_sends(db.engine, settings)
    swept = {i: record(i) for i in ids[1:]}
    assert {i: (r.status, r.error_code) for i, r in swept.items()} == {
        i: ("Retry", "ZOMBIE_RECOVERED") for i in ids[1:]
    }
    assert swept[began.id].ambiguous_attempt
    assert [swept[r.id].ambiguous_attempt for r in not_begun] == [False, False, False]


def test_a_busy_worker_claims_more_at_a_time_while_its_claims_come_back_full(
    app: Flask, smtp: ScriptedSmtpServer
) -> None:
    """One worker, 30 mails of one tenant due: its claims in the Sent writes take 1, 2, 4,
    4, ... records (fewer claims than records), and every mail goes out once."""
    acme = tenant("acme").id
    mail_server(acme, smtp)
    db.session.commit()
    ids = [accept_mail(app, acme, to=[f"b{i}@example.com"]) for i in range(30)]
    settings = app.config["SETTINGS"].replace(poll_interval_s=30.0, mail_send_concurrency=1)
    service = DeliveryService(db.engine, settings)
    service.start()
    try:
        deadline = time.monotonic() + 20.0
        while not all(record(i).status == "Sent" for i in ids):
            assert time.monotonic() < deadline, "not all Sent"
            time.sleep(0.05)
    finally:
        service.stop()
        assert service.wait(5.0)
    pool = service.pools[Channel.MAIL]
    assert pool.claimed_total == 30
    assert pool.claimed_with_sent >= 28
    assert pool.claims_with_sent <= 12
    assert sorted(m.rcpt_tos[0] for m in smtp.messages) == sorted(
        f"b{i}@example.com" for i in range(30)
    )


def test_a_prepared_record_held_too_long_is_left_to_the_sweep(app: Flask) -> None:
    """A held record an earlier attempt prepared (a due Retry) is not sent after the pool's
    ``max_hold_s``: the sweep may have given it to another worker meanwhile. An unprepared
    one goes on (preparation writes by version, so a record taken from it stops there)."""
    from portal.delivery.pool import ChannelPool, ChannelSpec

    acme = tenant("acme").id
    ids = [accept_mail(app, acme, to=[f"u{i}@example.com"]) for i in range(2)]
    prepared, fresh = claim_due(db.engine, MailSendRecord, 2)
    prepared.prepared_at = fresh.created_time  # any time: an earlier attempt prepared it
    spec = ChannelSpec(Channel.MAIL, MailSendRecord, 2, object, lambda _c, _r: None, 0.75, 0.0)
    pool = ChannelPool(db.engine, spec, 30.0)
    long_ago = time.monotonic() - 1.0
    pool._held().extend([(prepared, long_ago), (fresh, long_ago)])
    assert pool._next_held() is fresh
    assert pool._next_held() is None
    assert {record(i).status for i in ids} == {"Sending"}


def test_a_worker_claims_one_at_a_time_while_another_of_its_pool_waits_for_work(
    app: Flask,
) -> None:
    """Holding records while another worker of the pool sits idle would make them wait behind
    this worker's sends: the Sent write is then asked for one, whatever the claims before."""
    spec = ChannelSpec(
        channel=Channel.MAIL,
        model=MailSendRecord,
        concurrency=4,
        make_context=lambda: None,
        process=lambda _context, _record: None,
    )
    pool = ChannelPool(db.engine, spec, poll_interval_s=30.0)
    pool._current.want = NEXT_CLAIM_MAX  # claims came back full: it would take the most
    assert pool._may_claim() == NEXT_CLAIM_MAX
    waiting = threading.Thread(target=pool._wait_for_work)
    waiting.start()  # another worker waits for work, and nothing is handed over yet
    try:
        deadline = time.monotonic() + 5.0
        while pool._idle == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert pool._may_claim() == 1
        # The asks end with the Sent write they were for (ChannelPool._attempt_and_next).
        pool._current.claiming = False
        pool._end_claim()
    finally:
        pool.stop()
        waiting.join(5.0)
    assert not waiting.is_alive()
    assert pool._may_claim() == 0  # stopping: none
