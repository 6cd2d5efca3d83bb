"""The flow the configuration pages share (mail servers, bounce mailboxes, SMS providers): the
list, the edit page, adding and saving a row with its name unique in the tier, deleting after a
confirm page, the audit row of each change, and Test connection within the caps.

Each module describes its row as a ``Pages``, as the template editor's channels describe
themselves as a ``template_pages.Kind``; ``add_routes`` gives its blueprint the views that are
the same for every row (index, new, create, edit, update, test, and for a server or provider
delete), and the module keeps only what is its own: its fields, what its list and edit page
show besides the rows, what deleting would do, and how its connection is tested. Every edit
page extends ``templates/shared/config_edit.html``, every connection test page is
``templates/shared/config_test.html``.

Deleting takes two steps and no JavaScript: the Delete button (a GET, or a POST without
``confirm=yes``) answers with ``templates/shared/confirm_delete.html``, which says what the
deletion would do; only its own POST, with ``confirm=yes``, acts. Every create, update and
delete adds an audit row (CONFIG_CREATE / CONFIG_UPDATE / CONFIG_DELETE) to the transaction
that makes the change; an update's remark names the fields that changed, never a value.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from flask import Blueprint, Response, flash, redirect, render_template, request, url_for
from flask.typing import ResponseReturnValue
from markupsafe import escape
from sqlalchemy import ColumnElement, func, inspect, or_, select, true
from sqlalchemy import update as sql_update
from sqlalchemy.exc import IntegrityError

from portal.extensions import db
from portal.messaging.sending import health, outbound
from portal.models import (
    AuditAction,
    Channel,
    MailReceiveConfig,
    MailSendRecord,
    MailSendServerConfig,
    SendStatus,
    SmsProviderConfig,
    SmsSendRecord,
)
from portal.models.secretbox import SecretUnavailable
from portal.tenancy import PLATFORM_TENANT_ID
from portal.web.access import Permission, audit, requires
from portal.web.forms import (
    Form,
    form_data,
    is_htmx,
    owned,
    settings,
    tier_name,
    varies,
    viewed_tier,
)

C = TypeVar("C", MailSendServerConfig, MailReceiveConfig, SmsProviderConfig)
# The kinds of row that carry sends, and so have a health.
_CHANNELS: dict[type, Channel] = {
    MailSendServerConfig: Channel.MAIL,
    SmsProviderConfig: Channel.SMS,
}
D = TypeVar("D", MailSendServerConfig, SmsProviderConfig)  # the rows with a tier default


@dataclass(frozen=True)
class Pages(Generic[C]):
    """One kind of configuration row's pages: the model, its words, and the hooks where the
    kinds differ."""

    model: type[C]
    blueprint: str  # "mail_servers": the endpoints and the template folder
    row_name: str  # "server": the row in the templates, and "server_id" in the URLs
    noun: str  # "mail server": the Add button and the messages
    title: str  # "Mail servers": the list page, linked from each edit page
    add_title: str  # "Add a mail server": a new row's page
    labels: Mapping[str, str]
    read: Callable[[Form, C, int], bool]  # check the form and copy it onto the row, in a tier
    listing: Callable[[int, Sequence[C]], dict[str, Any]]  # the list page's rows, and the rest
    context: Callable[[C | None], dict[str, Any]]  # what else the edit page shows
    check: Callable[[C, int], dict[str, object]]  # Test connection's answer (may raise Busy)
    audit_type: str  # "mail_server": the audit rows' target_type
    defaults: Mapping[str, str]  # a new row's form
    added_hint: str = ""  # what the message after adding adds
    on_save: Callable[[C], None] | None = None  # after the flush, before the commit
    test_title: str = "Connection test"  # the test page's heading
    # What deleting a server or provider would do; None: the module has its own delete view.
    deletion: Callable[[C], Deletion] | None = None
    shown: Callable[[C], dict[str, object]] | None = None  # saved values the form shows its way

    @property
    def heading(self) -> str:
        """The noun as a heading starts: "Mail server"."""
        return f"{self.noun[:1].upper()}{self.noun[1:]}"

    def endpoint(self, view: str) -> str:
        return f"{self.blueprint}.{view}"

    def url(self, view: str, row: C) -> str:
        """The URL of one of ``row``'s views ("edit", "update", "test", "delete"...)."""
        values: dict[str, Any] = {f"{self.row_name}_id": row.id}
        return url_for(self.endpoint(view), **values)

    def called(self, row: C) -> str:
        """How an audit remark or a message names the row: "mail server 'relay'"."""
        return f"{self.noun} {row.name!r}"

    def audited(self, action: AuditAction, row: C, remark: str) -> None:
        """The audit row of a change to ``row``, in the transaction that makes it."""
        audit(
            action,
            tenant_id=row.tenant_id,
            target_type=self.audit_type,
            target_id=row.id,
            remark=remark,
        )

    def form_of(self, row: C) -> Form:
        """A saved row's form: each labelled field that is a column of the row, as ``shown``
        has it if it says (a secret is no column: it is kept encrypted, and never shown)."""
        columns = inspect(self.model).column_attrs.keys()
        values = {name: getattr(row, name) for name in self.labels if name in columns}
        if self.shown is not None:
            values |= self.shown(row)
        return Form(form_data(**values), self.labels)


