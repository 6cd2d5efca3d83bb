"""The dry run of a template change: the new content rendered against the
variables of the last records that used the template, before it goes live.

Each record's variables go through what acceptance and preparation would do with the new
version: a strict template refuses a send that lacks a needed variable, then the sandboxed
render (with its limits) either gives content or fails. The whole run has a time budget
(2 s): what is left unchecked is reported ("checked N of 200"). A few records are rendered
with the current version as well, for a side-by-side look.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from portal.messaging.templating import rendering
from portal.messaging.templating.html_text import html_to_text
from portal.messaging.templating.parsing import TemplateRenderError
from portal.messaging.templating.variables import variable_needs
from portal.models import MailTemplate, Scope, SmsTemplate
from portal.models.by_channel import PARTS
from portal.tenancy import PLATFORM_TENANT_ID

RECENT = 200
BUDGET_S = 2.0
SAMPLES = 3
FIRST_ERRORS = 5


@dataclass(frozen=True)
class Sample:
    """One record's variables rendered by the current and the new version."""

    record_id: int
    current: str
    new: str


@dataclass
class DryRun:
    """What the new version would do to the recent sends."""

    found: int = 0  # records that used the template (at most RECENT)
    checked: int = 0
    rendered: int = 0
    refused: int = 0  # strict, and a needed variable missing
    missing: Counter[str] = field(default_factory=Counter)
    failed: int = 0  # does not render (or renders empty)
    errors: list[str] = field(default_factory=list)  # the first few, with their record
    samples: list[Sample] = field(default_factory=list)
    from_sample: bool = False  # no sends yet: checked against the sample variables

    @property
    def complete(self) -> bool:
        return self.checked == self.found


def _recent(session: Session, template: MailTemplate | SmsTemplate) -> list[tuple[int, Any]]:
    """(id, variables) of the last records that named this template, newest first; by id or
    code, in the template's tier (a platform template: platform-scope sends of any tenant)."""
    model = PARTS[template.channel].record
    named = or_(model.template_id == template.id, model.template_code == template.code)
    if template.tenant_id == PLATFORM_TENANT_ID:
        where = [model.scope == Scope.PLATFORM.value, named]
    else:
        where = [
            model.tenant_id == template.tenant_id,
            model.scope == Scope.TENANT.value,
            named,
        ]
    rows = session.execute(
        select(model.id, model.variables).where(*where).order_by(model.id.desc()).limit(RECENT)
    )
    return [(int(rid), variables) for rid, variables in rows]


def _render(channel: str, sources: tuple[str | None, ...], variables: dict[str, Any]) -> str:
    """The message as preparation would render it, as one text (TemplateRenderError)."""
    if channel == "mail":
        subject, html, text = sources
        mail = rendering.render_mail(subject, html, text, variables)
        body = mail.text or (html_to_text(mail.html) if mail.html else "")
        if not body.strip() and not (mail.html or "").strip():
            raise TemplateRenderError("the body renders empty")
        return f"Subject: {mail.subject}\n\n{body}"
    (content,) = sources
    rendered = rendering.render(content or "", variables, html=False).strip()
    if not rendered:
        raise TemplateRenderError("the content renders empty")
    return rendered


def sources_of(template: MailTemplate | SmsTemplate) -> tuple[str | None, ...]:
    return tuple(getattr(template, name) for name in template.sources)


def run(
    session: Session,
    template: MailTemplate | SmsTemplate,
    new_sources: tuple[str | None, ...],
    *,
    strict: bool,
    samples: bool = True,
    budget_s: float = BUDGET_S,
    sample: dict[str, Any] | None = None,
) -> DryRun:
    """Render ``new_sources`` against the recent records' variables (see the module)."""
    channel = template.channel.value
    deadline = time.monotonic() + budget_s
    result = DryRun()
    records = _recent(session, template)
    if not records and sample is not None:
        records, result.from_sample = [(0, sample)], True
    result.found = len(records)
    try:
        needs = variable_needs(list(new_sources), draft=True)
    except TemplateRenderError as exc:
        result.failed = result.checked = result.found
        result.errors.append(str(exc))
        return result
    current = sources_of(template)
    for record_id, variables in records:
        if time.monotonic() > deadline:
            break
        result.checked += 1
        given = variables if isinstance(variables, dict) else {}
        lacking = [name for name in needs.needed if name not in given]
        if strict and lacking:
            result.refused += 1
            result.missing.update(lacking)
            continue
        try:
            new = _render(channel, new_sources, given)
        except TemplateRenderError as exc:
            result.failed += 1
            if len(result.errors) < FIRST_ERRORS:
                result.errors.append(f"record {record_id}: {exc}")
            continue
        result.rendered += 1
        if samples and len(result.samples) < SAMPLES:
            try:
                before = _render(channel, current, given)
            except TemplateRenderError as exc:
                before = f"(does not render: {exc})"
            result.samples.append(Sample(record_id, before, new))
    return result
