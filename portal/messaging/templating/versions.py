"""Template versions: every save of a template is an immutable version.

``save_version`` is called wherever a template's content is saved (the editor, attachments,
restore, import), after its ``version`` was bumped: it stores the whole content under that
number. A version names attachments by the SHA-256 of their bytes, kept once in
``template_blob``. ``restore`` puts a version's content back on the template (the caller
bumps ``version`` and saves a new version), and ``diff`` compares two versions field by field,
line by line for the Liquid parts.
"""

from __future__ import annotations

import base64
import binascii
import difflib
import hashlib
from dataclasses import dataclass
from typing import Any, TypeVar

from sqlalchemy import select
from sqlalchemy.orm import Session

from portal.models import MailTemplate, SmsTemplate, TemplateBlob, TemplateVersion

AnyTemplate = MailTemplate | SmsTemplate
T = TypeVar("T", MailTemplate, SmsTemplate)

# The content of a version, per channel: what "the whole content" is.
MAIL_FIELDS = (
    "subject",
    "html_body",
    "text_body",
    "reply_to",
    "priority",
    "preferred_server_id",
    "stream",
    "strict_variables",
)
SMS_FIELDS = ("content", "stream", "strict_variables")
LABELS = {
    "subject": "Subject",
    "html_body": "HTML body",
    "text_body": "Text body",
    "reply_to": "Reply-To",
    "priority": "Priority",
    "preferred_server_id": "Preferred server",
    "stream": "Stream",
    "strict_variables": "Strict variables",
    "content": "Content",
    "attachments": "Attachments",
}


def channel_of(template: AnyTemplate) -> str:
    return template.channel.value


def _fields(template: AnyTemplate) -> tuple[str, ...]:
    return MAIL_FIELDS if isinstance(template, MailTemplate) else SMS_FIELDS


def _blob(session: Session, content: str) -> str:
    """Keep an attachment's bytes once; its SHA-256."""
    try:
        raw = base64.b64decode(content, validate=False)
    except (binascii.Error, ValueError):
        raw = content.encode()
    digest = hashlib.sha256(raw).hexdigest()
    if session.get(TemplateBlob, digest) is None:
        session.add(TemplateBlob(sha256=digest, content=content, size=len(raw)))
        session.flush()
    return digest


def content_of(session: Session, template: AnyTemplate) -> dict[str, Any]:
    """The template's content as a version holds it (attachments by hash)."""
    content: dict[str, Any] = {name: getattr(template, name) for name in _fields(template)}
    if isinstance(template, MailTemplate):
        content["attachments"] = [
            {
                "name": a.get("name"),
                "contentType": a.get("contentType"),
                "sha256": _blob(session, str(a.get("content") or "")),
            }
            for a in template.attachments or []
        ]
    return content


def latest(session: Session, template: AnyTemplate) -> TemplateVersion | None:
    return session.scalar(
        select(TemplateVersion)
        .where(
            TemplateVersion.tenant_id == template.tenant_id,
            TemplateVersion.channel == channel_of(template),
            TemplateVersion.template_id == template.id,
        )
        .order_by(TemplateVersion.number.desc())
        .limit(1)
    )


def save_version(
    session: Session, template: AnyTemplate, author: str | None, remark: str | None = None
) -> TemplateVersion:
    """Store the template's content as version ``template.version`` (flushes the template
    first, so a new one has its id). A number already taken (a template whose counter was
    set back by hand) moves the counter past it: a version is never overwritten."""
    session.flush()
    last = latest(session, template)
    if last is not None and template.version <= last.number:
        template.version = last.number + 1
        session.flush()
    row = TemplateVersion(
        tenant_id=template.tenant_id,
        channel=channel_of(template),
        template_id=template.id,
        number=template.version,
        author=author,
        remark=remark,
        content=content_of(session, template),
    )
    session.add(row)
    session.flush()
    return row


