"""Mail templates: the editor with a live preview, the sandboxed HTML preview, attachments,
and Send test through the real delivery path (``template_pages`` holds what SMS shares).

What was previewed is what goes out. A test mail is accepted by ``templateId`` (seed 000: a
disabled template all the same) and its record is pinned to the version the editor shows, so
delivery renders that version even if another is saved before the record is prepared. The
send-test POST carries the whole editor form and the template's version: unsaved edits are
saved first, through the dry run, and a test from an editor whose version moved on is refused.

The rendered HTML is tenant content, so it is never part of our own pages: the preview POST
stores it in Redis under a per-editor slot (one key per open editor, overwritten at each
keystroke, expiring after half an hour), and an ``<iframe sandbox>`` loads it from
``preview_html``, which answers with the sandboxing CSP (no scripts, no remote loads, inline
styles allowed). ``srcdoc`` would inherit this page's CSP, which forbids the inline styles mail
HTML depends on, so the preview would not look like the mail.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import re
import secrets
from dataclasses import dataclass
from typing import Any

import redis
from flask import Response, abort, flash, redirect, request, url_for
from flask.typing import ResponseReturnValue
from werkzeug.exceptions import RequestEntityTooLarge

from portal.extensions import db
from portal.messaging.records import acceptance, validation
from portal.messaging.templating import rendering as templating
from portal.messaging.templating import versions as template_versions
from portal.models import MailTemplate
from portal.redis_store import connect
from portal.web.access import Permission, requires, user
from portal.web.configuration import config_pages, mail_servers, template_pages
from portal.web.configuration.template_pages import (
    STALE,
    Kind,
    Preview,
    TestSend,
    editor,
    form_of,
    settings,
)
from portal.web.forms import Form, owned, viewed_tier
from portal.web.security import sandboxed

log = logging.getLogger(__name__)

LABELS = template_pages.LABELS | {
    "subject": "Subject",
    "html_body": "HTML body",
    "text_body": "Text body",
    "priority": "Priority",
    "reply_to": "Reply-To",
    "preferred_server_id": "Preferred server",
    "to": "Email address",
    "file": "Attachment",
}
PREVIEW_TTL_S = 1800
_SLOT = re.compile(r"^[A-Za-z0-9_-]{8,32}$")


# --- the editor's fields ---------------------------------------------------------------


def _read(form: Form, tier: int) -> dict[str, Any] | None:
    """Mail's fields: the subject and bodies (compile errors with line and column), priority,
    Reply-To and preferred server."""
    subject = form.text("subject", required=True, max_len=validation.MAX_SUBJECT_CHARS)
    limit = templating.configured_limits().source_max_chars
    html = form.text("html_body", multiline=True, max_len=limit)
    text = form.text("text_body", multiline=True, max_len=limit)
    if html is None and text is None and not {"html_body", "text_body"} & set(form.errors):
        form.fail("html_body", "or a text body is required")
    for part, source, is_html in (
        ("subject", subject, False),
        ("html_body", html, True),
        ("text_body", text, False),
    ):
        if source is not None:
            try:
                templating.compile_check(source, html=is_html)
            except templating.TemplateRenderError as exc:
                form.fail(part, f"has an error: {exc}")
    priority = form.number("priority", lo=1, hi=5)
    reply_to = form.email("reply_to")
    server_id = None
    raw_server = form.raw("preferred_server_id").strip()
    if raw_server:
        choices = {str(s.id): s.id for s in config_pages.listed(mail_servers.PAGES, tier)}
        server_id = choices.get(raw_server)
        if server_id is None:
            form.fail("preferred_server_id", "must be one of this tier's mail servers")
    if subject is None:
        return None
    return {
        "subject": subject,
        "html_body": html,
        "text_body": text,
        "priority": priority,
        "reply_to": reply_to,
        "preferred_server_id": server_id,
    }


def _saved(template: MailTemplate) -> dict[str, Any]:
    """The saved template as ``template_pages.read`` reads its editor."""

    def body(value: str | None) -> str | None:
        value = (value or "").replace("\r\n", "\n")
        return value if value.strip() else None

    return {
        "code": template.code.strip(),
        "name": (template.name or template.code).strip(),
        "enabled": template.enabled,
        "strict_variables": template.strict_variables,
        "subject": (template.subject or "").strip(),
        "html_body": body(template.html_body),
        "text_body": body(template.text_body),
        "priority": template.priority,
        "reply_to": template.reply_to,
        "preferred_server_id": template.preferred_server_id,
    }


def _context(template: MailTemplate | None, tier: int) -> dict[str, Any]:
    return {
        "server_options": [
            (str(s.id), s.name if s.enabled else f"{s.name} (disabled)")
            for s in config_pages.listed(mail_servers.PAGES, tier)
        ],
        "attachment_error": None,
        "attachment_limit": settings().attachment_max_bytes,
    }


# --- preview -----------------------------------------------------------------------------


@dataclass
class MailPreview(Preview):
    subject: str | None = None
    html_url: str | None = None
    html_unavailable: bool = False
    text: str | None = None
    text_derived: bool = False


def _preview_key(slot: str) -> str:
    return f"mail-preview:{user().id}:{slot}"


def _store_html(slot: str, html: str) -> str | None:
    """Keep the rendered HTML for the iframe; None when Redis is away (no HTML preview)."""
    try:
        connect(settings().redis_url).set(_preview_key(slot), html.encode(), ex=PREVIEW_TTL_S)
    except redis.RedisError as exc:
        log.warning("HTML preview not stored: %s", exc)
        return None
    version = hashlib.sha256(html.encode()).hexdigest()[:12]
    return url_for("mail_templates.preview_html", slot=slot, v=version)


def _preview(
    subject: str | None,
    html: str | None,
    text: str | None,
    variables_raw: str,
    slot: str,
) -> MailPreview:
    """Render as preparation does (same functions, same order), reporting what fails."""
    preview = MailPreview()
    variables = preview.sample(
        [("Subject", subject), ("HTML body", html), ("Text body", text)], variables_raw
    )
    if variables is None:
        return preview
    try:
        templating.validate_variables(variables)
    except templating.TemplateRenderError as exc:
        preview.errors.append(f"Sample variables: {exc}")
        return preview
    rendered_html = None
    for label, source, is_html in (
        ("Subject", subject, False),
        ("HTML body", html, True),
        ("Text body", text, False),
    ):
        if not source:
            continue
        try:
            rendered = templating.render(source, variables, html=is_html, draft=True)
        except templating.TemplateRenderError as exc:
            preview.errors.append(f"{label}: {exc}")
            continue
        if label == "Subject":
            preview.subject = " ".join(rendered.split())
        elif is_html:
            rendered_html = rendered
            preview.html_url = _store_html(slot, rendered)
            preview.html_unavailable = preview.html_url is None
        else:
            preview.text = rendered
    if rendered_html and not preview.text and not preview.errors:
        # As preparation does: an HTML mail without a text part gets one made from the HTML.
        preview.text = templating.html_to_text(rendered_html)
        preview.text_derived = True
    return preview


def _slot(raw: str | None) -> str:
    return raw if raw and _SLOT.match(raw) else secrets.token_urlsafe(12)


def _preview_panel(form: Form) -> dict[str, Any]:
    """The preview of the editor's input, and the slot its HTML is kept under."""
    slot = _slot(form.raw("preview_slot"))
    preview = _preview(
        form.raw("subject") or None,
        form.raw("html_body").replace("\r\n", "\n") or None,
        form.raw("text_body").replace("\r\n", "\n") or None,
        form.raw("variables"),
        slot,
    )
    return {"preview": preview, "slot": slot}


