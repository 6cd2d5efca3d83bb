"""The portal application factory."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping
from typing import Any

from flask import Flask
from sqlalchemy import event
from sqlalchemy.engine import Engine

from portal.config import INSTANCE_DIR, Settings
from portal.extensions import csrf, db
from portal.messaging.templating import limits as template_limits
from portal.models import secretbox

log = logging.getLogger(__name__)


def create_app(config: Settings | Mapping[str, Any] | None = None, *, web: bool = True) -> Flask:
    """Build the app: settings, extensions, blueprints and CLI commands.

    ``web=False`` builds what a delivery process needs (settings, the database, the
    sandbox's limits, the secret box) without the portal's pages, the API, CSRF, migrations
    and commands: the worker, its delivery children and its chore children start many times
    a day (restarts, deploys, every test that starts one), and the web layer was a fifth to a
    quarter of each start's CPU (0.4-0.7 s of 2.1-2.6). Nothing they run needs a page or a
    request."""
    settings = _settings(config)
    app = Flask(
        __name__,
        instance_path=str(INSTANCE_DIR),
        template_folder="../templates",
        static_folder="../static",
    )
    app.config.update(
        SETTINGS=settings,
        SECRET_KEY=settings.secret_key,
        SQLALCHEMY_DATABASE_URI=settings.database_url,
        SQLALCHEMY_ENGINE_OPTIONS=engine_options(settings),
        MAX_CONTENT_LENGTH=settings.max_request_bytes,
        SESSION_COOKIE_HTTPONLY=True,
        SESSION_COOKIE_SAMESITE="Lax",
        SESSION_COOKIE_SECURE=settings.production,
        REMEMBER_COOKIE_SECURE=settings.production,
        REMEMBER_COOKIE_HTTPONLY=True,
        WTF_CSRF_TIME_LIMIT=None,
        JSON_SORT_KEYS=False,
    )
    if isinstance(config, Mapping):
        app.config.update({k: v for k, v in config.items() if k.isupper()})
    secretbox.configure(settings.secret_key)
    template_limits.configure(settings)

    db.init_app(app)
    with app.app_context():
        if db.engine.dialect.name == "sqlite":
            _tune_sqlite(db.engine)
        else:
            ping_when_idle(db.engine, settings.pool_ping_idle_s)
    if not web:
        return app
    from flask_migrate import Migrate

    Migrate(app, db, directory=str(_migrations_dir()), render_as_batch=True)
    csrf.init_app(app)

    from portal import cli
    from portal.web import register_blueprints

    register_blueprints(app)
    cli.register(app)
    return app


def _settings(config: Settings | Mapping[str, Any] | None) -> Settings:
    if isinstance(config, Settings):
        return config
    settings = Settings.from_env()
    if config and "SETTINGS" in config:
        given = config["SETTINGS"]
        assert isinstance(given, Settings)
        return given
    return settings


def _migrations_dir() -> Any:
    from portal.config import ROOT

    return ROOT / "migrations"


def engine_options(settings: Settings) -> dict[str, Any]:
    """Pool sizes for the workers, LISTEN and the chores together; SQLite waits, not fails."""
    if settings.database_url.startswith("sqlite"):
        return {"connect_args": {"timeout": 30, "check_same_thread": False}}
    workers = settings.mail_send_concurrency + settings.sms_send_concurrency
    return {
        # A busy worker holds a connection (direct.holding) and may open a Session beside
        # it: 2 x workers at the peak, plus LISTEN, the poller and the metrics reads.
        "pool_size": max(5, workers // 2 + 2),
        "max_overflow": workers + workers // 2 + 4,
        # Not pool_pre_ping: that is a round trip at every checkout, as many as the
        # statements on the delivery path. _ping_when_idle pings only a connection that sat
        # idle, which is when a restarted server has broken it.
        "pool_recycle": 1800,
        "pool_timeout": 30,
        # A transaction-mode pooler hands each transaction any server connection: a statement
        # prepared on one is unknown on the next (DATABASE_POOLER=transaction).
        **(
            {"connect_args": {"prepare_threshold": None}}
            if settings.database_pooler == "transaction"
            else {}
        ),
    }


def ping_when_idle(engine: Engine, idle_s: float) -> None:
    """Ping a pooled connection at checkout only when it sat idle over ``idle_s``.

    A busy worker's checkouts cost no round trip; a connection a database restart broke is
    found by its ping after the quiet spell, or, when it was busy, by the statement that
    fails (SQLAlchemy then drops every connection of that age, and the caller retries).
    """
    from sqlalchemy.exc import DisconnectionError

    @event.listens_for(engine.pool, "checkin")
    def _checkin(_dbapi_connection: Any, record: Any) -> None:
        record.info["idle_since"] = time.monotonic()

    @event.listens_for(engine.pool, "checkout")
    def _checkout(dbapi_connection: Any, record: Any, _proxy: Any) -> None:
        if time.monotonic() - record.info.get("idle_since", 0.0) <= idle_s:
            return
        try:
            engine.dialect.do_ping(dbapi_connection)
        except Exception as exc:
            raise DisconnectionError("the pooled connection failed its ping") from exc


def _tune_sqlite(engine: Engine) -> None:
    """WAL, a busy timeout, and a transaction that takes the write lock at its first write.

    Reads never take SQLite's write lock: until a transaction writes, each SELECT runs alone
    (autocommit at the driver; in WAL it reads the last commit, as PostgreSQL's READ COMMITTED
    does at each statement). The first statement that writes (or a SELECT ... FOR UPDATE, or a
    SAVEPOINT) is preceded by ``BEGIN IMMEDIATE``: the lock is taken before anything is read
    inside the transaction, so a writer waits its turn (busy timeout) instead of failing with
    "database is locked" when another writer committed since its first read. A page that only
    reads therefore never holds the lock, and a second connection it opens (the breaker's
    states, the recipient tokens written after it) never waits on the first.
    """

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA busy_timeout=30000")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    @event.listens_for(engine, "before_cursor_execute")
    def _lock_before_first_write(
        conn: Any, cursor: Any, statement: str, _params: Any, context: Any, _many: bool
    ) -> None:
        if cursor.connection.in_transaction or not conn.in_transaction():
            return
        if conn.get_execution_options().get("isolation_level") == "AUTOCOMMIT":
            return
        if sqlite_reads_only(statement, context):
            return
        cursor.execute("BEGIN IMMEDIATE")


_WRITE_WORD = re.compile(r"\b(INSERT|UPDATE|DELETE|REPLACE)\b", re.IGNORECASE)


def sqlite_reads_only(statement: str, context: Any = None) -> bool:
    """Whether a statement only reads, so that it may run without SQLite's write lock.

    Unsure means no: a statement that might write takes the lock (it then waits, never fails).
    """
    compiled = getattr(context, "compiled", None)
    if compiled is not None:
        if context.isinsert or context.isupdate or context.isdelete:
            return False
        if getattr(compiled.statement, "_for_update_arg", None) is not None:
            return False
    head = statement.lstrip()[:8].upper()
    if head.startswith(("SELECT", "PRAGMA", "EXPLAIN")):
        return True
    if head.startswith("WITH"):
        return _WRITE_WORD.search(statement) is None
    return False