def page(
    pages: Pages[C], row: C | None, form: Form, status: int = 200, **extra: Any
) -> tuple[str, int]:
    """The edit page (a new row's when ``row`` is None or not saved yet); ``extra`` overrides
    the kind's context (a sub-form coming back with errors)."""
    saved = row if row is not None and row.id is not None else None
    tier = saved.tenant_id if saved is not None else viewed_tier()
    return render_template(
        f"{pages.blueprint}/edit.html",
        pages=pages,
        form=form,
        tier_name=tier_name(tier),
        **{pages.row_name: saved},
        health=health_of(pages, [saved] if saved is not None else []),
        **(pages.context(saved) | extra),
    ), status


def health_of(pages: Pages[C], rows: Sequence[C]) -> dict[int, health.State]:
    """The health of ``rows`` (mail servers or SMS providers; none for other kinds), as
    ``health.states`` reads it for every page that shows one: row id -> state."""
    channel = _CHANNELS.get(pages.model)
    if channel is None or not rows:
        return {}
    window = settings().health_window_s
    return health.states(db.session, channel, [r.id for r in rows], window_s=window)


def listed(pages: Pages[C], tier: int) -> Sequence[C]:
    """The tier's rows, by name."""
    model = pages.model
    return db.session.scalars(
        select(model).where(model.tenant_id == tier).order_by(model.name)
    ).all()


# --- the fields -----------------------------------------------------------------------------

# The fields of a server the service logs in to (a mail server, a bounce mailbox).
SERVER_LABELS = {
    "name": "Name",
    "host": "Host",
    "port": "Port",
    "security": "Security",
    "verify_tls": "Check the server's TLS certificate",
    "username": "Username",
    "password": "Password",
}


def check_host(
    form: Form, tier: int, host: str | None, port: int, *, forbidden: str, example: str
) -> None:
    """A host is a name or an IP address (none of the ``forbidden`` characters) that the tier's
    outbound policy lets the service connect to on ``port``; else an error of the form."""
    if host is None:
        return
    if any(c.isspace() or c in forbidden for c in host):
        form.fail("host", f"must be a host name or IP address, such as {example}")
        return
    allowed = outbound.allows_private(settings(), tier)
    problem = outbound.host_problem(host, port, allow_private=allowed)
    if problem:
        form.fail("host", f"cannot be used: {problem}")


def unreadable(row: object, *secrets: str) -> list[str]:
    """The ``secrets`` stored on ``row`` that can no longer be decrypted (SECRET_KEY changed):
    the edit page says so, and a new value replaces them."""
    found = []
    for name in secrets:
        try:
            getattr(row, name)  # decrypting is the check
        except SecretUnavailable:
            found.append(name)
    return found


