"""The delivery loop's one-statement claim, charge and Sent (portal.models.direct), on both
dialects: what they return must be what the ORM would load, and what they write must be what
the Session code they replaced wrote."""

from __future__ import annotations

import threading
import time
import traceback
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from flask import Flask
from sqlalchemy import create_engine, event, func, inspect, select, text, update
from sqlalchemy.orm import Session

from portal.extensions import db
from portal.messaging.after_send import events
from portal.messaging.sending import quota, sent_write
from portal.messaging.sending.claim import claim_due, claiming_next
from portal.messaging.sending.outcomes import Claimed
from portal.messaging.sending.sent_write import record_sent
from portal.models import (
    Channel,
    DeliveryEvent,
    MailSendRecord,
    MailSendServerConfig,
    SendStatus,
    TenantMessageQuota,
    TenantMessageUsage,
)
from portal.models.direct import driver_cursor, holding
from tests.support.delivery import accept_mail, tenant


def _accept(app: Flask, tenant_id: int, n: int, **body: Any) -> list[int]:
    return [
        accept_mail(
            app,
            tenant_id,
            to=[f"U{i}@Example.com"],
            cc=["cc@example.com"],
            subject=f"S {i}",
            text="Hi",
            variables={"n": i, "nested": {"ü": [1, 2]}},
            **body,
        )
        for i in range(n)
    ]


def _loaded(record_id: int) -> MailSendRecord:
    with Session(db.engine, expire_on_commit=False) as session:
        found = session.get(MailSendRecord, record_id)
        assert found is not None
        return found


def test_claim_due_returns_what_the_orm_loads_and_claims_oldest_first(any_app: Flask) -> None:
    acme = tenant("acme")
    ids = _accept(any_app, acme.id, 3, expiresAt="2999-01-01T00:00:00Z")
    # The middle one waits in Retry, due already; a Retry due later is left alone.
    db.session.execute(
        update(MailSendRecord)
        .where(MailSendRecord.id == ids[1])
        .values(status=SendStatus.RETRY.value, next_retry_at=datetime.now(UTC) - timedelta(hours=1))
    )
    later = _accept(any_app, acme.id, 1)[0]
    db.session.execute(
        update(MailSendRecord)
        .where(MailSendRecord.id == later)
        .values(status=SendStatus.RETRY.value, next_retry_at=datetime.now(UTC) + timedelta(hours=1))
    )
    db.session.commit()

    first = claim_due(db.engine, MailSendRecord, 1)
    assert [r.id for r in first] == [ids[1]]  # due an hour ago: the longest due
    rest = claim_due(db.engine, MailSendRecord, 5)
    assert sorted(r.id for r in rest) == [ids[0], ids[2]]
    assert claim_due(db.engine, MailSendRecord, 5) == []

    for claimed in [*first, *rest]:
        assert inspect(claimed).detached
        loaded = _loaded(claimed.id)
        assert loaded.status == SendStatus.SENDING.value
        for attr in inspect(MailSendRecord).column_attrs:
            assert getattr(claimed, attr.key) == getattr(loaded, attr.key), attr.key
        assert claimed.version == 1
        assert claimed.expires_at is not None
        assert claimed.expires_at.tzinfo is not None
        assert claimed.variables == {"n": loaded.variables["n"], "nested": {"ü": [1, 2]}}
        assert claimed.first_claimed_at == claimed.updated_time


def test_concurrent_claims_never_hand_out_a_record_twice(app: Flask) -> None:
    acme = tenant("acme")
    ids = set(_accept(app, acme.id, 120))
    engine = db.engine
    got: list[int] = []
    lock = threading.Lock()

    def worker() -> None:
        while True:
            records = claim_due(engine, MailSendRecord, 2)
            if not records:
                return
            with lock:
                got.extend(r.id for r in records)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(got) == len(set(got)) == len(ids)
    assert set(got) == ids


def test_record_sent_writes_by_version_and_says_nothing_when_the_race_is_lost(
    any_app: Flask,
) -> None:
    acme = tenant("acme")
    (rid,) = _accept(any_app, acme.id, 1)
    (record,) = claim_due(db.engine, MailSendRecord, 1)
    claimed = Claimed(Channel.MAIL, record.id, record.version, record.tenant_id, 0)
    refused = {"x@example.com": [550, "no such user"]}
    assert record_sent(db.engine, claimed, "<m1@example.com>", refused=refused)
    assert not record_sent(db.engine, claimed, "<m2@example.com>")  # the version moved on
    row = _loaded(rid)
    assert (row.status, row.version, row.provider_message_id) == ("Sent", 2, "<m1@example.com>")
    assert row.refused_recipients == refused
    assert row.sent_at is not None
    assert row.next_retry_at is None


