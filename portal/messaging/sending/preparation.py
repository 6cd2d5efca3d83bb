"""Preparation on a record's first attempt (seed 000's table): template, render, content
checks, server or provider choice, quota charge, and the write-back that freezes it all.

Retries replay what was frozen: no second render, no second choice, no second charge. A record
that cannot be prepared fails with a marker code saying why.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any, ClassVar, TypeVar

from email_validator import EmailNotValidError, validate_email
from sqlalchemy import Engine, Update, bindparam, exists, func, select, update
from sqlalchemy.orm import Session

from portal.config import Settings
from portal.messaging.records.validation import MAX_SMS_CHARS
from portal.messaging.sending import quota
from portal.messaging.sending.classify import MarkerCode
from portal.messaging.sending.configcache import CONFIGS
from portal.messaging.sending.outcomes import Claimed

# Asked before every attempt rather than by preparation; the tests still import it from here.
from portal.messaging.sending.suppressed import suppressed_recipients as suppressed_recipients
from portal.messaging.templating import checks as template_checks
from portal.messaging.templating import rendering as templating
from portal.messaging.templating import versions as template_versions
from portal.models import (
    Channel,
    MailSendRecord,
    MailSendServerConfig,
    MailTemplate,
    Scope,
    SmsProviderConfig,
    SmsProviderRegion,
    SmsSendRecord,
    SmsTemplate,
    SmsTemplateProviderBinding,
    db_now,
)
from portal.models.direct import Direct, Lookup, reader
from portal.tenancy import PLATFORM_TENANT_ID

T = TypeVar("T", MailTemplate, SmsTemplate)
R = TypeVar("R", MailSendRecord, SmsSendRecord)

SUPPRESSED = MarkerCode.SUPPRESSED.value  # the error code of a record the list stopped


class Shortfall(StrEnum):
    """Which of preparation's steps stopped a record: what a person has to add or fix before
    it can be prepared (``diagnosis`` tells it from the marker code's other causes)."""

    NO_TEMPLATE = "NO_TEMPLATE"  # none with that id, or none enabled under the code
    TEMPLATE_DISABLED = "TEMPLATE_DISABLED"  # one under the code, but disabled
    TEMPLATE_BROKEN = "TEMPLATE_BROKEN"  # does not render, needs variables, version gone
    CONTENT_INVALID = "CONTENT_INVALID"  # empty, too long, a malformed Reply-To
    NO_ROUTE = "NO_ROUTE"  # no default mail server; no SMS provider for the country
    NO_BINDING = "NO_BINDING"  # the SMS template is bound to none of the country's providers
    SERVER_DISABLED = "SERVER_DISABLED"  # the server named (or chosen before) missing or disabled
    SERVER_MISCONFIGURED = "SERVER_MISCONFIGURED"  # it cannot send as configured
    QUOTA_FULL = "QUOTA_FULL"  # this month's quota is used up


class PreparationFailed(Exception):
    """The record cannot be prepared; ``code`` is the marker code, ``shortfall`` the step."""

    def __init__(self, code: MarkerCode, message: str, shortfall: Shortfall):
        super().__init__(message)
        self.code = code
        self.message = message
        self.shortfall = shortfall


@dataclass(frozen=True, kw_only=True)
class Prepared:
    """What preparation decided for a record, whatever its channel: the server or provider it
    goes through and what it sends, frozen on the record (``COLUMNS``) for retries to replay."""

    COLUMNS: ClassVar[dict[str, str]]  # each column it is frozen in, and the field it holds

    config_id: int  # the server or provider
    config_name: str  # its name; "" when replayed from the record (the config names it then)
    template_version: int | None = None  # the template version it was prepared with

    def frozen(self) -> dict[str, Any]:
        """The record's columns of what preparation froze, as the write-back sets them."""
        return {column: getattr(self, name) for column, name in self.COLUMNS.items()}


@dataclass(frozen=True, kw_only=True)
class PreparedMail(Prepared):
    """What a mail record sends and through which server, as preparation froze it."""

    COLUMNS = {
        "rendered_subject": "subject",
        "rendered_html": "html",
        "rendered_text": "text",
        "final_reply_to": "reply_to",
        "final_priority": "priority",
        "final_attachments": "attachments",
        "server_config_id": "config_id",
        "read_receipt": "read_receipt",
        "message_id_header": "message_id",
        "template_version": "template_version",
    }

    subject: str
    html: str | None
    text: str | None
    reply_to: str | None
    priority: int | None
    attachments: list[dict[str, Any]] | None
    read_receipt: bool
    message_id: str
    # The server row as preparation read it (detached), so the first attempt sends through
    # it without reading it again; None when replayed from the record.
    server: MailSendServerConfig | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, kw_only=True)
