"""Fixtures on real services: PostgreSQL (the test database the test command creates), Redis,
and SQLite files for the embedded default. A missing test database fails the run."""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from flask import Flask
from sqlalchemy import create_engine, make_url, text
from sqlalchemy.orm import Session

from portal import create_app
from portal.config import Settings
from portal.extensions import db
from portal.models import ApiKey, Base, Tenant
from portal.models.tenant import new_api_token
from portal.tenancy import PLATFORM_TENANT_ID
from tests.support.smtp_server import ScriptedSmtpServer

# Under pytest-xdist each worker (gw0, gw1, ...) has its own PostgreSQL database and Redis db:
# the fixtures drop the schema and flush the db, which must not reach another worker's tests.
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
_WORKER_INDEX = int(XDIST_WORKER[2:]) if XDIST_WORKER.startswith("gw") else -1


def _for_this_worker(database_url: str, redis_url: str) -> tuple[str, str]:
    if _WORKER_INDEX < 0:
        return database_url, redis_url
    url = make_url(database_url)
    database = url.set(database=f"{url.database}_{XDIST_WORKER}")
    redis_base = make_url(redis_url.replace("redis://", "postgresql://", 1))
    base_db = int((redis_base.database or "0") or 0)
    redis_db = (base_db - 1 - _WORKER_INDEX) % 16
    redis_url = redis_url.rsplit("/", 1)[0] + f"/{redis_db}"
    return database.render_as_string(hide_password=False), redis_url


TEST_DATABASE_URL, TEST_REDIS_URL = _for_this_worker(
    os.environ.get(
        "TEST_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postroom_test"
    ),
    os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/15"),
)
TEST_PG_ADMIN_URL = os.environ.get(
    "TEST_PG_ADMIN_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)
# Processes the tests start read these (and so does any helper that reads the environment).
os.environ["TEST_DATABASE_URL"] = TEST_DATABASE_URL
os.environ["TEST_REDIS_URL"] = TEST_REDIS_URL
# Processes a test starts with the environment (chores, CLI runs) reach the test servers on
# 127.0.0.1 as settings_for_tests does.
os.environ.setdefault("OUTBOUND_TENANT_ALLOW_PRIVATE", "true")

# The tiers, by the folder a test file is in: what a test needs to run.
TIERS = {
    "unit": "no services",
    "integration": "PostgreSQL and Redis, in this process",
    "process": "real worker.py, gunicorn or run-command processes",
    "browser": "Debian's Chromium driven by Playwright",
    "embedded": "the run command on the embedded default (SQLite, embedded Redis)",
}
# Tiers whose tests start processes or a browser keep to this many xdist groups each (a file's
# tests always in one group, a group's tests one after the other on one worker), beside the
# in-process tiers, so their waits overlap the others' CPU work.
SERIAL_TIERS = {"process": 2, "browser": 1, "embedded": 1}
# The process tier's files by share. The fault tests and the two-process tests each start
# several workers and time their shutdowns: they share one worker, one file after the other,
# since beside each other on 2 cores the fault tests' shutdown bounds failed. The rest of the
# tier is the other share.
PROCESS_SHARES = {"test_faults.py": 0, "test_concurrency.py": 0}


def tier_of(path: Path) -> str | None:
    """The tier of a test file: the folder under tests/ it lies in (None: no tier)."""
    parts = path.resolve().relative_to(Path(__file__).resolve().parent).parts
    return parts[0] if len(parts) > 1 and parts[0] in TIERS else None


# Every process a test run starts carries this variable (children inherit the environment):
# a run that was killed leaves processes behind that keep polling the test database, and the
# next run stops them before it starts.
CHILD_MARK = "POSTROOM_TEST_CHILD"


def pytest_configure(config: pytest.Config) -> None:
    # A test process holds some 600,000 long-lived objects (flask, SQLAlchemy, hypothesis,
    # playwright and the collected tests), and Python's default thresholds scan all of them
    # every 70,000 net allocations: 12-19 full collections a worker, 3.5-6.4 s. At these
    # thresholds it does 6, under 1 s. Memory stays bounded: garbage is still collected.
    gc.set_threshold(10_000, 20, 20)
    for tier, needs in TIERS.items():
        config.addinivalue_line("markers", f"{tier}: the {tier} tier ({needs})")
    if _WORKER_INDEX >= 0:
        _create_database(TEST_DATABASE_URL)
    elif CHILD_MARK not in os.environ:
        stop_left_behind()
        os.environ[CHILD_MARK] = str(os.getpid())


def stop_left_behind() -> list[int]:
    """SIGKILL the processes an earlier, killed test run left: marked, and orphaned (their
    parent is gone, so init or a subreaper adopted them). Their children follow (each
    worker's children die with their parent)."""
    import signal

    stopped = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            environ = (proc / "environ").read_bytes()
            stat = (proc / "stat").read_text()
        except OSError:
            continue
        if f"{CHILD_MARK}=".encode() not in environ:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == 1 or not Path(f"/proc/{parent}").exists():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(proc.name), signal.SIGKILL)
                stopped.append(int(proc.name))
    return stopped