def test_a_sent_write_claims_the_next_record_in_the_same_statement(app: Flask) -> None:
    """Inside ``claiming_next`` (a busy pool worker), the Sent write also claims the next due
    record: the one ``claim_due`` would have taken, as the ORM would load it. The Sent write
    itself is as without it; a lost version race still hands over what was claimed."""
    acme = tenant("acme")
    ids = _accept(app, acme.id, 4)
    (first,) = claim_due(db.engine, MailSendRecord, 1)
    claimed = Claimed(Channel.MAIL, first.id, first.version, first.tenant_id, 0)
    refused = {"x@example.com": [550, "no such user"]}
    with claiming_next(MailSendRecord, lambda: True) as following:
        assert record_sent(db.engine, claimed, "<n1@example.com>", refused=refused)
    row = _loaded(first.id)
    assert (row.status, row.version, row.provider_message_id) == ("Sent", 2, "<n1@example.com>")
    assert row.refused_recipients == refused
    assert following.ran
    (second,) = following.records
    assert second.id == ids[1]  # the oldest still due
    assert inspect(second).detached
    loaded = _loaded(second.id)
    assert loaded.status == SendStatus.SENDING.value
    for attr in inspect(MailSendRecord).column_attrs:
        assert getattr(second, attr.key) == getattr(loaded, attr.key), attr.key

    # A stopping worker claims nothing more: the Sent write runs alone.
    nxt = Claimed(Channel.MAIL, second.id, second.version, second.tenant_id, 0)
    with claiming_next(MailSendRecord, lambda: False) as following:
        assert record_sent(db.engine, nxt, "<n2@example.com>")
    assert not following.ran
    assert _loaded(ids[2]).status == SendStatus.PENDING.value

    # A lost race writes nothing, and the record claimed with it is handed over all the same.
    with claiming_next(MailSendRecord, lambda: True) as following:
        assert not record_sent(db.engine, nxt, "<n3@example.com>")
    assert following.ran
    assert [r.id for r in following.records] == [ids[2]]
    assert _loaded(second.id).provider_message_id == "<n2@example.com>"

    # The last one: the claim runs and finds nothing due.
    (last,) = claim_due(db.engine, MailSendRecord, 1)
    done = Claimed(Channel.MAIL, last.id, last.version, last.tenant_id, 0)
    with claiming_next(MailSendRecord, lambda: True) as following:
        assert record_sent(db.engine, done, "<n4@example.com>")
    assert following.ran
    assert following.records == []
    statuses = {r: _loaded(r).status for r in ids}
    assert statuses == {ids[0]: "Sent", ids[1]: "Sent", ids[2]: "Sending", ids[3]: "Sent"}


def test_the_driver_connection_goes_back_to_the_pool_out_of_autocommit(app: Flask) -> None:
    """A pooled connection the driver path used must still roll back a Session's work."""
    acme = tenant("acme")
    _accept(app, acme.id, 1)
    engine = db.engine
    for _ in range(3):
        claim_due(engine, MailSendRecord, 1)
    with driver_cursor(engine) as cursor:
        cursor.execute("SELECT 1")
    with Session(engine) as session:
        session.execute(update(TenantMessageUsage).values(mail_count=999))
        session.execute(
            text("INSERT INTO tenant_message_usage (tenant_id, month) VALUES (:t, 'x')"),
            {"t": acme.id},
        )
        session.rollback()
    assert (
        db.session.scalar(select(TenantMessageUsage).where(TenantMessageUsage.month == "x")) is None
    )


