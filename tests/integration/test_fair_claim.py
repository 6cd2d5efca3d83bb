"""Fair claiming: streams, tenants in turn, the broadcast share.

Order, not wall time: a pool of real worker threads runs a no-op attempt that writes each
record Sent through ``sent_write.record_sent`` (so a busy worker's next claim rides on its Sent
write, as in production) and notes the order records were taken in. The claim's cost is
compared in buffers at one tenant and at 1,000 (EXPLAIN ANALYZE, rolled back).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from flask import Flask
from sqlalchemy import Engine, select, text

from portal.delivery.pool import ChannelPool, ChannelSpec, broadcast_cap
from portal.extensions import db
from portal.messaging.records import acceptance
from portal.messaging.records.validation import AcceptanceError
from portal.messaging.sending.claim import _CLAIMS, RouteGate, enter_route, gating_routes
from portal.messaging.sending.outcomes import Claimed
from portal.messaging.sending.sent_write import record_sent
from portal.models import Channel, MailSendRecord, MailTemplate, SmsSendRecord, SmsTemplate
from portal.tenancy import tenant_context
from tests.support.delivery import tenant, unfinished

WORKERS = 4

pytestmark = pytest.mark.timeout(60)


def _queue(tenant_id: int, n: int, stream: str = "transactional", age_s: float = 0.0) -> None:
    """``n`` Pending mail records of one tenant, oldest first, all older than ``age_s``."""
    db.session.execute(
        text(
            "INSERT INTO mail_send_record (tenant_id, scope, status, version, retry_count, "
            "stream, to_addrs, subject, text_body, created_time, updated_time) "
            "SELECT :tenant, 'TENANT', 'Pending', 0, 0, :stream, '[\"a@example.com\"]', 'S', "
            "'T', now() - make_interval(secs => :age + (:n - g) / 1000.0), "
            "now() - make_interval(secs => :age + (:n - g) / 1000.0) "
            "FROM generate_series(1, :n) g"
        ),
        {"tenant": tenant_id, "n": n, "stream": stream, "age": age_s},
    )
    db.session.commit()


class Recorder:
    """The attempt the pool runs: note the record, write it Sent (the next claim rides on
    the write), and track how many broadcast records are in hand at once."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.order: list[tuple[int, int, str]] = []  # (record id, tenant, stream)
        self.lock = threading.Lock()
        self.broadcast_now = 0
        self.broadcast_most = 0

    def __call__(self, _context: Any, record: Any) -> None:
        broadcast = record.stream == "broadcast"
        with self.lock:
            self.order.append((record.id, record.tenant_id, record.stream))
            if broadcast:
                self.broadcast_now += 1
                self.broadcast_most = max(self.broadcast_most, self.broadcast_now)
        try:
            time.sleep(0.001)
            claimed = Claimed(Channel.MAIL, record.id, record.version, record.tenant_id, 0)
            record_sent(self.engine, claimed, f"<{record.id}@test>")
        finally:
            if broadcast:
                with self.lock:
                    self.broadcast_now -= 1


class _NoContext:
    def close(self) -> None:
        pass


@pytest.fixture
def run_pool(app: Flask) -> Iterator[Any]:
    pools: list[ChannelPool] = []

    def run(recorder: Any, until: Any, share: float = 0.75) -> ChannelPool:
        spec = ChannelSpec(
            channel=Channel.MAIL,
            model=MailSendRecord,
            concurrency=WORKERS,
            make_context=_NoContext,
            process=recorder,
            broadcast_max_share=share,
        )
        pool = ChannelPool(db.engine, spec, poll_interval_s=0.05)
        pools.append(pool)
        pool.start()
        deadline = time.monotonic() + 30
        while not until() and time.monotonic() < deadline:
            time.sleep(0.005)
        pool.stop()
        assert not (left := unfinished(pool, 10)), left
        return pool

    yield run
    for pool in pools:
        pool.stop()


def _position(order: list[tuple[int, int, str]], predicate: Any) -> int:
    return next(i for i, item in enumerate(order) if predicate(item))


def test_one_tenants_backlog_does_not_hold_back_another_tenants_mail(
    app: Flask, run_pool: Any
) -> None:
    a, b = tenant("acme").id, tenant("globex").id
    _queue(a, 2_000, age_s=60)
    _queue(b, 1)
    recorder = Recorder(db.engine)
    run_pool(recorder, lambda: any(t == b for _, t, _s in list(recorder.order)))
    at = _position(recorder.order, lambda item: item[1] == b)
    assert at < 2 * WORKERS, at  # not behind A's 2,000


