"""The mail fetch chore: read every enabled bounce mailbox, store each message once, apply it.

For each enabled MailReceiveConfig, in its tenant's context:

- open the folder read-only (EXAMINE) and compare its UIDVALIDITY with ours: a different one
  means the UIDs were renumbered (the folder was recreated), so the watermark starts again at
  0; the messages read again are not stored twice (below);
- take at most ``max_messages`` UIDs above the watermark, oldest first;
- per message, one short transaction: move the watermark to its UID (by compare-and-set, so two
  overlapping runs never both take a message), store it once (unique on config + Message-ID,
  or a sha256 of the content when it has none) and apply it to its send record;
- a message that cannot be read or applied is stored with the error and the watermark moves
  on: one broken message never blocks the rest. The server is asked twice (on a fresh
  connection the second time) before a message counts as unreadable. A database that fails
  (connection, timeout, deadlock) is not the message's fault: the run stops where it is and the
  next one takes the message again.

Every run is written on the (config, folder)'s state row, created if the folder was never
opened: ``last_run_at``, and ``last_error`` in plain words (connection refused, login failed,
folder missing, timeout, TLS) when it could not read the folder, cleared by a run that could.
So a mailbox that cannot be reached shows on its portal page, not only in the worker's log.

Nothing here holds a database connection while it talks to the IMAP server.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import asdict, dataclass, field, replace
from email.parser import BytesHeaderParser
from email.policy import compat32
from typing import Any

from sqlalchemy import Engine, func, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError, InterfaceError, OperationalError
from sqlalchemy.orm import Session

from portal.config import Settings
from portal.messaging.after_send.receiving import apply, bounces
from portal.messaging.after_send.receiving.imap import (
    Fetched,
    ImapError,
    MailboxAddress,
    ReadOnlyMailbox,
)
from portal.messaging.sending import outbound
from portal.messaging.sending.outcomes import stored_text
from portal.models import MailReceiveConfig, MailReceiveState, ReceivedMail, SmtpSecurity, db_now
from portal.models.secretbox import SecretUnavailable
from portal.tenancy import tenant_context

log = logging.getLogger("portal.receiving")

MAX_MESSAGES_PER_RUN = 100  # per mailbox and run; the rest waits for the next run
MAX_MESSAGE_BYTES = 256 * 1024  # read and kept per message; a DSN's report comes first
MAX_BROKEN_PER_RUN = 10  # unreadable messages (each costs a reconnect) before a mailbox stops
IMAP_TIMEOUT_S = 30.0
MAX_ID_CHARS = 300
MAX_SUBJECT_CHARS = 1000
MAX_ERROR_CHARS = 2000
# SECRET_KEY changed since the password was saved (the portal says the same on its page).
UNREADABLE_PASSWORD = "The stored password cannot be decrypted: enter it again and save."


@dataclass(frozen=True)
class FetchLimits:
    max_messages: int = MAX_MESSAGES_PER_RUN
    max_bytes: int = MAX_MESSAGE_BYTES
    max_broken: int = MAX_BROKEN_PER_RUN
    timeout_s: float = IMAP_TIMEOUT_S
    # Whose mailboxes may reach private addresses (portal.messaging.sending.outbound); None: the
    # environment's settings.
    settings: Settings | None = None


@dataclass
class MailboxRun:
    """What one run did with one mailbox."""

    config_id: int
    tenant_id: int
    folder: str
    stored: int = 0
    duplicates: int = 0
    broken: int = 0
    bounces_failed: int = 0  # Sent records turned Failed
    receipts_read: int = 0
    uidvalidity_reset: bool = False
    last_uid: int = 0
    error: str | None = None


@dataclass
class FetchReport:
    mailboxes: list[MailboxRun] = field(default_factory=list)

    def total(self, name: str) -> int:
        return sum(int(getattr(run, name)) for run in self.mailboxes)

    def as_dict(self) -> dict[str, Any]:
        keys = ("stored", "duplicates", "broken", "bounces_failed", "receipts_read")
        return {k: self.total(k) for k in keys} | {
            "mailboxes": [asdict(run) for run in self.mailboxes]
        }


class _WatermarkMoved(Exception):
    """Another run moved this mailbox's watermark: it owns the messages from here on."""


@dataclass
class _Watermark:
    state_id: int
    uidvalidity: int
    last_uid: int


