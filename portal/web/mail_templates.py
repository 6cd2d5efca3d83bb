"""Mail templates: the editor with a live preview, the sandboxed HTML preview, attachments,
and Send test through the real delivery path.

What was previewed is what goes out. A test mail is accepted by ``templateId``, so delivery
renders the *saved* template (seed 000: a disabled one all the same); the Send test button is
therefore disabled while the editor has unsaved edits (static/app.js), and the server checks it
again: the send-test POST carries the whole editor form and the template's version, and is
refused when the version moved on or the form differs from what is saved.

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
import json
import logging
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import redis
from flask import (
    Blueprint,
    Response,
    abort,
    current_app,
    flash,
    redirect,
    render_template,
    request,
    url_for,
)
from flask.typing import ResponseReturnValue
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from werkzeug.exceptions import RequestEntityTooLarge

from portal.config import Settings
from portal.extensions import db
from portal.messaging import acceptance, templating
from portal.models import MailSendServerConfig, MailTemplate, Scope
from portal.redis_store import connect
from portal.tenancy import PLATFORM_TENANT_ID, new_trace_id, tenant_context
from portal.web.access import Permission, requires, user
from portal.web.forms import (
    Form,
    form_data,
    is_htmx,
    owned,
    record_url,
    tier_name,
    varies,
    viewed_tier,
)
from portal.web.security import sandboxed

bp = Blueprint("mail_templates", __name__, url_prefix="/mail-templates")
log = logging.getLogger(__name__)

LABELS = {
    "code": "Code",
    "name": "Name",
    "subject": "Subject",
    "html_body": "HTML body",
    "text_body": "Text body",
    "enabled": "Enabled",
    "priority": "Priority",
    "reply_to": "Reply-To",
    "preferred_server_id": "Preferred server",
    "variables": "Sample variables",
    "to": "Email address",
    "file": "Attachment",
}
EDITOR_FIELDS = (
    "code",
    "name",
    "subject",
    "html_body",
    "text_body",
    "enabled",
    "priority",
    "reply_to",
    "preferred_server_id",
)
PREVIEW_TTL_S = 1800
SAMPLE_TTL_S = 30 * 24 * 3600
_SLOT = re.compile(r"^[A-Za-z0-9_-]{8,32}$")
_SAFE_FILENAME = re.compile(r"^[^/\\\x00-\x1f\x7f]{1,255}$")
_CONTENT_TYPE = re.compile(r"^[A-Za-z0-9][\w.+-]*/[A-Za-z0-9][\w.+-]*$")
STALE = (
    "This template was saved again since you opened it (in another tab, or by someone else). "
    "Reload the page to see the saved version."
)
UNSAVED = (
    "You have unsaved changes. A test mail sends the saved template, so save first, "
    "then send the test."
)


def _settings() -> Settings:
    settings: Settings = current_app.config["SETTINGS"]
    return settings


# --- the editor's fields ---------------------------------------------------------------


@dataclass(frozen=True)
class Fields:
    """A template's editable fields, as the form parses them and as they are saved."""

    code: str
    name: str
    subject: str
    html_body: str | None
    text_body: str | None
    enabled: bool
    priority: int | None
    reply_to: str | None
    preferred_server_id: int | None


def _saved(template: MailTemplate) -> Fields:
    def body(value: str | None) -> str | None:
        value = (value or "").replace("\r\n", "\n")
        return value if value.strip() else None

    return Fields(
        code=template.code.strip(),
        name=(template.name or template.code).strip(),
        subject=(template.subject or "").strip(),
        html_body=body(template.html_body),
        text_body=body(template.text_body),
        enabled=template.enabled,
        priority=template.priority,
        reply_to=template.reply_to,
        preferred_server_id=template.preferred_server_id,
    )


def _servers(tier: int) -> list[MailSendServerConfig]:
    """The servers a template of this tier may prefer: its own tier's only."""
    return list(
        db.session.scalars(
            select(MailSendServerConfig)
            .where(MailSendServerConfig.tenant_id == tier)
            .order_by(MailSendServerConfig.name)
        )
    )


