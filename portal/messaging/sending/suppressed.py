"""Which of a record's recipients are on its tenant's suppression list, asked before every
attempt (``pipeline``), ahead of preparation and its quota charge. The list itself, and who
writes to it, is ``after_send.suppression``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Engine, and_, bindparam, literal_column, select

from portal.messaging.after_send import suppression
from portal.messaging.sending import claim
from portal.messaging.sending.configcache import CONFIGS
from portal.models import Channel, ConfigEpoch, MailSendRecord, SmsSendRecord, Suppression
from portal.models.direct import Direct, padded


def _suppression_statement(size: int) -> Direct:
    """Active suppressions of one tenant and channel among ``size`` addresses, each row led
    by the configuration epoch (``configcache``); one row of NULLs after it when there are
    none, so the epoch rides on this lookup without a round trip of its own."""
    epoch = ConfigEpoch.current().label("epoch")
    columns = (
        Suppression.address,
        Suppression.reason,
        Suppression.created_time,
        Suppression.created_by,
        Suppression.detail,
    )
    one = select(literal_column("1").label("one")).subquery("one")
    found = and_(
        Suppression.tenant_id == bindparam("tenant"),
        Suppression.channel == bindparam("channel"),
        Suppression.address.in_([bindparam(f"v{i}") for i in range(size)]),
        Suppression.removed_at.is_(None),
    )
    statement = select(epoch, *columns).select_from(one.outerjoin(Suppression, found))
    return Direct(statement, (epoch, *columns))


_SUPPRESSION_STATEMENTS: dict[int, Direct] = {}


def suppressed_recipients(
    engine: Engine, record: MailSendRecord | SmsSendRecord
) -> tuple[dict[str, str], int]:
    """The record's recipients on its tenant's suppression list (address -> why), and how many
    distinct recipients it has.

    Checked before every attempt, ahead of preparation and its quota charge, so a recipient
    suppressed while the record waited in Retry is not sent to either. The caller decides:
    every recipient suppressed ends the record ``Suppressed`` (no provider call); for mail with
    some suppressed, the rest are sent to and the suppressed ones are listed in
    ``refused_recipients`` as ``[SUPPRESSED, why]``.
    """
    channel = Channel.SMS if isinstance(record, SmsSendRecord) else Channel.MAIL
    wanted: dict[str, str] = {}  # normalised -> as written (lower-cased for mail)
    raw: list[str] = []
    if isinstance(record, SmsSendRecord):
        # Acceptance stored the number in E.164, the list's own form: parsing it again with
        # libphonenumber cost more CPU than the rest of the lookup.
        if record.phone_number:
            wanted[record.phone_number] = record.phone_number
    else:
        raw = [*record.to_addrs, *(record.cc_addrs or []), *(record.bcc_addrs or [])]
    # What the claim read beside the record (PostgreSQL, migration 0028) answers for every
    # recipient whose normal form is its ASCII lower case, as the claim computed it.
    look = claim.looked(record)
    for address in raw:
        try:
            key = suppression.normalise(channel, address)
        except suppression.InvalidAddress:
            continue
        wanted.setdefault(key, address.strip().lower())
        if look is not None and not (address.isascii() and key == address.lower()):
            look = None
    if not wanted:
        CONFIGS.seen(look.epoch if look is not None else None)
        return {}, len(set(raw))
    # A forgotten recipient's suppression keeps only the address's hash: look for
    # both forms.
    lookup = dict(wanted)
    for address, written in wanted.items():
        lookup[suppression.hashed(address)] = written
    found: list[Sequence[Any]]
    if look is not None:
        found = json.loads(look.suppressions) if look.suppressions else []
        epoch = look.epoch
    else:
        statement, addresses = padded(list(lookup), _SUPPRESSION_STATEMENTS, _suppression_statement)
        _count, rows = statement.run(
            engine, tenant=record.tenant_id, channel=channel.value, **addresses
        )
        epoch = rows[0][0] if rows and engine.dialect.name == "postgresql" else None
        found = [
            (address, reason, created.strftime("%Y-%m-%d %H:%M") if created else None, *more)
            for _epoch, address, reason, created, *more in rows
        ]
    # The configs this attempt reads next may come from the cache while this epoch holds.
    CONFIGS.seen(epoch)
    blocked: dict[str, str] = {}
    for address, reason, created, created_by, detail in found:
        if address not in lookup:  # none (no suppression), or a key only the claim computed
            continue
        why = f"{reason.replace('_', ' ')} since {created + ' UTC' if created else '?'}"
        if created_by:
            why += f" by {created_by}"
        if detail:
            why += f": {detail[:200]}"
        blocked[lookup[address]] = why
    return blocked, len(wanted)
