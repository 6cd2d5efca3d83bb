"""Circuit breaker state per mail server and SMS provider.

Redis holds the live state (the failure streak, the probe lease); this table mirrors every
change of state (opened, a probe failed, closed), so the portal's pages and the metrics read it
without Redis, and it is the whole state while Redis is away.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import JSON, Float, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from portal.models.base import Base, UTCDateTime


class BreakerState(Base):
    """One row per server or provider that has failed at least once since it last answered.

    ``down_since`` set: open (deferring its records); NULL: closed, counting ``streak`` (the
    distinct record ids that failed at the connection level in a row).
    """

    __tablename__ = "breaker_state"

    channel: Mapped[str] = mapped_column(String(10), primary_key=True)
    config_id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    down_since: Mapped[datetime | None] = mapped_column(UTCDateTime)
    last_error: Mapped[str | None] = mapped_column(Text)
    next_probe_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    interval_s: Mapped[float] = mapped_column(Float, nullable=False, default=0.0)
    probe_record_id: Mapped[int | None] = mapped_column(Integer)
    probe_until: Mapped[datetime | None] = mapped_column(UTCDateTime)
    last_probe_record_id: Mapped[int | None] = mapped_column(Integer)
    streak: Mapped[list[int]] = mapped_column(JSON, nullable=False, default=list)
    updated_time: Mapped[datetime | None] = mapped_column(UTCDateTime)
