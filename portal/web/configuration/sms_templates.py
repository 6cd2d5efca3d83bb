"""SMS templates: the editor with a live preview, Send test, and provider bindings
(``template_pages`` holds what mail shares).

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
from dataclasses import dataclass
from typing import Any

from flask import flash, redirect, request, url_for
from flask.typing import ResponseReturnValue
from sqlalchemy import select

from portal.extensions import db
from portal.messaging.records import acceptance, addresses, validation
from portal.messaging.templating import rendering as templating
from portal.models import SmsProviderConfig, SmsTemplate, SmsTemplateProviderBinding
from portal.web.access import Permission, requires
from portal.web.configuration import config_pages, sms_providers, template_pages
from portal.web.configuration.template_pages import Kind, Preview, TestSend, editor, form_of
from portal.web.forms import Form, owned, owned_under, viewed_tier

LABELS = template_pages.LABELS | {"content": "Content", "phone": "Phone number"}
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


# --- fields ----------------------------------------------------------------------------------


def _read(form: Form, tier: int) -> dict[str, Any] | None:
    """SMS's one field: the content (a compile error with line and column)."""
    content = form.text("content", required=True, multiline=True, max_len=validation.MAX_SMS_CHARS)
    if content is not None:
        try:
            templating.compile_check(content, html=False)
        except templating.TemplateRenderError as exc:
            form.fail("content", f"has an error: {exc}")
    return {"content": content}


# --- preview -----------------------------------------------------------------------------------


@dataclass
class SmsPreview(Preview):
    text: str | None = None
    segments: Segments | None = None


def _render(content: str, variables_raw: str) -> SmsPreview:
    """Render the content as delivery would, reporting every problem as a message."""
    preview = SmsPreview()
    if not content.strip():
        return preview
    variables = preview.sample([("Content", content)], variables_raw)
    if variables is None:
        return preview
    try:
        # Stripped as delivery strips it: the count is of what goes out.
        preview.text = templating.render(content, variables, html=False, draft=True).strip()
    except templating.TemplateRenderError as exc:
        preview.errors.append(f"Content: {exc}")
        return preview
    preview.segments = segments(preview.text)
    if not preview.text.strip():
        preview.errors.append("The message comes out empty with these variables.")
    elif len(preview.text) > validation.MAX_SMS_CHARS:
        preview.errors.append(
            f"The message is {len(preview.text):,} characters; "
            f"at most {validation.MAX_SMS_CHARS:,} can be sent."
        )
    return preview


def _preview_of_form(form: Form) -> SmsPreview:
    return _render(form.raw("content").replace("\r\n", "\n"), form.raw("variables"))


# --- the editor page ---------------------------------------------------------------------------


def _bindings(template: SmsTemplate) -> list[tuple[SmsTemplateProviderBinding, str]]:
    rows = db.session.execute(
        select(SmsTemplateProviderBinding, SmsProviderConfig.name)
        .join(SmsProviderConfig, SmsProviderConfig.id == SmsTemplateProviderBinding.provider_id)
        .where(SmsTemplateProviderBinding.template_id == template.id)
        .order_by(SmsProviderConfig.name, SmsTemplateProviderBinding.country_code)
    ).all()
    return [(binding, name) for binding, name in rows]


def _context(template: SmsTemplate | None, tier: int) -> dict[str, Any]:
    return {
        "bindings": _bindings(template) if template is not None else [],
        "binding_form": Form({}, BINDING_LABELS),
        "provider_options": [
            (str(p.id), p.name) for p in config_pages.listed(sms_providers.PAGES, tier)
        ],
    }


# --- send test -------------------------------------------------------------------------------


def _test(template: SmsTemplate, form: Form) -> TestSend:
    """A test whose content is the previewed text; an enabled template's code goes along."""
    phone = form.text("phone", required=True, max_len=32)
    if phone is not None:
        try:
            phone, _country = addresses.parse_phone_number(phone, "phone")
        except addresses.AddressError as exc:
            form.fail("phone", exc.message.removeprefix("phone").strip())
    shown = _preview_of_form(form)
    problem = None
    if shown.errors:
        problem = "Fix the preview first: " + " ".join(shown.errors)
    elif shown.text is None:
        problem = "Write the content first."
    if phone is None or shown.text is None:
        return TestSend(None, phone, problem)
    body: dict[str, Any] = {"phoneNumber": phone, "content": shown.text}
    if template.enabled:
        body["templateCode"] = template.code
    return TestSend(body, phone, problem)


SMS = Kind(
    model=SmsTemplate,
    message_noun="SMS",
    labels=LABELS,
    fields=("content",),
    read=_read,
    preview=lambda form: {"preview": _preview_of_form(form)},
    context=_context,
    test=_test,
    accept=acceptance.send_sms,
)
bp = template_pages.blueprint(SMS, __name__)


# --- provider bindings -----------------------------------------------------------------------


@bp.post("/<int:template_id>/bindings")
@requires(Permission.EDIT_CONFIG)
def create_binding(template_id: int) -> ResponseReturnValue:
    """Bind the template to a provider (for one country, or any): external id and signature."""
    template = owned(SmsTemplate, template_id, viewed_tier())
    form = Form(request.form, BINDING_LABELS)
    provider_id = None
    choices = {
        str(p.id): p.id for p in config_pages.listed(sms_providers.PAGES, template.tenant_id)
    }
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
        return editor(SMS, template, form_of(SMS, template), status=422, binding_form=form)
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
    where = f"for {country}" if country else "for any country"
    template_pages.audit_save(SMS, template, f"bound to provider {provider_id} {where}")
    db.session.commit()
    flash("Binding added.", "success")
    return redirect(url_for("sms_templates.edit", template_id=template.id), 303)


@bp.post("/<int:template_id>/bindings/<int:binding_id>/delete")
@requires(Permission.EDIT_CONFIG)
def delete_binding(template_id: int, binding_id: int) -> ResponseReturnValue:
    """Remove one binding."""
    template = owned(SmsTemplate, template_id, viewed_tier())
    binding = owned_under(SmsTemplateProviderBinding, binding_id, template, "template_id")
    db.session.delete(binding)
    where = f"for {binding.country_code}" if binding.country_code else "for any country"
    template_pages.audit_save(SMS, template, f"unbound from provider {binding.provider_id} {where}")
    db.session.commit()
    flash("Binding removed.", "success")
    return redirect(url_for("sms_templates.edit", template_id=template.id), 303)
