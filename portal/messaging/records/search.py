"""What a search box's text means, and the conditions that find it, for either channel.

People type what they have in front of them: a whole address or part of one (``carol``,
``carol@``, ``@example.com``), a word of a subject, a phone number as it is written in their
country (``07911 123456``) or without its ``+``, a record id, a Message-ID, a provider's
message id or their own business key. ``interpret`` reads the text into ``Term``s, each with
the words the results page shows ("phone number +447911123456 (GB)"); ``conditions`` turns
them into one channel's WHERE.

Every condition walks an index: the record tables' primary key and business-key constraint,
SMS's (tenant_id, phone_number, id), and the insert-only side tables (``mail_send_recipient``,
``mail_send_subject``, ``send_attempt``) with their trigram indexes on PostgreSQL (migration
0025). The record tables get no index for search.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import phonenumbers
from sqlalchemy import ColumnElement, Select, literal_column, select, union_all

from portal.messaging.records.addresses import AddressError, email_address, parse_phone_number
from portal.models import (
    Channel,
    MailSendRecipient,
    MailSendRecord,
    MailSendSubject,
    SendAttempt,
    SmsSendRecord,
)
from portal.models.by_channel import PARTS

MAX_ID = 2**63 - 1
# Our own Message-IDs are "<mail-<record id>@<domain>>" (preparation.message_id_for).
_MESSAGE_ID = re.compile(r"<?mail-([1-9]\d{0,18})@([^<>\s@]+)>?", re.IGNORECASE)
_PHONE = re.compile(r"\+?[\d\s().\-/]+")
_DIGITS = re.compile(r"\D")
_RECORD_ID = re.compile(r"#?([1-9]\d{0,18})")


class TermKind(StrEnum):
    RECORD_ID = "record_id"
    MESSAGE_ID = "message_id"
    ADDRESS = "address"
    ADDRESS_PART = "address_part"
    SUBJECT = "subject"
    PHONE = "phone"
    BUSINESS_KEY = "business_key"
    PROVIDER_ID = "provider_id"


# Which channels each kind of term can find.
_CHANNELS: dict[TermKind, frozenset[Channel]] = {
    TermKind.RECORD_ID: frozenset(Channel),
    TermKind.MESSAGE_ID: frozenset({Channel.MAIL}),
    TermKind.ADDRESS: frozenset({Channel.MAIL}),
    TermKind.ADDRESS_PART: frozenset({Channel.MAIL}),
    TermKind.SUBJECT: frozenset({Channel.MAIL}),
    TermKind.PHONE: frozenset({Channel.SMS}),
    TermKind.BUSINESS_KEY: frozenset(Channel),
    TermKind.PROVIDER_ID: frozenset(Channel),
}


@dataclass(frozen=True)
class Term:
    """One reading of the text: what kind, its normalised value, and how the page says it."""

    kind: TermKind
    value: str
    label: str
    # Also looked for (a business key, a provider id): said after the main readings.
    secondary: bool = False

    @property
    def channels(self) -> frozenset[Channel]:
        return _CHANNELS[self.kind]


@dataclass(frozen=True)
class Understanding:
    """Everything the text may mean; the results match any of it."""

    text: str
    terms: tuple[Term, ...]

    @property
    def description(self) -> str:
        main = [t.label for t in self.terms if not t.secondary]
        also = [t.label for t in self.terms if t.secondary]
        text = " or ".join(main)
        if also:
            text += ("; also " if main else "") + " or ".join(also)
        return text

    @property
    def channels(self) -> frozenset[Channel]:
        return frozenset(c for t in self.terms for c in t.channels)

    def of(self, kind: TermKind) -> list[Term]:
        return [t for t in self.terms if t.kind is kind]


def country_code(raw: Any) -> str | None:
    """An ISO 3166 alpha-2 country the phone library knows (upper-cased), None for empty;
    ``ValueError`` otherwise."""
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return None
    if not isinstance(raw, str):
        raise ValueError("country must be an ISO 3166 alpha-2 code like GB")
    code = raw.strip().upper()
    if code not in phonenumbers.SUPPORTED_REGIONS:
        raise ValueError(f"country {raw!r} is not an ISO 3166 alpha-2 code like GB or DE")
    return code


def _phone_terms(text: str, country: str) -> list[Term]:
    """A number in international form, with 00 or without its +, or national for ``country``."""
    digits = _DIGITS.sub("", text)
    if not 5 <= len(digits) <= 17:
        return []
    readings: list[tuple[str, str]] = []  # (what parse_phone_number gets, the country said)
    stripped = text.strip()
    if stripped.startswith("+"):
        readings.append(("+" + digits, ""))
    elif digits.startswith("00"):
        readings.append(("+" + digits[2:], ""))
    else:
        try:
            national = phonenumbers.parse(stripped, country)
        except phonenumbers.NumberParseException:
            national = None
        if national is not None and phonenumbers.is_valid_number(national):
            e164 = phonenumbers.format_number(national, phonenumbers.PhoneNumberFormat.E164)
            readings.append((e164, country))
        readings.append(("+" + digits, ""))
    terms: dict[str, Term] = {}
    for candidate, read_in in readings:
        try:
            number, region = parse_phone_number(candidate, "q")
        except AddressError:
            continue
        if number not in terms:
            where = read_in or region
            label = f"phone number {number}" + (f" ({where})" if where else "")
            terms[number] = Term(TermKind.PHONE, number, label)
    if not terms:  # kept as typed when it would not parse (rows written before validation)
        terms[stripped] = Term(TermKind.PHONE, stripped, f"phone number “{stripped}” as typed")
    return list(terms.values())


def _address_terms(text: str) -> list[Term]:
    """A whole address (normalised as acceptance keeps it) or a part of one."""
    try:
        address = email_address(text, "q").lower()
    except AddressError:
        part = text.lower()
        if part.endswith("@"):
            label = f"an address starting with “{part}”"
        elif part.startswith("@"):
            label = f"an address at {part[1:]}" if part[1:] else "an address"
        else:
            label = f"an address containing “{part}”"
        return [Term(TermKind.ADDRESS_PART, part, label)]
    return [Term(TermKind.ADDRESS, address, f"email address {address}")]


def _also(text: str) -> list[Term]:
    """A single token may also be a business key or a provider's message id (exact)."""
    return [
        Term(TermKind.BUSINESS_KEY, text, f"business key “{text}”", secondary=True),
        Term(TermKind.PROVIDER_ID, text, f"provider message id “{text}”", secondary=True),
    ]


