"""The migrations are numbered in apply order, and a database upgraded before they were
renumbered (its alembic_version holding an old id such as '0052') upgrades on: env.py
translates the old id once and Alembic applies whatever is missing from there."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

import pytest
from alembic.script import ScriptDirectory
from flask import Flask
from flask_migrate import downgrade
from sqlalchemy import inspect, text

from portal.extensions import db
from portal.models.enums import SendStatus
from tests.conftest import make_app
from tests.integration.test_migrations import (
    MIGRATIONS,
    _dispose,
    current_revisions,
    heads,
    schema_diff,
    throwaway_pg_url,
)

__all__ = ["throwaway_pg_url"]

OLD_HEAD = "0052"


def old_to_new() -> dict[str, str]:
    """env.py's OLD_TO_NEW, read from its source (importing env.py runs a migration)."""
    tree = ast.parse((MIGRATIONS / "env.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "OLD_TO_NEW":
            mapping: dict[str, str] = ast.literal_eval(node.value)
            return mapping
    raise AssertionError("env.py has no OLD_TO_NEW")


def test_file_order_is_apply_order() -> None:
    script = ScriptDirectory(str(MIGRATIONS))
    applied = [rev.revision for rev in script.walk_revisions("base", "heads")][::-1]
    files = sorted(p.name for p in (MIGRATIONS / "versions").glob("*.py"))
    assert [script.get_revision(rev).path.split("/")[-1] for rev in applied] == files
    for number, (name, rev) in enumerate(zip(files, applied, strict=True), start=1):
        assert re.fullmatch(rf"{number:04d}_\w+\.py", name), name
        assert rev == f"r{number:04d}", name


def test_every_old_id_names_one_new_revision_and_no_new_id_is_an_old_one() -> None:
    mapping = old_to_new()
    revisions = {rev.revision for rev in ScriptDirectory(str(MIGRATIONS)).walk_revisions()}
    assert OLD_HEAD in mapping
    assert mapping[OLD_HEAD] in heads()
    assert len(set(mapping.values())) == len(mapping)
    # Every revision from before the renumbering has its old id; later ones need none.
    assert set(mapping.values()) <= revisions
    assert set(mapping) & revisions == set()


@pytest.fixture(params=["postgresql", "sqlite"])
def fresh_app(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Flask]:
    """An app on an empty database of this test's own, migrated to head."""
    if request.param == "postgresql":
        url = request.getfixturevalue("throwaway_pg_url")
    else:
        url = f"sqlite:///{tmp_path / 'renumbered.db'}"
    app = make_app(url)
    try:
        yield app
    finally:
        _dispose(app)


def _cli_upgrade(app: Flask) -> list[tuple[str, str]]:
    """What an operator runs, ``flask db upgrade``; the steps it ran, from Alembic's log of
    them in the command's output ("Running upgrade r0030 -> r0031, ...")."""
    result = app.test_cli_runner().invoke(args=["db", "upgrade"])
    assert result.exit_code == 0, result.output
    assert result.exception is None
    assert "Context impl" in result.output  # the log is there to read
    return re.findall(r"Running upgrade (\S*) -> (\S+),", result.output)


def _version(app: Flask) -> str:
    with app.app_context(), db.engine.connect() as connection:
        return str(connection.scalar(text("SELECT version_num FROM alembic_version")))


def _set_version(app: Flask, revision: str) -> None:
    with app.app_context(), db.engine.begin() as connection:
        connection.execute(text("UPDATE alembic_version SET version_num = :r"), {"r": revision})


def _records_in_every_status(app: Flask) -> dict[str, list[tuple[int, str]]]:
    with app.app_context(), db.engine.begin() as connection:
        tenant = connection.execute(
            text("INSERT INTO tenant (slug, name) VALUES ('renum', 'Renum') RETURNING id")
        ).scalar_one()
        for status in SendStatus:
            connection.execute(
                text(
                    "INSERT INTO mail_send_record (tenant_id, scope, status, version, "
                    "retry_count, to_addrs) VALUES (:t, 'TENANT', :s, 1, 0, "
                    "'[\"ann@example.com\"]')"
                ),
                {"t": tenant, "s": status.value},
            )
            connection.execute(
                text(
                    "INSERT INTO sms_send_record (tenant_id, scope, status, version, "
                    "retry_count, phone_number) VALUES (:t, 'TENANT', :s, 1, 0, '+447911000001')"
                ),
                {"t": tenant, "s": status.value},
            )
    records = _records(app)
    assert {table: {s for _, s in rows} for table, rows in records.items()} == {
        "mail_send_record": set(SendStatus),
        "sms_send_record": set(SendStatus),
    }
    return records


def _records(app: Flask) -> dict[str, list[tuple[int, str]]]:
    with app.app_context(), db.engine.connect() as connection:
        return {
            table: [
                (row.id, row.status)
                for row in connection.execute(text(f"SELECT id, status FROM {table} ORDER BY id"))
            ]
            for table in ("mail_send_record", "sms_send_record")
        }


def test_a_database_at_the_old_head_upgrades_to_the_new_head(fresh_app: Flask) -> None:
    records = _records_in_every_status(fresh_app)
    _set_version(fresh_app, OLD_HEAD)

    steps = _cli_upgrade(fresh_app)

    assert (_version(fresh_app),) == heads()
    assert steps == []  # the old head is the new head: nothing to apply
    assert _records(fresh_app) == records
    with fresh_app.app_context(), db.engine.connect() as connection:
        assert schema_diff(connection) == []

    steps = _cli_upgrade(fresh_app)  # again: nothing to translate, nothing to apply

    assert (_version(fresh_app),) == heads()
    assert steps == []
    assert _records(fresh_app) == records


def test_a_database_at_an_older_old_id_gets_the_migrations_it_lacks(fresh_app: Flask) -> None:
    # Old 0041 ran before old 0016 (the inbox notices by mail): a database left there lacks
    # that column and everything after it.
    new = old_to_new()["0041"]
    with fresh_app.app_context():
        downgrade(revision=new)
        db.session.remove()
        with db.engine.connect() as connection:
            columns = {c["name"] for c in inspect(connection).get_columns("app_user")}
            assert "notices_by_mail" not in columns
            assert not inspect(connection).has_table("record_event")
    records = _records_in_every_status(fresh_app)
    _set_version(fresh_app, "0041")

    steps = _cli_upgrade(fresh_app)

    script = ScriptDirectory(str(MIGRATIONS))
    applied = [rev.revision for rev in script.walk_revisions(new, "heads")][::-1]
    assert applied[0] == new
    assert steps == list(pairwise(applied))
    with fresh_app.app_context(), db.engine.connect() as connection:
        assert current_revisions(connection) == heads()
        columns = {c["name"] for c in inspect(connection).get_columns("app_user")}
        assert "notices_by_mail" in columns
        assert inspect(connection).has_table("record_event")
        assert schema_diff(connection) == []
    assert _records(fresh_app) == records
