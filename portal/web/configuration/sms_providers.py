"""SMS providers: the accounts a tier sends SMS through, their routes by country, and a
credential check.

Secrets (the auth token and the webhook secret) are write-only, as mail server passwords are;
one that can no longer be decrypted (SECRET_KEY changed) is said so, and a new one replaces it.
The edit page shows where the provider posts its delivery events and how they are signed, naming
the stored secret that checks them (never showing it).
A provider that send records point at is never deleted, only disabled; Delete (and removing a
route) first shows a confirm page saying what would change, with the count of Pending/Retry SMS
prepared for the provider. Routes say which
providers may carry SMS to a country, lower priority first; a country with routes never falls
back to the default provider.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import quote

from flask import Blueprint, flash, redirect, request, url_for
from flask.typing import ResponseReturnValue
from sqlalchemy import select

from portal.extensions import db
from portal.importer import dedupes, default_uncertain_policy
from portal.messaging.sending import outbound
from portal.messaging.sending.transports.sms import CONFIG_ERROR, SmsResult, _http, twilio, vonage
from portal.models import (
    AuditAction,
    SmsProviderConfig,
    SmsProviderKind,
    SmsProviderRegion,
    SmsSendRecord,
    UncertainPolicy,
)
from portal.models.secretbox import SecretUnavailable
from portal.web.access import Permission, audit, requires
from portal.web.configuration import config_pages
from portal.web.forms import (
    MAX_INT,
    Form,
    owned,
    owned_under,
    replace_secret,
    settings,
    viewed_tier,
)
from portal.web.machine.webhooks import SIGNATURE_HEADER

bp = Blueprint("sms_providers", __name__, url_prefix="/sms-providers")

LABELS = {
    "name": "Name",
    "provider": "Provider",
    "base_url": "Base URL",
    "account_id": "Account id",
    "secret": "Auth token",
    "webhook_secret": "Webhook secret",
    "sender_id": "Sender",
    "is_default": "Default provider of this tier",
    "enabled": "Enabled",
    "daily_send_limit": "Daily send limit",
    "rate_limit_per_minute": "Per-minute send limit",
    "retry_window_s": "Retry window (seconds)",
    "uncertain_policy": "When a send's outcome is uncertain",
}
ROUTE_LABELS = {"country": "Country", "priority": "Priority"}
KIND_OPTIONS = [
    (SmsProviderKind.TWILIO.value, "Twilio"),
    (SmsProviderKind.VONAGE.value, "Vonage"),
    (SmsProviderKind.HTTP_JSON.value, "Generic HTTP JSON"),
    (SmsProviderKind.TEST.value, "Test (sends nothing)"),
]
UNCERTAIN_OPTIONS = [
    ("", "The provider's default: hold for Twilio and Vonage, retry for the others"),
    (UncertainPolicy.RETRY.value, "Retry (may deliver twice where the provider cannot dedupe)"),
    (UncertainPolicy.HOLD.value, "Hold for a person to decide (Uncertain, never resent)"),
]
# What the policy means, for the form and the list, in words.
POLICY_TEXT = {
    UncertainPolicy.RETRY.value: "retried as usual: a keyed provider drops the duplicate, one "
    "without keys may deliver it twice",
    UncertainPolicy.HOLD.value: "held as Uncertain, never resent: a person checks with the "
    "provider and resolves it",
}


def _read(form: Form, provider: SmsProviderConfig, tier: int) -> bool:
    """Check the form and copy it onto ``provider``; False when it has errors."""
    name = form.text("name", required=True, max_len=200)
    kind = form.choice("provider", [k.value for k in SmsProviderKind])
    base_url = form.url("base_url")
    account_id = form.text("account_id", max_len=200)
    secret = form.text("secret", max_len=500)
    webhook_secret = form.text("webhook_secret", max_len=500)
    sender_id = form.text("sender_id", max_len=64)
    daily = form.number("daily_send_limit")
    per_minute = form.number("rate_limit_per_minute")
    window = form.number("retry_window_s", lo=60)
    policy = form.choice("uncertain_policy", ["", *(p.value for p in UncertainPolicy)], "")
    if kind == SmsProviderKind.HTTP_JSON.value and not base_url and "base_url" not in form.errors:
        form.fail("base_url", "is required for a generic HTTP JSON provider")
    if base_url and "base_url" not in form.errors:
        allowed = outbound.allows_private(settings(), tier)
        problem = outbound.url_problem_at_save(base_url, allow_private=allowed)
        if problem:
            form.fail("base_url", f"cannot be used: {problem}")
    config_pages.check_name(PAGES, form, provider, tier, name)
    if not form.ok:
        return False
    assert name is not None
    provider.tenant_id = tier
    provider.name = name
    provider.provider = kind
    provider.base_url = base_url
    provider.account_id = account_id
    replace_secret(form, provider, "secret", secret)
    replace_secret(form, provider, "webhook_secret", webhook_secret)
    provider.sender_id = sender_id
    provider.is_default = form.flag("is_default")
    provider.enabled = form.flag("enabled")
    provider.daily_send_limit = daily
    provider.rate_limit_per_minute = per_minute
    provider.retry_window_s = float(window) if window is not None else None
    provider.uncertain_policy = policy or default_uncertain_policy(kind)
    return True


def _shown(provider: SmsProviderConfig) -> dict[str, object]:
    """The retry window as the form takes it: whole seconds."""
    window = provider.retry_window_s
    return {"retry_window_s": int(window) if window is not None else None}


def _routes(provider: SmsProviderConfig) -> list[SmsProviderRegion]:
    return list(
        db.session.scalars(
            select(SmsProviderRegion)
            .where(SmsProviderRegion.provider_id == provider.id)
            .order_by(SmsProviderRegion.country_code)
        )
    )


# --- delivery events ---------------------------------------------------------------------------

# What each kind's provider posts to the webhook, and how webhooks.py checks its signature: the
# provider's own scheme keyed by one of the config's stored secrets (the form field named here),
# or ours (X-Postroom-Signature) keyed by the stored webhook secret. None of them is derived, so
# the page names the field and never shows its value.
WEBHOOK_TEXTS: dict[str, tuple[str, str, str]] = {
    SmsProviderKind.TWILIO.value: (
        "Set this URL as the status callback (StatusCallback) of the messages or of the "
        "Messaging Service: Twilio posts each status change here (delivered, undelivered, "
        "failed).",
        "Twilio signs each request itself: X-Twilio-Signature, an HMAC-SHA1 of this exact URL "
        "and the posted parameters, keyed by the account's auth token. Use the URL exactly as "
        "shown: a different host or scheme changes what is signed.",
        "secret",
    ),
    SmsProviderKind.VONAGE.value: (
        "Set this URL as the delivery receipt URL (SMS API, GET or POST) or the status URL "
        "(Messages API) in the Vonage dashboard, with signed webhooks turned on.",
        "Vonage signs each request itself with the account's signature secret: SMS API "
        "receipts carry a sig parameter (MD5 hash or HMAC, as chosen in the dashboard) with a "
        "timestamp that must be within 5 minutes; Messages API webhooks carry a bearer JWT "
        "(HS256). Enter that signature secret as this provider's webhook secret.",
        "webhook_secret",
    ),
}
GENERIC_WEBHOOK_TEXTS = (
    "Have the provider post delivery events here as JSON: one event or a list of up to 100, "
    "each with eventId, messageId, recipient, event (delivered, bounced, complained), "
    "bounceType, code, description and timestamp. Events about unknown message ids are kept "
    "until the id is written.",
    f"Sign each request with this provider's webhook secret: hex HMAC-SHA256 of the raw body, "
    f"sent in the {SIGNATURE_HEADER} header (a sha256= prefix is allowed).",
    "webhook_secret",
)


def stored_state(provider: SmsProviderConfig, name: str) -> str:
    """``stored``, ``missing`` or ``unreadable`` (SECRET_KEY changed) for a secret field."""
    try:
        value = provider.secret if name == "secret" else provider.webhook_secret
    except SecretUnavailable:
        return "unreadable"
    return "stored" if value else "missing"


def webhook_of(provider: SmsProviderConfig) -> dict[str, str]:
    """Where the provider posts its delivery events and how they are signed (for
    templates/shared/_webhook.html); names the stored credential, never shows it."""
    intro, signature, field = WEBHOOK_TEXTS.get(provider.provider, GENERIC_WEBHOOK_TEXTS)
    return {
        "url": url_for(
            "webhooks.sms", provider=provider.provider, config_id=provider.id, _external=True
        ),
        "intro": intro,
        "signature": signature,
        "credential": LABELS[field],
        "credential_field": field,
        "credential_state": stored_state(provider, field),
    }


def _context(provider: SmsProviderConfig | None) -> dict[str, Any]:
    """What the edit page shows besides the form: a saved provider's routes and webhook."""
    return {
        "kind_options": KIND_OPTIONS,
        "uncertain_options": UNCERTAIN_OPTIONS,
        "dedupes": dedupes,
        "policy_text": POLICY_TEXT,
        "routes": _routes(provider) if provider is not None else [],
        "route_form": Form({"priority": "100"}, ROUTE_LABELS),
        "webhook": webhook_of(provider) if provider is not None else None,
        "unreadable": (
            config_pages.unreadable(provider, "secret", "webhook_secret")
            if provider is not None
            else []
        ),
    }