def interpret(raw: str, country: str) -> Understanding:
    """Every reading of ``raw`` worth looking for; ``country`` reads national numbers."""
    text = raw.strip()
    terms: list[Term] = []
    single = bool(text) and not any(ch.isspace() for ch in text)
    message_id = _MESSAGE_ID.fullmatch(text)
    if not text:
        pass
    elif message_id and int(message_id.group(1)) <= MAX_ID:
        value = f"<mail-{message_id.group(1)}@{message_id.group(2)}>"
        terms.append(Term(TermKind.MESSAGE_ID, value, f"Message-ID {value}"))
    elif "@" in text and single:
        terms += _address_terms(text)
        terms += _also(text)
    elif _PHONE.fullmatch(text) and any(ch.isdigit() for ch in text):
        record_id = _RECORD_ID.fullmatch(text)
        if record_id and int(record_id.group(1)) <= MAX_ID:
            terms.append(Term(TermKind.RECORD_ID, record_id.group(1), f"record id {text}"))
        terms += _phone_terms(text, country)
        if single:
            terms += _also(text)
    else:
        record_id = _RECORD_ID.fullmatch(text)
        if record_id and int(record_id.group(1)) <= MAX_ID:
            terms.append(Term(TermKind.RECORD_ID, record_id.group(1), f"record id {text}"))
        terms.append(Term(TermKind.SUBJECT, text, f"mail subject containing “{text}”"))
        if single:
            terms.append(
                Term(TermKind.ADDRESS_PART, text.lower(), f"an address containing “{text}”")
            )
            terms += _also(text)
    return Understanding(text, tuple(terms))


def escape_like(text: str) -> str:
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


MIN_INDEX_WORD = 5  # an identifier-like word: 5 characters or more, one of them a digit
_WORD = re.compile(r"[^\W_]+")


def index_word(text: str) -> str | None:
    """The part of a subject or address search the trigram index looks up, or None to give it
    the whole text.

    A trigram index intersects the lists of every trigram of the pattern, and the trigrams of
    common words ("order", "is", "your") are in nearly every subject: their lists are as long
    as the table, and reading them made "order 424242 is" cost what the table weighs
    (bench/pages.py: 1,637 index pages at 1M rows; "424242" alone: 7). When the text has a word
    that looks like an identifier (an order, invoice or tracking number: 5 characters or more,
    one a digit, or a 4-digit number that is not a year; the longest such), the index looks up
    that word alone and the whole text is checked on the rows it finds. Without one the index
    gets the whole text: a single common word would find too many rows to check one by one.
    """
    word = _longest_identifier(text, numbers=True)
    return None if word == text else word


def _longest_identifier(text: str, *, numbers: bool) -> str | None:
    """The longest word of ``text`` that looks like an identifier: 5 characters or more, one a
    digit; with ``numbers`` also a 4-digit number that is not a year ("order 4242": a year is
    in too many subjects to check them one by one)."""
    words = [w for w in _WORD.findall(text) if _identifier(w, numbers)]
    return max(words, key=len) if words else None


def _identifier(word: str, numbers: bool) -> bool:
    if len(word) >= MIN_INDEX_WORD:
        return any(ch.isdigit() for ch in word)
    return numbers and len(word) == 4 and word.isdigit() and not 1900 <= int(word) <= 2099


def rare_core(text: str) -> str | None:
    """For an address part that holds an identifier-like word (``user4242``, ``smith1984``):
    the stretch of it around its digits (``er4242``, ``th1984``) for the trigram index, or
    None. In addresses the trigrams of letters ("use", "ser", "ith") are in nearly every row,
    so their lists grow with the table; those with a digit are few. The whole part is then
    checked on the rows the core finds."""
    word = _longest_identifier(text, numbers=False)
    if word is None:
        return None
    digits = [i for i, ch in enumerate(word) if ch.isdigit()]
    core = word[max(0, digits[0] - 2) : digits[-1] + 3]
    return core if len(core) >= 3 else None


