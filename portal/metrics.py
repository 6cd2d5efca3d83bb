"""Prometheus metrics shared by the portal and the worker."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

MESSAGE_SENT = Counter(
    "message_sent", "Sends the server or provider accepted", ["channel", "provider"]
)
MESSAGE_FAILED = Counter(
    "message_failed",
    "Failed attempts, preparation failures included, by what happened next",
    ["channel", "provider", "outcome"],
)
SEND_DURATION = Histogram(
    "message_send_duration_seconds",
    "Time talking to the server or provider per attempt",
    ["channel"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
