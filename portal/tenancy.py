"""Who a piece of work is for: the current tenant and trace id, as context variables.

Context variables (not thread-locals) so that the web request, a delivery worker thread and a
CLI command all carry them the same way, and a ``with tenant_context(...)`` block restores the
previous values on exit even when it raises.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

PLATFORM_TENANT_ID = -1
"""The platform tier's tenant id: the operator's own configuration, templates and quota."""

_current_tenant: ContextVar[int | None] = ContextVar("current_tenant", default=None)
_trace_id: ContextVar[str | None] = ContextVar("trace_id", default=None)


def current_tenant_id() -> int | None:
    """The tenant the current work runs for, or None outside any tenant context."""
    return _current_tenant.get()


def current_trace_id() -> str | None:
    """The trace id of the request that caused the current work."""
    return _trace_id.get()


def new_trace_id() -> str:
    """A fresh 32-hex-digit trace id (the W3C trace-context size)."""
    return secrets.token_hex(16)


@contextmanager
def tenant_context(tenant_id: int | None, trace_id: str | None = None) -> Iterator[None]:
    """Run a block as ``tenant_id`` (None: no tenant) under ``trace_id`` (kept if not given)."""
    tenant_token = _current_tenant.set(tenant_id)
    trace_token = _trace_id.set(trace_id) if trace_id is not None else None
    try:
        yield
    finally:
        _current_tenant.reset(tenant_token)
        if trace_token is not None:
            _trace_id.reset(trace_token)


@contextmanager
def trace_context(trace_id: str) -> Iterator[None]:
    """Run a block under ``trace_id``, keeping the tenant."""
    token = _trace_id.set(trace_id)
    try:
        yield
    finally:
        _trace_id.reset(token)


def names_config(tier: int | None, operator: bool) -> bool:
    """Whether a viewer may see a server's or provider's name and id: the one rule for the
    API, the record pages, the timeline, the attempt's headers page and a record's diagnosis.

    It goes by the tier of the config a record used, not by the record's scope: a tenant's
    mail falls back to the platform's server when the tenant has none. Platform operators see
    every config; anyone else sees "platform mail service" (or SMS) for a platform-tier one,
    and for one whose tier is unknown (None), so an unknown case never leaks a name.
    """
    return operator or (tier is not None and tier != PLATFORM_TENANT_ID)