def _create_database(url: str) -> None:
    name = make_url(url).database
    admin = create_engine(TEST_PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            exists = conn.execute(
                text("SELECT 1 FROM pg_database WHERE datname = :name"), {"name": name}
            ).first()
            if exists is None:
                conn.execute(text(f'CREATE DATABASE "{name}"'))
    except Exception as exc:
        raise pytest.UsageError(f"cannot create the test database {name}: {exc}") from exc
    finally:
        admin.dispose()


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups off the marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test with its tier: its file's, or a heavier one its own mark names (a test
    that starts a worker process in a file of in-process tests is ``@pytest.mark.process``).
    Tests of the serial tiers share one xdist worker per tier."""
    for item in items:
        marked = [m.name for m in item.iter_markers() if m.name in TIERS]
        tier = marked[0] if marked else tier_of(Path(str(item.fspath)))
        if tier is None:
            continue  # tests/unit/test_tiers.py fails the run for such a file
        if not marked:
            item.add_marker(getattr(pytest.mark, tier))
        if tier in SERIAL_TIERS:
            share = 0
            if tier == "process":
                share = PROCESS_SHARES.get(Path(str(item.fspath)).name, SERIAL_TIERS[tier] - 1)
            item.add_marker(pytest.mark.xdist_group(f"{tier}-{share}"))
        elif _uses_module_fixture(item):
            # A module-scoped fixture (a filled database, a Dovecot) is built again by every
            # worker that runs one of the module's tests: its tests keep to one worker.
            item.add_marker(pytest.mark.xdist_group(f"module-{Path(str(item.fspath)).stem}"))
    # Long tests first: the workers take tests in this order, and one that starts last ends
    # the run seconds after every other worker is idle.
    items.sort(key=lambda item: item.get_closest_marker("long") is None)


def _uses_module_fixture(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(
        definition.scope == "module"
        for definitions in info.name2fixturedefs.values()
        for definition in definitions
    )


@pytest.fixture(autouse=True)
def cheap_hashing(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """argon2 at its cheapest in every test but those marked ``real_hashing`` (a sign-in at
    the real cost takes most of a second of CPU, and nothing else here is about hashing)."""
    if request.node.get_closest_marker("real_hashing") is None:
        from argon2 import PasswordHasher

        from portal.models import tenant as tenant_models

        monkeypatch.setattr(
            tenant_models, "_hasher", PasswordHasher(time_cost=1, memory_cost=8, parallelism=1)
        )


@pytest.fixture
def smtp() -> Iterator[ScriptedSmtpServer]:
    """A real SMTP server (aiosmtpd) in the test process that accepts every mail; a test that
    needs it to refuse, hang or authenticate defines its own ``smtp``."""
    with ScriptedSmtpServer() as server:
        yield server


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
        outbound_tenant_allow_private=True,  # every test server is on 127.0.0.1
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


_CLEAN_SQL = ";".join(
    f"DELETE FROM {table.name} WHERE id != {PLATFORM_TENANT_ID}"
    if table.name == "tenant"
    else f"DELETE FROM {table.name}"
    for table in reversed(Base.metadata.sorted_tables)
)


def _clean(app: Flask) -> None:
    """DELETE every row but the platform tier's tenant row (fast; no schema rebuild)."""
    with app.app_context(), db.engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            # One round trip for every table: this runs before each of some 2,000 tests.
            conn.exec_driver_sql(_CLEAN_SQL)
        else:
            for statement in _CLEAN_SQL.split(";"):
                conn.exec_driver_sql(statement)
    # The process's caches are keyed by row id and version. Deleting every row makes SQLite
    # hand the same ids out again (the product never deletes a template, and PostgreSQL never
    # reuses an id), so a test must not meet the last test's template under its id.
    from portal.messaging.sending.configcache import CONFIGS
    from portal.messaging.templating import checks as template_checks

    template_checks.forget_all()
    CONFIGS.clear()


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


_RERUNS: list[tuple[str, str]] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Keep what each rerun test failed on (pytest-rerunfailures names it only)."""
    if report.outcome == "rerun":
        _RERUNS.append((report.nodeid, report.longreprtext))


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """What each rerun test failed on the first time, so it can be made sturdier; and a
    skipped test fails the run: CI accepts no skip reason (none, for now)."""
    for nodeid, failure in _RERUNS:
        terminalreporter.write_sep("-", f"first failure of {nodeid} (then rerun)")
        terminalreporter.write_line(failure[-4000:])
    skipped = terminalreporter.stats.get("skipped", [])
    if skipped:
        terminalreporter.write_line(
            f"FAILING THE RUN: {len(skipped)} test(s) skipped; a skip hides a missing service "
            "or an unfinished test",
            red=True,
        )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # pytest's last look for unraisable exceptions collects five times over the whole heap
    # (2 s a worker). One collection finds the session's garbage; frozen after it, the five
    # scan only what that collection's finalizers left.
    gc.collect()
    gc.freeze()
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and reporter.stats.get("skipped") and exitstatus == 0:
        session.exitstatus = 1