def _read(form: Form, tier: int, template_id: int | None) -> Fields | None:
    """Parse and check the editor's fields (compile errors with line and column)."""
    code = form.text("code", required=True, max_len=acceptance.MAX_CODE_CHARS)
    name = form.text("name", max_len=200)
    subject = form.text("subject", required=True, max_len=acceptance.MAX_SUBJECT_CHARS)
    limit = templating.DEFAULT_LIMITS.source_max_chars
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
        choices = {str(s.id): s.id for s in _servers(tier)}
        server_id = choices.get(raw_server)
        if server_id is None:
            form.fail("preferred_server_id", "must be one of this tier's mail servers")
    if code is not None and "code" not in form.errors:
        clash = db.session.scalar(
            select(MailTemplate.id).where(
                MailTemplate.tenant_id == tier,
                MailTemplate.code == code,
                MailTemplate.id != (template_id or 0),
            )
        )
        if clash is not None:
            form.fail("code", f"{code!r} is already used by another mail template")
    if not form.ok or code is None or subject is None:
        return None
    return Fields(
        code=code,
        name=name or code,
        subject=subject,
        html_body=html,
        text_body=text,
        enabled=form.flag("enabled"),
        priority=priority,
        reply_to=reply_to,
        preferred_server_id=server_id,
    )


def _apply(template: MailTemplate, fields: Fields) -> None:
    template.code = fields.code
    template.name = fields.name
    template.subject = fields.subject
    template.html_body = fields.html_body
    template.text_body = fields.text_body
    template.enabled = fields.enabled
    template.priority = fields.priority
    template.reply_to = fields.reply_to
    template.preferred_server_id = fields.preferred_server_id


def _form_of(template: MailTemplate) -> Form:
    return Form(
        form_data(
            code=template.code,
            name=template.name,
            subject=template.subject,
            html_body=template.html_body,
            text_body=template.text_body,
            enabled=template.enabled,
            priority=template.priority,
            reply_to=template.reply_to,
            preferred_server_id=template.preferred_server_id,
            variables=remembered_sample("mail", template.id)
            or sample_variables(template.subject, template.html_body, template.text_body),
        ),
        LABELS,
    )


# --- preview -----------------------------------------------------------------------------


@dataclass
class Preview:
    """What the preview panel shows; every problem is a message, never an exception."""

    subject: str | None = None
    html_url: str | None = None
    html_unavailable: bool = False
    text: str | None = None
    text_derived: bool = False
    variables: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def variables_used(parts: Sequence[tuple[str, str | None]]) -> tuple[list[str], list[str]]:
    """The names the (label, source) parts use, in order, and the errors of parts that do not
    parse."""
    names: dict[str, None] = {}
    errors = []
    for label, source in parts:
        if not source:
            continue
        try:
            names.update(dict.fromkeys(templating.variables_of(source)))
        except templating.TemplateRenderError as exc:
            errors.append(f"{label}: {exc}")
    return list(names), errors


def sample_variables(*sources: str | None) -> str:
    """Sample variables for a template: each name it uses, with a placeholder value."""
    names, _ = variables_used([("", source) for source in sources])
    return json.dumps({name: f"[{name}]" for name in names}, indent=2, ensure_ascii=False)


def remember_sample(kind: str, template_id: int, raw: str) -> None:
    """Keep the sample variables a user saved a template with, so the editor reopens with
    them (they are not part of the template). Best effort: Redis away, nothing is kept."""
    if len(raw) > templating.DEFAULT_LIMITS.variables_max_bytes:
        return
    try:
        connect(_settings().redis_url).set(
            f"sample:{user().id}:{kind}:{template_id}", raw.encode(), ex=SAMPLE_TTL_S
        )
    except redis.RedisError as exc:
        log.warning("sample variables not kept: %s", exc)


def remembered_sample(kind: str, template_id: int) -> str | None:
    """The sample variables kept by ``remember_sample``, if any."""
    try:
        raw = connect(_settings().redis_url).get(f"sample:{user().id}:{kind}:{template_id}")
    except redis.RedisError:
        return None
    return raw.decode() if isinstance(raw, bytes) else None


def _preview_key(slot: str) -> str:
    return f"mail-preview:{user().id}:{slot}"


def _store_html(slot: str, html: str) -> str | None:
    """Keep the rendered HTML for the iframe; None when Redis is away (no HTML preview)."""
    try:
        connect(_settings().redis_url).set(_preview_key(slot), html.encode(), ex=PREVIEW_TTL_S)
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
) -> Preview:
    """Render as preparation does (same functions, same order), reporting what fails."""
    preview = Preview()
    preview.variables, preview.errors = variables_used(
        [("Subject", subject), ("HTML body", html), ("Text body", text)]
    )
    if preview.errors:
        return preview
    form = Form({"variables": variables_raw}, LABELS)
    variables = form.json_object("variables")
    if variables is None:
        preview.errors.append(form.errors["variables"])
        return preview
    preview.missing = [name for name in preview.variables if name not in variables]
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
            rendered = templating.render(source, variables, html=is_html)
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


