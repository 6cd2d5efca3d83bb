"""The writer of a record's events that no attempt row or delivery event holds
(``portal.models.record_events``): called in the transaction that changes the record, so the
event exists exactly when the change does."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from sqlalchemy import insert
from sqlalchemy.orm import Session

from portal.models import Channel, RecordEvent, RecordEventKind

MAX_TEXT = 2000


def note(
    session: Session,
    channel: Channel | str,
    record_id: int,
    tenant_id: int,
    kind: RecordEventKind,
    *,
    code: str | None = None,
    message: str | None = None,
    actor: str | None = None,
) -> None:
    """One event of one record, in the caller's transaction."""
    note_many(
        session,
        channel,
        {record_id: tenant_id},
        kind,
        code=code,
        actor=actor,
        messages={record_id: message} if message else None,
    )


def note_many(
    session: Session,
    channel: Channel | str,
    tenant_of: Mapping[int, int],
    kind: RecordEventKind,
    *,
    code: str | None = None,
    actor: str | None = None,
    messages: Mapping[int, str | None] | None = None,
    only: Iterable[int] | None = None,
) -> None:
    """The same event for each record of ``tenant_of`` (id -> tenant; ``only`` those ids), in
    one INSERT in the caller's transaction; ``messages`` per record."""
    ids = list(tenant_of) if only is None else [i for i in only if i in tenant_of]
    if not ids:
        return
    text = messages or {}
    rows = [
        {
            "tenant_id": tenant_of[rid],
            "channel": Channel(channel).value,
            "record_id": rid,
            "kind": kind.value,
            "code": code[:100] if code else None,
            "message": (text.get(rid) or "")[:MAX_TEXT].replace("\x00", "\ufffd") or None,
            "actor": actor[:400] if actor else None,
        }
        for rid in ids
    ]
    session.execute(insert(RecordEvent.__table__), rows)  # type: ignore[arg-type]
