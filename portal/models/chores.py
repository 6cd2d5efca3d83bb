"""When each periodic chore last ran, kept in the database.

The stuck-send sweep runs on rq-scheduler, which lives in Redis. Its last run is written here
too, so a delivery worker can tell from PostgreSQL alone that the sweep is overdue (Redis away,
its children down) and run it itself.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import BigInteger, Integer, ScalarSelect, String, literal_column, select
from sqlalchemy.orm import Mapped, mapped_column

from portal.models.base import Base, UTCDateTime


class ChoreRun(Base):
    """One row per chore: the database time its last run ended."""

    __tablename__ = "chore_run"

    name: Mapped[str] = mapped_column(String(100), primary_key=True)
    last_run_at: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False)


class ConfigEpoch(Base):
    """One row (id 1): a value that changes with every change to the configs a delivery
    worker reads at each send (servers, providers, routes, bindings; PostgreSQL triggers of
    migration 0016). Workers cache those configs while it stays the same."""

    __tablename__ = "config_epoch"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    epoch: Mapped[int] = mapped_column(BigInteger, nullable=False)

    @classmethod
    def current(cls) -> ScalarSelect[int]:
        """The epoch as a scalar subquery, for a statement a worker runs anyway (the claim;
        the suppression lookup) to bring it back without a round trip of its own."""
        return select(cls.epoch).where(cls.id == literal_column("1")).scalar_subquery()
