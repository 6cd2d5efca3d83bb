"""One attempt of one claimed record: prepare on the first attempt, check the rate limit, send,
record the outcome.

Runs in the record's tenant context under the trace id stored at acceptance. Each database
write is one statement in its own transaction; the send itself holds no connection. The server
or provider config is read at every attempt (a first attempt sends through the row preparation
just read), so a saved change applies to the next one.
"""

from __future__ import annotations

import base64
import logging
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Generic, TypeVar

import httpx
import psycopg
from sqlalchemy import Engine, bindparam
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from portal.config import Settings
from portal.messaging.after_send import suppression
from portal.messaging.sending import breaker, gates, outbound, outcomes, sent_write
from portal.messaging.sending.backoff import BackoffPolicy
from portal.messaging.sending.breaker import Breaker, ServerDown
from portal.messaging.sending.classify import DeferralCode, MarkerCode
from portal.messaging.sending.configcache import CONFIGS
from portal.messaging.sending.outcomes import Claimed
from portal.messaging.sending.preparation import (
    SUPPRESSED,
    Gate,
    PreparationFailed,
    PreparedMail,
    PreparedSms,
    build_mail,
    built_sms,
    prepare,
    rechoose_provider,
    rechoose_server,
    requeued_after_unusable_route,
)
from portal.messaging.sending.ratelimit import RateLimiter
from portal.messaging.sending.suppressed import suppressed_recipients
from portal.messaging.sending.transports import sms as sms_transport
from portal.messaging.sending.transports import smtp
from portal.messaging.sending.transports.mail_message import Attachment, OutgoingMail
from portal.messaging.sending.transports.smtp import (
    Security,
    SmtpConnectionPool,
    SmtpSendError,
    SmtpServer,
)
from portal.metrics import SEND_DURATION
from portal.models import (
    Channel,
    MailSendRecord,
    MailSendServerConfig,
    SendStatus,
    SmsProviderConfig,
    SmsSendRecord,
    UncertainPolicy,
)
from portal.models.direct import Lookup, reader
from portal.models.secretbox import SecretUnavailable
from portal.tenancy import tenant_context

log = logging.getLogger("portal.delivery")

DATABASE_ERROR = "DATABASE_ERROR"  # an attempt the database failed (retried as UNKNOWN)


@dataclass
class MailContext:
    """What a mail worker keeps between records: its SMTP connections and the policy.

    ``limiter`` None: the process-wide rate limiter on ``settings.redis_url``.
    """

    engine: Engine
    settings: Settings
    policy: BackoffPolicy
    pool: SmtpConnectionPool = field(default_factory=SmtpConnectionPool)
    limiter: RateLimiter | None = None
    breaker: Breaker | None = None  # None: the process-wide one

    def __post_init__(self) -> None:
        # Made now, so that an idle pool's polls keep the breakers' probes going (breaker.tick)
        # before this worker's first send.
        gates.breaker_of(self)

    def close(self) -> None:
        """QUIT every open SMTP connection (the worker is stopping)."""
        self.pool.close_all()


@dataclass
class SmsContext:
    """What an SMS worker keeps between records: its HTTP client (connections are kept
    alive between sends), the policy and the rate limiter (None: the process-wide one)."""

    engine: Engine
    settings: Settings
    policy: BackoffPolicy
    limiter: RateLimiter | None = None
    breaker: Breaker | None = None  # None: the process-wide one
    client: httpx.Client = field(init=False)

    def __post_init__(self) -> None:
        # Made here, in the worker thread that owns the context, and closed with it.
        self.client = sms_transport.new_client(
            self.settings.sms_connect_timeout_s, self.settings.sms_read_timeout_s
        )
        gates.breaker_of(self)  # as MailContext's

    def close(self) -> None:
        """Close the HTTP client's connections (the worker is stopping)."""
        self.client.close()