class PreparedSms(Prepared):
    """What an SMS record sends and through which provider, as preparation froze it."""

    COLUMNS = {
        "rendered_content": "content",
        "provider_config_id": "config_id",
        "provider_kind": "provider_kind",
        "external_template_id": "external_template_id",
        "signature": "signature",
        "frozen_variables": "variables",
        "template_version": "template_version",
    }

    content: str
    provider_kind: str
    external_template_id: str | None
    signature: str | None
    variables: dict[str, Any] | None


def message_id_for(record_id: int, from_address: str | None) -> str:
    """A Message-ID derived from the record id: the same on every attempt."""
    domain = from_address.rsplit("@", 1)[1] if from_address and "@" in from_address else None
    return f"<mail-{record_id}@{domain or socket.getfqdn() or 'postroom.local'}>"


def tier_of(record: MailSendRecord | SmsSendRecord) -> int:
    """The tier whose templates, servers, providers and quota a record uses: the platform's
    for a platform send, else its tenant's (a tenant's send may still fall back to the
    platform's default server or providers when it has none of its own)."""
    return PLATFORM_TENANT_ID if record.scope == Scope.PLATFORM.value else record.tenant_id


def _find_template(
    session: Session, model: type[T], record: MailSendRecord | SmsSendRecord
) -> T | None:
    """The template of ``model`` (the record's channel's) that the record names, in its tier:
    by code the enabled one; by id that row, even disabled (a test send from the editor: what
    was previewed goes out)."""
    tier = tier_of(record)
    if record.template_id is not None:
        return session.scalar(
            select(model).where(model.id == record.template_id, model.tenant_id == tier)
        )
    return session.scalar(
        select(model).where(
            model.tenant_id == tier,
            model.code == record.template_code,
            model.enabled.is_(True),
        )
    )


def _template_of(
    session: Session, model: type[T], record: MailSendRecord | SmsSendRecord
) -> T | None:
    """The record's template (None when it names none), as the version it renders;
    PreparationFailed when it is gone."""
    if record.template_id is None and record.template_code is None:
        return None
    template = _find_template(session, model, record)
    if template is None:
        wanted = (
            f"id {record.template_id}"
            if record.template_id is not None
            else f"code {record.template_code!r} (enabled)"
        )
        raise _no_template(session, model, record, f"no {model.noun} with {wanted}")
    return _pinned(session, record, template)


_SERVER_BY_ID = Lookup(
    MailSendServerConfig,
    MailSendServerConfig.id == bindparam("id"),
    MailSendServerConfig.tenant_id == bindparam("tier"),
)
_DEFAULT_SERVER = Lookup(
    MailSendServerConfig,
    MailSendServerConfig.tenant_id == bindparam("tier"),
    MailSendServerConfig.is_default.is_(True),
    MailSendServerConfig.enabled.is_(True),
    order_by=MailSendServerConfig.id,
    limit=1,
)


def _default_server(engine: Engine, tenant_id: int) -> MailSendServerConfig | None:
    found: MailSendServerConfig | None = CONFIGS.get(
        ("default_server", tenant_id), lambda: _DEFAULT_SERVER.first(engine, tier=tenant_id)
    )
    return found


