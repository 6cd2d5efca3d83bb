"""The inbox (issue 16, part 3): notices for tenant admins and platform operators."""

from __future__ import annotations

from sqlalchemy import Engine


def callback_trouble(
    engine: Engine, endpoint_id: int, delivery_id: int | None, paused: bool
) -> None:
    """A callback endpoint paused, or one of its deliveries dead (filled in by part 3)."""