# Transport codes that mean no answer came from the server or provider at all.
_NO_ANSWER = frozenset({"TIMEOUT", "NETWORK_ERROR", "CONFIG_ERROR", "INVALID_INPUT"})
_KIND = {Channel.MAIL: "mail server", Channel.SMS: "SMS provider"}


def _failed(ctx: MailContext | SmsContext, claimed: Claimed, failure: PreparationFailed) -> None:
    """Preparation (or choosing the server again) failed with a marker code: the outcome."""
    outcomes.handle_failure(
        ctx.engine, claimed, failure.code.value, failure.message, policy=ctx.policy
    )


def _defer(
    ctx: MailContext | SmsContext,
    claimed: Claimed,
    record: MailSendRecord | SmsSendRecord,
    down: ServerDown,
) -> None:
    """Back to Retry with no retry used: a busy server's record for a few seconds; one whose
    server's breaker is open waits for the breaker (due when it closes, or at its deadline)."""
    kind = _KIND[claimed.channel]
    if isinstance(down, gates.RouteBusy):
        why = (
            "its sends time out, so it may hold only a few of this worker's senders and they "
            "are all busy with it"
            if down.slow
            else "every other sender of this worker but one is busy with it"
        )
        outcomes.defer(
            ctx.engine,
            replace(claimed, provider=down.name),
            DeferralCode.SERVER_BUSY.value,
            f"not attempted yet: the {kind} {down.name!r} is slow ({why}), so this waits "
            "(no retry used)",
            breaker.defer_delay(down.check),
        )
        return
    channel = claimed.channel
    deadline = _deadline(ctx, record, channel, down.config_id)
    waiting = outcomes.defer(
        ctx.engine,
        replace(claimed, provider=down.name),
        breaker.SERVER_UNAVAILABLE,
        breaker.defer_message(kind, down.name, down.check),
        breaker.defer_delay(down.check),
        waiting_on=down.config_id,
        until=deadline,
    )
    # A probe may have closed the breaker between our check and this write, releasing the
    # records that were waiting then but not this one: look again.
    if waiting and not gates.breaker_of(ctx).is_open(channel, down.config_id):
        breaker.release(ctx.engine, channel, down.config_id)


def _deadline(
    ctx: MailContext | SmsContext,
    record: MailSendRecord | SmsSendRecord,
    channel: Channel,
    config_id: int,
) -> datetime | None:
    """When a record waiting for a breaker comes due by itself: just past its expiry or the
    end of its resend window (the SMS provider's own when it has one), so that the claim then
    ends it (``past_deadline``) as it would have ended at any attempt."""
    window = ctx.settings.resend_window_s
    if isinstance(ctx, SmsContext):
        provider, _account, _problem = _usable_provider(ctx, config_id)
        if provider is not None:
            window = _sms_window(ctx, provider)
    ends = [record.expires_at] if record.expires_at is not None else []
    if record.first_claimed_at is not None:
        ends.append(record.first_claimed_at + timedelta(seconds=window))
    return min(ends) + timedelta(seconds=1) if ends else None


def _cleared(
    ctx: MailContext | SmsContext,
    claimed: Claimed,
    record: MailSendRecord | SmsSendRecord,
    gate: Gate | None,
    config: MailSendServerConfig | SmsProviderConfig,
) -> bool:
    """The server's gate (a place among the pool's workers, its breaker; None when preparation
    ran it already) and its rate-limit windows; False when the record was deferred."""
    if gate is not None:
        try:
            gate(config.id, config.name)
        except ServerDown as down:
            _defer(ctx, claimed, record, down)
            return False
    return gates.admit(
        ctx.engine, claimed, config, gates.limiter_of(ctx.settings, ctx.limiter), ctx.policy
    )


