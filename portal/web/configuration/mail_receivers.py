"""Bounce mailboxes: the IMAP mailboxes a tier's bounces and read receipts arrive in; create,
edit, enable or disable, delete, test, and how far the fetch job has read each one.

The password is write-only, as a mail server's: no page or response carries it, not even
masked; a blank field keeps the stored one, and it is encrypted at rest (secretbox). A mailbox
whose messages are stored (received mail keeps its config id) is never deleted, only disabled;
Delete first shows a confirm page saying which of the two it would do.
"Test connection" logs in and opens the folder read-only (EXAMINE), exactly as the fetch job
does, and reports what it found: nothing in the mailbox changes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from flask import Blueprint, flash, redirect, request, url_for
from flask.typing import ResponseReturnValue
from sqlalchemy import func, select

from portal.extensions import db
from portal.messaging.after_send.receiving.fetch import UNREADABLE_PASSWORD, plain_error
from portal.messaging.after_send.receiving.imap import ImapError, MailboxAddress, ReadOnlyMailbox
from portal.messaging.sending import outbound
from portal.models import (
    AuditAction,
    MailReceiveConfig,
    MailReceiveState,
    ReceivedMail,
    SmtpSecurity,
)
from portal.models.secretbox import SecretUnavailable
from portal.web.access import Permission, requires
from portal.web.configuration import config_pages
from portal.web.forms import Form, owned, settings, viewed_tier

bp = Blueprint("mail_receivers", __name__, url_prefix="/mail-receivers")

LABELS = config_pages.SERVER_LABELS | {
    "secret": "Password",  # the column's name, for the audit remark of a change
    "folder": "Folder",
    "enabled": "Enabled",
}
SECURITY_OPTIONS = [
    (SmtpSecurity.SSL.value, "IMAPS: TLS from the start (usually port 993)"),
    (SmtpSecurity.STARTTLS.value, "STARTTLS (usually port 143)"),
    (SmtpSecurity.PLAIN.value, "None (plain text; local servers only)"),
]
DEFAULT_PORTS = {SmtpSecurity.SSL.value: 993}  # the others: 143
TEST_TIMEOUT_S = 10.0  # a page waits for the answer: never the fetch job's 30 s


def _read(form: Form, box: MailReceiveConfig, tier: int) -> bool:
    """Check the form and copy it onto ``box``; False (nothing usable) when it has errors."""
    name = form.text("name", required=True, max_len=200)
    host = form.text("host", required=True, max_len=255)
    port = form.number("port", lo=1, hi=65535)
    security = form.choice("security", [s.value for s in SmtpSecurity], SmtpSecurity.SSL.value)
    username = form.text("username", required=True, max_len=320)
    password = form.text("password", max_len=500)
    folder = form.text("folder", max_len=200)
    config_pages.check_host(
        form, tier, host, port or 993, forbidden="/@:", example="imap.example.com"
    )
    if not box.secret_encrypted and password is None and "password" not in form.errors:
        form.fail("password", "is required (the mailbox is read by logging in)")
    if form.flag("remove_password") and password is None:
        form.fail("password", "cannot be removed: the mailbox is read by logging in")
    config_pages.check_name(PAGES, form, box, tier, name)
    if not form.ok:
        return False
    assert name is not None
    assert host is not None
    assert username is not None
    box.tenant_id = tier
    box.name = name
    box.host = host
    box.security = security
    box.port = port or DEFAULT_PORTS.get(security, 143)
    box.verify_tls = form.flag("verify_tls")
    box.username = username
    if password is not None:
        try:
            box.secret = password
        except SecretUnavailable:  # the old one is unreadable (SECRET_KEY rotated): replace it
            box.secret_encrypted = None
            box.secret = password
    box.folder = folder or "INBOX"
    box.enabled = form.flag("enabled")
    return True


# --- how far the fetch job has read ---------------------------------------------------------


@dataclass(frozen=True)
class Reading:
    """What the fetch job has left behind for one mailbox: its watermark per folder, how its
    last run over the mailbox's folder went, and the messages it stored (with the newest that
    could not be read or applied)."""

    folder: str  # the folder the mailbox is set to read
    folders: list[MailReceiveState]
    stored: int = 0
    broken: int = 0
    last_stored_at: datetime | None = None
    last_error: str | None = None
    last_error_at: datetime | None = None
    last_error_uid: int | None = None

    @property
    def opened(self) -> list[MailReceiveState]:
        """The folders the job has opened at least once (a row without UIDVALIDITY only holds
        failed runs)."""
        return [state for state in self.folders if state.uidvalidity is not None]

    @property
    def last_read_at(self) -> datetime | None:
        times = [state.updated_time for state in self.opened if state.updated_time]
        return max(times) if times else None

    @property
    def current(self) -> MailReceiveState | None:
        """The state of the folder the mailbox is set to read (None: no run has tried it)."""
        return next((state for state in self.folders if state.folder == self.folder), None)

    @property
    def last_run_at(self) -> datetime | None:
        return self.current.last_run_at if self.current else None

    @property
    def run_error(self) -> str | None:
        """Why the last run could not read the folder (None: it could, or none ran yet)."""
        return self.current.last_error if self.current else None

    @property
    def failing_since(self) -> datetime | None:
        return self.current.last_error_at if self.current and self.current.last_error else None


def readings(
    tier: int, boxes: Sequence[MailReceiveConfig], *, with_error: bool = False
) -> dict[int, Reading]:
    """Each mailbox's Reading (one query for the watermarks, one for the counts)."""
    if not boxes:
        return {}
    config_ids = [box.id for box in boxes]
    states: dict[int, list[MailReceiveState]] = {i: [] for i in config_ids}
    for state in db.session.scalars(
        select(MailReceiveState)
        .where(MailReceiveState.config_id.in_(config_ids))
        .order_by(MailReceiveState.folder)
    ):
        states[state.config_id].append(state)
    counts = {
        config_id: (stored, broken, last)
        for config_id, stored, broken, last in db.session.execute(
            select(
                ReceivedMail.config_id,
                func.count(),
                func.count(ReceivedMail.error),
                func.max(ReceivedMail.fetched_at),
            )
            .where(ReceivedMail.tenant_id == tier, ReceivedMail.config_id.in_(config_ids))
            .group_by(ReceivedMail.config_id)
        )
    }
    result = {}
    for box in boxes:
        config_id = box.id
        stored, broken, last = counts.get(config_id, (0, 0, None))
        error: Any = None
        if with_error and broken:
            error = db.session.execute(
                select(ReceivedMail.error, ReceivedMail.fetched_at, ReceivedMail.uid)
                .where(
                    ReceivedMail.tenant_id == tier,
                    ReceivedMail.config_id == config_id,
                    ReceivedMail.error.is_not(None),
                )
                .order_by(ReceivedMail.id.desc())
                .limit(1)
            ).first()
        result[config_id] = Reading(
            folder=box.folder,
            folders=states[config_id],
            stored=stored,
            broken=broken,
            last_stored_at=last,
            last_error=error.error if error else None,
            last_error_at=error.fetched_at if error else None,
            last_error_uid=error.uid if error else None,
        )
    return result


