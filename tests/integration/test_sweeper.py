"""The stuck-send sweep in-process (seed 000 "Stuck sends"): records get to Sending only by a
real claim (``claim_next``) and are then left alone, as by a worker that died mid-send."""

from __future__ import annotations

import random
import threading
import time
from datetime import datetime

import pytest
from flask import Flask
from prometheus_client import REGISTRY
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from portal.config import Settings
from portal.extensions import db
from portal.messaging.records import acceptance, validation
from portal.messaging.sending import outcomes, sent_write, sweeper
from portal.messaging.sending.backoff import BackoffPolicy
from portal.messaging.sending.claim import claim_next
from portal.messaging.sending.outcomes import Claimed
from portal.messaging.sending.sweeper import BATCH, SweepReport, sweep_stuck_sends
from portal.models import Channel, DeadLetterMessage, MailSendRecord, db_now
from portal.tenancy import tenant_context
from tests.support.delivery import tenant

THRESHOLD_S = 0.3
PAST_THRESHOLD_S = THRESHOLD_S + 0.15


def settings(app: Flask, threshold_s: float = THRESHOLD_S) -> Settings:
    base: Settings = app.config["SETTINGS"]
    return base.replace(stuck_send_threshold_s=threshold_s)


# For "a record claimed just now is not stuck": a threshold no loaded machine crosses between
# a claim and the next statement (the short one, 0.3 s, was crossed under four test workers).
NOT_YET_S = 60.0


def accept(app: Flask, tenant_id: int, n: int) -> list[int]:
    items = [{"to": [f"u{i}@example.com"], "subject": f"S {i}", "text": "Hi"} for i in range(n)]
    ids: list[int] = []
    for start in range(0, n, validation.MAX_BATCH):
        with tenant_context(tenant_id):
            accepted = acceptance.send_mail_batch(
                db.session, items[start : start + validation.MAX_BATCH], settings=settings(app)
            )
        db.session.commit()
        ids += [a.id for a in accepted]
    return ids


def claim(k: int = 1, scan_size: int = 4, seed: int = 7) -> list[MailSendRecord]:
    """A real claim, as a worker makes it; the caller then abandons the records."""
    with Session(db.engine, expire_on_commit=False) as session, session.begin():
        claimed = claim_next(
            session, MailSendRecord, scan_size=scan_size, k=k, rng=random.Random(seed)
        )
    return claimed  # type: ignore[return-value]


def claim_each(n: int) -> list[int]:
    """Claim ``n`` due records one transaction each, in random order; ids in claim order."""
    rng = random.Random(11)
    order: list[int] = []
    for _ in range(n):
        with Session(db.engine, expire_on_commit=False) as session, session.begin():
            (one,) = claim_next(session, MailSendRecord, scan_size=16, k=1, rng=rng)
        order.append(one.id)
    return order


def set_retry_count(ids: list[int], retry_count: int) -> None:
    """Setup only: retries already used up (status is left to the real claim)."""
    db.session.execute(
        update(MailSendRecord).where(MailSendRecord.id.in_(ids)).values(retry_count=retry_count)
    )
    db.session.commit()


def rows(ids: list[int]) -> dict[int, MailSendRecord]:
    """The records as they are now, detached, holding no transaction (SQLite: no lock)."""
    db.session.expire_all()
    found = db.session.scalars(select(MailSendRecord).where(MailSendRecord.id.in_(ids))).all()
    db.session.expunge_all()
    db.session.rollback()
    return {r.id: r for r in found}


def record(record_id: int) -> MailSendRecord:
    return rows([record_id])[record_id]


def db_clock() -> datetime:
    value = db.session.scalar(select(db_now()))
    db.session.rollback()
    assert value is not None
    return value


def failed_metric(outcome: str) -> float:
    value = REGISTRY.get_sample_value(
        "message_failed_total", {"channel": "mail", "provider": "sweeper", "outcome": outcome}
    )
    return value or 0.0


def dead_letters() -> list[DeadLetterMessage]:
    found = list(db.session.scalars(select(DeadLetterMessage).order_by(DeadLetterMessage.id)))
    db.session.expunge_all()
    db.session.rollback()
    return found


# --- both dialects ---------------------------------------------------------------------------