def _choose_server(
    engine: Engine, record: MailSendRecord, template: MailTemplate | None
) -> MailSendServerConfig:
    tier = tier_of(record)
    wanted = record.server_id or (template.preferred_server_id if template else None)
    if wanted is not None:
        server: MailSendServerConfig | None = CONFIGS.get(
            ("server_in", wanted, tier),
            lambda: _SERVER_BY_ID.first(engine, id=wanted, tier=tier),
        )
        if server is None or not server.enabled:
            raise PreparationFailed(
                MarkerCode.CONFIG_NOT_RESOLVABLE,
                f"mail server {wanted} is missing or disabled in this tier",
                Shortfall.SERVER_DISABLED,
            )
    else:
        server = _default_server(engine, tier)
        if server is None and record.scope == Scope.TENANT.value and tier != PLATFORM_TENANT_ID:
            server = _default_server(engine, PLATFORM_TENANT_ID)
        if server is None:
            raise PreparationFailed(
                MarkerCode.CONFIG_NOT_RESOLVABLE,
                "no default mail server is configured",
                Shortfall.NO_ROUTE,
            )
    if not server.from_address and not server.username:
        raise PreparationFailed(
            MarkerCode.CONFIG_NOT_RESOLVABLE,
            f"mail server {server.name!r} has neither a from address nor a username",
            Shortfall.SERVER_MISCONFIGURED,
        )
    return server


def _render(source: str | None, variables: dict[str, Any], *, html: bool, what: str) -> str | None:
    if source is None or source == "":
        return source
    try:
        return templating.render(source, variables, html=html)
    except templating.TemplateRenderError as exc:
        raise PreparationFailed(
            MarkerCode.TEMPLATE_NOT_RESOLVABLE,
            f"the template's {what} does not render: {exc}",
            Shortfall.TEMPLATE_BROKEN,
        ) from None


def _check_needs(
    template: MailTemplate | SmsTemplate, variables: dict[str, Any], *, subject: bool, body: bool
) -> None:
    """A strict template's version saved after acceptance may need a variable the request
    lacks: fail naming it; a Retry after fixing the template prepares afresh."""
    missing = template_checks.unmet(template, variables, subject=subject, body=body)
    if missing:
        raise PreparationFailed(
            MarkerCode.TEMPLATE_NOT_RESOLVABLE,
            f"template {template.code!r} version {template.version} needs variables the "
            f"request does not give: {', '.join(missing)}",
            Shortfall.TEMPLATE_BROKEN,
        )


def _mail_template_of(engine: Engine, record: MailSendRecord) -> MailTemplate | None:
    """``_template_of`` in a session of its own (mail's steps read through the engine)."""
    if record.template_id is None and record.template_code is None:
        return None  # no session for a mail that names no template
    with Session(reader(engine)) as session:
        return _template_of(session, MailTemplate, record)


def _no_template(
    session: Session,
    model: type[T],
    record: MailSendRecord | SmsSendRecord,
    message: str,
) -> PreparationFailed:
    """The failure of a record whose template was not found: a code that names only a
    disabled template is told apart (one more read, on this failure only), as the person who
    fixes it enables that one rather than creating another."""
    shortfall = Shortfall.NO_TEMPLATE
    if record.template_id is None and record.template_code is not None:
        disabled = session.scalar(
            select(model.id)
            .where(model.tenant_id == tier_of(record), model.code == record.template_code)
            .limit(1)
        )
        if disabled is not None:
            shortfall = Shortfall.TEMPLATE_DISABLED
            message += f" (template {record.template_code!r} is disabled)"
    return PreparationFailed(MarkerCode.TEMPLATE_NOT_RESOLVABLE, message, shortfall)


