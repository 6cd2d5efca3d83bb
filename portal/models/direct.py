"""Statements the delivery loop runs for every record: compiled once, run on the driver.

A claim and its completion are one statement each. Through a Session, each also pays
SQLAlchemy's per-execution work: a cache key, an execution context, and a result object
that reads the driver's column descriptions (psycopg builds one object per column, 54 for a
mail record, at every execution). bench/claim.py measured that at several times the cost of
the statements themselves. Here a Core statement is compiled once per dialect and run on a
pooled DBAPI connection in autocommit (one round trip, no BEGIN/COMMIT), its parameters and
result columns converted by the same type processors SQLAlchemy uses, so values come back
exactly as the ORM would hand them over. PostgreSQL statements are server-side prepared.

Only for hot, single-statement work: anything that needs a transaction uses a Session.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import lru_cache
from typing import Any, TypeVar

import psycopg
from sqlalchemy import Engine, inspect, select
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import Mapper
from sqlalchemy.sql.compiler import Compiled
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.expression import ClauseElement

T = TypeVar("T")
_PLACEHOLDER = re.compile(r"%\((\w+)\)s")


class _Plan:
    """One statement compiled for one dialect, with its parameter and result converters."""

    def __init__(self, statement: ClauseElement, returning: Sequence[Any], dialect: Dialect):
        compiled: Compiled = statement.compile(dialect=dialect)
        self.compiled = compiled
        self.sql = compiled.string
        self.positional: tuple[str, ...] | None = (
            tuple(compiled.positiontup or ()) if dialect.positional else None  # type: ignore[attr-defined]
        )
        self.bind_processors: dict[str, Callable[[Any], Any]] = {}
        for name, bind in compiled.binds.items():  # type: ignore[attr-defined]
            processor = bind.type.dialect_impl(dialect).bind_processor(dialect)
            if processor is not None:
                self.bind_processors[name] = processor
        processors = [
            column.type.dialect_impl(dialect).result_processor(dialect, None)
            for column in returning
        ]
        self.converting = [(i, p) for i, p in enumerate(processors) if p is not None]
        self.prepare = dialect.name == "postgresql"
        self.native: tuple[str, ...] | None = None
        if self.prepare and self.positional is None:
            # PostgreSQL: the SQL with its own $n placeholders, run on a RawCursor. psycopg
            # otherwise parses ``%(name)s`` out of the SQL at every execution, and for a
            # statement over 4 KB (the Sent write with the next claim returns 56 columns)
            # without its cache: a regex pass over the whole text per record.
            order: list[str] = []

            def number(match: re.Match[str]) -> str:
                if match.group(1) not in order:
                    order.append(match.group(1))
                return f"${order.index(match.group(1)) + 1}"

            self.sql = _PLACEHOLDER.sub(number, self.sql).replace("%%", "%")
            self.native = tuple(order)

    def parameters(self, given: Mapping[str, Any]) -> Any:
        values = self.compiled.construct_params(dict(given)) or {}
        for name, processor in self.bind_processors.items():
            if name in values:
                values[name] = processor(values[name])
        if self.positional is not None:
            return tuple(values[name] for name in self.positional)
        if self.native is not None:
            return tuple(values[name] for name in self.native)
        return values

    def rows(self, raw: Sequence[Sequence[Any]]) -> list[Sequence[Any]]:
        converting = self.converting
        if not converting:
            return list(raw)
        out: list[Sequence[Any]] = []
        for row in raw:
            values = list(row)
            for i, processor in converting:
                if values[i] is not None:
                    values[i] = processor(values[i])
            out.append(values)
        return out


class Direct:
    """A Core statement run straight on the driver; ``returning`` lists its result columns
    in order (empty for a statement that returns nothing).

    PostgreSQL plans a prepared statement for the values given at each of its first five
    runs, then keeps a generic plan unless that plan looks dearer, in which case it plans
    anew at every run. A statement whose plan depends on a constant of the code (the claim's
    ``status = 'Pending'``) should write it into the SQL (``literal_column``), not bind it:
    the claim with ``status = $1`` was planned at every run, which cost a quarter of it.
    """

    def __init__(self, statement: ClauseElement, returning: Sequence[Any] = ()):
        self.statement = statement
        self.returning = tuple(returning)
        self._plans: dict[str, _Plan] = {}
        self._lock = threading.Lock()

    def _plan(self, dialect: Dialect) -> _Plan:
        plan = self._plans.get(dialect.name)
        if plan is None:
            with self._lock:
                plan = self._plans.get(dialect.name) or _Plan(
                    self.statement, self.returning, dialect
                )
                self._plans[dialect.name] = plan
        return plan

    def run(self, engine: Engine, **params: Any) -> tuple[int, list[Sequence[Any]]]:
        """Execute in its own (autocommit) transaction: (rows affected, rows returned).

        A connection the database dropped (a restart, a failover) fails its statement; the
        whole pool's older connections are then replaced, as SQLAlchemy does for its own
        statements, and the statement runs once more on a fresh connection. Every statement
        run here is safe to repeat: writes are guarded by version (a repeat of one that did
        commit matches no row) and a claim that committed unseen leaves its record in
        Sending for the stuck-send sweep.
        """
        plan = self._plan(engine.dialect)
        args = plan.parameters(params)
        try:
            return self._execute(engine, plan, args)
        except Disconnected:
            pass
        try:
            return self._execute(engine, plan, args)
        except Disconnected as gone:
            raise gone.__cause__ or gone from None

    def _execute(self, engine: Engine, plan: _Plan, args: Any) -> tuple[int, list[Sequence[Any]]]:
        with driver_cursor(engine, native=plan.native is not None) as cursor:
            # Not behind a transaction-mode pooler (DATABASE_POOLER: prepare_threshold None).
            if plan.prepare and cursor.connection.prepare_threshold is not None:
                cursor.execute(plan.sql, args, prepare=True)
            else:
                cursor.execute(plan.sql, args)
            fetched = cursor.fetchall() if self.returning else []
            count = len(fetched) if self.returning else cursor.rowcount
        return count, plan.rows(fetched)


class Disconnected(Exception):
    """The pooled connection was found dropped by the database (raised from its error)."""


class _Held:
    """The connection a thread keeps between its statements inside ``holding``."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.proxied: Any = None  # checked out at the first statement

    def connection(self) -> tuple[Any, Any]:
        if self.proxied is None:
            self.proxied = self.engine.raw_connection()
            self.proxied.driver_connection.autocommit = True
        return self.proxied, self.proxied.driver_connection

    def drop(self) -> None:
        """Give the connection back (out of autocommit, as the pool hands connections out)."""
        proxied, self.proxied = self.proxied, None
        if proxied is None:
            return
        raw = proxied.driver_connection
        if raw is not None and not raw.closed and proxied.is_valid:
            try:
                raw.autocommit = False
            except Exception:
                proxied.invalidate()
        proxied.close()