def test_abandoned_claims_are_put_back_to_retry_due_now(any_app: Flask) -> None:
    acme = tenant("acme").id
    db.session.commit()
    ids = accept(any_app, acme, 3)
    claimed = claim(k=2, scan_size=3)
    stuck = sorted(r.id for r in claimed)
    (pending,) = set(ids) - set(stuck)
    assert {r.status for r in claimed} == {"Sending"}
    before = failed_metric("retry")

    # Not yet past the threshold: nothing happens.
    assert sweep_stuck_sends(db.engine, settings(any_app, NOT_YET_S)).total == 0
    assert {r.status for r in rows(stuck).values()} == {"Sending"}

    time.sleep(PAST_THRESHOLD_S)
    report = sweep_stuck_sends(db.engine, settings(any_app))
    assert report.recovered == {"mail": 2}
    assert report.exhausted == {}
    now = db_clock()
    for row in rows(stuck).values():
        assert (row.status, row.error_code, row.retry_count, row.version) == (
            "Retry",
            "ZOMBIE_RECOVERED",
            1,
            2,  # claim, sweep
        )
        assert row.next_retry_at is not None
        assert row.next_retry_at <= now  # due at once
        assert "stuck in Sending" in (row.error_message or "")
    assert (record(pending).status, record(pending).version) == ("Pending", 0)
    assert failed_metric("retry") == before + 2
    assert dead_letters() == []

    # Due now means the next claim takes them again (oldest due first, the Pending one too).
    again = claim(k=3, scan_size=3)
    assert sorted(r.id for r in again) == sorted(ids)
    # ... and a second sweep finds nothing: they were claimed again only just now.
    assert sweep_stuck_sends(db.engine, settings(any_app, NOT_YET_S)).total == 0


def test_claims_with_retries_used_up_become_dead_letters(any_app: Flask) -> None:
    acme = tenant("acme").id
    db.session.commit()
    max_retries = settings(any_app).max_retries
    (rid,) = accept(any_app, acme, 1)
    set_retry_count([rid], max_retries)
    (claimed,) = claim()
    assert claimed.id == rid
    before = failed_metric("dead_letter")

    time.sleep(PAST_THRESHOLD_S)
    report = sweep_stuck_sends(db.engine, settings(any_app))
    assert (report.recovered, report.exhausted) == ({}, {"mail": 1})
    row = record(rid)
    assert (row.status, row.error_code, row.retry_count, row.version) == (
        "DeadLetter",
        "ZOMBIE_EXHAUSTED",
        max_retries,
        2,
    )
    assert row.next_retry_at is None
    (letter,) = dead_letters()
    assert (letter.source, letter.event_id, letter.channel, letter.tenant_id) == (
        "SendExhausted",
        str(rid),
        "mail",
        acme,
    )
    assert letter.error_code == "ZOMBIE_EXHAUSTED"
    assert letter.status == "Pending"  # triage
    assert letter.payload is not None
    assert letter.payload["recordId"] == rid
    assert letter.payload["errorCode"] == "ZOMBIE_EXHAUSTED"
    assert failed_metric("dead_letter") == before + 1
    # Not due: nothing claims a dead letter, and the sweep leaves it alone.
    assert claim() == []
    assert sweep_stuck_sends(db.engine, settings(any_app)).total == 0
    assert len(dead_letters()) == 1


# --- PostgreSQL ------------------------------------------------------------------------------


def test_claims_younger_than_the_threshold_are_untouched(app: Flask) -> None:
    acme = tenant("acme").id
    db.session.commit()
    accept(app, acme, 2)
    (old,) = claim()
    time.sleep(PAST_THRESHOLD_S)
    (young,) = claim()
    report = sweep_stuck_sends(db.engine, settings(app))
    assert report.recovered == {"mail": 1}
    assert (record(old.id).status, record(old.id).error_code) == ("Retry", "ZOMBIE_RECOVERED")
    young_row = record(young.id)
    assert (young_row.status, young_row.version, young_row.retry_count) == ("Sending", 1, 0)
    assert young_row.error_code is None


@pytest.mark.long
def test_at_most_200_a_run_oldest_first(app: Flask) -> None:
    acme = tenant("acme").id
    db.session.commit()
    total = BATCH + 5
    ids = accept(app, acme, total)
    order = claim_each(total)  # one claim each, in random order: updated_time follows it
    assert sorted(order) == sorted(ids)
    assert order != sorted(order)  # the claim order is not the id order
    time.sleep(PAST_THRESHOLD_S)

    report = sweep_stuck_sends(db.engine, settings(app))
    assert report.recovered == {"mail": BATCH}
    after = rows(ids)
    still_sending = {rid for rid, row in after.items() if row.status == "Sending"}
    assert still_sending == set(order[BATCH:])  # the 5 claimed last
    assert {after[rid].status for rid in order[:BATCH]} == {"Retry"}

    report = sweep_stuck_sends(db.engine, settings(app))
    assert report.recovered == {"mail": 5}
    assert {row.status for row in rows(ids).values()} == {"Retry"}