def _address_pattern(part: str) -> str:
    if part.endswith("@") and not part.startswith("@"):
        return escape_like(part) + "%"
    if part.startswith("@") and not part.endswith("@"):
        return "%" + escape_like(part)
    return "%" + escape_like(part) + "%"


Scope = Callable[[Any], ColumnElement[bool]]


def _branch(
    term: Term, channel: Channel, scope: Scope
) -> tuple[Select[Any], ColumnElement[int]] | None:
    """The ids one term finds in one channel, as a select over the one index it walks, and
    its id column (for the caller's cursor and order); None when the term is not this
    channel's."""
    if channel not in term.channels:
        return None
    model = PARTS[channel].record
    column: Any
    match term.kind:
        case TermKind.RECORD_ID:
            column = model.id
            where = [scope(model.tenant_id), model.id == int(term.value)]
        case TermKind.MESSAGE_ID:
            column = MailSendRecord.id
            record_id = int(term.value[6 : term.value.index("@")])
            where = [
                scope(MailSendRecord.tenant_id),
                MailSendRecord.id == record_id,
                MailSendRecord.message_id_header == term.value,
            ]
        case TermKind.ADDRESS:
            column = MailSendRecipient.record_id
            where = [scope(MailSendRecipient.tenant_id), MailSendRecipient.address == term.value]
        case TermKind.ADDRESS_PART:
            column = MailSendRecipient.record_id
            pattern = _address_pattern(term.value)
            where = [scope(MailSendRecipient.tenant_id)]
            core = rare_core(term.value) if pattern.startswith("%") else None
            if core is not None:
                # The index gets the core (see rare_core), the whole part is checked on its
                # rows, and the rows are sorted by id, not walked down the record_id index:
                # with the part's few matches misjudged as many, PostgreSQL walked that index
                # back from the newest and filtered ("user4242" at 1M: 357,526 rows, 38 ms).
                column = MailSendRecipient.record_id + literal_column("0")
                where += [
                    MailSendRecipient.address.like(f"%{escape_like(core)}%", escape="\\"),
                    MailSendRecipient.address.concat("").like(pattern, escape="\\"),
                ]
            else:
                where.append(MailSendRecipient.address.like(pattern, escape="\\"))
        case TermKind.SUBJECT:
            column = MailSendSubject.record_id
            pattern = f"%{escape_like(term.value)}%"
            where = [scope(MailSendSubject.tenant_id)]
            word = index_word(term.value)
            if word is None:
                where.append(MailSendSubject.subject.ilike(pattern, escape="\\"))
            else:
                # The trigram index gets one word; the whole text is checked on its rows only
                # (``|| ''`` keeps the planner from giving the index every trigram again).
                where += [
                    MailSendSubject.subject.ilike(f"%{escape_like(word)}%", escape="\\"),
                    MailSendSubject.subject.concat("").ilike(pattern, escape="\\"),
                ]
        case TermKind.PHONE:
            column = SmsSendRecord.id
            where = [scope(SmsSendRecord.tenant_id), SmsSendRecord.phone_number == term.value]
        case TermKind.BUSINESS_KEY:
            column = model.id
            where = [scope(model.tenant_id), model.business_key == term.value]
        case TermKind.PROVIDER_ID:
            column = SendAttempt.record_id
            where = [
                SendAttempt.provider_message_id == term.value,
                SendAttempt.channel == channel.value,
                scope(SendAttempt.tenant_id),
            ]
    return select(column.label("id")).where(*where), column


def conditions(
    understanding: Understanding,
    channel: Channel,
    scope: Scope,
    *,
    before: int | None = None,
    newest: int | None = None,
) -> ColumnElement[bool] | None:
    """One channel's WHERE for ``understanding`` (any term matches), or None when nothing in
    it can be that channel's. ``scope`` restricts a tenant_id column to the viewer's tenants.

    Each term is its own select of ids over its own index, put together with UNION ALL: an OR
    of them would leave the planner one way in, a walk of the whole record table. ``before``
    (the keyset cursor) goes into each; ``newest`` takes only that many of each, newest
    first, for a page that needs no more (the results page; a list with more filters cannot).
    """
    model = PARTS[channel].record
    parts: list[Select[Any]] = []
    for term in understanding.terms:
        branch = _branch(term, channel, scope)
        if branch is None:
            continue
        stmt, column = branch
        if before is not None:
            stmt = stmt.where(column < before)
        if newest is not None:
            stmt = stmt.order_by(column.desc()).limit(newest)
            stmt = select(stmt.subquery().c.id)
        parts.append(stmt)
    if not parts:
        return None
    if len(parts) == 1:
        return model.id.in_(parts[0])
    found = union_all(*parts).subquery()
    return model.id.in_(select(found.c.id))


def reading_country(tenant_country: str | None, default: str) -> str:
    """The country national numbers are read in: the tenant's, else the platform default."""
    return tenant_country or default
