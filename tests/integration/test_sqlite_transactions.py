"""SQLite transactions on the embedded default: reads never hold the write lock, a transaction
takes it at its first write (or a SELECT ... FOR UPDATE) and holds it to the end, so another
connection's write waits then, and only then."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator

import pytest
from flask import Flask
from sqlalchemy import select

from portal import sqlite_reads_only
from portal.extensions import db
from portal.models import Tenant


@pytest.fixture
def sqlite_db(sqlite_app: Flask) -> Iterator[str]:
    with sqlite_app.app_context():
        yield str(db.engine.url.database)
        db.session.remove()


def _write_elsewhere(path: str) -> bool:
    """Whether another connection can write now (waiting at most 0.2 s for the lock)."""
    other = sqlite3.connect(path, timeout=0.2, isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")
        other.execute("ROLLBACK")
        return True
    except sqlite3.OperationalError as exc:
        if "locked" not in str(exc):
            raise
        return False
    finally:
        other.close()


def test_a_transaction_that_only_read_leaves_the_lock_free(sqlite_db: str) -> None:
    db.session.scalars(select(Tenant)).all()
    assert db.session().in_transaction()
    # Before, the first SELECT began the transaction with BEGIN IMMEDIATE: a page's reads held
    # the lock, and a second connection of the same request waited 30 s on it.
    assert _write_elsewhere(sqlite_db)
    db.session.rollback()


def test_the_first_write_takes_the_lock_until_the_end(sqlite_db: str) -> None:
    db.session.scalars(select(Tenant)).all()
    db.session.add(Tenant(slug="locks", name="Locks"))
    db.session.flush()
    assert not _write_elsewhere(sqlite_db)
    db.session.commit()
    assert _write_elsewhere(sqlite_db)


def test_a_select_for_update_takes_the_lock(sqlite_db: str) -> None:
    db.session.scalars(select(Tenant).with_for_update()).all()
    assert not _write_elsewhere(sqlite_db)
    db.session.rollback()
    assert _write_elsewhere(sqlite_db)


@pytest.mark.parametrize(
    ("statement", "reads"),
    [
        ("SELECT 1", True),
        ("  select * from tenant", True),
        ("PRAGMA foreign_keys", True),
        ("WITH t AS (SELECT 1) SELECT * FROM t", True),
        ("WITH t AS (SELECT 1) UPDATE tenant SET name = 'x'", False),
        ("INSERT INTO tenant (slug) VALUES ('a')", False),
        ("UPDATE tenant SET name = 'a'", False),
        ("DELETE FROM tenant", False),
        ("SAVEPOINT sa_savepoint_1", False),
        ("CREATE TABLE x (a int)", False),
    ],
)
def test_what_counts_as_a_read(statement: str, reads: bool) -> None:
    assert sqlite_reads_only(statement) is reads