def test_two_sweeps_at_once_change_each_record_exactly_once(app: Flask) -> None:
    acme = tenant("acme").id
    db.session.commit()
    ids = accept(app, acme, BATCH)
    exhausted_ids = ids[::10]  # 20 of them with their retries used up
    max_retries = settings(app).max_retries
    set_retry_count(exhausted_ids, max_retries)
    claimed = claim(k=BATCH, scan_size=BATCH)
    assert len(claimed) == BATCH
    time.sleep(PAST_THRESHOLD_S)

    barrier = threading.Barrier(2)
    reports: list[SweepReport] = []
    errors: list[BaseException] = []
    engine, short = db.engine, settings(app)

    def sweep() -> None:
        try:
            barrier.wait(5)
            reports.append(sweep_stuck_sends(engine, short))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=sweep) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert len(reports) == 2
    recovered = sum(r.recovered.get("mail", 0) for r in reports)
    exhausted = sum(r.exhausted.get("mail", 0) for r in reports)
    assert (recovered, exhausted) == (BATCH - len(exhausted_ids), len(exhausted_ids))
    print(f"\nper sweep: {[(r.recovered, r.exhausted) for r in reports]}")

    after = rows(ids)
    for rid, row in after.items():
        assert row.version == 2, (rid, row.version)  # claim + exactly one sweep
        if rid in exhausted_ids:
            assert (row.status, row.retry_count) == ("DeadLetter", max_retries)
        else:
            assert (row.status, row.retry_count) == ("Retry", 1)
    letters = dead_letters()
    assert sorted(int(d.event_id or 0) for d in letters) == sorted(exhausted_ids)


def test_a_late_worker_loses_the_version_race_to_the_sweep(app: Flask) -> None:
    acme = tenant("acme").id
    db.session.commit()
    accept(app, acme, 1)
    (held,) = claim()
    stale = Claimed(Channel.MAIL, held.id, held.version, held.tenant_id, held.retry_count)
    time.sleep(PAST_THRESHOLD_S)
    assert sweep_stuck_sends(db.engine, settings(app)).recovered == {"mail": 1}
    swept = record(held.id)
    snapshot = (swept.status, swept.version, swept.retry_count, swept.error_code)
    assert snapshot == ("Retry", 2, 1, "ZOMBIE_RECOVERED")
    sent_before = REGISTRY.get_sample_value(
        "message_sent_total", {"channel": "mail", "provider": "unprepared"}
    )

    # The worker comes back from its slow send and writes Sent with the version it claimed.
    assert sent_write.record_sent(db.engine, stale, "<late@postroom>") is False
    # ... or a failure: the same, nothing happens.
    policy = BackoffPolicy.from_settings(settings(app))
    assert outcomes.handle_failure(db.engine, stale, "421", "try later", policy=policy) is None
    row = record(held.id)
    assert (row.status, row.version, row.retry_count, row.error_code) == snapshot
    assert row.sent_at is None
    assert row.provider_message_id is None
    assert (
        REGISTRY.get_sample_value(
            "message_sent_total", {"channel": "mail", "provider": "unprepared"}
        )
        == sent_before
    )


def test_a_worker_that_finishes_between_the_sweeps_read_and_write_wins(app: Flask) -> None:
    acme = tenant("acme").id
    db.session.commit()
    accept(app, acme, 1)
    (held,) = claim()
    claimed = Claimed(Channel.MAIL, held.id, held.version, held.tenant_id, held.retry_count)
    time.sleep(PAST_THRESHOLD_S)
    before = failed_metric("retry")
    # The sweep has read the record (id, version) while it was Sending; then the worker's
    # slow send returns and it writes Sent; then the sweep writes by the version it read.
    assert sent_write.record_sent(db.engine, claimed, "<done@postroom>") is True
    assert sweeper._transition(db.engine, claimed, settings(app)) is None
    row = record(held.id)
    assert (row.status, row.version, row.retry_count, row.error_code) == ("Sent", 2, 0, None)
    assert failed_metric("retry") == before  # a write that did not happen records nothing
    assert sweep_stuck_sends(db.engine, settings(app)).total == 0
    assert dead_letters() == []