@pytest.mark.parametrize("channel", [Channel.MAIL, Channel.SMS])
def test_the_charge_is_one_statement_that_honours_the_ceiling(
    any_app: Flask, channel: Channel
) -> None:
    """SQLite: the test reads through db.session, which on SQLite begins IMMEDIATE (the write
    lock); each read ends its transaction before the next charge, as the worker never holds one."""
    settings = any_app.config["SETTINGS"]
    acme, bravo, charlie = (tenant(slug).id for slug in ("acme", "bravo", "charlie"))
    column = "mail_monthly_limit" if channel is Channel.MAIL else "sms_monthly_limit"
    db.session.add(TenantMessageQuota(tenant_id=acme, **{column: 2}))
    db.session.add(TenantMessageQuota(tenant_id=bravo, **{column: 0}))
    db.session.commit()

    assert [quota.charge(db.engine, acme, channel, settings) for _ in range(3)] == [
        True,
        True,
        False,
    ]
    assert not quota.charge(db.engine, bravo, channel, settings)  # a ceiling of 0
    used = quota.usage(db.session, acme, settings)
    assert (used.mail_used, used.sms_used) == ((2, 0) if channel is Channel.MAIL else (0, 2))
    assert quota.usage(db.session, bravo, settings).mail_used == 0
    db.session.rollback()

    # No quota row: the setting's default applies; no default: no ceiling, still counted.
    limited = settings.replace(mail_monthly_default=1, sms_monthly_default=1)
    assert quota.charge(db.engine, charlie, channel, limited)
    assert not quota.charge(db.engine, charlie, channel, limited)
    assert all(quota.charge(db.engine, charlie, channel, settings) for _ in range(5))
    used = quota.usage(db.session, charlie, settings)
    assert used.mail_used + used.sms_used == 6


def _sent_record(app: Flask) -> tuple[int, int, Claimed]:
    """A claimed mail record routed through a server: (record id, server id, its claim)."""
    acme = tenant("acme")
    server = MailSendServerConfig(
        tenant_id=acme.id, name="s", host="127.0.0.1", port=25, security="plain", is_default=True
    )
    db.session.add(server)
    db.session.flush()
    server_id = server.id
    record_id = accept_mail(app, acme.id, to=["ann@example.com"])
    db.session.execute(
        update(MailSendRecord)
        .where(MailSendRecord.id == record_id)
        .values(server_config_id=server_id)
    )
    db.session.commit()
    (record,) = claim_due(db.engine, MailSendRecord, 1)
    return record_id, server_id, Claimed(Channel.MAIL, record.id, record.version, acme.id, 0)


def _send_in_background(claimed: Claimed, pmid: str) -> tuple[threading.Thread, dict[str, bool]]:
    """record_sent on a thread of its own; its answer lands in the dict under "sent"."""
    result: dict[str, bool] = {}
    engine = db.engine
    writer = threading.Thread(
        target=lambda: result.setdefault("sent", record_sent(engine, claimed, pmid))
    )
    writer.start()
    return writer, result


def _store_event(
    session: Session,
    claimed: Claimed,
    server_id: int,
    pmid: str,
    kind: events.EventType = events.EventType.BOUNCED,
    dedup: str | None = None,
) -> Any:
    """What the webhook does for an event of ``pmid`` (a permanent bounce unless ``kind``
    says otherwise), not committed."""
    return events.store(
        session,
        Channel.MAIL,
        tenant_id=claimed.tenant_id,
        config_id=server_id,
        provider="generic",
        event=events.ProviderEvent(
            dedup or f"dedup-{pmid}",
            kind,
            pmid,
            recipient="ann@example.com",
            code="550 5.1.1" if kind is events.EventType.BOUNCED else None,
        ),
    )


def test_an_event_stored_while_the_sent_write_waits_is_applied(app: Flask) -> None:
    """The Sent write waits on a row lock (a sweep, a cancel) while a bounce for its provider
    id arrives: the webhook waits for the Sent write's event lock, then finds the record by
    its provider id; the bounce is applied either way, never left waiting."""
    record_id, server_id, claimed = _sent_record(app)
    locker = db.engine.connect()
    held = locker.begin()
    locker.execute(
        text("SELECT id FROM mail_send_record WHERE id = :i FOR UPDATE"), {"i": record_id}
    )
    writer, result = _send_in_background(claimed, "<pmid-1@example.com>")
    time.sleep(0.3)  # the Sent UPDATE has taken the event lock and waits for the row lock
    stored: list[Any] = []
    engine = db.engine

    def webhook() -> None:
        with Session(engine) as session:
            stored.append(_store_event(session, claimed, server_id, "<pmid-1@example.com>"))
            session.commit()

    hook = threading.Thread(target=webhook)
    hook.start()
    hook.join(0.5)
    assert hook.is_alive(), "the webhook did not wait for the Sent write's event lock"
    held.commit()
    locker.close()
    writer.join(30)
    hook.join(30)
    assert result == {"sent": True}
    assert stored[0].record_id == record_id  # found once the Sent write committed
    row = _loaded(record_id)
    assert row.delivery_outcome == "bounced"
    event = db.session.scalar(select(DeliveryEvent))
    assert event is not None
    assert event.record_id == record_id


