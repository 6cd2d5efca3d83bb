"""SMS templates: the editor with a live preview, Send test, and provider bindings.

An SMS template is only ever resolved by code among enabled templates (seed 000), so a test
cannot name the template row the way a mail test does. Instead the text previewed is the text
sent: the send-test POST carries the editor's content and sample variables, the server renders
them exactly as the preview did and accepts an SMS with that text as its ``content`` (saved or
not). When the saved template is enabled its code goes along too, so delivery applies the
template's provider bindings (external template id, signature); a disabled template's test
goes out as plain content.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

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

from portal.config import Settings
from portal.extensions import db
from portal.messaging import acceptance, templating
from portal.models import Scope, SmsProviderConfig, SmsTemplate, SmsTemplateProviderBinding
from portal.tenancy import PLATFORM_TENANT_ID, new_trace_id, tenant_context
from portal.web.access import Permission, requires
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
from portal.web.mail_templates import (
    STALE,
    remember_sample,
    remembered_sample,
    sample_variables,
    variables_used,
)

bp = Blueprint("sms_templates", __name__, url_prefix="/sms-templates")

LABELS = {
    "code": "Code",
    "name": "Name",
    "content": "Content",
    "enabled": "Enabled",
    "variables": "Sample variables",
    "phone": "Phone number",
}
BINDING_LABELS = {
    "provider_id": "Provider",
    "country": "Country",
    "external_template_id": "External template id",
    "signature": "Signature",
}

# GSM 03.38: the basic set counts one unit a character, the extension set two; anything else
# sends the whole message as UCS-2, which fits far fewer characters in a segment.
_GSM_BASIC = set(
    "@£$¥èéùìòÇ\nØø\rÅåΔ_ΦΓΛΩΠΨΣΘΞÆæßÉ !\"#¤%&'()*+,-./0123456789:;<=>?"
    "¡ABCDEFGHIJKLMNOPQRSTUVWXYZÄÖÑÜ§¿abcdefghijklmnopqrstuvwxyzäöñüà"
)
_GSM_EXTENDED = set("^{}\\[~]|€\f")


@dataclass(frozen=True)
class Segments:
    encoding: str
    characters: int
    count: int


def segments(text: str) -> Segments:
    """How many SMS segments ``text`` takes, and in which encoding."""
    if all(c in _GSM_BASIC or c in _GSM_EXTENDED for c in text):
        units = sum(2 if c in _GSM_EXTENDED else 1 for c in text)
        single, part, encoding = 160, 153, "GSM-7"
    else:
        units = len(text.encode("utf-16-le")) // 2
        single, part, encoding = 70, 67, "UCS-2 (Unicode)"
    count = 0 if units == 0 else 1 if units <= single else math.ceil(units / part)
    return Segments(encoding, len(text), count)


def _settings() -> Settings:
    settings: Settings = current_app.config["SETTINGS"]
    return settings


# --- fields ----------------------------------------------------------------------------------


def _read(form: Form, tier: int, template_id: int | None) -> dict[str, Any] | None:
    code = form.text("code", required=True, max_len=acceptance.MAX_CODE_CHARS)
    name = form.text("name", max_len=200)
    content = form.text("content", required=True, multiline=True, max_len=acceptance.MAX_SMS_CHARS)
    if content is not None:
        try:
            templating.compile_check(content, html=False)
        except templating.TemplateRenderError as exc:
            form.fail("content", f"has an error: {exc}")
    if code is not None and "code" not in form.errors:
        clash = db.session.scalar(
            select(SmsTemplate.id).where(
                SmsTemplate.tenant_id == tier,
                SmsTemplate.code == code,
                SmsTemplate.id != (template_id or 0),
            )
        )
        if clash is not None:
            form.fail("code", f"{code!r} is already used by another SMS template")
    if not form.ok or code is None:
        return None
    return {"code": code, "name": name or code, "content": content, "enabled": form.flag("enabled")}


def _form_of(template: SmsTemplate) -> Form:
    return Form(
        form_data(
            code=template.code,
            name=template.name,
            content=template.content,
            enabled=template.enabled,
            variables=remembered_sample("sms", template.id) or sample_variables(template.content),
        ),
        LABELS,
    )


# --- preview -----------------------------------------------------------------------------------


@dataclass
class Preview:
    text: str | None = None
    segments: Segments | None = None
    variables: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def _render(content: str, variables_raw: str) -> Preview:
    """Render the content as delivery would, reporting every problem as a message."""
    preview = Preview()
    preview.variables, preview.errors = variables_used([("Content", content)])
    if preview.errors or not content.strip():
        return preview
    form = Form({"variables": variables_raw}, LABELS)
    variables = form.json_object("variables")
    if variables is None:
        preview.errors.append(form.errors["variables"])
        return preview
    preview.missing = [name for name in preview.variables if name not in variables]
    try:
        # Stripped as delivery strips it: the count is of what goes out.
        preview.text = templating.render(content, variables, html=False).strip()
    except templating.TemplateRenderError as exc:
        preview.errors.append(f"Content: {exc}")
        return preview
    preview.segments = segments(preview.text)
    if not preview.text.strip():
        preview.errors.append("The message comes out empty with these variables.")
    elif len(preview.text) > acceptance.MAX_SMS_CHARS:
        preview.errors.append(
            f"The message is {len(preview.text):,} characters; "
            f"at most {acceptance.MAX_SMS_CHARS:,} can be sent."
        )
    return preview


def _preview_of_form(form: Form) -> Preview:
    return _render(form.raw("content").replace("\r\n", "\n"), form.raw("variables"))


# --- pages -------------------------------------------------------------------------------------


def _bindings(template: SmsTemplate) -> list[tuple[SmsTemplateProviderBinding, str]]:
    rows = db.session.execute(
        select(SmsTemplateProviderBinding, SmsProviderConfig.name)
        .join(SmsProviderConfig, SmsProviderConfig.id == SmsTemplateProviderBinding.provider_id)
        .where(SmsTemplateProviderBinding.template_id == template.id)
        .order_by(SmsProviderConfig.name, SmsTemplateProviderBinding.country_code)
    ).all()
    return [(binding, name) for binding, name in rows]


def _providers(tier: int) -> list[SmsProviderConfig]:
    return list(
        db.session.scalars(
            select(SmsProviderConfig)
            .where(SmsProviderConfig.tenant_id == tier)
            .order_by(SmsProviderConfig.name)
        )
    )


def _editor(
    template: SmsTemplate | None,
    form: Form,
    *,
    status: int = 200,
    send_result: dict[str, Any] | None = None,
    binding_form: Form | None = None,
) -> tuple[str, int]:
    tier = template.tenant_id if template is not None else viewed_tier()
    return render_template(
        "sms_templates/edit.html",
        template=template,
        form=form,
        tier_name=tier_name(tier),
        preview=_preview_of_form(form),
        send=send_result or {},
        bindings=_bindings(template) if template is not None else [],
        binding_form=binding_form or Form({}, BINDING_LABELS),
        provider_options=[(str(p.id), p.name) for p in _providers(tier)],
    ), status


@bp.get("/")
@requires(Permission.EDIT_TEMPLATES)
def index() -> str:
    """The viewed tier's SMS templates."""
    tier = viewed_tier()
    templates = db.session.scalars(
        select(SmsTemplate).where(SmsTemplate.tenant_id == tier).order_by(SmsTemplate.code)
    ).all()
    return render_template(
        "sms_templates/index.html", templates=templates, tier_name=tier_name(tier)
    )


