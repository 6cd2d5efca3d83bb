"""Mail servers: the SMTP servers a tier sends through; create, edit, disable, test; and where
their delivery events are posted.

The password is write-only: no page or response carries it, not even masked or encrypted. The
form has a blank password field ("leave blank to keep") and a "remove" checkbox. A server that
send records point at is never deleted (records keep its id to be retried through it): it is
disabled instead. Delete first shows a confirm page saying how many Pending/Retry mails are
prepared for the server and what would become of them.

The edit page shows the server's webhook URL and signing secret (derived from SECRET_KEY and
the config id, so never stored), read-only with a copy button, to whoever may edit servers; and
says so when the stored password can no longer be decrypted (a new one replaces it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from flask import Blueprint, url_for

from portal.messaging.sending import outbound
from portal.messaging.sending.transports.smtp import (
    Security,
    SmtpServer,
    connection_hint,
    shown_error,
    test_connection,
)
from portal.models import MailSendRecord, MailSendServerConfig, SmtpSecurity, UncertainPolicy
from portal.models.secretbox import SecretUnavailable
from portal.tenancy import PLATFORM_TENANT_ID
from portal.web.configuration import config_pages
from portal.web.forms import Form, replace_secret, settings
from portal.web.machine.webhooks import GENERIC, SIGNATURE_HEADER, mail_webhook_secret

bp = Blueprint("mail_servers", __name__, url_prefix="/mail-servers")

LABELS = config_pages.SERVER_LABELS | {
    "from_address": "From address",
    "from_name": "From name",
    "reply_to": "Reply-To",
    "read_receipt": "Ask for read receipts",
    "is_default": "Default server of this tier",
    "enabled": "Enabled",
    "daily_send_limit": "Daily send limit",
    "rate_limit_per_minute": "Per-minute send limit",
    "uncertain_policy": "When a send's outcome is uncertain",
}
SECURITY_OPTIONS = [
    (SmtpSecurity.STARTTLS.value, "STARTTLS (usually port 587)"),
    (SmtpSecurity.SSL.value, "TLS from the start (usually port 465)"),
    (SmtpSecurity.PLAIN.value, "None (plain text; local relays only)"),
]
UNCERTAIN_OPTIONS = [
    (UncertainPolicy.RETRY.value, "Retry (may deliver twice)"),
    (UncertainPolicy.HOLD.value, "Hold for a person to decide"),
]


def _read(form: Form, server: MailSendServerConfig, tier: int) -> bool:
    """Check the form and copy it onto ``server``; False (nothing usable) when it has errors."""
    name = form.text("name", required=True, max_len=200)
    host = form.text("host", required=True, max_len=255)
    port = form.number("port", lo=1, hi=65535)
    security = form.choice("security", [s.value for s in SmtpSecurity], "starttls")
    username = form.text("username", max_len=320)
    password = form.text("password", max_len=500)
    from_address = form.email("from_address")
    from_name = form.text("from_name", max_len=200)
    reply_to = form.email("reply_to")
    daily = form.number("daily_send_limit")
    per_minute = form.number("rate_limit_per_minute")
    policy = form.choice("uncertain_policy", [p.value for p in UncertainPolicy], "retry")
    config_pages.check_host(
        form, tier, host, port or 587, forbidden="/@", example="smtp.example.com"
    )
    if not from_address and not username and not {"from_address", "username"} & set(form.errors):
        form.fail("from_address", "or a username is required (the sender is one of them)")
    config_pages.check_name(PAGES, form, server, tier, name)
    if not form.ok:
        return False
    assert name is not None
    assert host is not None
    server.tenant_id = tier
    server.name = name
    server.host = host
    server.port = port or 587
    server.security = security
    server.verify_tls = form.flag("verify_tls")
    server.username = username
    replace_secret(form, server, "password", password)
    server.from_address = from_address
    server.from_name = from_name
    server.reply_to = reply_to
    server.read_receipt = form.flag("read_receipt")
    server.is_default = form.flag("is_default")
    server.enabled = form.flag("enabled")
    server.daily_send_limit = daily
    server.rate_limit_per_minute = per_minute
    server.uncertain_policy = policy
    return True


def webhook_of(server: MailSendServerConfig) -> dict[str, str]:
    """Where the server's delivery events are posted, and the secret that signs them
    (for templates/shared/_webhook.html).

    The secret is derived (from SECRET_KEY and the config id), not stored: it is shown here
    only, to those who may edit the server, so they can set up the sender of the events.
    """
    return {
        "url": url_for("webhooks.mail", provider=GENERIC, config_id=server.id, _external=True),
        "intro": (
            "Have the service behind this server post delivered, bounced and complained events "
            "here, as JSON. Events about mail we do not know are kept until the mail is sent."
        ),
        "signature": (
            "Sign each request with the secret below: hex HMAC-SHA256 of the raw body, sent in "
            f"the {SIGNATURE_HEADER} header."
        ),
        "secret": mail_webhook_secret(settings(), server.id),
        "secret_hint": (
            "Derived from the portal's secret key: it changes when that key is rotated. Keep it "
            "to the sender of the events; select it to copy."
        ),
    }


def _listing(tier: int, servers: Sequence[MailSendServerConfig]) -> dict[str, Any]:
    return {"servers": servers}


def _context(server: MailSendServerConfig | None) -> dict[str, Any]:
    """What the edit page shows besides the form."""
    return {
        "security_options": SECURITY_OPTIONS,
        "uncertain_options": UNCERTAIN_OPTIONS,
        "webhook": webhook_of(server) if server is not None else None,
        "unreadable": config_pages.unreadable(server, "password") if server is not None else [],
    }


def _deletion(server: MailSendServerConfig) -> config_pages.Deletion:
    """What deleting ``server`` would do (its confirm page; ``refused`` when it may not be).

    Counted by ``config_pages.use_of``. What happens to a prepared mail is the pipeline's rule:
    a retry replays the server frozen at preparation (read again by id, enabled or not) and
    never chooses another; with the row gone the attempt fails CONFIG_NOT_RESOLVABLE, a
    category that is not retried.
    """
    use = config_pages.use_of(
        MailSendRecord, server, MailSendRecord.server_config_id, MailSendRecord.server_id
    )
    waiting = use.waiting
    prepared = (
        f"{waiting:,} Pending or Retry mail{'s' if waiting != 1 else ''} of {use.whose} "
        f"{'are' if waiting != 1 else 'is'} prepared for this server."
    )
    replay = (
        "An automatic retry replays the server chosen when the mail was prepared: with this "
        "server gone or disabled such mail fails with CONFIG_NOT_RESOLVABLE at its next "
        "attempt. A Retry by hand then chooses a server again, keeping the rendered message, "
        "its Message-ID and its quota charge."
    )
    facts: list[str] = [prepared]
    refused = None
    if use.used:
        refused = (
            "Send records use this server, so it cannot be deleted: their retries and delivery "
            "events go through it."
        )
        facts += [
            "They go out through it when retried while it is enabled. Untick Enabled instead "
            "and it carries nothing more:",
            replay,
        ]
    else:
        facts += [
            replay,
            "Templates that prefer this server send through the default server instead; a send "
            "that names it by id fails with CONFIG_NOT_RESOLVABLE.",
        ]
        if server.is_default:
            fallback = (
                "the platform's default server"
                if server.tenant_id != PLATFORM_TENANT_ID
                else "no server and fails with CONFIG_NOT_RESOLVABLE"
            )
            facts.append(
                "It is the default server of this tier: unless you make another one the "
                f"default, mail that names no server goes to {fallback}."
            )
    return config_pages.Deletion(
        title=f"Delete mail server {server.name!r}?",
        facts=facts,
        action=PAGES.url("delete", server),
        back=PAGES.url("edit", server),
        button=None if refused else "Delete this server",
        refused=refused,
    )


def _check(server: MailSendServerConfig, tier: int) -> dict[str, object]:
    """Connect to the saved server, say hello, log in and quit: the latency or the error (never
    the server's own words), with a hint at the setting to look at."""
    timeout = min(settings().smtp_connect_timeout_s, settings().outbound_test_timeout_s)
    try:
        password = server.password
    except SecretUnavailable:
        unreadable = "The stored password cannot be decrypted: enter it again and save."
        return {"latency_ms": 0, "error": unreadable, "hint": None}
    tested = SmtpServer(
        key=f"test:{server.id}:{server.config_version}",
        host=server.host,
        port=server.port,
        security=Security(server.security),
        username=server.username,
        password=password,
        connect_timeout_s=timeout,
        read_timeout_s=timeout,
        verify_tls=server.verify_tls,
        allow_private=outbound.allows_private(settings(), server.tenant_id),
    )
    with outbound.test_slot(settings(), tier):
        latency, error = test_connection(tested)
    hint = None
    if error is not None:
        hint = connection_hint(tested, error)  # the raw error names no setting
        error = shown_error(error)
    return {"latency_ms": round(latency * 1000), "error": error, "hint": hint}


PAGES = config_pages.Pages(
    model=MailSendServerConfig,
    blueprint="mail_servers",
    row_name="server",
    noun="mail server",
    title="Mail servers",
    add_title="Add a mail server",
    labels=LABELS,
    read=_read,
    listing=_listing,
    context=_context,
    check=_check,
    audit_type="mail_server",
    defaults={"port": "587", "security": "starttls", "verify_tls": "on", "enabled": "on"},
    added_hint=" Test its connection below.",
    on_save=config_pages.take_default,
    deletion=_deletion,
)
config_pages.add_routes(bp, PAGES)