def ensure_saved(session: Session, template: AnyTemplate) -> None:
    """Before a change: a template with no version yet (made before versions, or outside the
    portal) gets its current content kept as its current version, so history starts there."""
    if latest(session, template) is None:
        save_version(session, template, None, "as it was before this change")


def changed(session: Session, template: AnyTemplate) -> bool:
    """Whether the template's content differs from its latest version (none: changed)."""
    last = latest(session, template)
    return last is None or last.content != content_of(session, template)


def versions(session: Session, tenant_id: int, channel: str, template_id: int) -> list[Any]:
    """A template's versions, newest first (tenant-scoped)."""
    return list(
        session.scalars(
            select(TemplateVersion)
            .where(
                TemplateVersion.tenant_id == tenant_id,
                TemplateVersion.channel == channel,
                TemplateVersion.template_id == template_id,
            )
            .order_by(TemplateVersion.number.desc())
        )
    )


def version(
    session: Session, tenant_id: int, channel: str, template_id: int, number: int
) -> TemplateVersion | None:
    """One version of a template of this tenant, or None."""
    return session.scalar(
        select(TemplateVersion).where(
            TemplateVersion.tenant_id == tenant_id,
            TemplateVersion.channel == channel,
            TemplateVersion.template_id == template_id,
            TemplateVersion.number == number,
        )
    )


def restore(session: Session, template: AnyTemplate, old: TemplateVersion) -> None:
    """Put an old version's content back on the template (the caller bumps the version and
    saves it as a new one). A preferred server that is gone is left unset."""
    content = old.content
    for name in _fields(template):
        if name in content:
            setattr(template, name, content[name])
    if isinstance(template, MailTemplate):
        files = []
        for item in content.get("attachments") or []:
            blob = session.get(TemplateBlob, item.get("sha256"))
            if blob is not None:
                files.append(
                    {
                        "name": item.get("name"),
                        "contentType": item.get("contentType"),
                        "content": blob.content,
                    }
                )
        template.attachments = files or None


def as_version(session: Session, template: T, number: int) -> T | None:
    """The template as its version ``number`` held it: itself when that is its current version,
    else a copy detached from ``session`` (nothing of it is ever written back); None when the
    template has no such version. A test send from the editor renders what it previewed."""
    if template.version == number:
        return template
    old = version(session, template.tenant_id, channel_of(template), template.id, number)
    if old is None:
        return None
    session.expunge(template)
    restore(session, template, old)
    template.version = number
    return template


@dataclass(frozen=True)
class FieldDiff:
    """One field of two versions: unchanged, or its lines side by side."""

    name: str
    label: str
    same: bool
    rows: list[tuple[str, str, str]]  # (kind: same|changed|added|removed, left, right)


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, list):
        return "\n".join(
            f"{a.get('name')} ({a.get('contentType')}, sha256 {str(a.get('sha256'))[:12]})"
            for a in value
        )
    return str(value)


def diff(left: dict[str, Any], right: dict[str, Any]) -> list[FieldDiff]:
    """Field by field, each field's lines side by side (difflib's opcodes)."""
    names = [n for n in LABELS if n in left or n in right]
    out = []
    for name in names:
        a, b = _text(left.get(name)).splitlines(), _text(right.get(name)).splitlines()
        rows: list[tuple[str, str, str]] = []
        for op, i1, i2, j1, j2 in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes():
            if op == "equal":
                rows.extend(
                    ("same", a[i], b[j]) for i, j in zip(range(i1, i2), range(j1, j2), strict=True)
                )
                continue
            width = max(i2 - i1, j2 - j1)
            for k in range(width):
                la = a[i1 + k] if i1 + k < i2 else ""
                rb = b[j1 + k] if j1 + k < j2 else ""
                kind = "changed" if op == "replace" else ("removed" if op == "delete" else "added")
                if op == "replace" and i1 + k >= i2:
                    kind = "added"
                elif op == "replace" and j1 + k >= j2:
                    kind = "removed"
                rows.append((kind, la, rb))
        out.append(FieldDiff(name, LABELS[name], a == b, rows))
    return out