def test_a_sent_write_waits_for_an_event_being_stored_and_then_sees_it(app: Flask) -> None:
    """PostgreSQL: a webhook holds the event lock of (route, provider id) from before its
    insert until its commit; the Sent write's look (inside its statement) takes the same lock
    first, so it waits and then sees the committed event. Nothing else looks here: without
    the lock the Sent write would look before the commit and the bounce would stay unapplied."""
    record_id, server_id, claimed = _sent_record(app)
    with Session(db.engine) as webhook:
        stored = _store_event(webhook, claimed, server_id, "<pmid-2@example.com>")
        assert stored.record_id is None  # the provider id is not written yet
        writer, result = _send_in_background(claimed, "<pmid-2@example.com>")
        writer.join(0.5)
        assert writer.is_alive(), "the Sent write did not wait for the event being stored"
        webhook.commit()
    writer.join(30)
    assert result == {"sent": True}
    row = _loaded(record_id)
    assert row.delivery_outcome == "bounced"
    assert row.status == SendStatus.FAILED.value  # a permanent bounce after the send


def test_a_resend_under_the_same_id_and_its_webhook_do_not_deadlock(
    app: Flask, caplog: pytest.LogCaptureFixture
) -> None:
    """A record sent again under the same Message-ID (a retry after a bounce) already carries
    its provider id, so a webhook holding the event lock can find and update it. The Sent
    write takes the event lock before its row lock, so the two queue instead of deadlocking
    (PostgreSQL would abort one of them after a second: the webhook's answer or the Sent
    write, leaving a sent mail for the sweep to send again)."""
    record_id, server_id, claimed = _sent_record(app)
    pmid = "<again@example.com>"
    assert record_sent(db.engine, claimed, pmid)
    db.session.execute(
        update(MailSendRecord)
        .where(MailSendRecord.id == record_id)
        .values(status="Retry", next_retry_at=datetime.now(UTC) - timedelta(seconds=1))
    )
    db.session.commit()
    (record,) = claim_due(db.engine, MailSendRecord, 1)
    again = Claimed(Channel.MAIL, record.id, record.version, claimed.tenant_id, 1)
    with Session(db.engine) as webhook:
        events.lock_for_events(webhook, Channel.MAIL, server_id, [pmid])
        writer, result = _send_in_background(again, pmid)
        time.sleep(0.3)  # the Sent write waits for the event lock, holding no row lock
        stored = _store_event(webhook, again, server_id, pmid)
        assert stored.record_id == record_id  # found by its provider id, and updated
        webhook.commit()
    writer.join(30)
    assert not writer.is_alive()
    assert "recording it failed" not in caplog.text
    assert "sent" in result


def test_webhooks_storing_the_same_ids_in_opposite_orders_do_not_deadlock(app: Flask) -> None:
    """The webhook takes every lock of its batch first, in sorted order."""
    _record_id, server_id, claimed = _sent_record(app)
    ids = [f"<pmid-{i}@example.com>" for i in range(5)]
    engine = db.engine
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def webhook(order: list[str], tag: str) -> None:
        try:
            with Session(engine) as session:
                barrier.wait()
                events.lock_for_events(session, Channel.MAIL, server_id, order)
                for pmid in order:
                    _store_event(
                        session,
                        claimed,
                        server_id,
                        pmid,
                        events.EventType.DELIVERED,
                        dedup=f"{tag}-{pmid}",
                    )
                    time.sleep(0.02)
                session.commit()
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=webhook, args=(ids, "a")),
        threading.Thread(target=webhook, args=(list(reversed(ids)), "b")),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    assert db.session.scalar(select(func.count()).select_from(DeliveryEvent)) == 10