@bp.get("/new")
@requires(Permission.EDIT_TEMPLATES)
def new() -> tuple[str, int]:
    """An empty editor."""
    return _editor(None, Form({"enabled": "on", "variables": "{}"}, LABELS))


@bp.post("/")
@requires(Permission.EDIT_TEMPLATES)
def create() -> ResponseReturnValue:
    """Save a new SMS template in the viewed tier."""
    tier = viewed_tier()
    form = Form(request.form, LABELS)
    values = _read(form, tier, None)
    if values is None:
        return _editor(None, form, status=422)
    template = SmsTemplate(tenant_id=tier, version=1, **values)
    db.session.add(template)
    try:
        db.session.commit()
    except IntegrityError:
        db.session.rollback()
        form.fail("code", "is already used by another SMS template")
        return _editor(None, form, status=422)
    remember_sample("sms", template.id, form.raw("variables"))
    flash(f"Template {template.code!r} created.", "success")
    return redirect(url_for("sms_templates.edit", template_id=template.id), 303)


@bp.get("/<int:template_id>/edit")
@requires(Permission.EDIT_TEMPLATES)
def edit(template_id: int) -> tuple[str, int]:
    """The editor, with the saved template previewed."""
    template = owned(SmsTemplate, template_id, viewed_tier())
    return _editor(template, _form_of(template))


@bp.post("/<int:template_id>")
@requires(Permission.EDIT_TEMPLATES)
def update(template_id: int) -> ResponseReturnValue:
    """Save the editor; refused when the template was saved elsewhere since it was opened."""
    template = owned(SmsTemplate, template_id, viewed_tier())
    form = Form(request.form, LABELS)
    values = _read(form, template.tenant_id, template.id)
    if form.raw("version") != str(template.version):
        form.errors["version"] = STALE
    if values is None or not form.ok:
        return _editor(template, form, status=422)
    for key, value in values.items():
        setattr(template, key, value)
    template.version += 1
    try:
        db.session.commit()
    except IntegrityError:
        db.session.rollback()
        form.fail("code", "is already used by another SMS template")
        return _editor(template, form, status=422)
    remember_sample("sms", template.id, form.raw("variables"))
    flash("Template saved.", "success")
    return redirect(url_for("sms_templates.edit", template_id=template.id), 303)