def _pinned(session: Session, record: MailSendRecord | SmsSendRecord, template: T) -> T:
    """A test send's template as the version its editor previewed; any other
    record's as it is now (seed 000: the version current at preparation)."""
    number = record.pinned_template_version
    if number is None:
        return template
    found = template_versions.as_version(session, template, number)
    if found is None:
        raise PreparationFailed(
            MarkerCode.TEMPLATE_NOT_RESOLVABLE,
            f"template {template.code!r} has no version {number}, which this test send renders",
            Shortfall.TEMPLATE_BROKEN,
        )
    return found


def build_mail(engine: Engine, record: MailSendRecord, settings: Settings) -> PreparedMail:
    """Steps 1 to 4: what this record will send, and through which server (no writes)."""
    template = _mail_template_of(engine, record)
    variables = record.variables or {}
    subject = record.subject
    html = record.html_body
    text = record.text_body
    if template is not None:
        _check_needs(
            template, variables, subject=subject is None, body=html is None and text is None
        )
        with templating.one_deadline():  # the three parts share one render deadline
            if subject is None:
                subject = _render(template.subject, variables, html=False, what="subject")
            if html is None and text is None:
                html = _render(template.html_body, variables, html=True, what="HTML body")
                text = _render(template.text_body, variables, html=False, what="text body")
    subject = " ".join((subject or "").split())
    if html and not text:
        text = templating.html_to_text(html)
    if not (html or "").strip() and not (text or "").strip():
        raise PreparationFailed(
            MarkerCode.CONTENT_INVALID, "the message body is empty", Shortfall.CONTENT_INVALID
        )
    if not subject:
        raise PreparationFailed(
            MarkerCode.CONTENT_INVALID, "the subject is empty", Shortfall.CONTENT_INVALID
        )
    longest = max(len(html or ""), len(text or ""))
    if longest > settings.mail_body_max_chars:
        raise PreparationFailed(
            MarkerCode.CONTENT_INVALID,
            f"the body has {longest} characters, over the limit of {settings.mail_body_max_chars}",
            Shortfall.CONTENT_INVALID,
        )
    server = _choose_server(engine, record, template)
    reply_to = record.reply_to or (template.reply_to if template else None) or server.reply_to
    if reply_to:
        try:
            reply_to = validate_email(reply_to, check_deliverability=False).normalized
        except EmailNotValidError as exc:
            raise PreparationFailed(
                MarkerCode.CONTENT_INVALID,
                f"the Reply-To {reply_to!r} is malformed: {exc}",
                Shortfall.CONTENT_INVALID,
            ) from None
    return PreparedMail(
        subject=subject,
        html=html or None,
        text=text or None,
        reply_to=reply_to,
        priority=record.priority or (template.priority if template else None),
        attachments=record.attachments or (template.attachments if template else None),
        config_id=server.id,
        config_name=server.name,
        read_receipt=server.read_receipt,
        message_id=message_id_for(record.id, server.from_address),
        server=server,
        template_version=template.version if template else None,
    )


# Called with the chosen server's or provider's id and name before the quota is charged; raises
# (breaker.ServerDown) when its circuit breaker is open, so a message that cannot go out uses none.
Gate = Callable[[int, str], None]


P = TypeVar("P", PreparedMail, PreparedSms)


def prepare(
    engine: Engine,
    record: R,
    claimed: Claimed,
    settings: Settings,
    build: Callable[[Engine, R, Settings], P],
    gate: Gate | None = None,
) -> tuple[P, Claimed] | None:
    """Prepare (``build``: the channel's steps 1 to 4), charge the quota (last: a message that
    cannot go out uses none) and write back, for either channel.

    Raises PreparationFailed with the marker code, or what ``gate`` raises; returns None when
    the write-back lost a version race (someone else moved the record on: stop quietly).
    """
    prepared = build(engine, record, settings)
    if gate is not None:
        gate(prepared.config_id, prepared.config_name)
    frozen = prepared.frozen()
    if not _charge_and_freeze(engine, type(record), tier_of(record), claimed, settings, frozen):
        return None
    return prepared, claimed.bumped(provider=prepared.config_name)