# --- views ------------------------------------------------------------------------------------


def _context(box: MailReceiveConfig | None) -> dict[str, Any]:
    """What the edit page shows besides the form: how far a saved mailbox has been read."""
    reading = None
    if box is not None:
        reading = readings(box.tenant_id, [box], with_error=True)[box.id]
    return {"security_options": SECURITY_OPTIONS, "reading": reading}


def _listing(tier: int, boxes: Sequence[MailReceiveConfig]) -> dict[str, Any]:
    """The list page: each mailbox and how far it has been read."""
    return {"boxes": boxes, "readings": readings(tier, boxes)}


@bp.post("/<int:box_id>/enabled")
@requires(Permission.EDIT_CONFIG)
def enable(box_id: int) -> ResponseReturnValue:
    """Turn reading on (``enabled=on``) or off (anything else) without the whole form."""
    box = owned(MailReceiveConfig, box_id, viewed_tier())
    box.enabled = Form(request.form, LABELS).flag("enabled")
    _audit_enabled(box, "")
    db.session.commit()
    if box.enabled:
        flash(f"Bounce mailbox {box.name!r} enabled: the next fetch run reads it.", "success")
    else:
        flash(f"Bounce mailbox {box.name!r} disabled: it is no longer read.", "success")
    fallback = url_for("mail_receivers.index")
    target = request.form.get("next", "")
    edit_url = PAGES.url("edit", box)
    return redirect(edit_url if target == edit_url else fallback, 303)


def _audit_enabled(box: MailReceiveConfig, why: str) -> None:
    """The audit row of turning reading on or off (when it changed)."""
    changed = config_pages.changed_fields(PAGES, box)
    if changed:
        state = "enabled" if box.enabled else "disabled"
        PAGES.audited(AuditAction.CONFIG_UPDATE, box, f"{PAGES.called(box)}: {state}{why}")


def _stored(box: MailReceiveConfig) -> int:
    """How many messages read from the mailbox are stored (they keep its config id)."""
    return (
        db.session.scalar(
            select(func.count()).where(
                ReceivedMail.tenant_id == box.tenant_id, ReceivedMail.config_id == box.id
            )
        )
        or 0
    )