def check_name(pages: Pages[C], form: Form, row: C, tier: int, name: str | None) -> None:
    """A name another row of the tier has is an error of the form."""
    if name is None or "name" in form.errors:
        return
    model = pages.model
    clash = db.session.scalar(
        select(model.id).where(
            model.tenant_id == tier, model.name == name, model.id != (row.id or 0)
        )
    )
    if clash is not None:
        form.fail("name", f"{name!r} is already used by another {pages.noun}")


def take_default(row: D) -> None:
    """A default row takes the default from its tier's others (each moves to a new version)."""
    if not row.is_default:
        return
    model = type(row)
    db.session.execute(
        sql_update(model)
        .where(model.tenant_id == row.tenant_id, model.id != row.id, model.is_default.is_(True))
        .values(is_default=False, config_version=model.config_version + 1)
    )


# Columns every save moves by itself: not a change anyone made.
_UNAUDITED = frozenset({"id", "tenant_id", "config_version", "created_time", "updated_time"})


def changed_fields(pages: Pages[C], row: C) -> list[str]:
    """The labels of the fields the pending update changes (before the flush), in the form's
    order. A secret is named ("Password"), never shown: its column only says that a new
    ciphertext was set."""
    state = inspect(row)
    names = []
    for column in state.mapper.column_attrs:
        if column.key in _UNAUDITED or not state.attrs[column.key].history.has_changes():
            continue
        names.append(column.key.removesuffix("_encrypted"))
    order = {name: i for i, name in enumerate(pages.labels)}
    names.sort(key=lambda name: order.get(name, len(order)))
    return [pages.labels.get(name, name.replace("_", " ").capitalize()) for name in names]


def save(pages: Pages[C], row: C, form: Form, changed: list[str] | None = None) -> bool:
    """Commit with its audit row (``changed``: an update's changed fields; None: a new row);
    False, with the error on the form, when the name was taken meanwhile."""
    try:
        db.session.flush()  # a new row gets its id, so on_save can leave it out
        if pages.on_save is not None:
            pages.on_save(row)
        if changed is None:
            action, remark = AuditAction.CONFIG_CREATE, f"{pages.called(row)} added"
        else:
            action = AuditAction.CONFIG_UPDATE
            what = f"changed {', '.join(changed)}" if changed else "saved, nothing changed"
            remark = f"{pages.called(row)}: {what}"
        pages.audited(action, row, remark)
        db.session.commit()
    except IntegrityError:  # the same name saved by someone else a moment ago
        db.session.rollback()
        form.fail("name", f"is already used by another {pages.noun}")
        return False
    return True


def create(pages: Pages[C]) -> ResponseReturnValue:
    """Add a row to the viewed tier from the posted form, then show its page."""
    form = Form(request.form, pages.labels)
    row = pages.model()
    if not pages.read(form, row, viewed_tier()):
        return page(pages, None, form, 422)
    db.session.add(row)
    if not save(pages, row, form):
        return page(pages, None, form, 422)
    flash(f"{pages.heading} {row.name!r} added.{pages.added_hint}", "success")
    return redirect(pages.url("edit", row), 303)


def update(pages: Pages[C], row_id: int) -> ResponseReturnValue:
    """Save the posted form onto the row ``row_id`` of the viewed tier."""
    row = owned(pages.model, row_id, viewed_tier())
    form = Form(request.form, pages.labels)
    if not pages.read(form, row, row.tenant_id):
        db.session.rollback()
        return page(pages, row, form, 422)
    if not save(pages, row, form, changed_fields(pages, row)):
        row = owned(pages.model, row_id, viewed_tier())
        return page(pages, row, form, 422)
    flash(f"{pages.heading} saved.", "success")
    return redirect(pages.url("edit", row), 303)