def _queue_retry(tenant_id: int, n: int, age_s: float = 60.0) -> None:
    """``n`` Retry mail records of one tenant, all due ``age_s`` ago (an outage's backlog)."""
    db.session.execute(
        text(
            "INSERT INTO mail_send_record (tenant_id, scope, status, version, retry_count, "
            "stream, to_addrs, subject, text_body, next_retry_at, created_time, updated_time) "
            "SELECT :tenant, 'TENANT', 'Retry', 2, 1, 'transactional', '[\"a@example.com\"]', "
            "'S', 'T', now() - make_interval(secs => :age + (:n - g) / 1000.0), "
            "now() - interval '1 hour', now() - make_interval(secs => :age) "
            "FROM generate_series(1, :n) g"
        ),
        {"tenant": tenant_id, "n": n, "age": age_s},
    )
    db.session.commit()


def test_one_tenants_retry_backlog_does_not_hold_back_another_tenants_new_mail(
    app: Flask, run_pool: Any
) -> None:
    """A's 2,000 records came due long ago (a server back after an outage): B's new mail
    still goes within the next few claims (a Pending and a Retry record of one rank go in
    the tenants' turn, not by age), and A's backlog is not starved either."""
    a, b = tenant("acme").id, tenant("globex").id
    _queue_retry(a, 2_000, age_s=120)
    _queue(b, 3)
    recorder = Recorder(db.engine)
    run_pool(recorder, lambda: sum(item[1] == b for item in list(recorder.order)) == 3)
    taken = [item[1] for item in recorder.order]
    assert _position(recorder.order, lambda item: item[1] == b) < 2 * WORKERS, taken
    # B's three went while A's were being drained, not after them.
    last_b = max(i for i, t in enumerate(taken) if t == b)
    assert last_b < 6 * WORKERS, taken
    # And A's were taken among them. Not strictly in turns: the turn is read from the last
    # committed claim, so workers claiming at the same moment may all see B's turn (under
    # load, B's three have gone one after another).
    assert a in taken[:last_b], taken


def test_due_retries_take_the_tenants_turn_too(app: Flask) -> None:
    """Claim by claim: A's 500 retries came due long ago, C's one just now, and B has none:
    C's retry is taken within the next two claims, not after A's 500 (idx_*_retry_fair); a
    tenant whose retries are all still to come is looked past."""
    from portal.messaging.sending.claim import claiming_next

    a, b, c = (tenant(slug).id for slug in ("acme", "globex", "initech"))
    _queue_retry(a, 500, age_s=300)
    _queue_retry(b, 3, age_s=-3600)  # due in an hour
    _queue_retry(c, 1, age_s=1)
    (record,) = _CLAIMS[MailSendRecord](db.engine, 1)
    taken = [record.tenant_id]
    for _ in range(4):
        with claiming_next(MailSendRecord, lambda: True) as following:
            claimed = Claimed(Channel.MAIL, record.id, record.version, record.tenant_id, 0)
            assert record_sent(db.engine, claimed, f"<{record.id}@test>")
        (record,) = following.records
        taken.append(record.tenant_id)
    assert c in taken[:3], taken
    assert b not in taken, taken
    assert taken.count(a) >= 3, taken


def test_tenants_take_turns_record_by_record(app: Flask) -> None:
    """Claim by claim (each worker's next claim in its Sent write): with three tenants due
    the turn goes round them, whatever their backlogs."""
    ids = [tenant(slug).id for slug in ("t1", "t2", "t3")]
    for n, tenant_id in zip((300, 5, 5), ids, strict=True):
        _queue(tenant_id, n)
    (record,) = _CLAIMS[MailSendRecord](db.engine, 1)
    taken = [record.tenant_id]
    from portal.messaging.sending.claim import claiming_next

    for _ in range(8):
        with claiming_next(MailSendRecord, lambda: True) as following:
            claimed = Claimed(Channel.MAIL, record.id, record.version, record.tenant_id, 0)
            assert record_sent(db.engine, claimed, f"<{record.id}@test>")
        assert following.ran
        (record,) = following.records
        taken.append(record.tenant_id)
    # Each window of three claims holds every tenant once.
    for start in range(0, 9, 3):
        assert sorted(taken[start : start + 3]) == sorted(ids), taken


def test_one_transactional_mail_goes_before_a_broadcast_backlog(app: Flask, run_pool: Any) -> None:
    a = tenant("acme").id
    _queue(a, 1_000, stream="broadcast", age_s=60)
    _queue(a, 1, stream="transactional")
    recorder = Recorder(db.engine)
    pool = run_pool(
        recorder, lambda: any(s == "transactional" for _, _t, s in list(recorder.order))
    )
    at = _position(recorder.order, lambda item: item[2] == "transactional")
    assert at < 2 * WORKERS, at
    assert recorder.broadcast_most <= pool.broadcast_cap == 3
    assert pool.broadcast_held == 0  # every slot given back


