"""What acceptance checks of a send's template: that it exists in the
send scope's tier (by code: enabled; by id: even disabled, for a test send), and, when the
template is strict, that the variables hold every name it needs.

A template's needs come from ``variables.variable_needs`` and depend only on its content,
so they are kept per (channel, id, version) for the life of the process. The look-up by code
is kept too, per (channel, tier, code), for at most ``FRESH_S`` (1 s): a template saved in
another process is seen within a second, and one saved in this process at once (the ORM
events below drop every entry). A code that finds nothing is never kept, so a template
created a moment ago is found by the next send. On the API's hot path this means one
look-up per code per process per second, and no parse at all.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import event

from portal.messaging.templating.parsing import TemplateRenderError
from portal.messaging.templating.variables import VariableNeeds, variable_needs
from portal.models import MailTemplate, SmsTemplate

FRESH_S = 1.0
_NEEDS_MAX = 4_096  # (channel, id, version) entries; a few KB each at most
_BY_CODE_MAX = 4_096

# (sql, parameters) -> the first row or None; the caller's connection, in its transaction.
Fetch = Callable[[str, tuple[Any, ...]], "tuple[Any, ...] | None"]

_FACTS_SQL = {
    "mail": "SELECT id, version, enabled, strict_variables, stream FROM mail_template",
    "sms": "SELECT id, version, enabled, strict_variables, stream FROM sms_template",
}
_BY_CODE = {ch: sql + " WHERE tenant_id = %s AND code = %s" for ch, sql in _FACTS_SQL.items()}
_BY_ID = {ch: sql + " WHERE id = %s AND tenant_id = %s" for ch, sql in _FACTS_SQL.items()}
# The parts in the order of ``PARTS``: mail's subject first, then its bodies.
_SOURCES = {
    "mail": "SELECT version, subject, html_body, text_body FROM mail_template WHERE id = %s",
    "sms": "SELECT version, content FROM sms_template WHERE id = %s",
}
PARTS = {"mail": ("subject", "body", "body"), "sms": ("body",)}


@dataclass(frozen=True)
class TemplateFacts:
    """What acceptance needs to know of a template, by version."""

    id: int
    version: int
    enabled: bool
    strict: bool
    stream: str
    needed: tuple[str, ...]  # by every part
    optional: tuple[str, ...]
    subject_needs: tuple[str, ...] = ()  # mail: what the subject alone needs
    body_needs: tuple[str, ...] = ()  # what the bodies (or the SMS content) need

    def missing(
        self, variables: Mapping[str, Any] | None, *, subject: bool = True, body: bool = True
    ) -> list[str]:
        """The needed names the variables lack, for the parts that will be rendered (a
        request that gives its own subject or body does not render that part)."""
        wanted = (self.subject_needs if subject else ()) + (self.body_needs if body else ())
        given = variables or {}
        return sorted({name for name in wanted if name not in given})


class _Cache:
    """The per-process caches, shared by a process's threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.needs: OrderedDict[tuple[str, int, int], tuple[VariableNeeds, ...]] = OrderedDict()
        self.by_code: dict[tuple[str, int, str], tuple[float, TemplateFacts]] = {}

    def clear(self) -> None:
        with self.lock:
            self.by_code.clear()


_cache = _Cache()


def forget() -> None:
    """Drop every kept look-up by code (a template was saved in this process)."""
    _cache.clear()


def forget_all() -> None:
    """Drop the parsed needs too, kept by (channel, id, version): only for a process whose
    database was emptied under it (the tests), where SQLite hands a deleted row's id out again
    and a new template could meet an old one's needs under the same id and version. The
    product never deletes a template."""
    _cache.clear()
    with _cache.lock:
        _cache.needs.clear()


def _needs(
    fetch: Fetch, channel: str, template_id: int, version: int
) -> tuple[int, tuple[VariableNeeds, ...]]:
    """The needs of each part of the template's version (from the cache, else parsed now);
    the version may be newer than asked when it was saved meanwhile."""
    key = (channel, template_id, version)
    with _cache.lock:
        found = _cache.needs.get(key)
        if found is not None:
            _cache.needs.move_to_end(key)
            return version, found
    row = fetch(_SOURCES[channel], (template_id,))
    if row is None:
        return version, tuple(VariableNeeds((), ()) for _ in PARTS[channel])
    version = int(row[0])
    needs = []
    for source in row[1:]:
        try:
            needs.append(variable_needs([source]))
        except TemplateRenderError:
            # A template that does not parse fails at preparation, naming the error; its
            # sends are not refused here for names nobody can tell.
            needs.append(VariableNeeds((), ()))
    result = tuple(needs)
    with _cache.lock:
        _cache.needs[(channel, template_id, version)] = result
        while len(_cache.needs) > _NEEDS_MAX:
            _cache.needs.popitem(last=False)
    return version, result


