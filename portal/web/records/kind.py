"""One channel's record pages (``Kind``: its blueprint, model, search and list columns), and
the one way ids from a request become its records (``visible``, ``find_record``): scoped to
the viewed tenant, so another tenant's id finds nothing, as an id that does not exist."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from flask import abort
from sqlalchemy import ColumnElement, Select, select

from portal.extensions import db
from portal.messaging.records.retry import Model
from portal.models import Channel, MailSendServerConfig, SmsProviderConfig, Tenant
from portal.web.records.filters import MAX_ID


@dataclass(frozen=True)
class Search:
    """The conditions a search box adds, and how the list names them."""

    clauses: list[ColumnElement[bool]]
    description: str


@dataclass(frozen=True)
class Kind:
    """One channel's record pages: its blueprint, model, search and list columns, and the
    configs (servers, providers) its records are sent through."""

    blueprint: str
    model: Model
    channel: Channel
    config: type[MailSendServerConfig] | type[SmsProviderConfig]
    platform_service: str  # what a tenant sees instead of a platform-tier config's name
    title: str
    noun: str
    search_label: str
    search_hint: str
    preview_heading: str
    search: Callable[[str, int | None, int | None], Search]
    list_columns: tuple[str, ...]

    @property
    def row_prefix(self) -> str:
        return f"{self.blueprint.replace('_', '-')}-row-"

    def endpoint(self, view: str) -> str:
        return f"{self.blueprint}.{view}"


def tenant_scope(column: Any, tenant: int | None) -> ColumnElement[bool]:
    """``column`` restricted to ``tenant``; for all tenants, to every tenant id.

    "Every tenant id" is not a no-op: it lets an index that starts with tenant_id serve a
    search across tenants (one range scan per tenant) instead of a full scan.
    """
    if tenant is None:
        return column.in_(select(Tenant.id))  # type: ignore[no-any-return]
    return column == tenant  # type: ignore[no-any-return]


def visible(kind: Kind, ids: Iterable[int], tenant: int | None, *columns: Any) -> Select[Any]:
    """The one way ids from a request become records: ``select(*columns)`` (the records
    themselves by default) of those among ``ids`` that belong to ``tenant``, the viewed tenant
    (None: an operator looking at every tenant, as the lists do).

    Every id->row query of the record pages goes through here, so another tenant's id finds
    nothing, exactly like an id that does not exist.
    """
    model = kind.model
    stmt: Select[Any] = select(*columns) if columns else select(model)
    stmt = stmt.where(model.id.in_(list(ids)))
    if tenant is not None:
        stmt = stmt.where(model.tenant_id == tenant)
    return stmt


def find_record(kind: Kind, record_id: int, tenant: int | None) -> Any:
    """The record, if the viewer may see it; 404 otherwise (another tenant's included)."""
    if record_id > MAX_ID:
        abort(404)
    record = db.session.scalar(visible(kind, [record_id], tenant))
    if record is None:
        abort(404)
    return record