def _listing(tier: int, providers: Sequence[SmsProviderConfig]) -> dict[str, Any]:
    """The list page: each provider with the countries it routes."""
    countries: dict[int, list[str]] = {}
    for route in db.session.scalars(
        select(SmsProviderRegion)
        .where(SmsProviderRegion.tenant_id == tier)
        .order_by(SmsProviderRegion.priority, SmsProviderRegion.country_code)
    ):
        countries.setdefault(route.provider_id, []).append(route.country_code)
    return {
        "providers": providers,
        "countries": countries,
        "kinds": dict(KIND_OPTIONS),
        "dedupes": dedupes,
        "policy_text": POLICY_TEXT,
    }


def _deletion(provider: SmsProviderConfig) -> config_pages.Deletion:
    """What deleting ``provider`` would do (its confirm page; ``refused`` when it may not be).

    Counted by ``config_pages.use_of``. What happens to a prepared SMS is the pipeline's rule:
    a retry replays the provider frozen at preparation and never picks another; when that
    provider is disabled or gone the attempt fails CONFIG_NOT_RESOLVABLE, a category that is
    not retried.
    """
    use = config_pages.use_of(SmsSendRecord, provider, SmsSendRecord.provider_config_id)
    facts: list[str] = [
        f"{use.waiting:,} Pending or Retry SMS of {use.whose} "
        f"{'are' if use.waiting != 1 else 'is'} "
        "prepared for this provider.",
    ]
    refused = None
    if use.used:
        refused = (
            "Send records use this provider, so it cannot be deleted: their retries and "
            "delivery events go through it."
        )
        facts.append(
            "They go out through it when retried while it is enabled. Untick Enabled and they "
            "fail with CONFIG_NOT_RESOLVABLE at their next attempt; a Retry by hand then "
            "chooses a provider again, keeping the rendered text, its idempotency key and its "
            "quota charge."
        )
    else:
        countries = [route.country_code for route in _routes(provider)]
        if countries:
            facts.append(
                f"Its routes ({', '.join(countries)}) and the template bindings to it are "
                "deleted with it: SMS to those countries go through their other routed "
                "providers, or the default provider when no route is left."
            )
        if provider.is_default:
            facts.append(
                "It is the default provider of this tier: unless you make another one the "
                "default, SMS to countries without a route fail with CONFIG_NOT_RESOLVABLE (a "
                "tenant left with no enabled provider at all uses the platform's)."
            )
    return config_pages.Deletion(
        title=f"Delete SMS provider {provider.name!r}?",
        facts=facts,
        action=PAGES.url("delete", provider),
        back=PAGES.url("edit", provider),
        button=None if refused else "Delete this provider",
        refused=refused,
    )