def test_broadcast_never_takes_every_worker(app: Flask, run_pool: Any) -> None:
    a = tenant("acme").id
    _queue(a, 400, stream="broadcast")
    recorder = Recorder(db.engine)

    def done() -> bool:
        return len(recorder.order) >= 400

    pool = run_pool(recorder, done)
    assert len(recorder.order) == 400  # all sent, through the broadcast slots alone
    assert 1 <= recorder.broadcast_most <= WORKERS - 1
    assert pool.broadcast_held == 0


def test_broadcast_cap() -> None:
    assert [broadcast_cap(n, 0.75) for n in (1, 2, 3, 4, 10)] == [1, 1, 2, 3, 7]
    assert broadcast_cap(4, 1.0) == 3  # one worker always stays free
    assert broadcast_cap(4, 0.0) == 1


def _claim_buffers() -> int:
    """Shared buffers the one-record claim touches (EXPLAIN ANALYZE, rolled back)."""
    sql = _CLAIMS[MailSendRecord].direct("postgresql", 1)._plan(db.engine.dialect).sql
    with db.engine.connect() as conn:
        (plan,) = conn.execute(text(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {sql}")).one()
        conn.rollback()
    document = plan[0] if isinstance(plan, list) else json.loads(plan)[0]
    root = document["Plan"]
    assert root["Actual Rows"] == 1
    return int(root["Shared Hit Blocks"] + root.get("Shared Read Blocks", 0))


def _vacuum_analyze() -> None:
    """The table without the dead rows earlier tests and the first half left (deleted rows stay
    in the index until a vacuum, and the walk would count them, as often as autovacuum
    happened not to run): both halves are measured on a clean table."""
    db.session.commit()
    with db.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE mail_send_record"))


def test_the_claim_costs_about_the_same_with_1000_tenants_due_as_with_one(app: Flask) -> None:
    one = tenant("acme").id
    _queue(one, 2_000)
    _vacuum_analyze()
    alone = min(_claim_buffers() for _ in range(3))
    db.session.execute(text("DELETE FROM mail_send_record"))
    db.session.commit()
    # 1,000 tenant ids (the index walk needs no tenant rows), two records each.
    db.session.execute(
        text(
            "INSERT INTO mail_send_record (tenant_id, scope, status, version, retry_count, "
            "stream, to_addrs, subject, text_body, created_time, updated_time) "
            "SELECT 1000 + g % 1000, 'TENANT', 'Pending', 0, 0, 'transactional', "
            "'[\"a@example.com\"]', 'S', 'T', now() - make_interval(secs => g / 1000.0), "
            "now() - make_interval(secs => g / 1000.0) FROM generate_series(1, 2000) g"
        )
    )
    _vacuum_analyze()
    many = min(_claim_buffers() for _ in range(3))
    print(f"claim buffers: 1 tenant {alone}, 1,000 tenants {many}")
    assert many <= 2 * alone, (alone, many)


# --- the stream at acceptance ----------------------------------------------------------------


def _accept(app: Flask, tenant_id: int, channel: str, **body: Any) -> Any:
    settings = app.config["SETTINGS"]
    with tenant_context(tenant_id):
        if channel == "mail":
            request = {"to": ["ann@example.com"], "subject": "Hello", "text": "Hi"} | body
            result = acceptance.send_mail(db.session, request, settings=settings)
        else:
            request = {"phoneNumber": "+447911123456", "content": "Hi"} | body
            result = acceptance.send_sms(db.session, request, settings=settings)
    db.session.commit()
    model = MailSendRecord if channel == "mail" else SmsSendRecord
    return db.session.get(model, result.id)


@pytest.mark.parametrize("channel", ["mail", "sms"])
def test_stream_at_acceptance_given_defaulted_or_from_the_template(
    app: Flask, channel: str
) -> None:
    acme = tenant("acme").id
    template_model = MailTemplate if channel == "mail" else SmsTemplate
    fields = {"subject": "S", "text_body": "T"} if channel == "mail" else {"content": "Hi"}
    db.session.add(
        template_model(tenant_id=acme, code="news", name="News", stream="broadcast", **fields)
    )
    db.session.commit()
    assert _accept(app, acme, channel).stream == "transactional"
    assert _accept(app, acme, channel, stream="broadcast").stream == "broadcast"
    plain = {"subject": None, "text": None} if channel == "mail" else {"content": None}
    from_template = _accept(app, acme, channel, templateCode="news", **plain)
    assert from_template.stream == "broadcast"
    given = _accept(app, acme, channel, templateCode="news", stream="transactional", **plain)
    assert given.stream == "transactional"
    with pytest.raises(AcceptanceError) as refused:
        _accept(app, acme, channel, stream="bulk")
    assert (refused.value.status, refused.value.field) == (422, "stream")


# --- at most pool size - 1 workers per server -------------------------------------------------


def test_a_hanging_server_holds_at_most_all_but_one_worker(app: Flask, run_pool: Any) -> None:
    """Every record goes to one server that hangs (50 ms a send): at most WORKERS - 1 are in
    flight to it at once; the attempt that finds no room is told so (``enter_route``
    False: the pipeline defers it) and its worker is free for other work."""
    a = tenant("acme").id
    _queue(a, 40)
    inside = {"now": 0, "most": 0, "refused": 0}
    lock = threading.Lock()
    engine = db.engine

    def attempt(_context: Any, record: Any) -> None:
        if enter_route(("mail", 1)):
            with lock:
                inside["now"] += 1
                inside["most"] = max(inside["most"], inside["now"])
            time.sleep(0.05)
            with lock:
                inside["now"] -= 1
        else:
            with lock:
                inside["refused"] += 1
        claimed = Claimed(Channel.MAIL, record.id, record.version, record.tenant_id, 0)
        record_sent(engine, claimed, f"<{record.id}@test>")

    done = {"n": 0}

    def counting(context: Any, record: Any) -> None:
        attempt(context, record)
        with lock:
            done["n"] += 1

    run_pool(counting, lambda: done["n"] >= 40)
    assert inside["most"] == WORKERS - 1, inside
    assert inside["refused"] > 0, inside


def test_the_route_gate_counts_per_route_and_gives_back_on_leaving() -> None:
    gate = RouteGate(2)
    assert gate.try_enter("x")
    assert gate.try_enter("x")
    assert not gate.try_enter("x")
    assert gate.try_enter("y")  # another server: its own count
    gate.leave("x")
    assert gate.try_enter("x")
    with gating_routes(RouteGate(1)):
        assert enter_route("z")
        assert enter_route("z")  # the same attempt again: already in
    assert enter_route("z")  # outside a pool: always


def test_the_route_gate_serves_waiters_first_come_first_served() -> None:
    """A worker that leaves a route and comes straight back for its next record queues
    behind one already waiting (with barging it took the place again, record after record,
    until the waiter gave up as SERVER_BUSY)."""
    gate = RouteGate(1)
    assert gate.try_enter("x")
    order: list[str] = []
    waiting = threading.Event()

    def waiter() -> None:
        waiting.set()
        if gate.try_enter("x", 5.0):
            order.append("waiter")
            time.sleep(0.05)
            gate.leave("x")

    thread = threading.Thread(target=waiter)
    thread.start()
    waiting.wait(5.0)
    time.sleep(0.1)  # the waiter is queued
    for _ in range(20):  # the holder's next records, without a pause between them
        gate.leave("x")
        assert gate.try_enter("x", 5.0)
        order.append("holder")
    thread.join(5.0)
    assert order[0] == "waiter", order[:3]
    assert not gate.try_enter("x")  # the holder has it again; nobody else may enter
    gate.leave("x")
    assert gate.try_enter("x", 0.01)


def test_import_sets_a_templates_stream_and_keeps_it_when_left_out(
    app: Flask, tmp_path: Any
) -> None:
    runner = app.test_cli_runner()
    data: dict[str, Any] = {
        "tenants": [{"slug": "acme", "name": "Acme"}],
        "mailTemplates": [
            {"tenant": "acme", "code": "news", "subject": "S", "text": "T", "stream": "broadcast"}
        ],
        "smsTemplates": [{"tenant": "acme", "code": "otp", "content": "C", "stream": "broadcast"}],
    }

    def run(payload: dict[str, Any]) -> Any:
        path = tmp_path / "config.json"
        path.write_text(json.dumps(payload))
        return runner.invoke(args=["import-config", str(path)])

    assert run(data).exit_code == 0
    for entry in (*data["mailTemplates"], *data["smsTemplates"]):
        entry.pop("stream")
    assert run(data).exit_code == 0  # left out: the stored stream stays
    db.session.expire_all()
    assert db.session.scalars(select(MailTemplate.stream)).all() == ["broadcast"]
    assert db.session.scalars(select(SmsTemplate.stream)).all() == ["broadcast"]
    data["mailTemplates"][0]["stream"] = "bulk"
    refused = run(data)
    assert refused.exit_code != 0
    assert "stream" in refused.output