def _preview_of_form(form: Form, slot: str) -> Preview:
    return _preview(
        form.raw("subject") or None,
        form.raw("html_body").replace("\r\n", "\n") or None,
        form.raw("text_body").replace("\r\n", "\n") or None,
        form.raw("variables"),
        slot,
    )


# --- pages ---------------------------------------------------------------------------------


def _editor(
    template: MailTemplate | None,
    form: Form,
    *,
    status: int = 200,
    send_result: dict[str, Any] | None = None,
    attachment_error: str | None = None,
) -> tuple[str, int]:
    tier = template.tenant_id if template is not None else viewed_tier()
    slot = _slot(request.form.get("preview_slot"))
    return render_template(
        "mail_templates/edit.html",
        template=template,
        form=form,
        tier_name=tier_name(tier),
        server_options=[
            (str(s.id), s.name if s.enabled else f"{s.name} (disabled)") for s in _servers(tier)
        ],
        slot=slot,
        preview=_preview_of_form(form, slot),
        send=send_result or {},
        attachment_error=attachment_error,
        attachment_limit=_settings().attachment_max_bytes,
    ), status


@bp.get("/")
@requires(Permission.EDIT_TEMPLATES)
def index() -> str:
    """The viewed tier's mail templates."""
    tier = viewed_tier()
    templates = db.session.scalars(
        select(MailTemplate).where(MailTemplate.tenant_id == tier).order_by(MailTemplate.code)
    ).all()
    return render_template(
        "mail_templates/index.html", templates=templates, tier_name=tier_name(tier)
    )


@bp.get("/new")
@requires(Permission.EDIT_TEMPLATES)
def new() -> tuple[str, int]:
    """An empty editor."""
    return _editor(None, Form({"enabled": "on", "variables": "{}"}, LABELS))


@bp.post("/")
@requires(Permission.EDIT_TEMPLATES)
def create() -> ResponseReturnValue:
    """Save a new template in the viewed tier."""
    tier = viewed_tier()
    form = Form(request.form, LABELS)
    fields = _read(form, tier, None)
    if fields is None:
        return _editor(None, form, status=422)
    template = MailTemplate(tenant_id=tier, version=1, attachments=None)
    _apply(template, fields)
    db.session.add(template)
    try:
        db.session.commit()
    except IntegrityError:  # the same code saved by someone else a moment ago
        db.session.rollback()
        form.fail("code", "is already used by another mail template")
        return _editor(None, form, status=422)
    remember_sample("mail", template.id, form.raw("variables"))
    flash(f"Template {template.code!r} created.", "success")
    return redirect(url_for("mail_templates.edit", template_id=template.id), 303)


@bp.get("/<int:template_id>/edit")
@requires(Permission.EDIT_TEMPLATES)
def edit(template_id: int) -> tuple[str, int]:
    """The editor, with the saved template previewed."""
    template = owned(MailTemplate, template_id, viewed_tier())
    return _editor(template, _form_of(template))


@bp.post("/<int:template_id>")
@requires(Permission.EDIT_TEMPLATES)
def update(template_id: int) -> ResponseReturnValue:
    """Save the editor; refused when the template was saved elsewhere since it was opened."""
    template = owned(MailTemplate, template_id, viewed_tier())
    form = Form(request.form, LABELS)
    fields = _read(form, template.tenant_id, template.id)
    if form.raw("version") != str(template.version):
        form.errors["version"] = STALE
    if fields is None or not form.ok:
        return _editor(template, form, status=422)
    _apply(template, fields)
    template.version += 1
    try:
        db.session.commit()
    except IntegrityError:
        db.session.rollback()
        form.fail("code", "is already used by another mail template")
        return _editor(template, form, status=422)
    remember_sample("mail", template.id, form.raw("variables"))
    flash("Template saved.", "success")
    return redirect(url_for("mail_templates.edit", template_id=template.id), 303)


@bp.post("/preview")
@requires(Permission.EDIT_TEMPLATES)
def preview() -> str:
    """The preview panel for the editor's current input (renders, stores nothing but the
    HTML for its iframe)."""
    form = Form(request.form, LABELS)
    slot = _slot(request.form.get("preview_slot"))
    return render_template(
        "mail_templates/_preview.html", preview=_preview_of_form(form, slot), slot=slot
    )