# --- routes by country -----------------------------------------------------------------------


@bp.post("/<int:provider_id>/routes")
@requires(Permission.EDIT_CONFIG)
def create_route(provider_id: int) -> ResponseReturnValue:
    """Let this provider carry SMS to one more country."""
    provider = owned(SmsProviderConfig, provider_id, viewed_tier())
    form = Form(request.form, ROUTE_LABELS)
    country = form.country("country", required=True)
    priority = form.number("priority", lo=0, hi=MAX_INT)
    if country is not None:
        clash = db.session.scalar(
            select(SmsProviderRegion.id).where(
                SmsProviderRegion.provider_id == provider.id,
                SmsProviderRegion.country_code == country,
            )
        )
        if clash is not None:
            form.fail("country", f"{country} already has a route through this provider")
    if not form.ok or country is None:
        return config_pages.page(PAGES, provider, PAGES.form_of(provider), 422, route_form=form)
    route = SmsProviderRegion(
        tenant_id=provider.tenant_id,
        provider_id=provider.id,
        country_code=country,
        priority=100 if priority is None else priority,
    )
    db.session.add(route)
    db.session.flush()
    _audit_route(AuditAction.CONFIG_CREATE, provider, route, f"added (priority {route.priority})")
    db.session.commit()
    flash(f"Route for {country} added.", "success")
    return redirect(PAGES.url("edit", provider), 303)


