"""gunicorn settings for the portal: Prometheus multiprocess bookkeeping."""

from __future__ import annotations

from typing import Any


def child_exit(server: Any, worker: Any) -> None:
    """Let Prometheus drop a dead worker's live gauges (counters are kept)."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(worker.pid)