_FROZEN_COLUMNS: dict[type[MailSendRecord] | type[SmsSendRecord], tuple[str, ...]] = {
    MailSendRecord: tuple(PreparedMail.COLUMNS),
    SmsSendRecord: tuple(PreparedSms.COLUMNS),
}


def _freeze_statement(model: type[MailSendRecord] | type[SmsSendRecord]) -> Update:
    """The write-back of what preparation decided, by version.

    It leaves ``updated_time`` as the claim wrote it: no indexed column changes, so the update
    is HOT (PostgreSQL writes no index entry; in a bench/smtp.py run 1,990 of 1,990
    write-backs were HOT, none before), and the clocks that read it (the stuck-send sweep's
    threshold, the tenants' turn from the newest claim) count from the claim, when the
    attempt began."""
    columns = _FROZEN_COLUMNS[model]
    return (
        update(model)
        .where(model.id == bindparam("rid"), model.version == bindparam("ver"))
        .values(
            version=model.version + 1,
            prepared_at=db_now(),
            **{c: bindparam(f"frozen_{c}", type_=getattr(model, c).type) for c in columns},
        )
    )


def _charged_and_frozen(model: type[MailSendRecord] | type[SmsSendRecord]) -> Direct:
    """PostgreSQL: the charge and the write-back in one statement (data-modifying CTEs); the
    write-back happens only when the charge did. Returns (charged, frozen) counts."""
    channel = model.channel
    charged = quota.charge_statement(channel, "postgresql").cte("charged")
    frozen = (
        _freeze_statement(model)
        .where(exists(select(charged.c.id)))
        .returning(model.id)
        .cte("frozen")
    )
    counts = (
        select(func.count()).select_from(charged).scalar_subquery(),
        select(func.count()).select_from(frozen).scalar_subquery(),
    )
    # Its commit need not wait for the disk (synchronous_commit, for this transaction only):
    # every attempt ends in a write of the same record that does wait (Sent, Retry, Failed),
    # which flushes this one with it, and a database crash before that loses only what a
    # new attempt redoes: the render, the same Message-ID (derived from the record id) and
    # the charge, which the crash took back with it. The claim before it stays synchronous,
    # so a crash still leaves the record in Sending for the sweep. One disk flush fewer per
    # mail: at one worker, a tenth of a mail's time (bench/smtp.py).
    no_wait = func.set_config("synchronous_commit", "off", True)
    return Direct(select(*counts, no_wait), counts)


_FREEZE = {model: Direct(_freeze_statement(model)) for model in _FROZEN_COLUMNS}
_CHARGE_AND_FREEZE = {model: _charged_and_frozen(model) for model in _FROZEN_COLUMNS}


def _charge_and_freeze(
    engine: Engine,
    model: type[MailSendRecord] | type[SmsSendRecord],
    tier: int,
    claimed: Claimed,
    settings: Settings,
    frozen: dict[str, Any],
) -> bool:
    """Steps 5 and 6 for either channel: charge the quota (last, so a message that cannot go
    out uses none), then write the prepared values back by version (one statement on
    PostgreSQL, two on SQLite). False when the write-back lost a version race; the charge then
    stays, a small reconcilable over-count."""
    values = {f"frozen_{c}": frozen[c] for c in _FROZEN_COLUMNS[model]}
    values |= {"rid": claimed.id, "ver": claimed.version}
    if engine.dialect.name == "postgresql":
        params = quota.charge_params(tier, claimed.channel, settings) | values
        _count, rows = _CHARGE_AND_FREEZE[model].run(engine, **params)
        charged, written = rows[0][:2]
    else:
        charged = quota.charge(engine, tier, claimed.channel, settings)
        written = charged and _FREEZE[model].run(engine, **values)[0] == 1
    if not charged:
        raise PreparationFailed(
            MarkerCode.MONTHLY_QUOTA_EXCEEDED,
            f"this month's {'mail' if claimed.channel is Channel.MAIL else 'SMS'} quota is used up",
            Shortfall.QUOTA_FULL,
        )
    return bool(written)