def test_writes_survive_the_database_dropping_every_pooled_connection(app: Flask) -> None:
    """After a restart or failover the pool's connections are dead but were busy a moment ago
    (not pinged): each statement finds out, the pool is renewed, and the statement runs once
    more; nothing is left in Sending for the sweep to send twice."""
    acme = tenant("acme")
    for i in range(6):
        accept_mail(app, acme.id, to=[f"u{i}@example.com"])
    engine = db.engine
    records = claim_due(engine, MailSendRecord, 6)
    held = [engine.raw_connection() for _ in range(4)]
    pids = [h.driver_connection.info.backend_pid for h in held]  # type: ignore[union-attr]
    for h in held:
        h.close()
    # From a connection outside the pool: one of the pool's own would terminate itself.
    outside = create_engine(engine.url)
    try:
        with outside.begin() as conn:
            conn.execute(
                text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE pid = ANY(:p)"),
                {"p": pids},
            )
    finally:
        outside.dispose()
    time.sleep(0.2)
    done = [
        record_sent(engine, Claimed(Channel.MAIL, r.id, r.version, r.tenant_id, 0), f"<m{r.id}@x>")
        for r in records
    ]
    assert done == [True] * 6
    statuses = {_loaded(r.id).status for r in records}
    assert statuses == {"Sent"}
    assert quota.charge(engine, acme.id, Channel.MAIL, app.config["SETTINGS"])


def test_a_held_connection_serves_every_statement_and_goes_back_out_of_autocommit(
    app: Flask,
) -> None:
    """Inside holding(), a worker's statements share one checkout; it returns to the pool
    at the end ready for a Session (a transaction that can roll back)."""
    acme_id = tenant("acme").id
    for i in range(3):
        accept_mail(app, acme_id, to=[f"h{i}@example.com"])
    engine = db.engine
    checkouts: list[int] = []
    me = threading.get_ident()

    def count(_dbapi: Any, _record: Any, _proxy: Any) -> None:
        if threading.get_ident() == me:  # not acceptance's NOTIFY thread
            checkouts.append("".join(traceback.format_stack(limit=12)))

    event.listen(engine.pool, "checkout", count)
    try:
        with holding(engine), holding(engine):  # nested: the outer one holds
            pids = set()
            for record in claim_due(engine, MailSendRecord, 3):
                claimed = Claimed(Channel.MAIL, record.id, record.version, acme_id, 0)
                assert record_sent(engine, claimed, f"<h{record.id}@x>")
                with driver_cursor(engine) as cursor:
                    cursor.execute("SELECT pg_backend_pid()")
                    pids.add(cursor.fetchone()[0])
    finally:
        event.remove(engine.pool, "checkout", count)
    # On a failure (seen twice in six make check runs, never alone), where each checkout came
    # from and whether the Sent writes' group commit thought a leader was stuck.
    committer = sent_write._committer(engine, Channel.MAIL)
    assert len(checkouts) == 1, (committer._running, "\n-----\n".join(checkouts))
    assert len(pids) == 1
    with Session(engine) as session:  # the pool's LIFO hands the same connection back
        session.execute(update(TenantMessageUsage).values(mail_count=999))
        session.rollback()
    assert db.session.scalar(select(func.max(TenantMessageUsage.mail_count))) != 999


def test_a_held_connection_the_database_dropped_is_replaced_and_the_write_runs_again(
    app: Flask,
) -> None:
    acme = tenant("acme")
    for i in range(2):
        accept_mail(app, acme.id, to=[f"d{i}@example.com"])
    engine = db.engine
    with holding(engine):
        first, second = claim_due(engine, MailSendRecord, 2)
        with driver_cursor(engine) as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            pid = cursor.fetchone()[0]
        with Session(engine) as session:
            session.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid})
            session.commit()
        time.sleep(0.2)
        for record in (first, second):
            claimed = Claimed(Channel.MAIL, record.id, record.version, acme.id, 0)
            assert record_sent(engine, claimed, f"<d{record.id}@x>")
        with driver_cursor(engine) as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            assert cursor.fetchone()[0] != pid
    assert {_loaded(first.id).status, _loaded(second.id).status} == {"Sent"}