# --- send test -------------------------------------------------------------------------------


def _test(template: MailTemplate, form: Form) -> TestSend:
    """A test of the template by templateId, pinned to the version the editor shows; with
    unsaved edits the page saves them first (``template_pages.send_test``)."""
    problem = None
    unsaved = False
    if form.raw("version") != str(template.version):
        problem = STALE
    else:
        values = template_pages.read(MAIL, Form(form.data, LABELS), template.tenant_id, template.id)
        if values is None:
            problem = "The editor has errors. Fix them, then send the test."
        elif values != _saved(template) or template_pages.read_stream(form) != template.stream:
            unsaved = True
    to = form.email("to", required=True)
    variables = form.json_object("variables")
    if to is None or variables is None:
        return TestSend(None, to, problem)
    return TestSend(
        {"to": [to], "templateId": template.id, "variables": variables},
        to,
        problem,
        version=template.version,
        unsaved=unsaved,
    )


MAIL = Kind(
    model=MailTemplate,
    message_noun="mail",
    labels=LABELS,
    fields=("subject", "html_body", "text_body", "priority", "reply_to", "preferred_server_id"),
    read=_read,
    preview=_preview_panel,
    context=_context,
    test=_test,
    accept=acceptance.send_mail,
)
bp = template_pages.blueprint(MAIL, __name__)


