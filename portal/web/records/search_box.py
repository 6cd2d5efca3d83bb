"""The search box as the viewer means it: ``portal.messaging.records.search`` read with the viewed
tenant's country and scoped to the viewed tenant. The results page (``search``) and each
list's own box (``Kind.search`` of mail and SMS) both go through here, so the three boxes
read the same text the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flask import current_app
from sqlalchemy import ColumnElement, false, select

from portal.extensions import db
from portal.messaging.records import search
from portal.models import Channel, Tenant
from portal.web.records.kind import Search, tenant_scope


def country(tenant: int | None) -> str:
    """The country a national phone number is read in: the viewed tenant's, else the
    platform's DEFAULT_COUNTRY (also for an operator looking at every tenant)."""
    default: str = current_app.config["SETTINGS"].default_country
    if tenant is None:
        return default
    own = db.session.scalar(select(Tenant.country).where(Tenant.id == tenant))
    return search.reading_country(own, default)


def understood(q: str, tenant: int | None) -> search.Understanding:
    """What the box's text means for a viewer of ``tenant`` (None: every tenant)."""
    return search.interpret(q, country(tenant))


def where(
    meaning: search.Understanding,
    channel: Channel,
    tenant: int | None,
    *,
    before: int | None = None,
    newest: int | None = None,
) -> ColumnElement[bool] | None:
    """One channel's condition for ``meaning``, every read scoped to ``tenant``, older than
    ``before``; ``newest``: only that many of each term's newest (``search.conditions``)."""

    def scope(column: Any) -> ColumnElement[bool]:
        return tenant_scope(column, tenant)

    return search.conditions(meaning, channel, scope, before=before, newest=newest)


def channel_search(channel: Channel) -> Callable[[str, int | None, int | None], Search]:
    """A list's ``Kind.search``: the box read as everywhere, kept to this channel; text that
    cannot be this channel's finds nothing and the list says what it read instead."""

    def run(q: str, tenant: int | None, before: int | None) -> Search:
        meaning = understood(q, tenant)
        condition = where(meaning, channel, tenant, before=before)
        if condition is None:
            return Search([false()], f"matching {meaning.description} (never a {channel.value})")
        return Search([condition], f"matching {meaning.description}")

    return run