# --- SMS --------------------------------------------------------------------------------


def _routed_providers(session: Session, tier: int, country: str | None) -> list[SmsProviderConfig]:
    """The tier's enabled providers with a route row for ``country``, in route priority order."""
    if not country:
        return []
    return list(
        session.scalars(
            select(SmsProviderConfig)
            .join(SmsProviderRegion, SmsProviderRegion.provider_id == SmsProviderConfig.id)
            .where(
                SmsProviderRegion.tenant_id == tier,
                SmsProviderRegion.country_code == country,
                SmsProviderConfig.tenant_id == tier,
                SmsProviderConfig.enabled.is_(True),
            )
            .order_by(SmsProviderRegion.priority, SmsProviderConfig.id)
        )
    )


def _default_providers(session: Session, tier: int) -> list[SmsProviderConfig]:
    return list(
        session.scalars(
            select(SmsProviderConfig)
            .where(
                SmsProviderConfig.tenant_id == tier,
                SmsProviderConfig.is_default.is_(True),
                SmsProviderConfig.enabled.is_(True),
            )
            .order_by(SmsProviderConfig.id)
        )
    )


def _has_providers(session: Session, tier: int) -> bool:
    return (
        session.scalar(
            select(SmsProviderConfig.id)
            .where(SmsProviderConfig.tenant_id == tier, SmsProviderConfig.enabled.is_(True))
            .limit(1)
        )
        is not None
    )


def sms_candidates(session: Session, record: SmsSendRecord) -> list[SmsProviderConfig]:
    """The providers that may carry this SMS, best first (before the template's bindings).

    Route rows for the recipient's country win outright, in priority order; only when there
    are none do the tier's default providers apply. Disabled providers count as absent.

    Tier fallback: a TENANT send whose tenant has no enabled SMS provider at all uses the
    platform tier's routes and defaults, as mail uses the platform's default server when the
    tenant has none. A tenant that has providers of its own owns its routing: a country it
    neither routes nor covers by a default fails CONFIG_NOT_RESOLVABLE rather than silently
    going out (and being billed) through the platform's account. A PLATFORM send never uses
    a tenant's providers.
    """
    tier = tier_of(record)
    country = (record.country_code or "").upper() or None
    tiers = [tier]
    if (
        record.scope == Scope.TENANT.value
        and tier != PLATFORM_TENANT_ID
        and not _has_providers(session, tier)
    ):
        tiers = [PLATFORM_TENANT_ID]
    for candidate_tier in tiers:
        routed = _routed_providers(session, candidate_tier, country)
        if routed:
            return routed
        defaults = _default_providers(session, candidate_tier)
        if defaults:
            return defaults
    return []


def _bound_provider(
    session: Session,
    template: SmsTemplate,
    candidates: list[SmsProviderConfig],
    country: str | None,
) -> tuple[SmsProviderConfig, SmsTemplateProviderBinding | None]:
    """The first candidate the template is bound to (with its binding), or the first candidate
    when the template has no bindings at all."""
    bindings: list[SmsTemplateProviderBinding] = CONFIGS.get(
        ("sms_bindings", template.id),
        lambda: list(
            session.scalars(
                select(SmsTemplateProviderBinding)
                .where(SmsTemplateProviderBinding.template_id == template.id)
                .order_by(SmsTemplateProviderBinding.id)
            )
        ),
    )
    if not bindings:
        return candidates[0], None
    usable: dict[int, SmsTemplateProviderBinding] = {}
    for binding in bindings:
        if binding.country_code is not None and binding.country_code.upper() != country:
            continue
        # An exact-region binding beats a generic one (country NULL) at the same provider.
        if binding.country_code is not None or binding.provider_id not in usable:
            usable[binding.provider_id] = binding
    for provider in candidates:
        if provider.id in usable:
            return provider, usable[provider.id]
    names = ", ".join(repr(p.name) for p in candidates)
    raise PreparationFailed(
        MarkerCode.CONFIG_NOT_RESOLVABLE,
        f"SMS template {template.code!r} has no provider binding for country "
        f"{country or '(unknown)'}: the providers for it ({names}) are not bound to the template",
        Shortfall.NO_BINDING,
    )


