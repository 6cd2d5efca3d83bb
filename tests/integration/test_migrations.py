"""The migrations: one head, a schema equal to the models' on both dialects, and a full
downgrade and upgrade again on a throwaway PostgreSQL database."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from flask import Flask
from flask_migrate import downgrade, upgrade
from sqlalchemy import create_engine, inspect, make_url, select, text
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError

from portal.extensions import db
from portal.models import Base, Tenant
from portal.models.record import SCAN_TABLE_STORAGE
from portal.tenancy import PLATFORM_TENANT_ID
from tests.conftest import make_app

MIGRATIONS = Path(__file__).resolve().parents[2] / "migrations"
TEST_PG_ADMIN_URL = os.environ.get(
    "TEST_PG_ADMIN_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)
TABLES = {t.name for t in Base.metadata.sorted_tables}


def schema_diff(connection: Connection) -> list[object]:
    """What autogenerate would write to turn the database into the models (empty: equal)."""
    context = MigrationContext.configure(connection, opts={"compare_type": True})
    # No filter on either dialect: SQLite produces no spurious diffs for this schema today.
    # Should one appear that is purely a SQLite reflection limitation, filter exactly it here.
    return list(compare_metadata(context, Base.metadata))


def heads() -> tuple[str, ...]:
    return tuple(ScriptDirectory(str(MIGRATIONS)).get_heads())


def current_revisions(connection: Connection) -> tuple[str, ...]:
    return tuple(MigrationContext.configure(connection).get_current_heads())


def test_there_is_exactly_one_head() -> None:
    script = ScriptDirectory(str(MIGRATIONS))
    assert len(script.get_heads()) == 1, script.get_heads()
    # Every revision is reachable from the head: no orphaned branch hides behind it.
    walked = {rev.revision for rev in script.walk_revisions()}
    assert walked == {
        rev.revision for rev in script.revision_map.iterate_revisions("heads", "base")
    }


def test_migrated_schema_equals_the_models(any_app: Flask) -> None:
    with db.engine.connect() as connection:
        assert current_revisions(connection) == heads()
        assert schema_diff(connection) == []


def test_platform_tier_row_and_tenant_id_range(any_app: Flask) -> None:
    platform = db.session.get(Tenant, PLATFORM_TENANT_ID)
    assert platform is not None
    assert (platform.slug, platform.is_active) == ("platform", True)
    db.session.rollback()  # on SQLite every transaction holds the write lock (BEGIN IMMEDIATE)
    # The check constraint keeps 0 and other negatives out.
    with pytest.raises(IntegrityError), db.engine.begin() as connection:
        connection.execute(text("INSERT INTO tenant (id, slug, name) VALUES (0, 'zero', 'Z')"))
    assert db.session.scalar(select(Tenant.id).where(Tenant.slug == "zero")) is None


def test_what_autogenerate_cannot_see_is_there_too(any_app: Flask) -> None:
    """Check constraints and dialect options are not compared by autogenerate: look directly."""
    with db.engine.connect() as connection:
        checks = {
            table: {c["name"] for c in inspect(connection).get_check_constraints(table)}
            for table in ("tenant", "app_user")
        }
        assert checks == {
            "tenant": {"ck_tenant_tenant_id_range"},
            "app_user": {"ck_app_user_app_user_role"},
        }
        if connection.dialect.name == "sqlite":
            sql = connection.scalar(
                text("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'tenant'")
            )
            assert "AUTOINCREMENT" in sql.upper()
        else:
            for table in ("mail_send_record", "sms_send_record"):
                options = connection.scalar(
                    text("SELECT reloptions FROM pg_class WHERE relname = :t"), {"t": table}
                )
                wanted = {f"{k}={v}" for k, v in SCAN_TABLE_STORAGE.items()}
                assert set(options) == wanted, table
            # 0027: an address prefix walks this btree (operator classes are not compared).
            definition = connection.scalar(
                text("SELECT indexdef FROM pg_indexes WHERE indexname = :i"),
                {"i": "idx_mail_recipient_search"},
            )
            assert "(tenant_id, address varchar_pattern_ops, record_id)" in definition


def _first_tenant_id(app: Flask) -> int:
    with app.app_context():
        tenant = Tenant(slug="first", name="First")
        db.session.add(tenant)
        db.session.commit()
        tenant_id = tenant.id
        db.session.remove()
    return tenant_id


def _down_and_up_again(app: Flask) -> None:
    with app.app_context():
        downgrade(revision="base")
        with db.engine.connect() as connection:
            assert set(inspect(connection).get_table_names()) & TABLES == set()
            assert current_revisions(connection) == ()
        upgrade()
        with db.engine.connect() as connection:
            assert current_revisions(connection) == heads()
            assert set(inspect(connection).get_table_names()) >= TABLES
            assert schema_diff(connection) == []
            platform = connection.execute(
                text("SELECT slug FROM tenant WHERE id = :id"), {"id": PLATFORM_TENANT_ID}
            ).scalar_one()
            assert platform == "platform"
        db.session.remove()


def _dispose(app: Flask) -> None:
    with app.app_context():
        db.session.remove()
        db.engine.dispose()


@pytest.fixture
def throwaway_pg_url() -> Iterator[str]:
    """A PostgreSQL database of this test's own, dropped afterwards whatever happens."""
    name = f"postroom_migrations_{uuid.uuid4().hex[:12]}"
    admin = create_engine(TEST_PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as connection:
            connection.execute(text(f'CREATE DATABASE "{name}"'))
    except Exception as exc:  # a missing server fails the run; it is not skipped
        admin.dispose()
        raise pytest.UsageError(f"cannot create a database at {TEST_PG_ADMIN_URL}: {exc}") from exc
    try:
        yield make_url(TEST_PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def test_downgrade_to_base_and_upgrade_again_on_postgresql(throwaway_pg_url: str) -> None:
    app = make_app(throwaway_pg_url)
    try:
        with app.app_context(), db.engine.connect() as connection:
            assert schema_diff(connection) == []
        _down_and_up_again(app)
        assert _first_tenant_id(app) == 1
    finally:
        _dispose(app)


def test_new_tenant_on_sqlite_gets_id_1_also_after_downgrade_and_upgrade(tmp_path: Path) -> None:
    app = make_app(f"sqlite:///{tmp_path / 'fresh.db'}")
    try:
        assert _first_tenant_id(app) == 1  # not 0: the platform row's -1 must not seed max+1
        _down_and_up_again(app)
        assert _first_tenant_id(app) == 1
    finally:
        _dispose(app)


def _tokens_left_behind_go(app: Flask) -> None:
    """0026: the recipient tokens earlier purges left behind (no record of their channel to
    their address in their tenant any more) are deleted; the others stay."""
    with app.app_context():
        downgrade(revision="r0025")
        with db.engine.begin() as connection:
            tenant = connection.execute(
                text("INSERT INTO tenant (slug, name) VALUES ('t26', 'T26') RETURNING id")
            ).scalar_one()
            record = connection.execute(
                text(
                    "INSERT INTO mail_send_record (tenant_id, scope, status, version, "
                    "retry_count, to_addrs) VALUES (:t, 'TENANT', 'Sent', 1, 0, "
                    "'[\"ann@example.com\"]') RETURNING id"
                ),
                {"t": tenant},
            ).scalar_one()
            connection.execute(
                text(
                    "INSERT INTO mail_send_recipient (record_id, tenant_id, address, kind) "
                    "VALUES (:r, :t, 'ann@example.com', 'to')"
                ),
                {"r": record, "t": tenant},
            )
            connection.execute(
                text(
                    "INSERT INTO sms_send_record (tenant_id, scope, status, version, "
                    "retry_count, phone_number) VALUES (:t, 'TENANT', 'Sent', 1, 0, "
                    "'+447911000001')"
                ),
                {"t": tenant},
            )
            for token, channel, address in [
                ("kept-mail", "mail", "ann@example.com"),
                ("gone-mail", "mail", "bob@example.com"),
                ("kept-sms", "sms", "+447911000001"),
                ("gone-sms", "sms", "+447911000002"),
                ("gone-channel", "sms", "ann@example.com"),
            ]:
                connection.execute(
                    text(
                        "INSERT INTO recipient_token (token, tenant_id, channel, address) "
                        "VALUES (:k, :t, :c, :a)"
                    ),
                    {"k": token, "t": tenant, "c": channel, "a": address},
                )
        upgrade()
        with db.engine.connect() as connection:
            left = set(connection.scalars(text("SELECT token FROM recipient_token")))
            assert left == {"kept-mail", "kept-sms"}
            assert schema_diff(connection) == []
        db.session.remove()


def test_0026_deletes_tokens_left_behind_on_postgresql(throwaway_pg_url: str) -> None:
    app = make_app(throwaway_pg_url)
    try:
        _tokens_left_behind_go(app)
    finally:
        _dispose(app)


def test_0026_deletes_tokens_left_behind_on_sqlite(tmp_path: Path) -> None:
    app = make_app(f"sqlite:///{tmp_path / 'tokens.db'}")
    try:
        _tokens_left_behind_go(app)
    finally:
        _dispose(app)