def past_deadline(
    engine: Engine,
    claimed: Claimed,
    record: MailSendRecord | SmsSendRecord,
    retry_window_s: float | None = None,
) -> bool:
    """Each claim checks the deadlines before sending (seed 002); True when the record ended.

    ``record.updated_time`` is the claim's time on the database clock. Past ``expiresAt`` the
    record ends Failed with EXPIRED; past the resend window after the first claim (seed 002:
    ``RESEND_WINDOW_S``, 23 hours, or the SMS provider's own ``retry_window_s``), Failed with
    RETRY_WINDOW_EXPIRED: no automatic attempt after it. Either ends Uncertain instead when an
    earlier attempt was ambiguous: the message may have gone out, and failing it would hide
    that.
    """
    now = record.updated_time
    code: MarkerCode | None = None
    if record.expires_at is not None and now >= record.expires_at:
        code = MarkerCode.EXPIRED
        message = f"not sent: it expired at {record.expires_at.isoformat()} before it was due"
    elif (
        retry_window_s is not None
        and record.first_claimed_at is not None
        and (now - record.first_claimed_at).total_seconds() > retry_window_s
    ):
        code = MarkerCode.RETRY_WINDOW_EXPIRED
        message = (
            f"not retried: over {retry_window_s:g} s since the first attempt (the resend "
            "window); the server's or provider's duplicate protection may have lapsed, so "
            "another attempt could send it twice"
        )
    if code is None:
        return False
    status = SendStatus.FAILED
    if record.ambiguous_attempt:
        status = SendStatus.UNCERTAIN
        message += "; an earlier attempt may have been accepted: resolve it by hand"
    outcomes.finish(engine, claimed, status, code.value, message)
    return True


def _suppressed(
    engine: Engine, claimed: Claimed, record: MailSendRecord | SmsSendRecord
) -> dict[str, str] | None:
    """The suppressed recipients (address -> why); None when every recipient is suppressed
    and the record has been ended Suppressed (no provider call)."""
    blocked, total = suppressed_recipients(engine, record)
    if blocked and len(blocked) >= total:
        why = "; ".join(f"{a}: {r}" for a, r in blocked.items())
        outcomes.finish(
            engine,
            claimed,
            SendStatus.SUPPRESSED,
            SUPPRESSED,
            f"not sent: the recipient is on the suppression list ({why})",
        )
        return None
    return blocked


def frozen_mail(record: MailSendRecord) -> PreparedMail:
    """What an earlier attempt prepared; retries replay it as it is."""
    assert record.server_config_id is not None
    assert record.message_id_header is not None
    return PreparedMail(
        subject=record.rendered_subject or "",
        html=record.rendered_html,
        text=record.rendered_text,
        reply_to=record.final_reply_to,
        priority=record.final_priority,
        attachments=record.final_attachments,
        config_id=record.server_config_id,
        config_name="",
        read_receipt=record.read_receipt,
        message_id=record.message_id_header,
    )


_SERVER = Lookup(MailSendServerConfig, MailSendServerConfig.id == bindparam("id"))


def _server(config: MailSendServerConfig, settings: Settings) -> SmtpServer:
    return SmtpServer(
        key=f"{config.id}:{config.config_version}",
        host=config.host,
        port=config.port,
        security=Security(config.security),
        username=config.username,
        password=config.password,
        connect_timeout_s=settings.smtp_connect_timeout_s,
        read_timeout_s=settings.smtp_read_timeout_s,
        verify_tls=config.verify_tls,
        allow_private=outbound.allows_private(settings, config.tenant_id),
    )