def _choose_provider(
    session: Session, record: SmsSendRecord, template: SmsTemplate | None
) -> tuple[SmsProviderConfig, SmsTemplateProviderBinding | None]:
    """Step 4 for SMS: the provider, and the template's binding to it."""
    country = (record.country_code or "").upper() or None
    candidates: list[SmsProviderConfig] = CONFIGS.get(
        ("sms_candidates", record.scope, tier_of(record), country),
        lambda: sms_candidates(session, record),
    )
    if not candidates:
        raise PreparationFailed(
            MarkerCode.CONFIG_NOT_RESOLVABLE,
            f"no SMS provider serves country {country or '(unknown)'}: no route for it and "
            "no default provider is configured",
            Shortfall.NO_ROUTE,
        )
    if template is None:
        return candidates[0], None
    return _bound_provider(session, template, candidates, country)


def build_sms(session: Session, record: SmsSendRecord) -> PreparedSms:
    """Steps 1 to 4 for SMS: the content, and the provider with its binding (no writes)."""
    template = _template_of(session, SmsTemplate, record)
    variables = record.variables or {}
    content = record.content
    if not content and template is not None:
        _check_needs(template, variables, subject=False, body=True)
        content = _render(template.content, variables, html=False, what="content")
    content = (content or "").strip()
    if not content:
        raise PreparationFailed(
            MarkerCode.CONTENT_INVALID, "the SMS content is empty", Shortfall.CONTENT_INVALID
        )
    if len(content) > MAX_SMS_CHARS:
        raise PreparationFailed(
            MarkerCode.CONTENT_INVALID,
            f"the SMS content has {len(content)} characters, over the limit of {MAX_SMS_CHARS}",
            Shortfall.CONTENT_INVALID,
        )
    provider, binding = _choose_provider(session, record, template)
    return PreparedSms(
        content=content,
        config_id=provider.id,
        provider_kind=provider.provider,
        config_name=provider.name,
        external_template_id=binding.external_template_id if binding else None,
        signature=binding.signature if binding else None,
        variables=record.variables,
        template_version=template.version if template else None,
    )


def built_sms(engine: Engine, record: SmsSendRecord, _settings: Settings) -> PreparedSms:
    """``build_sms`` in a session of its own, as ``prepare`` builds (SMS has no settings)."""
    with Session(reader(engine)) as session:
        return build_sms(session, record)


# --- what preparation would do, without doing it --------------------------------------------


def dry_run(
    engine: Engine, record: MailSendRecord | SmsSendRecord, settings: Settings, *, render: bool
) -> MailSendServerConfig | SmsProviderConfig:
    """The server or provider preparation would choose for ``record`` now (detached), by
    preparation's own steps and without writing or charging anything; PreparationFailed as
    preparation would raise it. With ``render``, steps 1 to 4 (the template rendered, the
    content checked); without, the template found and the server or provider chosen only,
    which is what a manual retry of a prepared record whose route is gone runs
    (``rechoose_server``, ``rechoose_provider``). The quota (step 5) is the caller's to read:
    a charge is a write."""
    if isinstance(record, MailSendRecord):
        if render:
            prepared = build_mail(engine, record, settings)
            assert prepared.server is not None  # build_mail always hands its server row on
            return prepared.server
        return _choose_server(engine, record, _mail_template_of(engine, record))
    with Session(reader(engine)) as session:  # its rows stay readable once it closes
        if render:
            chosen = session.get(SmsProviderConfig, build_sms(session, record).config_id)
            assert chosen is not None  # build_sms chose it in this session
            return chosen
        provider, _binding = _choose_provider(
            session, record, _template_of(session, SmsTemplate, record)
        )
        return provider