def _facts(fetch: Fetch, channel: str, row: tuple[Any, ...]) -> TemplateFacts:
    template_id, version, enabled, strict, stream = row
    version, parts = _needs(fetch, channel, int(template_id), int(version))
    kinds = PARTS[channel]
    subject = {
        n for kind, p in zip(kinds, parts, strict=True) if kind == "subject" for n in p.needed
    }
    body = {n for kind, p in zip(kinds, parts, strict=True) if kind == "body" for n in p.needed}
    needed = subject | body
    optional = {n for p in parts for n in p.optional} - needed
    return TemplateFacts(
        id=int(template_id),
        version=version,
        enabled=bool(enabled),
        strict=bool(strict),
        stream=str(stream),
        needed=tuple(sorted(needed)),
        optional=tuple(sorted(optional)),
        subject_needs=tuple(sorted(subject)),
        body_needs=tuple(sorted(body)),
    )


def by_code(fetch: Fetch, channel: str, tier: int, code: str) -> TemplateFacts | None:
    """The template with this code in the tier (enabled or not), or None; kept for up to
    ``FRESH_S`` when found, never when not."""
    key = (channel, tier, code)
    now = time.monotonic()
    with _cache.lock:
        kept = _cache.by_code.get(key)
    if kept is not None and now - kept[0] < FRESH_S:
        return kept[1]
    row = fetch(_BY_CODE[channel], (tier, code))
    if row is None:
        with _cache.lock:
            _cache.by_code.pop(key, None)
        return None
    facts = _facts(fetch, channel, row)
    with _cache.lock:
        if len(_cache.by_code) >= _BY_CODE_MAX:
            _cache.by_code.clear()
        _cache.by_code[key] = (now, facts)
    return facts


def by_id(fetch: Fetch, channel: str, tier: int, template_id: int) -> TemplateFacts | None:
    """The template with this id in the tier (enabled or not), or None; read every time
    (a send by id reads its template row anyway), its needs from the cache by version."""
    row = fetch(_BY_ID[channel], (template_id, tier))
    return None if row is None else _facts(fetch, channel, row)


def needs_of(channel: str, sources: tuple[str | None, ...]) -> TemplateFacts:
    """The needs of content that is not (or not yet) saved: the editor's, a version's."""
    kinds = PARTS[channel]
    subject: set[str] = set()
    body: set[str] = set()
    optional: set[str] = set()
    for kind, source in zip(kinds, sources, strict=True):
        if not source:
            continue
        found = variable_needs([source])
        (subject if kind == "subject" else body).update(found.needed)
        optional.update(found.optional)
    needed = subject | body
    return TemplateFacts(
        id=0,
        version=0,
        enabled=True,
        strict=True,
        stream="",
        needed=tuple(sorted(needed)),
        optional=tuple(sorted(optional - needed)),
        subject_needs=tuple(sorted(subject)),
        body_needs=tuple(sorted(body)),
    )


def _saved(*_args: object) -> None:
    forget()


for _model in (MailTemplate, SmsTemplate):
    for _event in ("after_insert", "after_update", "after_delete"):
        event.listen(_model, _event, _saved)


def unmet(
    template: MailTemplate | SmsTemplate,
    variables: Mapping[str, Any] | None,
    *,
    subject: bool = True,
    body: bool = True,
) -> list[str]:
    """Preparation's check: the names a strict template's current version needs
    that the record's variables lack (a version saved after acceptance may need more); empty
    when the template is not strict or asks for nothing more. Parsed once per version."""
    if not template.strict_variables:
        return []
    if isinstance(template, MailTemplate):
        channel = "mail"
        sources: tuple[str | None, ...] = (
            template.subject,
            template.html_body,
            template.text_body,
        )
    else:
        channel, sources = "sms", (template.content,)
    key = (channel, template.id, template.version)
    with _cache.lock:
        parts = _cache.needs.get(key)
    if parts is None:
        found = []
        for source in sources:
            try:
                found.append(variable_needs([source]))
            except TemplateRenderError:
                found.append(VariableNeeds((), ()))  # the render names the error
        parts = tuple(found)
        with _cache.lock:
            _cache.needs[key] = parts
    wanted = [
        name
        for kind, part in zip(PARTS[channel], parts, strict=True)
        if (subject if kind == "subject" else body)
        for name in part.needed
    ]
    given = variables or {}
    return sorted({name for name in wanted if name not in given})
