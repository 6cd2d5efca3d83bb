"""The words of a diagnosis: why a retry would fail again (``Reason``) and how each reason
reads in a count; what a record's cause is called, by its error code, category or status; and
who can act, by rank."""

from __future__ import annotations

from enum import StrEnum

from portal.messaging.sending.classify import DeferralCode, ErrorCategory, MarkerCode
from portal.models import Role, SendStatus
from portal.tenancy import PLATFORM_TENANT_ID


class Reason(StrEnum):
    """Why sending a record again now would fail the same way."""

    EXPIRED = "EXPIRED"
    SUPPRESSED = "SUPPRESSED"
    RECIPIENT_REFUSED = "RECIPIENT_REFUSED"
    NO_TEMPLATE = "NO_TEMPLATE"
    TEMPLATE_DISABLED = "TEMPLATE_DISABLED"
    TEMPLATE_BROKEN = "TEMPLATE_BROKEN"
    CONTENT_INVALID = "CONTENT_INVALID"
    NO_ROUTE = "NO_ROUTE"
    NO_BINDING = "NO_BINDING"
    SERVER_DISABLED = "SERVER_DISABLED"
    SERVER_MISCONFIGURED = "SERVER_MISCONFIGURED"
    SERVER_DOWN = "SERVER_DOWN"
    CREDENTIALS_REFUSED = "CREDENTIALS_REFUSED"
    MESSAGE_REFUSED = "MESSAGE_REFUSED"
    QUOTA_FULL = "QUOTA_FULL"


# How each reason reads in a count ("3 would fail again: server down").
REASON_LABEL: dict[Reason, str] = {
    Reason.EXPIRED: "expired",
    Reason.SUPPRESSED: "recipient suppressed",
    Reason.RECIPIENT_REFUSED: "recipient refused for good",
    Reason.NO_TEMPLATE: "no such template",
    Reason.TEMPLATE_DISABLED: "template disabled",
    Reason.TEMPLATE_BROKEN: "template does not render",
    Reason.CONTENT_INVALID: "content invalid",
    Reason.NO_ROUTE: "no server or provider for it",
    Reason.NO_BINDING: "no template binding for the country",
    Reason.SERVER_DISABLED: "server or provider missing or disabled",
    Reason.SERVER_MISCONFIGURED: "server or provider misconfigured",
    Reason.SERVER_DOWN: "server or provider down",
    Reason.CREDENTIALS_REFUSED: "credentials refused",
    Reason.MESSAGE_REFUSED: "message refused",
    Reason.QUOTA_FULL: "monthly quota full",
}

# The least role that can act, by rank: a role can do what the roles below it can.
RANK = {Role.SUPPORT: 0, Role.TENANT_ADMIN: 1, Role.PLATFORM_OPERATOR: 2}
ROLE_WORDS = {
    Role.SUPPORT: "support staff",
    Role.TENANT_ADMIN: "a tenant admin (or a platform operator)",
    Role.PLATFORM_OPERATOR: "a platform operator",
}

# What a record's cause is called, by its error code or category (the panel's heading).
MARKER_TITLE: dict[MarkerCode, str] = {
    MarkerCode.TEMPLATE_NOT_RESOLVABLE: "Template missing, disabled or broken",
    MarkerCode.CONFIG_NOT_RESOLVABLE: "Send configuration incomplete",
    MarkerCode.MONTHLY_QUOTA_EXCEEDED: "Monthly quota used up",
    MarkerCode.CONTENT_INVALID: "Content invalid",
    MarkerCode.QUOTA_EXCEEDED: "Rate-limit window full",
    MarkerCode.RATE_LIMIT_UNAVAILABLE: "Rate-limit check unavailable",
    MarkerCode.ZOMBIE_RECOVERED: "Stuck send recovered",
    MarkerCode.ZOMBIE_EXHAUSTED: "Stuck send, retries used up",
    MarkerCode.EXPIRED: "Expired before sending",
    MarkerCode.RETRY_WINDOW_EXPIRED: "Retry window ran out",
    MarkerCode.SUPPRESSED: "Recipient on the suppression list",
    MarkerCode.RESOLVED_FAILED: "Resolved as failed",
}
DEFERRAL_TITLE: dict[DeferralCode, str] = {
    DeferralCode.SERVER_UNAVAILABLE: "Waiting for the server to come back",
    DeferralCode.SERVER_BUSY: "Waiting for a slow server",
}
CATEGORY_TITLE: dict[ErrorCategory, str] = {
    ErrorCategory.TRANSIENT: "Temporary fault",
    ErrorCategory.QUOTA: "Rate limit or quota",
    ErrorCategory.UNKNOWN: "Unrecognised error",
    ErrorCategory.PERMANENT: "Recipient refused",
    ErrorCategory.INVALID_INPUT: "Invalid message or recipient",
    ErrorCategory.AUTH: "Credentials refused",
    ErrorCategory.CONFIG: "Configuration incomplete",
}
STATUS_TITLE: dict[SendStatus, str] = {
    SendStatus.PENDING: "Waiting to send",
    SendStatus.SENDING: "Sending now",
    SendStatus.SENT: "Sent",
    SendStatus.CANCELLED: "Cancelled",
    SendStatus.SUPPRESSED: "Recipient on the suppression list",
    SendStatus.UNCERTAIN: "Outcome unknown",
}


def admin_of(tier: int) -> Role:
    """Who changes a tier's configuration, templates and suppressions."""
    return Role.PLATFORM_OPERATOR if tier == PLATFORM_TENANT_ID else Role.TENANT_ADMIN