# --- the chore -------------------------------------------------------------------------------


def fetch_all(engine: Engine, limits: FetchLimits | None = None) -> FetchReport:
    """Read every enabled mailbox once (the scheduled job); one failing mailbox never stops
    the others."""
    limits = limits or FetchLimits()
    if limits.settings is None:
        limits = replace(limits, settings=Settings.from_env())
    with Session(engine) as session:
        configs = session.execute(
            select(MailReceiveConfig.id, MailReceiveConfig.tenant_id, MailReceiveConfig.folder)
            .where(MailReceiveConfig.enabled.is_(True))
            .order_by(MailReceiveConfig.id)
        ).all()
    report = FetchReport()
    for config_id, tenant_id, folder in configs:
        with tenant_context(tenant_id):
            try:
                run = fetch_mailbox(engine, config_id, limits)
            except Exception as exc:
                log.exception("mailbox read failed", extra={"config_id": config_id})
                said = (str(exc).splitlines() or [""])[0]  # not the SQL and its parameters
                error = f"The run stopped: {type(exc).__name__}: {said}"
                run = MailboxRun(config_id, tenant_id, folder, error=error)
                try:  # the database may be what failed: then the log is all there is
                    record_run(engine, config_id, folder, error)
                except Exception:
                    log.exception("mailbox run not recorded", extra={"config_id": config_id})
        if run is not None:
            report.mailboxes.append(run)
    return report


def fetch_mailbox(engine: Engine, config_id: int, limits: FetchLimits) -> MailboxRun | None:
    """One run over one mailbox, recorded on its folder's state; None if the config is gone
    or disabled meanwhile."""
    with Session(engine) as session:
        config = session.get(MailReceiveConfig, config_id)
        if config is None or not config.enabled:
            return None
        run = MailboxRun(config.id, config.tenant_id, config.folder)
        mailbox_name = f"bounce mailbox {config.name}"
        try:
            address = MailboxAddress(
                host=config.host,
                port=config.port,
                security=SmtpSecurity(config.security),
                username=config.username,
                password=config.secret or "",
                folder=config.folder,
                verify_tls=config.verify_tls,
                timeout_s=limits.timeout_s,
                allow_private=outbound.allows_private(
                    limits.settings or Settings.from_env(), config.tenant_id
                ),
            )
        except SecretUnavailable as exc:
            run.error = UNREADABLE_PASSWORD
            log.error("mailbox not read: %s", exc, extra={"config_id": config_id})
        except ValueError as exc:
            run.error = f"The security setting {config.security!r} is unknown: choose one and save."
            log.error("mailbox not read: %s", exc, extra={"config_id": config_id})
    if run.error is not None:
        record_run(engine, config_id, run.folder, run.error)
        return run
    failure = _read_mailbox(engine, config_id, run, address, limits, mailbox_name)
    record_run(engine, config_id, address.folder, failure)
    if run.stored or run.broken or run.error:
        log.info(
            "mailbox read",
            extra={"config_id": config_id, "stored": run.stored, "broken": run.broken},
        )
    return run


def _read_mailbox(
    engine: Engine,
    config_id: int,
    run: MailboxRun,
    address: MailboxAddress,
    limits: FetchLimits,
    mailbox_name: str,
) -> str | None:
    """Read the new messages into ``run``; why the folder could not be read (None: it was).

    Too many unreadable messages end the run early, but the folder was read: those messages
    are stored with their errors and shown as such, so that is not the run's failure.
    """
    mailbox = ReadOnlyMailbox(address)
    try:
        folder = mailbox.open()
        mark = _watermark(engine, config_id, address.folder, folder.uidvalidity, run)
        run.last_uid = mark.last_uid
        for uid in mailbox.uids_after(mark.last_uid, limits.max_messages):
            fetched, problem = _fetch(mailbox, uid, limits.max_bytes)
            outcome = _process(engine, config_id, run, mark, uid, fetched, problem, mailbox_name)
            run.last_uid = mark.last_uid
            _count(run, outcome)
            if run.broken >= limits.max_broken:
                run.error = f"{run.broken} unreadable messages; the rest waits for the next run"
                break
    except _WatermarkMoved:
        log.info("another run is reading this mailbox", extra={"config_id": config_id})
    except ImapError as exc:
        run.error = plain_error(str(exc), address)
        log.error("mailbox read stopped: %s", exc, extra={"config_id": config_id})
        return run.error
    finally:
        mailbox.close()
    return None


