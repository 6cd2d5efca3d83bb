"""The database ends the app's connections under it (pg_terminate_backend, as a restart or a
failover does) on real PostgreSQL: never a 500. A request that lost its connection answers 503
with Retry-After (JSON on the API, a page that needs no database in the portal); a send that
lost it before anything could be written is tried once more inside the request, and one whose
write may have committed is never tried again, so no record is written twice.

What holds for a 503 whose write may have committed: the record exists once or not at all, and
the same request repeated with its businessKey returns it (or writes it, once) — the API's
idempotency keys are how a client settles the doubt.
"""

from __future__ import annotations

import collections
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from flask import Flask
from flask.testing import FlaskClient
from sqlalchemy import func, make_url, select, text

from portal.extensions import db
from portal.models import MailSendRecipient, MailSendRecord
from tests.conftest import TEST_DATABASE_URL, make_api_key, make_tenant

TO = ["ann@example.com"]
DSN = make_url(TEST_DATABASE_URL).set(drivername="postgresql").render_as_string(hide_password=False)
OTHER_CLIENTS = (
    "FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid() "
    "AND backend_type = 'client backend'"
)


class Terminator:
    """A thread that ends the test database's other sessions every ``every_s`` seconds, as
    the review did every 2 s (more often here, for a short test)."""

    def __init__(self, every_s: float):
        self.every_s = every_s
        self.killed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="terminator", daemon=True)

    def __enter__(self) -> Terminator:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        with psycopg.connect(DSN, autocommit=True) as admin:
            while not self._stop.wait(self.every_s):
                row = admin.execute(f"SELECT count(pg_terminate_backend(pid)) {OTHER_CLIENTS}")
                self.killed += row.fetchone()[0]  # type: ignore[index]


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def mail(subject: str, key: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"to": TO, "subject": subject, "text": "Hello"}
    return body | ({"businessKey": key} if key else {})


def written() -> dict[str, list[tuple[int, int]]]:
    """subject -> [(record id, its recipient rows)], from a fresh session on a fresh
    connection: the terminator's last kill may have ended a pooled one too recently for the
    pool's ping (connections idle over 1 s) to notice, as a loaded run once saw."""
    db.session.remove()
    db.engine.dispose()
    rows = db.session.execute(
        select(MailSendRecord.subject, MailSendRecord.id, func.count(MailSendRecipient.id))
        .outerjoin(MailSendRecipient, MailSendRecipient.record_id == MailSendRecord.id)
        .group_by(MailSendRecord.id)
    )
    found: dict[str, list[tuple[int, int]]] = collections.defaultdict(list)
    for subject, record_id, recipients in rows:
        found[subject].append((record_id, recipients))
    db.session.rollback()
    return found


def assert_unavailable(response: Any) -> None:
    assert response.status_code == 503, response.text
    assert response.headers["Retry-After"].isdigit()
    assert response.json["error"]["code"] == "database_unavailable"


# --- under fire --------------------------------------------------------------------------------

THREADS = 4
ROUNDS = 25  # per thread: one single send and one batch of two