def outgoing_mail(
    record: MailSendRecord,
    prepared: PreparedMail,
    config: MailSendServerConfig,
    skip: dict[str, str] | None = None,
) -> OutgoingMail:
    """The mail as the transport sends it (also what an attempt's .eml is rebuilt from):
    ``skip`` holds the recipients the suppression list left out."""
    from_addr = config.from_address or config.username or ""

    def kept(addresses: list[str] | None) -> list[str]:
        return [a for a in addresses or [] if a.strip().lower() not in (skip or {})]

    return OutgoingMail(
        message_id=prepared.message_id,
        from_addr=from_addr,
        from_name=config.from_name,
        to=kept(record.to_addrs),
        cc=kept(record.cc_addrs),
        bcc=kept(record.bcc_addrs),
        reply_to=prepared.reply_to,
        subject=prepared.subject,
        html=prepared.html,
        text=prepared.text,
        attachments=[
            Attachment(
                a["name"],
                a.get("contentType") or "application/octet-stream",
                base64.b64decode(a["content"]),
            )
            for a in prepared.attachments or []
        ],
        priority=prepared.priority,
        read_receipt_to=from_addr if prepared.read_receipt else None,
        extra_headers={"X-Postroom-Record": str(record.id)},
    )


@dataclass
class _Holding:
    """The claim as it stands now: every write of ours that bumps the version (preparation's
    write-back, a new choice of server) replaces it, so an unexpected error is written by the
    record's current version, not the claim's (which would match nothing and leave the record
    in Sending for the sweep, marked ambiguous although nothing was sent)."""

    claimed: Claimed


def _run(
    channel: Channel,
    ctx: MailContext | SmsContext,
    record: MailSendRecord | SmsSendRecord,
    attempt: Callable[[_Holding], None],
) -> None:
    """One attempt for a claimed record, in its tenant and trace, whatever its channel."""
    holding = _Holding(
        Claimed(
            channel=channel,
            id=record.id,
            version=record.version,
            tenant_id=record.tenant_id,
            retry_count=record.retry_count,
            last_code=record.error_code,
        )
    )
    with tenant_context(record.tenant_id, record.trace_id), CONFIGS.attempt():
        try:
            attempt(holding)
        except Exception as exc:  # an unexpected error must not kill the worker
            log.exception("unexpected error while delivering", extra={"record_id": record.id})
            code = type(exc).__name__
            if isinstance(exc, (DBAPIError, psycopg.Error, sqlite3.Error)):
                # One stable code for the database, whichever layer raised it: the driver's
                # class names would be classified by their words (ProgramLimitExceeded reads
                # as a quota), and SQLAlchemy's and psycopg's differ for the same failure.
                code, message = DATABASE_ERROR, f"{type(exc).__name__}: {exc}"
            else:
                message = str(exc)
            outcomes.handle_failure(ctx.engine, holding.claimed, code, message, policy=ctx.policy)


def process_mail(ctx: MailContext, record: MailSendRecord) -> None:
    """One attempt for a claimed mail record (status Sending, version as claimed)."""
    _run(Channel.MAIL, ctx, record, lambda holding: _attempt(_MAIL, ctx, record, holding))


def process_sms(ctx: SmsContext, record: SmsSendRecord) -> None:
    """One attempt for a claimed SMS record (status Sending, version as claimed)."""
    _run(Channel.SMS, ctx, record, lambda holding: _attempt(_SMS, ctx, record, holding))


# --- one attempt, whatever its channel ---------------------------------------------------------

Ctx = TypeVar("Ctx", MailContext, SmsContext)
R = TypeVar("R", MailSendRecord, SmsSendRecord)
P = TypeVar("P", PreparedMail, PreparedSms)
C = TypeVar("C", MailSendServerConfig, SmsProviderConfig)
T = TypeVar("T", SmtpServer, sms_transport.ProviderAccount)  # what the transport sends through


@dataclass(frozen=True)
class _Steps(Generic[Ctx, R, P, C, T]):
    """Where an attempt differs per channel (one per channel, made at import: nothing is
    chosen per record)."""

    channel: Channel
    build: Callable[[Engine, R, Settings], P]  # preparation's steps 1 to 4
    replayed: Callable[[R], P]  # what an earlier attempt prepared
    # The server or provider as it is now, what the transport needs of it, else why not.
    route: Callable[[Ctx, P], tuple[C | None, T | None, str]]
    rechoose: Callable[[Engine, R, Claimed, P], tuple[P, Claimed] | None]
    # The config's own resend window, checked once it is known; None: the service's, at once.
    window: Callable[[Ctx, C], float] | None
    send: Callable[[Ctx, Claimed, R, P, C, T, dict[str, str]], None]  # and its outcome