def plain_error(error: str, address: MailboxAddress) -> str:
    """An IMAP error said plainly: what went wrong (refused by our policy, connection refused,
    host not found, timeout, TLS, login failed, folder missing). Never the server's or the
    library's words: a tenant must not read what some service at a host and port says."""
    lowered = error.lower()
    if lowered.startswith("refused: the server is refused"):
        return f"Not allowed. {address.host}: {outbound.REFUSED_ADDRESS}."
    if "cannot open folder" in lowered:
        return f"Folder missing. Logged in, but the folder {address.folder!r} cannot be opened."
    if "authenticationfailed" in lowered or "authentication failed" in lowered:
        return "Login failed. The server refused the username or password."
    if "login" in lowered and lowered.startswith("error:"):  # another refusal of LOGIN
        return "Login failed. The server refused the login."
    if "certificate" in lowered:
        return "TLS failed. The server's TLS certificate was not accepted."
    if lowered.startswith(("sslerror", "sslzeroreturnerror", "sleoferror")) or "[ssl" in lowered:
        return "TLS failed. No TLS connection could be set up with the server."
    if "timed out" in lowered or "timeout" in lowered:
        return "Timed out. The server did not answer in time."
    if "refused" in lowered:
        return f"Connection refused. Nothing answers at {address.host}:{address.port}."
    if "gaierror" in lowered or "name or service not known" in lowered:
        return f"Host not found. The name {address.host!r} cannot be resolved."
    return "The mailbox could not be read: the server's answer was not one of an IMAP server."


def record_run(engine: Engine, config_id: int, folder: str, error: str | None) -> None:
    """Write one run's outcome on the (config, folder)'s state, creating the row when the
    folder was never opened: ``last_run_at``; ``last_error`` (None clears it) and
    ``last_error_at``, when this run of failures began. "Last read" (updated_time) stays."""
    now = db_now()
    if error is None:
        outcome: dict[str, Any] = {"last_error": None, "last_error_at": None}
    else:
        outcome = {
            "last_error": stored_text(error, MAX_ERROR_CHARS),
            "last_error_at": func.coalesce(MailReceiveState.last_error_at, now),
        }
    first = outcome | {"last_error_at": now if error is not None else None}
    try:
        with Session(engine) as session, session.begin():
            dialect = session.get_bind().dialect.name
            insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
            session.execute(
                insert(MailReceiveState)
                .values(config_id=config_id, folder=folder, last_uid=0, last_run_at=now, **first)
                .on_conflict_do_update(
                    index_elements=["config_id", "folder"],
                    set_={"last_run_at": now, **outcome},
                )
            )
    except IntegrityError:  # the config was deleted during the run: nothing to show it on
        log.info("mailbox run not recorded: config gone", extra={"config_id": config_id})


def _fetch(mailbox: ReadOnlyMailbox, uid: int, max_bytes: int) -> tuple[Fetched | None, str | None]:
    """(the message, or None if it is gone; the problem if it cannot be read).

    A failed FETCH is tried once more on a fresh connection: servers drop the connection over
    a message they cannot read (Dovecot does), and a dropped connection may be all it was.
    A connection that cannot be opened again raises ImapError and ends the run.
    """
    problem = None
    for _attempt in range(2):
        if not mailbox.connected:
            mailbox.reopen()
        try:
            return mailbox.fetch(uid, max_bytes), None
        except ImapError as exc:
            mailbox.close()
            problem = str(exc)
    return None, problem


def _count(run: MailboxRun, outcome: str) -> None:
    if outcome == "duplicate":
        run.duplicates += 1
    elif outcome == "broken":
        run.broken += 1
        run.stored += 1
    elif outcome != "gone":
        run.stored += 1
        if outcome == apply.Outcome.FAILED:
            run.bounces_failed += 1
        elif outcome == apply.Outcome.READ:
            run.receipts_read += 1


# --- one message -----------------------------------------------------------------------------


