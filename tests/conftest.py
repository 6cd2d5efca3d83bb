"""Fixtures on real services: PostgreSQL (the test database the test command creates), Redis,
and SQLite files for the embedded default. A missing test database fails the run."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from flask import Flask
from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

from portal import create_app
from portal.config import Settings
from portal.extensions import db
from portal.models import ApiKey, Base, Tenant
from portal.models.tenant import new_api_token
from portal.tenancy import PLATFORM_TENANT_ID

TEST_DATABASE_URL = os.environ.get(
    "TEST_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postroom_test"
)
TEST_REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/15")


def settings_for_tests(database_url: str, **overrides: Any) -> Settings:
    """Settings for tests: real services, short durations."""
    base = Settings(
        database_url=database_url,
        redis_url=TEST_REDIS_URL,
        secret_key="test-secret-key-not-for-production",
        poll_interval_s=0.05,
        backoff_base_s=0.2,
        quota_retry_floor_s=0.5,
        stuck_send_threshold_s=2.0,
        sweep_interval_s=1.0,
        shutdown_grace_s=3.0,
        smtp_connect_timeout_s=2.0,
        smtp_read_timeout_s=2.0,
        worker_metrics_port=0,
        # Receivers in tests listen on 127.0.0.1; retries in milliseconds.
        callback_allow_private=True,
        callback_backoff_base_s=0.02,
    )
    return base.replace(**overrides) if overrides else base


def _reset_postgres(url: str) -> None:
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(text("DROP SCHEMA IF EXISTS public CASCADE"))
            conn.execute(text("CREATE SCHEMA public"))
    except Exception as exc:  # a missing test database must fail the run, not skip
        raise pytest.UsageError(
            f"the PostgreSQL test database is not reachable at {url}: {exc}. "
            "Run the README's test command, which creates it."
        ) from exc
    finally:
        engine.dispose()


def make_app(database_url: str, **overrides: Any) -> Flask:
    """An app on ``database_url``, migrated to head with the real migrations."""
    from flask_migrate import upgrade

    app = create_app(settings_for_tests(database_url, **overrides))
    app.config["TESTING"] = True
    with app.app_context():
        upgrade()
    return app


@pytest.fixture(scope="session")
def pg_app() -> Flask:
    _reset_postgres(TEST_DATABASE_URL)
    return make_app(TEST_DATABASE_URL)


@pytest.fixture(scope="session")
def sqlite_app(tmp_path_factory: pytest.TempPathFactory) -> Flask:
    path = tmp_path_factory.mktemp("sqlite") / "postroom.db"
    return make_app(f"sqlite:///{path}")


def _clean(app: Flask) -> None:
    """DELETE every row but the platform tier's tenant row (fast; no schema rebuild)."""
    with app.app_context():
        tables = [t for t in reversed(Base.metadata.sorted_tables)]
        with db.engine.begin() as conn:
            for table in tables:
                if table.name == "tenant":
                    conn.execute(table.delete().where(table.c.id != PLATFORM_TENANT_ID))
                else:
                    conn.execute(table.delete())


@pytest.fixture
def app(pg_app: Flask) -> Iterator[Flask]:
    """The PostgreSQL app, with clean tables."""
    _clean(pg_app)
    with pg_app.app_context():
        yield pg_app
        db.session.remove()


@pytest.fixture(params=["postgresql", "sqlite"])
def any_app(request: pytest.FixtureRequest) -> Iterator[Flask]:
    """The app on each dialect in turn, with clean tables."""
    flask_app: Flask = request.getfixturevalue(
        "pg_app" if request.param == "postgresql" else "sqlite_app"
    )
    _clean(flask_app)
    with flask_app.app_context():
        yield flask_app
        db.session.remove()


@pytest.fixture
def session(app: Flask) -> Session:
    return db.session


@pytest.fixture
def redis_client() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(TEST_REDIS_URL)
    try:
        client.ping()
    except redis.ConnectionError as exc:
        raise pytest.UsageError(f"Redis is not reachable at {TEST_REDIS_URL}: {exc}") from exc
    client.flushdb()
    yield client
    client.flushdb()


def make_tenant(slug: str, name: str | None = None) -> Tenant:
    tenant = Tenant(slug=slug, name=name or slug.title())
    db.session.add(tenant)
    db.session.flush()
    return tenant


def make_api_key(tenant_id: int, name: str = "test") -> str:
    token = new_api_token()
    key = ApiKey(tenant_id=tenant_id, name=name)
    key.set_token(token)
    db.session.add(key)
    db.session.flush()
    return token


@pytest.fixture
def tenants(any_app: Flask) -> tuple[Tenant, Tenant]:
    a, b = make_tenant("acme"), make_tenant("globex")
    db.session.commit()
    return a, b


@pytest.fixture
def root_dir() -> Path:
    return Path(__file__).resolve().parent.parent


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """A skipped test fails the run: CI accepts no skip reason (none, for now)."""
    skipped = terminalreporter.stats.get("skipped", [])
    if skipped:
        terminalreporter.write_line(
            f"FAILING THE RUN: {len(skipped)} test(s) skipped; a skip hides a missing service "
            "or an unfinished test",
            red=True,
        )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and reporter.stats.get("skipped") and exitstatus == 0:
        session.exitstatus = 1