def _audit_route(
    action: AuditAction, provider: SmsProviderConfig, route: SmsProviderRegion, what: str
) -> None:
    """The audit row of adding or removing a route, in the transaction that does it."""
    audit(
        action,
        tenant_id=provider.tenant_id,
        target_type="sms_route",
        target_id=route.id,
        remark=f"route for {route.country_code} through {PAGES.called(provider)} {what}",
    )


def _route_deletion(provider: SmsProviderConfig, route: SmsProviderRegion) -> config_pages.Deletion:
    """What removing a route would do: where SMS to its country go afterwards."""
    others = db.session.scalars(
        select(SmsProviderConfig.name)
        .join(SmsProviderRegion, SmsProviderRegion.provider_id == SmsProviderConfig.id)
        .where(
            SmsProviderRegion.tenant_id == provider.tenant_id,
            SmsProviderConfig.tenant_id == provider.tenant_id,
            SmsProviderRegion.country_code == route.country_code,
            SmsProviderRegion.id != route.id,
        )
        .order_by(SmsProviderRegion.priority, SmsProviderConfig.name)
    ).all()
    if others:
        after = (
            f"New SMS to {route.country_code} go through its other routed providers: "
            f"{', '.join(repr(name) for name in others)}."
        )
    else:
        after = (
            f"No other provider routes {route.country_code}: new SMS to it go to the default "
            "provider, or fail with CONFIG_NOT_RESOLVABLE when there is none."
        )
    return config_pages.Deletion(
        title=f"Remove the route for {route.country_code} through {provider.name!r}?",
        facts=[
            after,
            "SMS already prepared for this provider keep it: a retry replays the provider "
            "chosen when the SMS was prepared.",
        ],
        action=url_for("sms_providers.delete_route", provider_id=provider.id, route_id=route.id),
        back=PAGES.url("edit", provider),
        button="Remove this route",
    )