# --- choosing again after a manual retry ------------------------------------------------------
#
# A prepared record whose server or provider was disabled or deleted fails
# CONFIG_NOT_RESOLVABLE (a CONFIG failure: never retried automatically). When an operator then
# presses Retry, only the choice of server or provider runs again (a fix of seed 001's "no
# switching servers"): the frozen render, the Message-ID or idempotency key and the quota charge
# stay as they are.


def requeued_after_unusable_route(record: MailSendRecord | SmsSendRecord) -> bool:
    """Whether this claimed, prepared record comes back from a manual retry of a failure for
    an unusable server or provider. CONFIG_NOT_RESOLVABLE is never retried automatically, so a
    record claimed with that code got back to Retry only by hand (``retry.retry_records``)."""
    return (
        record.prepared_at is not None
        and record.error_code == MarkerCode.CONFIG_NOT_RESOLVABLE.value
    )


def _route_statement(
    model: type[MailSendRecord] | type[SmsSendRecord], columns: tuple[str, ...]
) -> Direct:
    return Direct(
        update(model)
        .where(model.id == bindparam("rid"), model.version == bindparam("ver"))
        .values(
            version=model.version + 1,
            updated_time=db_now(),
            **{c: bindparam(f"route_{c}", type_=getattr(model, c).type) for c in columns},
        )
    )


# The columns of the route a manual retry may choose again (preparation's step 4).
_ROUTE_COLUMNS: dict[type[MailSendRecord] | type[SmsSendRecord], tuple[str, ...]] = {
    MailSendRecord: ("server_config_id", "read_receipt"),
    SmsSendRecord: ("provider_config_id", "provider_kind", "external_template_id", "signature"),
}
_ROUTE = {model: _route_statement(model, columns) for model, columns in _ROUTE_COLUMNS.items()}


def _rerouted(engine: Engine, record: R, claimed: Claimed, chosen: P) -> tuple[P, Claimed] | None:
    """Write the route of ``chosen`` by version; None when the write lost a version race."""
    frozen = chosen.frozen()
    columns = _ROUTE_COLUMNS[type(record)]
    route = {f"route_{column}": frozen[column] for column in columns}
    count, _rows = _ROUTE[type(record)].run(engine, rid=claimed.id, ver=claimed.version, **route)
    if count != 1:
        return None
    return chosen, claimed.bumped(provider=chosen.config_name)


def rechoose_server(
    engine: Engine, record: MailSendRecord, claimed: Claimed, prepared: PreparedMail
) -> tuple[PreparedMail, Claimed] | None:
    """Choose the mail server again (step 4 only) and write it by version, keeping the rest of
    what was prepared; None when the write lost a version race. PreparationFailed when no
    server can be chosen."""
    server = _choose_server(engine, record, _mail_template_of(engine, record))
    chosen = replace(
        prepared,
        config_id=server.id,
        config_name=server.name,
        read_receipt=server.read_receipt,
        server=server,
    )
    return _rerouted(engine, record, claimed, chosen)


def rechoose_provider(
    engine: Engine, record: SmsSendRecord, claimed: Claimed, prepared: PreparedSms
) -> tuple[PreparedSms, Claimed] | None:
    """Choose the SMS provider and its template binding again and write them by version, as
    ``rechoose_server``."""
    with Session(reader(engine)) as session:
        provider, binding = _choose_provider(
            session, record, _template_of(session, SmsTemplate, record)
        )
    chosen = replace(
        prepared,
        config_id=provider.id,
        config_name=provider.name,
        provider_kind=provider.provider,
        external_template_id=binding.external_template_id if binding else None,
        signature=binding.signature if binding else None,
    )
    return _rerouted(engine, record, claimed, chosen)