def _deletion(box: MailReceiveConfig, stored: int) -> config_pages.Deletion:
    """What deleting the mailbox would do: delete it, or (messages stored) disable it."""
    if stored:
        return config_pages.Deletion(
            title=f"Delete bounce mailbox {box.name!r}?",
            refused=(
                f"{stored:,} message{'s' if stored != 1 else ''} read from this mailbox "
                f"{'are' if stored != 1 else 'is'} stored (bounces and receipts point at it), "
                "so it cannot be deleted."
            ),
            facts=[
                "It can be disabled instead: it is no longer read, and nothing in the mailbox "
                "changes."
                if box.enabled
                else "It is already disabled: it is no longer read."
            ],
            action=PAGES.url("delete", box),
            back=PAGES.url("edit", box),
            button="Disable this mailbox" if box.enabled else None,
        )
    return config_pages.Deletion(
        title=f"Delete bounce mailbox {box.name!r}?",
        facts=[
            "No message read from it is stored. It is no longer read, and how far it was read "
            "is forgotten; nothing in the mailbox itself changes."
        ],
        action=PAGES.url("delete", box),
        back=PAGES.url("edit", box),
        button="Delete this mailbox",
    )


@bp.route("/<int:box_id>/delete", methods=["GET", "POST"])
@requires(Permission.EDIT_CONFIG)
def delete(box_id: int) -> ResponseReturnValue:
    """Say what deleting the mailbox would do; with ``confirm=yes``, delete a mailbox with no
    stored messages, or disable one with stored messages."""
    box = owned(MailReceiveConfig, box_id, viewed_tier())
    stored = _stored(box)
    if not config_pages.confirmed():
        return config_pages.confirm_page(_deletion(box, stored))
    if stored:
        if box.enabled:
            box.enabled = False
            _audit_enabled(box, " (it has stored messages, so it was not deleted)")
            db.session.commit()
        flash(
            "Messages read from this mailbox are stored (bounces and receipts point at it), so "
            "it cannot be deleted. It is disabled instead: it is no longer read.",
            "error",
        )
        return redirect(PAGES.url("edit", box), 303)
    return config_pages.delete(PAGES, box)


@dataclass(frozen=True)
class ConnectionResult:
    error: str | None = None
    exists: int | None = None
    uidvalidity: int | None = None
    uidnext: int | None = None
    latency_ms: int = 0


def mailbox_address(box: MailReceiveConfig, timeout_s: float) -> MailboxAddress | str:
    """Where and how to log in (the decrypted password), or why we cannot try."""
    try:
        password = box.secret
    except SecretUnavailable:
        return UNREADABLE_PASSWORD
    if not password:
        return "No password is stored: enter it and save."
    try:
        security = SmtpSecurity(box.security)
    except ValueError:
        return f"The security setting {box.security!r} is unknown: choose one and save."
    return MailboxAddress(
        host=box.host,
        port=box.port,
        security=security,
        username=box.username,
        password=password,
        folder=box.folder,
        verify_tls=box.verify_tls,
        timeout_s=timeout_s,
        allow_private=outbound.allows_private(settings(), box.tenant_id),
    )


def check_connection(address: MailboxAddress) -> ConnectionResult:
    """Log in, open the folder read-only (EXAMINE), log out: what it holds, or the error."""
    started = time.monotonic()
    try:
        with ReadOnlyMailbox(address) as mailbox:
            folder = mailbox.folder
    except ImapError as exc:
        latency = round((time.monotonic() - started) * 1000)
        return ConnectionResult(plain_error(str(exc), address), latency_ms=latency)
    latency = round((time.monotonic() - started) * 1000)
    assert folder is not None
    return ConnectionResult(
        exists=folder.exists,
        uidvalidity=folder.uidvalidity,
        uidnext=folder.uidnext,
        latency_ms=latency,
    )


def _check(box: MailReceiveConfig, tier: int) -> dict[str, object]:
    """Log in to the saved mailbox and open its folder read-only: its count or the error."""
    timeout = min(TEST_TIMEOUT_S, settings().outbound_test_timeout_s)
    address = mailbox_address(box, timeout)
    db.session.close()  # no database connection held while the IMAP server answers
    if isinstance(address, str):
        return {"result": ConnectionResult(address)}
    with outbound.test_slot(settings(), tier):
        return {"result": check_connection(address)}


PAGES = config_pages.Pages(
    model=MailReceiveConfig,
    blueprint="mail_receivers",
    row_name="box",
    noun="bounce mailbox",
    title="Bounce mailboxes",
    add_title="Add a bounce mailbox",
    labels=LABELS,
    read=_read,
    listing=_listing,
    context=_context,
    check=_check,
    audit_type="mail_receiver",
    defaults={
        "port": "993",
        "security": SmtpSecurity.SSL.value,
        "verify_tls": "on",
        "folder": "INBOX",
        "enabled": "on",
    },
    added_hint=" Test its connection below.",
)
config_pages.add_routes(bp, PAGES)