_held = threading.local()
_IDLE = 0  # psycopg.pq.TransactionStatus.IDLE


@contextmanager
def holding(engine: Engine) -> Iterator[None]:
    """Within the block, this thread's Direct statements on PostgreSQL share one pooled
    connection, checked out at the first of them and given back at the end.

    A delivery worker holds one while it has records to work through: a checkout, its return
    and the two autocommit switches cost about as much client CPU as a short statement, and a
    mail runs five statements. It gives the connection back before it waits for work, so an
    idle worker holds none and a connection the database dropped meanwhile is never reused
    (one dropped while held fails its statement, which runs again on a fresh one). Sessions
    opened inside the block use connections of their own.
    """
    if engine.dialect.name != "postgresql" or getattr(_held, "slot", None) is not None:
        yield
        return
    slot = _Held(engine)
    _held.slot = slot
    try:
        yield
    finally:
        _held.slot = None
        slot.drop()


@contextmanager
def driver_cursor(engine: Engine, native: bool = False) -> Iterator[Any]:
    """A cursor on a pooled connection with the driver in autocommit; the connection goes
    back to the pool as it came (or stays with the thread inside ``holding``). A dropped
    connection raises Disconnected (from the driver's error) after marking every pooled
    connection as old as it for replacement. ``native``: a psycopg RawCursor (the SQL has
    PostgreSQL's own $n placeholders)."""
    slot: _Held | None = getattr(_held, "slot", None)
    if slot is not None and slot.engine.pool is engine.pool:
        proxied, raw = slot.connection()
        try:
            cursor = psycopg.RawCursor(raw) if native else raw.cursor()
            try:
                yield cursor
            finally:
                cursor.close()
        except Exception as exc:
            if raw.closed or raw.broken:
                slot.proxied = None
                engine.pool._invalidate(proxied, exc)
                proxied.close()
                raise Disconnected(str(exc)) from exc
            if raw.info.transaction_status != _IDLE:  # interrupted mid-statement: not reused
                slot.drop()
            raise
        return
    proxied = engine.raw_connection()
    raw = proxied.driver_connection
    postgres = engine.dialect.name == "postgresql"
    try:
        if postgres:
            raw.autocommit = True  # type: ignore[union-attr]
        cursor = psycopg.RawCursor(raw) if native else raw.cursor()  # type: ignore[union-attr,arg-type]
        try:
            yield cursor
        finally:
            cursor.close()
    except Exception as exc:
        if postgres and (raw.closed or raw.broken):  # type: ignore[union-attr]
            # What SQLAlchemy does when one of its statements finds the server gone: the
            # connections of this generation are recycled at their next checkout.
            engine.pool._invalidate(proxied, exc)
            raise Disconnected(str(exc)) from exc
        raise
    finally:
        if postgres and not raw.closed and proxied.is_valid:  # type: ignore[union-attr]
            try:
                raw.autocommit = False  # type: ignore[union-attr]
            except Exception:
                proxied.invalidate()
        proxied.close()