def _attempt(steps: _Steps[Ctx, R, P, C, T], ctx: Ctx, record: R, holding: _Holding) -> None:
    """One attempt, in order (docs/ARCHITECTURE.md): the deadlines, the suppression list,
    preparation on the first attempt, the server or provider as it is now (chosen again after
    a manual retry of its failure), its gate and rate limits, then the send."""
    claimed = holding.claimed
    own_window = steps.window
    early = ctx.settings.resend_window_s if own_window is None else None  # None: expiry only
    if past_deadline(ctx.engine, claimed, record, early):
        return
    skip = _suppressed(ctx.engine, claimed, record)
    if skip is None:
        return
    gate = gates.gate(ctx, steps.channel, record.id)
    gated = False
    if record.prepared_at is None:
        try:
            result = prepare(ctx.engine, record, claimed, ctx.settings, steps.build, gate)
        except PreparationFailed as failure:
            _failed(ctx, claimed, failure)
            return
        except ServerDown as down:
            _defer(ctx, claimed, record, down)
            return
        if result is None:
            return  # lost a version race: someone else moved the record on
        prepared, claimed = result
        holding.claimed = claimed
        gated = True
    else:
        prepared = steps.replayed(record)
    config, target, problem = steps.route(ctx, prepared)
    if (config is None or not config.enabled) and requeued_after_unusable_route(record):
        # Pressed Retry after that failure: choose the server or provider again, nothing else.
        try:
            chosen = steps.rechoose(ctx.engine, record, claimed, prepared)
        except PreparationFailed as failure:
            _failed(ctx, claimed, failure)
            return
        if chosen is None:
            return  # lost a version race
        prepared, claimed = chosen
        holding.claimed = claimed
        gated = False
        config, target, problem = steps.route(ctx, prepared)
    if config is None or target is None:
        outcomes.handle_failure(
            ctx.engine, claimed, MarkerCode.CONFIG_NOT_RESOLVABLE.value, problem, policy=ctx.policy
        )
        return
    claimed = replace(claimed, provider=config.name)
    holding.claimed = claimed
    if own_window is not None and past_deadline(
        ctx.engine, claimed, record, own_window(ctx, config)
    ):
        return  # past the provider's own resend window
    if not _cleared(ctx, claimed, record, None if gated else gate, config):
        return
    steps.send(ctx, claimed, record, prepared, config, target, skip)


def _send_failed(
    ctx: MailContext | SmsContext,
    claimed: Claimed,
    config: MailSendServerConfig | SmsProviderConfig,
    code: str | None,
    message: str | None,
    attempt: outcomes.Attempt,
    *,
    connection: bool,
    answered: bool,
    timed_out: bool,
    ambiguous: bool,
    retry_after_s: float | None = None,
) -> None:
    """A send that failed, either channel: tell the breaker and the route gate how
    (``gates.observed``; ``connection``: the server could not be reached), then write the failure
    with its attempt; an ambiguous one is held as Uncertain when the config says so."""
    gates.observed(
        ctx,
        claimed,
        config.id,
        answered=answered,
        down=f"{code} {message}" if connection else None,
        timed_out=timed_out,
    )
    outcomes.handle_failure(
        ctx.engine,
        claimed,
        code,
        message,
        policy=ctx.policy,
        retry_after_s=retry_after_s,
        ambiguous=ambiguous,
        hold=config.uncertain_policy == UncertainPolicy.HOLD.value,
        attempt=replace(attempt, unavailable=gates.unavailable(connection, answered)),
    )