def _process(
    engine: Engine,
    config_id: int,
    run: MailboxRun,
    mark: _Watermark,
    uid: int,
    fetched: Fetched | None,
    problem: str | None,
    mailbox_name: str,
) -> str:
    """Store and apply one message in one transaction with its watermark move."""
    if fetched is None and problem is None:
        with Session(engine) as session, session.begin():
            _advance(session, mark, uid)
        mark.last_uid = uid
        return "gone"  # expunged between SEARCH and FETCH
    values = _base_values(config_id, run, uid, fetched)
    if fetched is not None and problem is None:
        try:
            with Session(engine) as session, session.begin():
                _advance(session, mark, uid)
                outcome = _store_and_apply(session, run.tenant_id, values, fetched, mailbox_name)
            mark.last_uid = uid
            return outcome
        except (_WatermarkMoved, OperationalError, InterfaceError):
            raise  # the database's trouble, not the message's: this run stops, the next retries
        except Exception as exc:  # a broken message is stored with the error, and passed
            problem = f"{type(exc).__name__}: {exc}"
            log.exception(
                "received message not applied", extra={"config_id": config_id, "uid": uid}
            )
    broken = values | {"error": (problem or "unknown error")[:2000], "processed_at": db_now()}
    try:
        with Session(engine) as session, session.begin():
            _advance(session, mark, uid)
            _insert(session, broken)
    except _WatermarkMoved:
        raise
    except Exception:
        # Even the row would not store: keep where it was and why, without its content.
        log.exception("broken message stored without its content", extra={"uid": uid})
        with Session(engine) as session, session.begin():
            _advance(session, mark, uid)
            _insert(session, _bare(broken, run, uid))
    mark.last_uid = uid
    log.warning("broken message stored with its error: %s", problem, extra={"uid": uid})
    return "broken"


def _store_and_apply(
    session: Session, tenant_id: int, values: dict[str, Any], fetched: Fetched, by: str
) -> str:
    report = bounces.read(fetched.data)
    values = values | {
        "dedup_key": dedup_key(report.message_id, fetched),
        "message_id": _clip(report.message_id, MAX_ID_CHARS),
        "from_addr": _clip(report.from_addr, 320),
        "subject": _clip(report.subject, MAX_SUBJECT_CHARS),
        "kind": report.kind.value,
    }
    row_id = _insert(session, values)
    if row_id is None:
        return "duplicate"
    applied = apply.apply_report(session, tenant_id, report, by=by)
    session.execute(
        update(ReceivedMail)
        .where(ReceivedMail.id == row_id)
        .values(
            record_id=applied.record_id,
            bounce_status=applied.bounce_status.value if applied.bounce_status else None,
            bounce_code=_clip(applied.bounce_code, 64),
            processed_at=db_now(),
        )
    )
    return applied.outcome.value


def dedup_key(message_id: str | None, fetched: Fetched) -> str:
    """``mid:<Message-ID>``, or ``sha256:<hex>`` of the content (and its size) without one."""
    if message_id:
        key = f"mid:{message_id}"
        if len(key) <= MAX_ID_CHARS:
            return key
        return "mid-sha256:" + hashlib.sha256(message_id.encode()).hexdigest()
    digest = hashlib.sha256(fetched.data)
    digest.update(f"/{fetched.size}".encode())
    return "sha256:" + digest.hexdigest()


def _base_values(
    config_id: int, run: MailboxRun, uid: int, fetched: Fetched | None
) -> dict[str, Any]:
    """The row for a message as far as it can be read without the full parser."""
    values: dict[str, Any] = {
        "tenant_id": run.tenant_id,
        "config_id": config_id,
        "folder": run.folder,
        "uid": uid,
        "kind": bounces.Kind.OTHER.value,
        "size": 0,
        "truncated": False,
    }
    if fetched is None:
        # Unreadable: known by its place only (a new UIDVALIDITY makes it a new place).
        return _bare(values, run, uid)
    message_id = None
    subject = None
    try:
        headers = BytesHeaderParser(policy=compat32).parsebytes(fetched.data)
        found = bounces.message_ids([str(headers.get("Message-ID", ""))])
        message_id = found[0] if found else None
        subject = bounces.header_text(headers.get("Subject"))
    except Exception:  # the full parse will say what is wrong
        pass
    values |= {
        "dedup_key": dedup_key(message_id, fetched),
        "message_id": _clip(message_id, MAX_ID_CHARS),
        "subject": _clip(subject, MAX_SUBJECT_CHARS),
        "size": fetched.size,
        "raw": _text(fetched.data),
        "truncated": fetched.truncated,
    }
    if fetched.truncated:
        values["truncation_reason"] = (
            f"the message is {fetched.size} bytes; the first {len(fetched.data)} were read "
            f"and kept (limit {len(fetched.data)} bytes a message)"
        )
    return values