def test_the_delivery_loop_statements_are_planned_once_not_at_every_execution(
    app: Flask,
) -> None:
    """PostgreSQL plans a prepared statement for its values at each of the first five runs;
    after that it keeps a generic plan, unless that plan looks dearer than those, in which
    case it plans anew at every run. The claim with ``status = $1`` was such a statement, and
    its planning cost a quarter of a claim. Every statement a busy worker runs for a mail
    must settle on one plan; the claim, its values inline, is never planned again at all."""
    from tests.support.delivery import drain, mail_server
    from tests.support.smtp_server import ScriptedSmtpServer

    acme_id = tenant("acme").id
    with ScriptedSmtpServer() as smtp:
        mail_server(acme_id, smtp)
        db.session.commit()
        runs = 12
        for i in range(runs):
            accept_mail(app, acme_id, to=[f"p{i}@example.com"])
        with holding(db.engine):
            assert drain(app) == runs
            with driver_cursor(db.engine) as cursor:
                cursor.execute(
                    "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements"
                )
                plans = cursor.fetchall()
        assert len(smtp.messages) == runs
    # The single-record claim calls the claim function (migration 0022); the poll's claim of
    # several walks its indexes FOR UPDATE SKIP LOCKED in the statement itself. Both have
    # their values inline. A Sent write that claims the next records (``claiming_next``) also
    # says SKIP LOCKED, but binds the Sent values: like every statement with parameters it is
    # planned for its values at its first runs (the last check below bounds it). Whether a
    # drain runs one depends on timing (a fresh-clone run ran it once: custom 1).
    claims = [
        p
        for p in plans
        if ("postroom_claim_one" in p[0] or "SKIP LOCKED" in p[0]) and "$1" not in p[0]
    ]
    assert claims, plans
    # Never planned for its values (custom 0), and run: as often as these claims took the
    # records, which depends on timing (a Sent write may take some of them), so not a count
    # per record.
    for statement, generic, custom in claims:
        assert (custom, generic >= 1) == (0, True), (statement[:200], generic, custom)
    assert sum(generic for _s, generic, _c in claims) >= 3, claims
    for statement, generic, custom in plans:
        assert custom <= 5, (statement[:300], generic, custom)


def test_the_write_back_commits_without_waiting_for_the_disk_and_the_claim_waits(
    app: Flask,
) -> None:
    """The charge with the write-back commits asynchronously (its WAL is flushed by the
    attempt's last write, or within the WAL writer's delay); the claim, which the stuck-send
    sweep relies on after a crash, waits for its flush. Right after each statement, on the
    same connection: is the server's flushed WAL behind what it has written?

    WAL is the whole server's: other databases' asynchronous commits (another test run, a
    benchmark) leave it behind too. So the claim is compared with a control, a write of ours
    known to wait for its flush, sampled the same way: the claim must not be behind more
    often than that (on a quiet server, about never)."""
    from portal.messaging.sending import preparation

    acme_id = tenant("acme").id
    n = 10
    _accept(app, acme_id, n)
    settings = app.config["SETTINGS"]
    behind_after_claim = behind_after_freeze = behind_after_control = 0
    check = "SELECT pg_current_wal_flush_lsn() < pg_current_wal_insert_lsn()"
    with holding(db.engine):
        for i in range(n):
            with driver_cursor(db.engine) as cursor:
                # The control: a synchronous commit of a write (autocommit, the default
                # synchronous_commit), then the same look.
                cursor.execute("SET synchronous_commit = on")
                cursor.execute("UPDATE tenant SET name = name WHERE id = %s", (acme_id,))
                cursor.execute(check)
                behind_after_control += cursor.fetchone()[0]
            (record,) = claim_due(db.engine, MailSendRecord, 1)
            with driver_cursor(db.engine) as cursor:
                cursor.execute(check)
                behind_after_claim += cursor.fetchone()[0]
            claimed = Claimed(Channel.MAIL, record.id, record.version, acme_id, 0)
            frozen = {
                "rendered_subject": f"S {i}",
                "rendered_html": None,
                "rendered_text": "Hi",
                "final_reply_to": None,
                "final_priority": None,
                "final_attachments": None,
                "server_config_id": None,
                "read_receipt": False,
                "message_id_header": f"<w{i}@x>",
                "template_version": None,
            }
            assert preparation._charge_and_freeze(
                db.engine, MailSendRecord, acme_id, claimed, settings, frozen
            )
            with driver_cursor(db.engine) as cursor:
                cursor.execute(check)
                behind_after_freeze += cursor.fetchone()[0]
    # An asynchronous claim would be behind about every time (as the freeze is, below); the
    # margin is the noise of the other test workers' asynchronous commits on the same server,
    # which put the claim at 5 of 10 against the control's 2 in one parallel run.
    assert behind_after_claim <= behind_after_control + n // 2, (
        behind_after_claim,
        behind_after_control,
    )
    assert behind_after_freeze >= n - 3, behind_after_freeze
    written = db.session.scalars(
        select(MailSendRecord.message_id_header).where(MailSendRecord.tenant_id == acme_id)
    ).all()
    assert sorted(written) == sorted(f"<w{i}@x>" for i in range(n))
    usage = db.session.scalar(
        select(TenantMessageUsage.mail_count).where(TenantMessageUsage.tenant_id == acme_id)
    )
    assert usage == n