# --- mail -------------------------------------------------------------------------------------


def _mail_route(
    ctx: MailContext, prepared: PreparedMail
) -> tuple[MailSendServerConfig | None, SmtpServer | None, str]:
    """The server a first attempt chose, or on a retry the one it froze as it is now (a saved
    change applies); its SMTP settings unless it is gone or disabled, or its password
    unreadable."""
    config = prepared.server
    problem = "the mail server this record was prepared for no longer exists"
    if config is None:
        config_id = prepared.config_id
        config = CONFIGS.get(("server", config_id), lambda: _SERVER.first(ctx.engine, id=config_id))
        if config is not None and not config.enabled:
            problem = f"the mail server {config.name!r} this record was prepared for is disabled"
    if config is None or not config.enabled:
        return config, None, problem
    try:
        key = ("smtp", config.id, config.config_version)
        return config, CONFIGS.get(key, lambda: _server(config, ctx.settings)), problem
    except SecretUnavailable as exc:
        return config, None, str(exc)


def _send_mail(
    ctx: MailContext,
    claimed: Claimed,
    record: MailSendRecord,
    prepared: PreparedMail,
    config: MailSendServerConfig,
    server: SmtpServer,
    skip: dict[str, str],
) -> None:
    mail = outgoing_mail(record, prepared, config, skip)
    started_at, started = datetime.now(UTC), time.perf_counter()
    try:
        sent = ctx.pool.send(server, mail)
    except SmtpSendError as error:
        took = time.perf_counter() - started
        SEND_DURATION.labels("mail").observe(took)
        code, message = error.code, error.message
        attempt = outcomes.Attempt(
            started_at,
            took,
            config.id,
            config.name,
            code,
            message,
            refused=smtp.refusals(error.refused),
        )
        _send_failed(
            ctx,
            claimed,
            config,
            code,
            message,
            attempt,
            connection=error.connection,
            answered=code not in _NO_ANSWER,
            timed_out=code == smtp.TIMEOUT,  # at any stage, after DATA too
            ambiguous=error.after_data,
        )
        return
    took = time.perf_counter() - started
    SEND_DURATION.labels("mail").observe(took)
    refused = {k: list(v) for k, v in sent.refused.items()}
    # Suppressed recipients were left out; the record says so beside the server's refusals.
    refused |= {a: [SUPPRESSED, why] for a, why in skip.items()}
    sent_write.record_sent(
        ctx.engine,
        claimed,
        prepared.message_id,
        refused=refused or None,
        attempt=outcomes.Attempt(started_at, took, config.id, config.name, "250", sent.reply),
        batch_wait_s=ctx.settings.sent_batch_wait_s,
    )
    if sent.refused:
        # Sent to some, refused by others: those whose own reply says they are gone go on the
        # suppression list as the refusal of a whole mail's recipients does. A transaction of
        # its own after the Sent write (which may be batched with other records'), taken only
        # by a mail with a refused recipient.
        with Session(ctx.engine) as session, session.begin():
            suppression.suppress_refused(
                session,
                Channel.MAIL,
                claimed.id,
                claimed.tenant_id,
                None,
                None,
                refused=smtp.refusals(sent.refused),
            )
    gates.observed(ctx, claimed, config.id, answered=True)


_MAIL = _Steps(
    Channel.MAIL, build_mail, frozen_mail, _mail_route, rechoose_server, None, _send_mail
)


# --- SMS --------------------------------------------------------------------------------------


def _frozen_sms(record: SmsSendRecord) -> PreparedSms:
    """What an earlier attempt prepared; retries replay it as it is."""
    assert record.provider_config_id is not None
    return PreparedSms(
        content=record.rendered_content or "",
        config_id=record.provider_config_id,
        provider_kind=record.provider_kind or "",
        config_name="",
        external_template_id=record.external_template_id,
        signature=record.signature,
        variables=record.frozen_variables,
    )