@bp.get("/preview/<slot>")
@requires(Permission.EDIT_TEMPLATES)
def preview_html(slot: str) -> Response:
    """The rendered HTML of the last preview in one editor, for its sandboxed iframe."""
    if not _SLOT.match(slot):
        abort(404)
    try:
        html = connect(settings().redis_url).get(_preview_key(slot))
    except redis.RedisError:
        abort(404)
    if html is None:
        abort(404)
    assert isinstance(html, bytes)
    return sandboxed(Response(html, mimetype="text/html"))


# --- attachments -------------------------------------------------------------------------------


def _attachment_error(template: MailTemplate, message: str) -> tuple[str, int]:
    return editor(MAIL, template, form_of(MAIL, template), status=422, attachment_error=message)


def _decoded_size(attachments: list[dict[str, Any]]) -> int:
    return sum(len(str(a.get("content") or "")) * 3 // 4 for a in attachments)


@bp.post("/<int:template_id>/attachments")
@requires(Permission.EDIT_TEMPLATES)
def create_attachment(template_id: int) -> ResponseReturnValue:
    """Attach an uploaded file to the template (stored base64, within the size cap)."""
    template = owned(MailTemplate, template_id, viewed_tier())
    cap = settings().attachment_max_bytes
    try:
        upload = request.files.get("file")
    except RequestEntityTooLarge:
        return _attachment_error(template, f"Attachment must be at most {cap:,} bytes")
    if upload is None or not upload.filename:
        return _attachment_error(template, "Attachment: choose a file to upload")
    name = upload.filename.replace("\\", "/").rsplit("/", 1)[-1].strip()
    if not validation.SAFE_FILENAME.match(name):
        return _attachment_error(template, "Attachment must have a plain file name")
    content_type = (upload.mimetype or "").lower()
    if not validation.CONTENT_TYPE.match(content_type):
        content_type = "application/octet-stream"
    existing = list(template.attachments or [])
    if len(existing) >= validation.MAX_ATTACHMENTS:
        return _attachment_error(
            template, f"Attachment: a template has at most {validation.MAX_ATTACHMENTS} files"
        )
    if any(a.get("name") == name for a in existing):
        return _attachment_error(template, f"Attachment {name!r} is already attached")
    data = upload.stream.read(cap + 1)
    if not data:
        return _attachment_error(template, "Attachment: the file is empty")
    used = _decoded_size(existing)
    if used + len(data) > cap:
        return _attachment_error(
            template,
            f"Attachment is too large: the template's files may total {cap:,} bytes "
            f"and {used:,} are used",
        )
    template_versions.ensure_saved(db.session(), template)
    encoded = base64.b64encode(data).decode("ascii")
    template.attachments = [
        *existing,
        {"name": name, "contentType": content_type, "content": encoded},
    ]
    template.version += 1
    template_pages.audit_save(MAIL, template, f"saved, attachment {name!r} added")
    db.session.commit()
    flash(f"Attached {name}.", "success")
    return redirect(url_for("mail_templates.edit", template_id=template.id), 303)


@bp.post("/<int:template_id>/attachments/<int:index>/delete")
@requires(Permission.EDIT_TEMPLATES)
def delete_attachment(template_id: int, index: int) -> ResponseReturnValue:
    """Remove one attached file."""
    template = owned(MailTemplate, template_id, viewed_tier())
    existing = list(template.attachments or [])
    if not 0 <= index < len(existing):
        abort(404)
    template_versions.ensure_saved(db.session(), template)
    removed = existing.pop(index)
    template.attachments = existing or None
    template.version += 1
    template_pages.audit_save(MAIL, template, f"saved, attachment {removed.get('name')!r} removed")
    db.session.commit()
    flash(f"Removed {removed.get('name')}.", "success")
    return redirect(url_for("mail_templates.edit", template_id=template.id), 303)
