"""When each periodic chore last ran, kept in the database (issue 13, part 5).

The stuck-send sweep runs on rq-scheduler, which lives in Redis. Its last run is written here
too, so a delivery worker can tell from PostgreSQL alone that the sweep is overdue (Redis away,
its children down) and run it itself.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import String
from sqlalchemy.orm import Mapped, mapped_column

from portal.models.base import Base, UTCDateTime


class ChoreRun(Base):
    """One row per chore: the database time its last run ended."""

    __tablename__ = "chore_run"

    name: Mapped[str] = mapped_column(String(100), primary_key=True)
    last_run_at: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False)