@bp.route("/<int:provider_id>/routes/<int:route_id>/delete", methods=["GET", "POST"])
@requires(Permission.EDIT_CONFIG)
def delete_route(provider_id: int, route_id: int) -> ResponseReturnValue:
    """Say what removing a country route would do; with ``confirm=yes``, remove it."""
    provider = owned(SmsProviderConfig, provider_id, viewed_tier())
    route = owned_under(SmsProviderRegion, route_id, provider, "provider_id")
    if not config_pages.confirmed():
        return config_pages.confirm_page(_route_deletion(provider, route))
    _audit_route(AuditAction.CONFIG_DELETE, provider, route, "removed")
    db.session.delete(route)
    db.session.commit()
    flash(f"Route for {route.country_code} removed.", "success")
    return redirect(PAGES.url("edit", provider), 303)


# --- credential check --------------------------------------------------------------------------


def check_credentials(
    provider: SmsProviderConfig, timeout_s: float, *, allow_private: bool
) -> tuple[float, str | None]:
    """Ask the provider whether the saved credentials work, sending nothing: (latency, error).

    Twilio: fetch the account resource; Vonage: read the account balance. Both are free reads
    that only answer with the right credentials. The base URL passes the outbound policy like
    a send's; error texts never carry the secret nor anything the far side said.
    """
    started = time.monotonic()
    try:
        secret = provider.secret
    except SecretUnavailable:
        return 0.0, "The stored auth token cannot be decrypted: enter it again and save."
    if not provider.account_id or not secret:
        return 0.0, "Enter the account id and the auth token first."
    kind = provider.provider
    with outbound.http_client(timeout=timeout_s, follow_redirects=False) as client:
        if kind == SmsProviderKind.TWILIO.value:
            base = (provider.base_url or twilio.DEFAULT_BASE_URL).rstrip("/")
            account = quote(provider.account_id, safe="")
            answer = _http.post(
                client,
                f"{base}/2010-04-01/Accounts/{account}.json",
                provider="The provider",
                allow_private=allow_private,
                method="GET",
                auth=(provider.account_id, secret),
            )
        else:
            base = (provider.base_url or vonage.DEFAULT_BASE_URL).rstrip("/")
            answer = _http.post(
                client,
                f"{base}/account/get-balance",
                provider="The provider",
                allow_private=allow_private,
                method="GET",
                params={"api_key": provider.account_id, "api_secret": secret},
            )
    latency = time.monotonic() - started
    if isinstance(answer, SmsResult):
        if answer.code == CONFIG_ERROR:
            return latency, (answer.message or "").replace(secret, "***")
        return latency, f"No answer from the provider ({answer.code})"
    if answer.status_code in (401, 403):
        return latency, f"The provider refused the credentials (HTTP {answer.status_code})"
    if not answer.is_success:
        return latency, f"The provider answered HTTP {answer.status_code}"
    return latency, None


def _check(provider: SmsProviderConfig, tier: int) -> dict[str, object]:
    """Check the saved credentials where the provider offers a cheap way to."""
    context: dict[str, object] = {"latency_ms": 0, "error": None}
    if provider.provider == SmsProviderKind.TEST.value:
        context["note"] = "The test provider accepts every message without any network."
    elif provider.provider in (SmsProviderKind.TWILIO.value, SmsProviderKind.VONAGE.value):
        timeout = min(settings().sms_connect_timeout_s, settings().outbound_test_timeout_s)
        allowed = outbound.allows_private(settings(), provider.tenant_id)
        with outbound.test_slot(settings(), tier):
            latency, error = check_credentials(provider, timeout, allow_private=allowed)
        context.update(latency_ms=round(latency * 1000), error=error)
    else:
        context["unavailable"] = True
    return context


PAGES = config_pages.Pages(
    model=SmsProviderConfig,
    blueprint="sms_providers",
    row_name="provider",
    noun="SMS provider",
    title="SMS providers",
    add_title="Add an SMS provider",
    labels=LABELS,
    read=_read,
    listing=_listing,
    context=_context,
    check=_check,
    audit_type="sms_provider",
    defaults={"provider": "twilio", "enabled": "on"},
    on_save=config_pages.take_default,
    test_title="Credential check",
    deletion=_deletion,
    shown=_shown,
)
config_pages.add_routes(bp, PAGES)