@bp.post("/preview")
@requires(Permission.EDIT_TEMPLATES)
def preview() -> str:
    """The preview panel for the editor's current input (renders, stores nothing)."""
    form = Form(request.form, LABELS)
    return render_template("sms_templates/_preview.html", preview=_preview_of_form(form))


@bp.post("/<int:template_id>/send-test")
@requires(Permission.EDIT_TEMPLATES)
def send_test(template_id: int) -> ResponseReturnValue:
    """Accept a test SMS whose content is the previewed text, in the template's tier."""
    template = owned(SmsTemplate, template_id, viewed_tier())
    form = Form(request.form, LABELS)
    phone = form.text("phone", required=True, max_len=32)
    if phone is not None:
        try:
            phone, _country = acceptance.parse_phone_number(phone, "phone")
        except acceptance.AcceptanceError as exc:
            form.fail("phone", exc.message.removeprefix("phone").strip())
    shown = _preview_of_form(form)
    result: dict[str, Any] = {"errors": form.errors}
    if shown.errors:
        result["problem"] = "Fix the preview first: " + " ".join(shown.errors)
    elif shown.text is None:
        result["problem"] = "Write the content first."
    if phone is not None and form.ok and "problem" not in result and shown.text is not None:
        body: dict[str, Any] = {
            "phoneNumber": phone,
            "content": shown.text,
            "scope": (
                Scope.PLATFORM.value
                if template.tenant_id == PLATFORM_TENANT_ID
                else Scope.TENANT.value
            ),
        }
        if template.enabled:
            body["templateCode"] = template.code
        try:
            with tenant_context(template.tenant_id, new_trace_id()):
                accepted = acceptance.send_sms(db.session(), body, settings=_settings())
            db.session.commit()
        except acceptance.AcceptanceError as exc:
            db.session.rollback()
            result["problem"] = f"The test was not accepted: {exc.message}"
        else:
            result = {
                "record_id": accepted.id,
                "to": phone,
                "record_url": record_url("sms_records.show", accepted.id),
            }
    status = 200 if "record_id" in result else 422
    if is_htmx():
        html = render_template(
            "sms_templates/_send_test.html", template=template, form=form, send=result
        )
        return varies(Response(html, status))
    page, _ = _editor(template, form, status=status, send_result=result)
    return varies(Response(page, status))


# --- provider bindings -----------------------------------------------------------------------


@bp.post("/<int:template_id>/bindings")
@requires(Permission.EDIT_CONFIG)
def create_binding(template_id: int) -> ResponseReturnValue:
    """Bind the template to a provider (for one country, or any): external id and signature."""
    template = owned(SmsTemplate, template_id, viewed_tier())
    form = Form(request.form, BINDING_LABELS)
    provider_id = None
    choices = {str(p.id): p.id for p in _providers(template.tenant_id)}
    raw = form.raw("provider_id").strip()
    if not raw:
        form.fail("provider_id", "is required")
    elif raw not in choices:
        form.fail("provider_id", "must be one of this tier's SMS providers")
    else:
        provider_id = choices[raw]
    country = form.country("country")
    external_id = form.text("external_template_id", max_len=200)
    signature = form.text("signature", max_len=200)
    if provider_id is not None and form.ok:
        clash = db.session.scalar(
            select(SmsTemplateProviderBinding.id).where(
                SmsTemplateProviderBinding.template_id == template.id,
                SmsTemplateProviderBinding.provider_id == provider_id,
                SmsTemplateProviderBinding.country_code.is_(None)
                if country is None
                else SmsTemplateProviderBinding.country_code == country,
            )
        )
        if clash is not None:
            form.fail("country", "already has a binding for this provider; remove it first")
    if not form.ok or provider_id is None:
        return _editor(template, _form_of(template), status=422, binding_form=form)
    db.session.add(
        SmsTemplateProviderBinding(
            tenant_id=template.tenant_id,
            template_id=template.id,
            provider_id=provider_id,
            country_code=country,
            external_template_id=external_id,
            signature=signature,
        )
    )
    db.session.commit()
    flash("Binding added.", "success")
    return redirect(url_for("sms_templates.edit", template_id=template.id), 303)


@bp.post("/<int:template_id>/bindings/<int:binding_id>/delete")
@requires(Permission.EDIT_CONFIG)
def delete_binding(template_id: int, binding_id: int) -> ResponseReturnValue:
    """Remove one binding."""
    template = owned(SmsTemplate, template_id, viewed_tier())
    binding = owned(SmsTemplateProviderBinding, binding_id, template.tenant_id)
    if binding.template_id != template.id:
        abort(404)
    db.session.delete(binding)
    db.session.commit()
    flash("Binding removed.", "success")
    return redirect(url_for("sms_templates.edit", template_id=template.id), 303)
