"""Extensions, created unbound here and bound to the app in ``create_app`` (which also binds
Flask-Migrate, only where it builds the web layer); and what every user of the database shares
about losing its connection: which errors say so (``connection_lost``), and a pooled
connection the server has closed meanwhile is replaced at checkout, not used.
"""

from __future__ import annotations

import select
from typing import Any

import psycopg
from flask_login import LoginManager
from flask_sqlalchemy import SQLAlchemy
from flask_wtf import CSRFProtect
from sqlalchemy import event
from sqlalchemy.exc import DBAPIError, DisconnectionError, InvalidRequestError
from sqlalchemy.pool import Pool

from portal.models.base import Base

db = SQLAlchemy(model_class=Base)
login_manager = LoginManager()
csrf = CSRFProtect()


# --- a lost database connection ----------------------------------------------------------------

# SQLSTATEs of a server that ended the session or will not take one now: terminated by an
# operator or pg_terminate_backend (57P01), crashed (57P02), starting or stopping (57P03), and
# the connection exceptions (class 08). An error without one came from the client side (the
# socket closed, the server unreachable).
_LOST_STATES = ("57P01", "57P02", "57P03")
# What the pool raises when each connection it tried at checkout was found dead (the database
# ends sessions as fast as they open).
_CHECKOUT_EXHAUSTED = "This connection is closed"


def connection_lost(exc: BaseException) -> bool:
    """Whether ``exc`` says the database connection was lost or could not be had, as opposed to
    a statement the database refused: a request that meets it answers 503 with Retry-After."""
    if type(exc) is InvalidRequestError and str(exc) == _CHECKOUT_EXHAUSTED:
        return True
    orig: BaseException | None = exc
    if isinstance(exc, DBAPIError):
        if exc.connection_invalidated:
            return True
        orig = exc.orig
    if not isinstance(orig, psycopg.OperationalError | psycopg.InterfaceError):
        return False  # SQLite's errors (a lock, a full disk) are not a lost connection
    state = orig.sqlstate
    return state is None or state.startswith("08") or state in _LOST_STATES


@event.listens_for(Pool, "checkout")
def _closed_by_the_server(dbapi_connection: Any, _record: Any, _proxy: Any) -> None:
    """Replace a pooled PostgreSQL connection the server closed while it sat in the pool.

    A server that ends a session (a restart, pg_terminate_backend, idle_session_timeout) sends
    its FATAL notice and closes the socket at once, so the socket of an idle connection has
    input only then: nothing else reaches it (LISTEN uses connections of its own). One poll(2)
    with no wait finds it, with no round trip, so a connection killed in the pool never
    reaches a request's first statement, where its failure may leave a write in doubt.
    """
    if not isinstance(dbapi_connection, psycopg.Connection):
        return
    poller = select.poll()
    try:
        poller.register(dbapi_connection.fileno(), select.POLLIN)
    except psycopg.Error as exc:  # closed already: no socket
        raise DisconnectionError("the pooled connection is closed") from exc
    if poller.poll(0):
        raise DisconnectionError("the server closed the pooled connection")