@bp.get("/preview/<slot>")
@requires(Permission.EDIT_TEMPLATES)
def preview_html(slot: str) -> Response:
    """The rendered HTML of the last preview in one editor, for its sandboxed iframe."""
    if not _SLOT.match(slot):
        abort(404)
    try:
        html = connect(_settings().redis_url).get(_preview_key(slot))
    except redis.RedisError:
        abort(404)
    if html is None:
        abort(404)
    assert isinstance(html, bytes)
    return sandboxed(Response(html, mimetype="text/html"))


# --- send test -------------------------------------------------------------------------------


@bp.post("/<int:template_id>/send-test")
@requires(Permission.EDIT_TEMPLATES)
def send_test(template_id: int) -> ResponseReturnValue:
    """Accept a test mail of the saved template, by templateId, in the template's tier."""
    template = owned(MailTemplate, template_id, viewed_tier())
    form = Form(request.form, LABELS)
    problem = None
    if form.raw("version") != str(template.version):
        problem = STALE
    else:
        editor = Form(request.form, LABELS)
        fields = _read(editor, template.tenant_id, template.id)
        if fields is None:
            problem = "The editor has errors. Fix them and save, then send the test."
        elif fields != _saved(template):
            problem = UNSAVED
    to = form.email("to", required=True)
    variables = form.json_object("variables")
    result: dict[str, Any] = {"problem": problem, "errors": form.errors}
    if problem is None and to is not None and variables is not None:
        request_body = {
            "to": [to],
            "templateId": template.id,
            "variables": variables,
            "scope": (
                Scope.PLATFORM.value
                if template.tenant_id == PLATFORM_TENANT_ID
                else Scope.TENANT.value
            ),
        }
        try:
            with tenant_context(template.tenant_id, new_trace_id()):
                accepted = acceptance.send_mail(db.session(), request_body, settings=_settings())
            db.session.commit()
        except acceptance.AcceptanceError as exc:
            db.session.rollback()
            result["problem"] = f"The test was not accepted: {exc.message}"
        else:
            result = {
                "record_id": accepted.id,
                "to": to,
                "record_url": record_url("mail_records.show", accepted.id),
            }
    status = 200 if "record_id" in result else 422
    if is_htmx():
        html = render_template(
            "mail_templates/_send_test.html", template=template, form=form, send=result
        )
        return varies(Response(html, status))
    page, _ = _editor(template, form, status=status, send_result=result)
    return varies(Response(page, status))


# --- attachments -------------------------------------------------------------------------------


def _attachment_error(template: MailTemplate, message: str) -> tuple[str, int]:
    return _editor(template, _form_of(template), status=422, attachment_error=message)


def _decoded_size(attachments: list[dict[str, Any]]) -> int:
    return sum(len(str(a.get("content") or "")) * 3 // 4 for a in attachments)


@bp.post("/<int:template_id>/attachments")
@requires(Permission.EDIT_TEMPLATES)
def create_attachment(template_id: int) -> ResponseReturnValue:
    """Attach an uploaded file to the template (stored base64, within the size cap)."""
    template = owned(MailTemplate, template_id, viewed_tier())
    cap = _settings().attachment_max_bytes
    try:
        upload = request.files.get("file")
    except RequestEntityTooLarge:
        return _attachment_error(template, f"Attachment must be at most {cap:,} bytes")
    if upload is None or not upload.filename:
        return _attachment_error(template, "Attachment: choose a file to upload")
    name = upload.filename.replace("\\", "/").rsplit("/", 1)[-1].strip()
    if not _SAFE_FILENAME.match(name):
        return _attachment_error(template, "Attachment must have a plain file name")
    content_type = (upload.mimetype or "").lower()
    if not _CONTENT_TYPE.match(content_type):
        content_type = "application/octet-stream"
    existing = list(template.attachments or [])
    if len(existing) >= acceptance.MAX_ATTACHMENTS:
        return _attachment_error(
            template, f"Attachment: a template has at most {acceptance.MAX_ATTACHMENTS} files"
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
    encoded = base64.b64encode(data).decode("ascii")
    template.attachments = [
        *existing,
        {"name": name, "contentType": content_type, "content": encoded},
    ]
    template.version += 1
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
    removed = existing.pop(index)
    template.attachments = existing or None
    template.version += 1
    db.session.commit()
    flash(f"Removed {removed.get('name')}.", "success")
    return redirect(url_for("mail_templates.edit", template_id=template.id), 303)