def _account(config: SmsProviderConfig, settings: Settings) -> sms_transport.ProviderAccount:
    """The adapter's view of the config (decrypts the secret: may raise SecretUnavailable)."""
    return sms_transport.ProviderAccount(
        kind=config.provider,
        name=config.name,
        base_url=config.base_url or None,
        account_id=config.account_id,
        secret=config.secret,
        sender_id=config.sender_id,
        allow_private=outbound.allows_private(settings, config.tenant_id),
    )


def _usable_provider(
    ctx: SmsContext, provider_id: int
) -> tuple[SmsProviderConfig | None, sms_transport.ProviderAccount | None, str]:
    """The provider row, its account when it can send (enabled, secret readable), and what
    is wrong with it otherwise."""
    return CONFIGS.get(("sms_provider", provider_id), lambda: _read_provider(ctx, provider_id))


def _read_provider(
    ctx: SmsContext, provider_id: int
) -> tuple[SmsProviderConfig | None, sms_transport.ProviderAccount | None, str]:
    account: sms_transport.ProviderAccount | None = None
    problem = "the SMS provider this record was prepared for no longer exists"
    with Session(reader(ctx.engine)) as session:
        # Loaded columns stay readable once the session closes (nothing expires them).
        config = session.get(SmsProviderConfig, provider_id)
        if config is not None and not config.enabled:
            problem = f"the SMS provider {config.name!r} this record was prepared for is disabled"
        elif config is not None:
            try:
                account = _account(config, ctx.settings)
            except SecretUnavailable as exc:
                problem = str(exc)
    return config, account, problem


def _sms_route(
    ctx: SmsContext, prepared: PreparedSms
) -> tuple[SmsProviderConfig | None, sms_transport.ProviderAccount | None, str]:
    return _usable_provider(ctx, prepared.config_id)


def _sms_window(ctx: SmsContext, config: SmsProviderConfig) -> float:
    """The provider's own resend window, else the service's."""
    return ctx.settings.resend_window_s if config.retry_window_s is None else config.retry_window_s


def _send_sms(
    ctx: SmsContext,
    claimed: Claimed,
    record: SmsSendRecord,
    prepared: PreparedSms,
    config: SmsProviderConfig,
    account: sms_transport.ProviderAccount,
    _skip: dict[str, str],
) -> None:
    outgoing = sms_transport.OutgoingSms(
        record_id=record.id,
        to=record.phone_number,
        content=prepared.content,
        idempotency_key=sms_transport.idempotency_key(record.id),
        external_template_id=prepared.external_template_id,
        signature=prepared.signature,
        variables=prepared.variables,
    )
    started_at, started = datetime.now(UTC), time.perf_counter()
    answer = sms_transport.send(ctx.client, account, outgoing)
    took = time.perf_counter() - started
    SEND_DURATION.labels("sms").observe(took)
    attempt = outcomes.Attempt(
        started_at,
        took,
        config.id,
        config.name,
        answer.reply or answer.code,
        answer.message,
    )
    if answer.accepted:
        sent_write.record_sent(
            ctx.engine,
            claimed,
            answer.provider_message_id,
            duplicate=answer.duplicate,
            attempt=attempt,
        )
        gates.observed(ctx, claimed, config.id, answered=True)
        return
    _send_failed(
        ctx,
        claimed,
        config,
        answer.code,
        answer.message,
        attempt,
        connection=answer.connection,
        answered=answer.code not in _NO_ANSWER and not answer.ambiguous,
        timed_out=answer.code == sms_transport.TIMEOUT,  # connecting, or awaiting the answer
        ambiguous=answer.ambiguous,
        retry_after_s=answer.retry_after_s,
    )


_SMS = _Steps(
    Channel.SMS, built_sms, _frozen_sms, _sms_route, rechoose_provider, _sms_window, _send_sms
)