def test_mail_posted_while_the_database_ends_connections_is_202_or_503_and_never_twice(
    app: Flask,
) -> None:
    token = make_api_key(make_tenant("acme").id)
    db.session.commit()
    answers: list[tuple[list[dict[str, Any]], bool, Any]] = []  # (items, batch?, response)
    lock = threading.Lock()

    def post_mails(thread: int) -> None:
        client = app.test_client()
        for round_ in range(ROUNDS):
            keyed = round_ % 2 == 0  # half carry a businessKey, half do not
            items = [
                mail(f"s{thread}-{round_}-{n}", f"k{thread}-{round_}-{n}" if keyed else None)
                for n in range(3)
            ]
            single = client.post("/api/v1/mail", json=items[0], headers=auth(token))
            batch = client.post(
                "/api/v1/mail/batch", json={"items": items[1:]}, headers=auth(token)
            )
            with lock:
                answers.extend([(items[:1], False, single), (items[1:], True, batch)])

    with Terminator(every_s=0.1) as terminator:
        threads = [threading.Thread(target=post_mails, args=(n,)) for n in range(THREADS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert terminator.killed > 0

    statuses = collections.Counter(response.status_code for _, _, response in answers)
    assert set(statuses) <= {202, 503}, statuses  # never a 500
    assert statuses[202] > 0, statuses
    found = written()
    for items, batch, response in answers:
        subjects = [item["subject"] for item in items]
        if response.status_code == 202:
            ids = [i["id"] for i in response.json["items"]] if batch else [response.json["id"]]
            # Each accepted mail exists exactly once, under the id it was answered with, whole.
            assert [found[s] for s in subjects] == [[(i, 1)] for i in ids], (subjects, ids)
            continue
        assert_unavailable(response)
        # In doubt: written once (whole) or not at all, and a batch all or none.
        assert all(len(found[s]) <= 1 for s in subjects), subjects
        assert len({bool(found[s]) for s in subjects}) == 1, subjects
    every = [entry for entries in found.values() for entry in entries]
    assert all(recipients == 1 for _, recipients in every)  # nothing half-written

    # The doubt settled by the idempotency key: each refused keyed request sent again returns
    # the record a lost commit wrote, or writes it now; either way exactly one.
    client = app.test_client()
    for items, batch, response in answers:
        if response.status_code != 503 or "businessKey" not in items[0]:
            continue
        if batch:
            again = client.post("/api/v1/mail/batch", json={"items": items}, headers=auth(token))
        else:
            again = client.post("/api/v1/mail", json=items[0], headers=auth(token))
        assert again.status_code == 202, again.text
    found = written()
    keyed = [item for items, _, _ in answers for item in items if "businessKey" in item]
    assert all(len(found[item["subject"]]) == 1 for item in keyed)


# --- one lost connection, where it was lost ----------------------------------------------------


@pytest.fixture
def slow_first_insert(app: Flask) -> Iterator[None]:
    """The first insert into mail_send_record sleeps (the next ones do not): long enough for a
    test to end its session mid-write. ``probe_attempts`` counts every insert begun, aborted
    ones too (a sequence is not rolled back)."""
    statements = [
        "CREATE SEQUENCE probe_attempts",
        "CREATE FUNCTION probe_slow_insert() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        "IF nextval('probe_attempts') = 1 THEN PERFORM pg_sleep(30); END IF; RETURN NEW; END $$",
        "CREATE TRIGGER probe_slow BEFORE INSERT ON mail_send_record "
        "FOR EACH ROW EXECUTE FUNCTION probe_slow_insert()",
    ]
    with db.engine.begin() as connection:
        for statement in statements:
            connection.execute(text(statement))
    try:
        yield
    finally:
        db.session.remove()
        with db.engine.begin() as connection:
            connection.execute(text("DROP TRIGGER probe_slow ON mail_send_record"))
            connection.execute(text("DROP FUNCTION probe_slow_insert()"))
            connection.execute(text("DROP SEQUENCE probe_attempts"))


def attempts() -> int:
    with psycopg.connect(DSN) as admin:
        row = admin.execute("SELECT last_value, is_called FROM probe_attempts").fetchone()
    assert row is not None
    return int(row[0]) if row[1] else 0


def end_the_sleeping_insert() -> threading.Thread:
    """A thread that terminates the session whose insert sleeps, as soon as it does."""

    def run() -> None:
        with psycopg.connect(DSN, autocommit=True) as admin:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                row = admin.execute(
                    f"SELECT count(pg_terminate_backend(pid)) {OTHER_CLIENTS} "
                    "AND wait_event = 'PgSleep'"
                ).fetchone()
                if row is not None and row[0]:
                    return
                time.sleep(0.01)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_send_whose_connection_is_lost_before_its_commit_is_tried_once_more(
    app: Flask, slow_first_insert: None
) -> None:
    # A new key is not cached: the request reads it in the session's transaction, and the
    # insert runs in that transaction too; its COMMIT is never sent, so nothing is written.
    token = make_api_key(make_tenant("acme").id)
    db.session.commit()
    killer = end_the_sleeping_insert()
    response = app.test_client().post("/api/v1/mail", json=mail("once"), headers=auth(token))
    killer.join()
    assert response.status_code == 202, response.text
    assert attempts() == 2  # the lost one and the one that wrote
    assert written()["once"] == [(response.json["id"], 1)]


def test_a_send_whose_write_may_have_committed_is_503_and_never_tried_again(
    app: Flask, slow_first_insert: None
) -> None:
    token = make_api_key(make_tenant("acme").id)
    db.session.commit()
    client = app.test_client()
    # A read caches the key; then the single send writes in autocommit: its insert commits
    # itself, and losing the connection during it leaves the outcome unknown to the app.
    assert client.get("/api/v1/mail/1", headers=auth(token)).status_code == 404
    db.session.remove()  # end the read's transaction (the requests share this app context)
    before = attempts()
    killer = end_the_sleeping_insert()
    doubtful = mail("doubt", "order-1")
    response = client.post("/api/v1/mail", json=doubtful, headers=auth(token))
    killer.join()
    assert_unavailable(response)
    assert "businessKey" in response.json["error"]["message"]
    assert attempts() == before + 1  # not tried again
    assert written()["doubt"] == []  # the terminated insert did not commit
    # The client repeats it with the same key: written once, and once only.
    again = client.post("/api/v1/mail", json=doubtful, headers=auth(token))
    assert (again.status_code, again.json["duplicate"]) == (202, False)
    last = client.post("/api/v1/mail", json=doubtful, headers=auth(token))
    assert (last.status_code, last.json) == (202, {"id": again.json["id"], "duplicate": True})
    assert written()["doubt"] == [(again.json["id"], 1)]


# --- any route: 503, not 500 --------------------------------------------------------------------


def lose_the_session_connection() -> None:
    """End the backend of the connection ``db.session`` holds (the test client's requests
    share this app context, so their session is this one) and wait until it is gone."""
    pid = db.session.execute(text("SELECT pg_backend_pid()")).scalar_one()
    with psycopg.connect(DSN, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        while admin.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone():
            time.sleep(0.01)


def test_a_portal_page_that_loses_its_connection_is_a_plain_503_page(app: Flask) -> None:
    client: FlaskClient = app.test_client()
    page = client.get("/auth/login").text
    found = re.search(r'name="csrf_token" value="([^"]+)"', page)
    assert found is not None
    lose_the_session_connection()
    response = client.post(
        "/auth/login",
        data={"email": "ann@example.com", "password": "x" * 20, "csrf_token": found.group(1)},
    )
    assert response.status_code == 503, response.text
    assert response.mimetype == "text/html"
    assert response.headers["Retry-After"].isdigit()
    assert "database" in response.text
    db.session.remove()


def test_an_api_read_that_loses_its_connection_is_503_json(app: Flask) -> None:
    token = make_api_key(make_tenant("acme").id)  # not cached: the request reads it
    db.session.commit()
    lose_the_session_connection()
    response = app.test_client().get("/api/v1/mail/1", headers=auth(token))
    assert_unavailable(response)
    db.session.remove()