def delete(pages: Pages[C], row: C) -> ResponseReturnValue:
    """Delete the row (the caller has checked nothing needs it), then show the list."""
    pages.audited(AuditAction.CONFIG_DELETE, row, f"{pages.called(row)} deleted")
    db.session.delete(row)
    db.session.commit()
    flash(f"{pages.heading} {row.name!r} deleted.", "success")
    return redirect(url_for(pages.endpoint("index")), 303)


# --- the confirm step of a deletion -------------------------------------------------------


def confirmed() -> bool:
    """Whether this request is a deletion's second step: the confirm page's own POST. A GET,
    or a POST without ``confirm=yes`` (the Delete button of an older page), only asks."""
    return request.method == "POST" and request.form.get("confirm") == "yes"


@dataclass(frozen=True)
class Deletion:
    """What deleting a row would do, as its confirm page says it."""

    title: str  # "Delete mail server 'relay'?"
    facts: Sequence[str]  # what happens, one paragraph each
    action: str  # where the confirm page posts (with confirm=yes)
    back: str  # Cancel (the row's page)
    button: str | None  # the confirm button; None: nothing to confirm
    refused: str | None = None  # why it cannot be deleted (None: it can)


def confirm_page(deletion: Deletion) -> tuple[str, int]:
    """The confirm page of a deletion; nothing has changed yet."""
    return render_template("shared/confirm_delete.html", deletion=deletion), 200


def records_of_tier(
    model: type[MailSendRecord] | type[SmsSendRecord], tier: int
) -> ColumnElement[bool]:
    """The send records that can use a config of ``tier``: its own tenant's. A platform-tier
    config is every tenant's fallback, so any tenant's records can use it (and only operators
    see that tier)."""
    return true() if tier == PLATFORM_TENANT_ID else model.tenant_id == tier


def connection(pages: Pages[C], row: C, **context: object) -> Response:
    """Test connection's answer: the status box for htmx, a page of its own otherwise."""
    context = {pages.row_name: row, **context}
    if is_htmx():
        html = render_template(f"{pages.blueprint}/_connection.html", **context)
    else:
        html = render_template("shared/config_test.html", pages=pages, row=row, **context)
    return varies(Response(html))


def busy_response(busy: outbound.Busy) -> Response:
    """429 for a Test button pressed while too many connection tests run (the caps of
    ``outbound.test_slot``), with when to try again. To the button's htmx request, the status
    box it swaps (its id from ``HX-Target``), so the page says why nothing was tested."""
    target = request.headers.get("HX-Target", "")
    if re.fullmatch(r"connection-[0-9A-Za-z_-]{1,40}", target):
        body = (
            f'<div id="{target}" role="status" class="connection connection-bad">'
            f"{escape(str(busy))}</div>"
        )
        response = Response(body, 429, mimetype="text/html")
    else:
        response = Response(str(busy), 429, mimetype="text/plain")
    response.headers["Retry-After"] = str(busy.retry_after_s)
    return response


# --- the views every configuration row has ----------------------------------------------