class Loader:
    """Builds detached ORM objects from rows of a model's columns, in mapper order, without
    the ORM's per-row bookkeeping (the objects are read, never flushed)."""

    def __init__(self, model: type[T]):
        mapper: Mapper[T] = inspect(model)
        self.model = model
        self.mapper = mapper
        self.columns: tuple[ColumnElement[Any], ...] = tuple(
            prop.columns[0] for prop in mapper.column_attrs
        )
        self.keys = tuple(prop.key for prop in mapper.column_attrs)
        self.pk_index = self.keys.index(mapper.primary_key[0].key)

    def load(self, row: Sequence[Any]) -> Any:
        manager = self.mapper.class_manager
        instance = manager.new_instance()
        state = inspect(instance)
        # As the ORM's loading does: values straight into the instance dict (loaded, not
        # changed), and an identity key, so the object is detached rather than new.
        instance.__dict__.update(zip(self.keys, row, strict=True))
        state.key = self.mapper.identity_key_from_primary_key((row[self.pk_index],))
        return instance


@lru_cache(maxsize=64)
def reader(engine: Engine) -> Engine:
    """The engine in autocommit on PostgreSQL: a Session on it that only reads sends its
    SELECTs alone, without the BEGIN and ROLLBACK round trips. SQLite: the engine itself."""
    if engine.dialect.name != "postgresql":
        return engine
    return engine.execution_options(isolation_level="AUTOCOMMIT")


class Lookup:
    """A SELECT of a model's rows run on the driver, handing back detached objects: for the
    rows the delivery loop reads at every record (the mail server it sends through)."""

    def __init__(
        self, model: type[Any], *where: Any, order_by: Any = None, limit: int | None = None
    ):
        self.loader = Loader(model)
        statement = select(*self.loader.columns).where(*where)
        if order_by is not None:
            statement = statement.order_by(order_by)
        if limit is not None:
            statement = statement.limit(limit)
        self.direct = Direct(statement, self.loader.columns)

    def all(self, engine: Engine, **params: Any) -> list[Any]:
        _count, rows = self.direct.run(engine, **params)
        return [self.loader.load(row) for row in rows]

    def first(self, engine: Engine, **params: Any) -> Any:
        found = self.all(engine, **params)
        return found[0] if found else None


def padded(
    values: Sequence[T], cache: dict[int, Direct], build: Callable[[int], Direct]
) -> tuple[Direct, dict[str, T]]:
    """A statement with ``IN (:v0 .. :vN)`` for N a power of two at least len(values), the
    values padded with the first one: a handful of compiled statements serve any list length."""
    size = 1
    while size < len(values):
        size *= 2
    statement = cache.get(size)
    if statement is None:
        statement = cache.setdefault(size, build(size))
    params = {f"v{i}": values[i] if i < len(values) else values[0] for i in range(size)}
    return statement, params
