"""The declarative base, the column types every model shares, and the database clock."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import BigInteger, DateTime, Integer, MetaData, TextClause, TypeDecorator, text
from sqlalchemy.engine import Dialect
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.orm import DeclarativeBase
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.expression import FunctionElement

# Constraint names fixed by convention, so Alembic's batch mode on SQLite can find them.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


# 64-bit ids on PostgreSQL; SQLite only autoincrements a column declared INTEGER.
BigId = BigInteger().with_variant(Integer(), "sqlite")


class UTCDateTime(TypeDecorator[datetime]):
    """A timestamp that is always UTC-aware on the way in and on the way out.

    PostgreSQL stores ``timestamptz``; SQLite stores text without an offset, which SQLAlchemy
    hands back naive: this type makes it UTC-aware again, so no caller ever compares a naive
    datetime with an aware one.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column; use datetime.now(UTC)")
        value = value.astimezone(UTC)
        if dialect.name == "sqlite":
            return value.replace(tzinfo=None)
        return value

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        parsed: datetime = (
            datetime.fromisoformat(value)  # written by the database clock on SQLite
            if isinstance(value, str)
            else value
        )
        if parsed.tzinfo is None:
            return parsed.replace(tzinfo=UTC)
        return parsed.astimezone(UTC)


class db_now(FunctionElement[datetime]):
    """The database clock, to microseconds, in UTC: due times and sweeps compare against it."""

    type = UTCDateTime()
    inherit_cache = True


@compiles(db_now, "postgresql")
def _db_now_pg(element: db_now, compiler: SQLCompiler, **kw: Any) -> str:
    # statement_timestamp(), not now(): a long transaction must not see a frozen clock.
    return "statement_timestamp()"


@compiles(db_now, "sqlite")
def _db_now_sqlite(element: db_now, compiler: SQLCompiler, **kw: Any) -> str:
    return "strftime('%Y-%m-%d %H:%M:%f', 'now')"


class db_now_plus(FunctionElement[datetime]):
    """The database clock plus a number of seconds (a bound parameter)."""

    type = UTCDateTime()
    inherit_cache = True


@compiles(db_now_plus, "postgresql")
def _db_now_plus_pg(element: db_now_plus, compiler: SQLCompiler, **kw: Any) -> str:
    (seconds,) = list(element.clauses)
    return f"statement_timestamp() + make_interval(secs => {compiler.process(seconds, **kw)})"


@compiles(db_now_plus, "sqlite")
def _db_now_plus_sqlite(element: db_now_plus, compiler: SQLCompiler, **kw: Any) -> str:
    (seconds,) = list(element.clauses)
    modifier = f"printf('%+.6f seconds', {compiler.process(seconds, **kw)})"
    return f"strftime('%Y-%m-%d %H:%M:%f', 'now', {modifier})"


def now_default(dialect_name: str) -> TextClause:
    """The database clock as a column DEFAULT, in each dialect's words (for migrations)."""
    if dialect_name == "sqlite":
        return text("(strftime('%Y-%m-%d %H:%M:%f', 'now'))")
    return text("statement_timestamp()")