def _bare(values: dict[str, Any], run: MailboxRun, uid: int) -> dict[str, Any]:
    keep = ("tenant_id", "config_id", "folder", "uid", "kind", "size", "truncated", "error")
    bare = {k: values[k] for k in keep if k in values}
    return bare | {
        "dedup_key": f"uid:{run.config_id}:{run.folder}:{uid}"[:MAX_ID_CHARS],
        "processed_at": db_now(),
    }


def _text(data: bytes) -> str:
    """Bytes as storable text: UTF-8 (anything else replaced), no NUL (PostgreSQL refuses it)."""
    return data.decode("utf-8", "replace").replace("\x00", "\ufffd")


def _clip(value: str | None, limit: int) -> str | None:
    if value is None:
        return None
    value = value.replace("\x00", "\ufffd")
    return value[:limit]


def _insert(session: Session, values: dict[str, Any]) -> int | None:
    """Insert the row unless (config, dedup key) is stored already; its id, or None."""
    dialect = session.get_bind().dialect.name
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    stmt = (
        insert(ReceivedMail)
        .values(**values)
        .on_conflict_do_nothing(index_elements=["config_id", "dedup_key"])
        .returning(ReceivedMail.id)
    )
    return session.scalar(stmt)


# --- the watermark ---------------------------------------------------------------------------


def _watermark(
    engine: Engine, config_id: int, folder: str, uidvalidity: int, run: MailboxRun
) -> _Watermark:
    """This (config, folder)'s watermark, reset to 0 when the server's UIDVALIDITY changed."""
    with Session(engine) as session, session.begin():
        dialect = session.get_bind().dialect.name
        insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
        session.execute(
            insert(MailReceiveState)
            .values(config_id=config_id, folder=folder, uidvalidity=uidvalidity, last_uid=0)
            .on_conflict_do_nothing(index_elements=["config_id", "folder"])
        )
        state = session.execute(
            select(MailReceiveState.id, MailReceiveState.uidvalidity, MailReceiveState.last_uid)
            .where(MailReceiveState.config_id == config_id, MailReceiveState.folder == folder)
            .with_for_update()
        ).one()
        state_id, known, last_uid = state
        # The folder opened: that is "last read" for the portal, even with nothing new.
        session.execute(
            update(MailReceiveState)
            .where(MailReceiveState.id == state_id)
            .values(updated_time=db_now())
        )
        if known is None:  # the row of a folder whose runs so far all failed: first opened now
            session.execute(
                update(MailReceiveState)
                .where(MailReceiveState.id == state_id)
                .values(uidvalidity=uidvalidity, updated_time=db_now())
            )
        elif known != uidvalidity:
            session.execute(
                update(MailReceiveState)
                .where(MailReceiveState.id == state_id)
                .values(uidvalidity=uidvalidity, last_uid=0, updated_time=db_now())
            )
            log.warning(
                "UIDVALIDITY changed (%s -> %s): reading the folder again; messages already "
                "stored are not stored twice",
                known,
                uidvalidity,
                extra={"config_id": config_id},
            )
            run.uidvalidity_reset = True
            last_uid = 0
    return _Watermark(state_id, uidvalidity, last_uid)


def _advance(session: Session, mark: _Watermark, uid: int) -> None:
    """Move the watermark from where this run left it to ``uid`` (compare-and-set)."""
    result = session.execute(
        update(MailReceiveState)
        .where(
            MailReceiveState.id == mark.state_id,
            MailReceiveState.uidvalidity == mark.uidvalidity,
            MailReceiveState.last_uid == mark.last_uid,
        )
        .values(last_uid=uid, updated_time=db_now())
    )
    if result.rowcount != 1:  # type: ignore[attr-defined]
        raise _WatermarkMoved()


__all__ = [
    "FetchLimits",
    "FetchReport",
    "MailboxRun",
    "dedup_key",
    "fetch_all",
    "fetch_mailbox",
    "plain_error",
    "record_run",
]
