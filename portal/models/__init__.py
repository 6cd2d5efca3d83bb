"""SQLAlchemy models, one module per aggregate."""

from portal.models.attempts import AttemptOutcome, SendAttempt
from portal.models.audit import AuditAction, AuditEvent, LoginThrottle, add_audit
from portal.models.base import Base, UTCDateTime, db_now, db_now_plus
from portal.models.breaker import BreakerState
from portal.models.callbacks import CallbackDelivery, CallbackEndpoint, DeliveryStatus
from portal.models.chores import ChoreRun, ConfigEpoch
from portal.models.dead_letters import DeadLetterMessage
from portal.models.enums import (
    ApiScope,
    Channel,
    DeadLetterSource,
    Role,
    Scope,
    SendStatus,
    SmsProviderKind,
    SmtpSecurity,
    TriageStatus,
    UncertainPolicy,
)
from portal.models.events import (
    DeliveryEvent,
    MailReceiveConfig,
    MailReceiveState,
    ReceivedMail,
    Suppression,
)
from portal.models.inbox import Notification, NotificationRead
from portal.models.mail import MailSendRecipient, MailSendRecord, MailSendServerConfig, MailTemplate
from portal.models.quota import TenantMessageQuota, TenantMessageUsage
from portal.models.record_events import RecordEvent, RecordEventKind
from portal.models.search import MailSendSubject, RecipientToken
from portal.models.sms import (
    SmsProviderConfig,
    SmsProviderRegion,
    SmsSendRecord,
    SmsTemplate,
    SmsTemplateProviderBinding,
)
from portal.models.template_version import TemplateBlob, TemplateVersion
from portal.models.tenant import ApiKey, AppUser, Tenant

__all__ = [
    "ApiKey",
    "ApiScope",
    "AppUser",
    "AttemptOutcome",
    "AuditAction",
    "AuditEvent",
    "Base",
    "BreakerState",
    "CallbackDelivery",
    "CallbackEndpoint",
    "Channel",
    "ChoreRun",
    "ConfigEpoch",
    "DeadLetterMessage",
    "DeadLetterSource",
    "DeliveryEvent",
    "DeliveryStatus",
    "LoginThrottle",
    "MailReceiveConfig",
    "MailReceiveState",
    "MailSendRecipient",
    "MailSendRecord",
    "MailSendServerConfig",
    "MailSendSubject",
    "MailTemplate",
    "Notification",
    "NotificationRead",
    "ReceivedMail",
    "RecipientToken",
    "RecordEvent",
    "RecordEventKind",
    "Role",
    "Scope",
    "SendAttempt",
    "SendStatus",
    "SmsProviderConfig",
    "SmsProviderKind",
    "SmsProviderRegion",
    "SmsSendRecord",
    "SmsTemplate",
    "SmsTemplateProviderBinding",
    "SmtpSecurity",
    "Suppression",
    "TemplateBlob",
    "TemplateVersion",
    "Tenant",
    "TenantMessageQuota",
    "TenantMessageUsage",
    "TriageStatus",
    "UTCDateTime",
    "UncertainPolicy",
    "add_audit",
    "db_now",
    "db_now_plus",
]


def _bump_config_version(_mapper: object, _connection: object, target: object) -> None:
    """Every save that changes a server or provider config bumps its version, so caches keyed
    by it can never serve a stale config in any process. An assignment of an equal value is
    no change: it must not throw every worker's cached connection away."""
    from sqlalchemy.orm import object_session

    session = object_session(target)
    if session is None or not session.is_modified(target, include_collections=False):
        return
    target.config_version = (target.config_version or 0) + 1  # type: ignore[attr-defined]


def _register_events() -> None:
    from sqlalchemy import event

    for model in (MailSendServerConfig, SmsProviderConfig, MailReceiveConfig):
        event.listen(model, "before_update", _bump_config_version)


_register_events()