def add_routes(bp: Blueprint, pages: Pages[C]) -> None:
    """The views that are the same for every kind of row, at the URLs every row has: ``index``
    (the tier's rows), ``new`` (an empty form), ``create``, ``edit`` (a saved row's form;
    secrets are never shown), ``update`` (the next send or fetch uses the new settings),
    ``test`` (its connection), and for a server or provider ``delete``."""
    row_url = f"/<int:{pages.row_name}_id>"
    row_key = f"{pages.row_name}_id"
    edit_config = requires(Permission.EDIT_CONFIG)

    def index() -> str:
        """The viewed tier's rows, by name."""
        tier = viewed_tier()
        rows = listed(pages, tier)
        return render_template(
            f"{pages.blueprint}/index.html",
            tier_name=tier_name(tier),
            health=health_of(pages, rows),
            **pages.listing(tier, rows),
        )

    def new() -> tuple[str, int]:
        """An empty form for a new row of the viewed tier."""
        return page(pages, None, Form(dict(pages.defaults), pages.labels))

    def create_view() -> ResponseReturnValue:
        """Add a row to the viewed tier."""
        return create(pages)

    def edit(**row_id: int) -> tuple[str, int]:
        """The row's form (secrets are never shown)."""
        row = owned(pages.model, row_id[row_key], viewed_tier())
        return page(pages, row, pages.form_of(row))

    def update_view(**row_id: int) -> ResponseReturnValue:
        """Save the row; the next send or fetch through it uses the new settings."""
        return update(pages, row_id[row_key])

    def test(**row_id: int) -> ResponseReturnValue:
        """Test the saved row's connection: what it answered or the error, a few seconds at
        most, and only as many at once as the caps allow (else 429)."""
        tier = viewed_tier()
        row = owned(pages.model, row_id[row_key], tier)
        try:
            context = pages.check(row, tier)
        except outbound.Busy as busy:
            return busy_response(busy)
        return connection(pages, row, **context)

    bp.add_url_rule("/", "index", edit_config(index), methods=["GET"])
    bp.add_url_rule("/new", "new", edit_config(new), methods=["GET"])
    bp.add_url_rule("/", "create", edit_config(create_view), methods=["POST"])
    bp.add_url_rule(f"{row_url}/edit", "edit", edit_config(edit), methods=["GET"])
    bp.add_url_rule(row_url, "update", edit_config(update_view), methods=["POST"])
    bp.add_url_rule(f"{row_url}/test", "test", edit_config(test), methods=["POST"])
    deletion = pages.deletion
    if deletion is None:
        return

    def delete(**row_id: int) -> ResponseReturnValue:
        """Say what deleting the row would do; with ``confirm=yes``, delete it. One that send
        records use is never deleted (disable it instead)."""
        row = owned(pages.model, row_id[row_key], viewed_tier())
        return delete_unless_used(pages, row, deletion(row))

    bp.add_url_rule(f"{row_url}/delete", "delete", edit_config(delete), methods=["GET", "POST"])


# --- servers and providers: what their send records hold them to --------------------------


@dataclass(frozen=True)
class Use:
    """How send records use a server or provider (its deletion's confirm page says it)."""

    used: bool  # a record points at it: it is never deleted (retries and events need it)
    waiting: int  # Pending or Retry records prepared for it
    whose: str  # whose records those are: "any tenant" for a platform-tier row


def use_of(
    model: type[MailSendRecord] | type[SmsSendRecord],
    row: D,
    prepared_for: Any,
    *also: Any,
) -> Use:
    """Counted over the records that can use ``row`` (``records_of_tier``): whether any points
    at it (by ``prepared_for``, the config frozen at preparation, or ``also``), and how many
    Pending or Retry ones were prepared for it."""
    scope = records_of_tier(model, row.tenant_id)
    used = db.session.scalar(
        select(model.id).where(scope, or_(*(c == row.id for c in (prepared_for, *also)))).limit(1)
    )
    waiting = db.session.scalar(
        select(func.count()).where(
            scope,
            model.status.in_([SendStatus.PENDING.value, SendStatus.RETRY.value]),
            model.prepared_at.is_not(None),
            prepared_for == row.id,
        )
    )
    whose = "any tenant" if row.tenant_id == PLATFORM_TENANT_ID else tier_name(row.tenant_id)
    return Use(used is not None, waiting or 0, whose)


def delete_unless_used(pages: Pages[C], row: C, deletion: Deletion) -> ResponseReturnValue:
    """Delete's two steps for a server or provider: the confirm page, then the deletion,
    unless send records use the row (``deletion.refused``): it is disabled instead."""
    if not confirmed():
        return confirm_page(deletion)
    if deletion.refused:
        flash(
            f"Send records use this {pages.row_name}, so it cannot be deleted (their retries go "
            "through it). Untick Enabled to stop new sends from using it.",
            "error",
        )
        return redirect(pages.url("edit", row), 303)
    return delete(pages, row)
