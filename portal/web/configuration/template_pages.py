"""The template editor pages, written once for both channels: the list, the editor with its
live preview, saving with a version check, and Send test through the real delivery path.

``mail_templates`` and ``sms_templates`` each describe their channel as a ``Kind``: the model,
the fields it adds to code, name and enabled, how it previews, and what its test message is.
``blueprint`` makes the routes both channels have from a ``Kind``; each module then adds its
own (mail's sandboxed HTML preview and attachments, SMS's provider bindings). Every page is
rendered from the channel's folder (``mail_templates/edit.html``), which extends the shared
page in ``shared/`` and fills in the channel's blocks.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import redis
from flask import (
    Blueprint,
    Response,
    abort,
    current_app,
    flash,
    redirect,
    render_template,
    request,
    url_for,
)
from flask.typing import ResponseReturnValue
from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from portal import simulator
from portal.config import Settings
from portal.extensions import db
from portal.messaging.records import acceptance, validation
from portal.messaging.templating import dry_run as template_dry_run
from portal.messaging.templating import rendering as templating
from portal.messaging.templating import versions as template_versions
from portal.models import (
    AuditAction,
    Channel,
    MailTemplate,
    Scope,
    SmsTemplate,
)
from portal.models.by_channel import PARTS
from portal.models.record import Stream
from portal.redis_store import connect
from portal.tenancy import PLATFORM_TENANT_ID, new_trace_id, tenant_context
from portal.web.access import Permission, audit, can, requires, user, viewed_tenant
from portal.web.forms import (
    Form,
    form_data,
    is_htmx,
    owned,
    record_url,
    tier_name,
    varies,
    viewed_tier,
)

log = logging.getLogger(__name__)

T = TypeVar("T", MailTemplate, SmsTemplate)

# The fields every template has; each channel's labels add its own.
LABELS = {
    "code": "Code",
    "name": "Name",
    "enabled": "Enabled",
    "stream": "Stream",
    "strict_variables": "Refuse sends that lack a needed variable",
    "variables": "Sample variables",
}
STREAMS = [(Stream.TRANSACTIONAL.value, "Transactional"), (Stream.BROADCAST.value, "Broadcast")]
SAMPLE_TTL_S = 30 * 24 * 3600
STALE = (
    "This template was saved again since you opened it (in another tab, or by someone else). "
    "Reload the page to see the saved version."
)


def settings() -> Settings:
    settings: Settings = current_app.config["SETTINGS"]
    return settings


# --- what differs per channel ------------------------------------------------------------------


@dataclass(frozen=True)
class TestSend:
    """What Send test hands to acceptance (the request without its scope, and who it goes to),
    or why it is refused; a bad field is an error of the form instead."""

    request: dict[str, Any] | None
    to: str | None
    problem: str | None = None
    # The template version the test renders (pinned on its record), when it sends a template.
    version: int | None = None
    # The editor holds edits that are not saved: the test saves them first (through the dry run).
    unsaved: bool = False


class Accept(Protocol):
    """``acceptance.send_mail`` or ``acceptance.send_sms``."""

    def __call__(
        self, session: Session, request: Mapping[str, Any], *, settings: Settings | None = None
    ) -> acceptance.Accepted: ...


@dataclass(frozen=True)
class Kind(Generic[T]):
    """One channel's template pages: the model (which says its channel, its noun and the
    columns that hold Liquid), and the hooks where mail and SMS differ."""

    model: type[T]
    message_noun: str  # "mail": what a test sends ("Test mail to ... accepted")
    labels: Mapping[str, str]
    fields: tuple[str, ...]  # the columns the channel adds to code, name and enabled
    read: Callable[[Form, int], dict[str, Any] | None]  # the channel's fields, checked, or None
    preview: Callable[[Form], dict[str, Any]]  # the preview panel's context for the input
    context: Callable[[T | None, int], dict[str, Any]]  # what else the editor page shows
    test: Callable[[T, Form], TestSend]
    accept: Accept

    @property
    def channel(self) -> Channel:
        return self.model.channel

    @property
    def noun(self) -> str:
        """What a heading or a message calls the template ("mail template")."""
        return self.model.noun

    @property
    def sources(self) -> tuple[str, ...]:
        """The columns that hold Liquid (sample variables come from them)."""
        return self.model.sources

    @property
    def blueprint(self) -> str:
        return f"{self.channel.value}_templates"

    @property
    def heading(self) -> str:
        """The noun as a heading starts: "Mail template"."""
        return f"{self.noun[:1].upper()}{self.noun[1:]}"

    @property
    def title(self) -> str:
        return f"{self.heading}s"

    def endpoint(self, view: str) -> str:
        return f"{self.blueprint}.{view}"


# --- the editor's fields -------------------------------------------------------------------------


def read(kind: Kind[T], form: Form, tier: int, template_id: int | None) -> dict[str, Any] | None:
    """Parse and check the editor's fields: the template's column values, or None with the
    form's errors (one a field, in the order of the page)."""
    code = form.text("code", required=True, max_len=validation.MAX_CODE_CHARS)
    name = form.text("name", max_len=200)
    own = kind.read(form, tier)
    if code is not None and "code" not in form.errors:
        model = kind.model
        clash = db.session.scalar(
            select(model.id).where(
                model.tenant_id == tier, model.code == code, model.id != (template_id or 0)
            )
        )
        if clash is not None:
            form.fail("code", f"{code!r} is already used by another {kind.noun}")
    if not form.ok or code is None or own is None:
        return None
    return {
        "code": code,
        "name": name or code,
        "enabled": form.flag("enabled"),
        "strict_variables": form.flag("strict_variables"),
        **own,
    }


def read_stream(form: Form) -> str:
    """The template's default stream (for sends that name none); a field of its own, not of
    ``read``, whose values a test send compares with the saved template's content."""
    return form.choice("stream", [value for value, _ in STREAMS], Stream.TRANSACTIONAL.value)


def form_of(kind: Kind[T], template: T, **kept: str | None) -> Form:
    """The editor's form for the saved template; ``kept``: the fields that are not the
    template's (the sample variables, a test's recipient) as the person left them."""
    common: tuple[str, ...] = ("code", "name", "enabled", "stream", "strict_variables")
    values = {name: getattr(template, name) for name in (*common, *kind.fields)}
    saved = (
        json.dumps(template.sample_variables, indent=2, ensure_ascii=False)
        if template.sample_variables is not None
        else None
    )
    variables = (
        remembered_sample(kind.channel, template.id)
        or saved
        or sample_variables(*(getattr(template, name) for name in kind.sources))
    )
    return Form(form_data(**(values | {"variables": variables} | kept)), kind.labels)


def audit_save(kind: Kind[T], template: T, what: str) -> None:
    """The audit row of a change to ``template`` (committed with it): its channel and code,
    what happened ("created", "saved", "attachment added: a.pdf") and the version it made,
    which is kept as an immutable version."""
    template_versions.save_version(db.session(), template, user().email, what)
    audit(
        AuditAction.TEMPLATE_SAVE,
        tenant_id=template.tenant_id,
        target_type=f"{kind.channel.value}_template",
        target_id=template.id,
        remark=f"{kind.heading} {template.code!r} {what} (version {template.version})",
    )


# --- sample variables and the preview ------------------------------------------------------------


def variables_used(
    parts: Sequence[tuple[str, str | None]], *, draft: bool = False
) -> tuple[list[str], list[str]]:
    """The names the (label, source) parts use, in order, and the errors of parts that do not
    parse (a draft's too when over the limits, as saving it would be refused)."""
    names: dict[str, None] = {}
    errors = []
    for label, source in parts:
        if not source:
            continue
        try:
            names.update(dict.fromkeys(templating.variables_of(source, draft=draft)))
        except templating.TemplateRenderError as exc:
            errors.append(f"{label}: {exc}")
    return list(names), errors


def sample_variables(*sources: str | None) -> str:
    """Sample variables for a template: each name it uses, with a placeholder value."""
    names, _ = variables_used([("", source) for source in sources])
    return json.dumps({name: f"[{name}]" for name in names}, indent=2, ensure_ascii=False)


def saved_sample(form: Form) -> dict[str, Any] | None:
    """The editor's sample variables to keep with the template (the preview, Send
    test and a dry run without records use them); None unless a JSON object within limits."""
    raw = form.raw("variables")
    if not raw.strip() or len(raw) > templating.configured_limits().variables_max_bytes:
        return None
    try:
        value = json.loads(raw)
        return templating.validate_variables(value) if isinstance(value, dict) else None
    except (ValueError, templating.TemplateRenderError):
        return None


def remember_sample(channel: Channel, template_id: int, raw: str) -> None:
    """Keep the sample variables a user saved a template with, so the editor reopens with
    them (they are not part of the template). Best effort: Redis away, nothing is kept."""
    if len(raw) > templating.configured_limits().variables_max_bytes:
        return
    try:
        connect(settings().redis_url).set(
            f"sample:{user().id}:{channel}:{template_id}", raw.encode(), ex=SAMPLE_TTL_S
        )
    except redis.RedisError as exc:
        log.warning("sample variables not kept: %s", exc)


def remembered_sample(channel: Channel, template_id: int) -> str | None:
    """The sample variables kept by ``remember_sample``, if any."""
    try:
        raw = connect(settings().redis_url).get(f"sample:{user().id}:{channel}:{template_id}")
    except redis.RedisError:
        return None
    return raw.decode() if isinstance(raw, bytes) else None


@dataclass
class Preview:
    """What every preview panel shows; every problem is a message, never an exception."""

    variables: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    needed: list[str] = field(default_factory=list)  # what a send must give
    optional: list[str] = field(default_factory=list)
    strict: bool = True
    refused: list[str] = field(default_factory=list)  # needed names the sample lacks

    def sample(
        self, parts: Sequence[tuple[str, str | None]], variables_raw: str
    ) -> dict[str, Any] | None:
        """Note the names the (label, source) parts use and read the sample variables; None,
        with the error noted, when a part or the sample does not parse."""
        self.variables, self.errors = variables_used(parts, draft=True)
        if self.errors:
            return None
        try:
            needs = templating.variable_needs([source for _, source in parts], draft=True)
        except templating.TemplateRenderError:
            needs = templating.VariableNeeds((), ())
        self.needed, self.optional = list(needs.needed), list(needs.optional)
        form = Form({"variables": variables_raw}, LABELS)
        variables = form.json_object("variables")
        if variables is None:
            self.errors.append(form.errors["variables"])
            return None
        self.missing = [name for name in self.variables if name not in variables]
        # The rule acceptance applies: a strict template's send without these is refused.
        self.refused = [name for name in self.needed if name not in variables]
        return variables


def previewed(kind: Kind[T], form: Form) -> dict[str, Any]:
    """The channel's preview context, told whether the editor's template is strict."""
    context = kind.preview(form)
    preview = context.get("preview")
    if isinstance(preview, Preview):
        preview.strict = form.flag("strict_variables")
    return context


# --- pages -------------------------------------------------------------------------------------


def editor(
    kind: Kind[T],
    template: T | None,
    form: Form,
    *,
    status: int = 200,
    send: dict[str, Any] | None = None,
    **extra: Any,
) -> tuple[str, int]:
    """The editor page (a new template's when ``template`` is None), its input previewed;
    ``extra`` overrides the channel's context (a sub-form coming back with errors)."""
    tier = template.tenant_id if template is not None else viewed_tier()
    return render_template(
        f"{kind.blueprint}/edit.html",
        kind=kind,
        template=template,
        form=form,
        tier_name=tier_name(tier),
        send=send or {},
        simulated=simulator.entries(kind.channel.value),
        **(previewed(kind, form) | kind.context(template, tier) | extra),
    ), status


def save_edits(
    kind: Kind[T], template: T, form: Form, *, confirm_action: str | None = None
) -> tuple[str, int] | None:
    """Save the editor's content as the template's next version, or the editor page to show
    instead: with the form's errors, or with the dry run to confirm first (its "Save this
    version" posts to ``confirm_action``, else to Save). Refused when the template was saved
    elsewhere since the editor was opened."""
    values = read(kind, form, template.tenant_id, template.id)
    stream = read_stream(form)
    if form.raw("version") != str(template.version):
        form.errors["version"] = STALE
    if values is None or not form.ok:
        return editor(kind, template, form, status=422)
    if form.raw("dry_run_seen") != "yes":
        # A change goes live only after a look at what it does to recent sends:
        # a template with no earlier records saves at once.
        check = dry_run(kind, template, form, values)
        if check is not None and check.found:
            return editor(
                kind,
                template,
                form,
                dry_run=check,
                confirming=True,
                confirm_action=confirm_action,
            )
    template_versions.ensure_saved(db.session(), template)
    for key, value in values.items():
        setattr(template, key, value)
    template.stream = stream
    template.sample_variables = saved_sample(form) or template.sample_variables
    template.version += 1
    audit_save(kind, template, "saved")
    try:
        db.session.commit()
    except IntegrityError:
        db.session.rollback()
        form.fail("code", f"is already used by another {kind.noun}")
        return editor(kind, template, form, status=422)
    remember_sample(kind.channel, template.id, form.raw("variables"))
    return None


def whole_editor(page: tuple[str, int]) -> ResponseReturnValue:
    """The whole editor page as the answer to a POST that may come from htmx (Send test):
    htmx puts its main element in place of the page's, not the fragment it asked for."""
    html, status = page
    response = varies(Response(html, status))
    if is_htmx():
        response.headers["HX-Retarget"] = "#main"
        response.headers["HX-Reswap"] = "outerHTML"
        response.headers["HX-Reselect"] = "#main"
    return response


def blueprint(kind: Kind[T], import_name: str) -> Blueprint:
    """The blueprint of one channel's template pages, with the routes both channels have."""
    bp = Blueprint(kind.blueprint, import_name, url_prefix="/" + kind.blueprint.replace("_", "-"))

    @bp.get("/")
    @requires(Permission.EDIT_TEMPLATES)
    def index() -> str:
        """The viewed tier's templates."""
        tier = viewed_tier()
        model = kind.model
        templates = db.session.scalars(
            select(model).where(model.tenant_id == tier).order_by(model.code)
        ).all()
        return render_template(
            f"{kind.blueprint}/index.html",
            kind=kind,
            templates=templates,
            tier_name=tier_name(tier),
        )

    @bp.get("/new")
    @requires(Permission.EDIT_TEMPLATES)
    def new() -> tuple[str, int]:
        """An empty editor."""
        return editor(
            kind,
            None,
            Form({"enabled": "on", "strict_variables": "on", "variables": "{}"}, kind.labels),
        )

    @bp.post("/")
    @requires(Permission.EDIT_TEMPLATES)
    def create() -> ResponseReturnValue:
        """Save a new template in the viewed tier."""
        tier = viewed_tier()
        form = Form(request.form, kind.labels)
        values = read(kind, form, tier, None)
        stream = read_stream(form)
        if values is None or not form.ok:
            return editor(kind, None, form, status=422)
        template = kind.model(tenant_id=tier, version=1, stream=stream, **values)
        template.sample_variables = saved_sample(form)
        db.session.add(template)
        try:
            db.session.flush()  # the audit row names the new template's id
            audit_save(kind, template, "created")
            db.session.commit()
        except IntegrityError:  # the same code saved by someone else a moment ago
            db.session.rollback()
            form.fail("code", f"is already used by another {kind.noun}")
            return editor(kind, None, form, status=422)
        remember_sample(kind.channel, template.id, form.raw("variables"))
        flash(f"Template {template.code!r} created.", "success")
        return redirect(url_for(kind.endpoint("edit"), template_id=template.id), 303)

    @bp.get("/<int:template_id>/edit")
    @requires(Permission.EDIT_TEMPLATES)
    def edit(template_id: int) -> tuple[str, int]:
        """The editor, with the saved template previewed."""
        template = owned(kind.model, template_id, viewed_tier())
        return editor(kind, template, form_of(kind, template))

    @bp.post("/<int:template_id>")
    @requires(Permission.EDIT_TEMPLATES)
    def update(template_id: int) -> ResponseReturnValue:
        """Save the editor; refused when the template was saved elsewhere since it was opened."""
        template = owned(kind.model, template_id, viewed_tier())
        form = Form(request.form, kind.labels)
        page = save_edits(kind, template, form)
        if page is not None:
            return page
        flash("Template saved.", "success")
        return redirect(url_for(kind.endpoint("edit"), template_id=template.id), 303)

    @bp.post("/preview")
    @requires(Permission.EDIT_TEMPLATES)
    def preview() -> str:
        """The preview panel for the editor's current input (it saves nothing)."""
        form = Form(request.form, kind.labels)
        return render_template(
            f"{kind.blueprint}/_preview.html", kind=kind, **previewed(kind, form)
        )

    @bp.post("/<int:template_id>/dry-run")
    @requires(Permission.EDIT_TEMPLATES)
    def check(template_id: int) -> ResponseReturnValue:
        """Check against recent sends: the editor's content rendered against the variables
        of the last records that used this template, without saving."""
        template = owned(kind.model, template_id, viewed_tier())
        form = Form(request.form, kind.labels)
        values = read(kind, form, template.tenant_id, template.id)
        status = 200
        result = None
        if values is None or not form.ok:
            status = 422
        else:
            result = dry_run(kind, template, form, values, always=True)
        html = render_template(
            "shared/_dry_run.html",
            kind=kind,
            template=template,
            form=form,
            dry_run=result,
            confirming=False,
            checked_errors=result is None,
        )
        return varies(Response(html, status))

    @bp.post("/<int:template_id>/send-test")
    @requires(Permission.EDIT_TEMPLATES)
    def send_test(template_id: int) -> ResponseReturnValue:
        """Accept a test message in the template's tier, through the real delivery path.

        A test of the template renders the version the preview rendered: unsaved edits are
        saved first, through the dry run (whose confirmation comes back here), and the record
        is pinned to that version, whatever is saved after it."""
        template = owned(kind.model, template_id, viewed_tier())
        form = Form(request.form, kind.labels)
        test = kind.test(template, form)
        saved = False
        if test.unsaved and test.request is not None and form.ok:
            page = save_edits(
                kind,
                template,
                form,
                confirm_action=url_for(kind.endpoint("send_test"), template_id=template.id),
            )
            if page is not None:
                return whole_editor(page)
            saved = True
            form = form_of(
                kind,
                template,
                variables=form.raw("variables"),
                to=test.to,
                version=str(template.version),
            )
            test = kind.test(template, form)
        result: dict[str, Any] = {"problem": test.problem, "errors": form.errors}
        if test.problem is None and test.request is not None and form.ok:
            platform = template.tenant_id == PLATFORM_TENANT_ID
            scope = Scope.PLATFORM if platform else Scope.TENANT
            try:
                with tenant_context(template.tenant_id, new_trace_id()):
                    accepted = kind.accept(
                        db.session(), test.request | {"scope": scope.value}, settings=settings()
                    )
                mark_test(kind, template.tenant_id, accepted.id, test.version)
                db.session.commit()
            except validation.AcceptanceError as exc:
                db.session.rollback()
                result["problem"] = f"The test was not accepted: {exc.message}"
            else:
                result = {
                    "record_id": accepted.id,
                    "to": test.to,
                    "version": test.version,
                    "saved": saved,
                    "record_url": record_url(f"{kind.channel.value}_records.show", accepted.id),
                }
        status = 200 if "record_id" in result else 422
        if is_htmx() and not saved:
            html = render_template(
                f"{kind.blueprint}/_send_test.html",
                kind=kind,
                template=template,
                form=form,
                send=result,
                simulated=simulator.entries(kind.channel.value),
            )
            return varies(Response(html, status))
        # A save happened: the whole editor again (its version field moved on).
        return whole_editor(editor(kind, template, form, status=status, send=result))

    @bp.get("/<int:template_id>/versions")
    @requires(Permission.VIEW_RECORDS)
    def versions(template_id: int) -> str:
        """The template's saved versions, newest first, with a form to compare two."""
        template = owned(kind.model, template_id, viewed_tier())
        rows = template_versions.versions(
            db.session(), template.tenant_id, kind.channel.value, template.id
        )
        return render_template(
            "shared/template_versions.html",
            kind=kind,
            template=template,
            versions=rows,
            tier_name=tier_name(template.tenant_id),
            may_edit=can(Permission.EDIT_TEMPLATES),
        )

    @bp.get("/<int:template_id>/versions/<int:number>")
    @requires(Permission.VIEW_RECORDS)
    def version(template_id: int, number: int) -> str:
        """One saved version's whole content."""
        template = owned(kind.model, template_id, viewed_tier())
        return _version_page(template, number)

    def _version_page(template: Any, number: int) -> str:
        row = _version_or_404(kind, template, number)
        in_tier = template.tenant_id == viewed_tier()
        return render_template(
            "shared/template_version.html",
            kind=kind,
            template=template,
            version=row,
            labels=template_versions.LABELS,
            tier_name=tier_name(template.tenant_id),
            # The template's own pages are in the tier the viewer works in: an operator looking
            # at every tenant's records reaches other tenants' versions from the records, and
            # gets no link that would answer 404.
            in_tier=in_tier,
            may_edit=can(Permission.EDIT_TEMPLATES) and in_tier,
        )

    @bp.get("/<int:template_id>/versions/diff")
    @requires(Permission.VIEW_RECORDS)
    def diff(template_id: int) -> ResponseReturnValue:
        """Two versions side by side (``a`` and ``b`` are version numbers)."""
        template = owned(kind.model, template_id, viewed_tier())
        numbers = []
        for name in ("a", "b"):
            raw = request.args.get(name, "").strip()
            if not raw.isdigit() or not 1 <= int(raw) <= 2**31 - 1:
                return Response(f"{name}: give a version number", 422, mimetype="text/plain")
            numbers.append(int(raw))
        left = _version_or_404(kind, template, numbers[0])
        right = _version_or_404(kind, template, numbers[1])
        return render_template(
            "shared/template_diff.html",
            kind=kind,
            template=template,
            left=left,
            right=right,
            fields=template_versions.diff(left.content, right.content),
            tier_name=tier_name(template.tenant_id),
        )

    @bp.post("/<int:template_id>/versions/<int:number>/restore")
    @requires(Permission.EDIT_TEMPLATES)
    def restore(template_id: int, number: int) -> ResponseReturnValue:
        """Save an old version's content as a new version."""
        template = owned(kind.model, template_id, viewed_tier())
        row = _version_or_404(kind, template, number)
        template_versions.restore(db.session(), template, row)
        template.version += 1
        audit_save(kind, template, f"restored from version {number}")
        db.session.commit()
        flash(f"Version {number} restored as version {template.version}.", "success")
        return redirect(url_for(kind.endpoint("edit"), template_id=template.id), 303)

    @bp.get("/versions/record/<int:record_id>")
    @requires(Permission.VIEW_RECORDS)
    def record_version(record_id: int) -> ResponseReturnValue:
        """The template version a record was prepared with (the record page links here).

        Whoever may see the record sees it (the record page's own scope: an operator looking at
        every tenant's records included); the template is the record's tenant's."""
        from portal.web.records.kind import find_record
        from portal.web.records.mail_records import MAIL as MAIL_RECORDS
        from portal.web.records.sms_records import SMS as SMS_RECORDS

        record = find_record(
            MAIL_RECORDS if kind.channel == Channel.MAIL else SMS_RECORDS,
            record_id,
            viewed_tenant(allow_all=True),
        )
        tier = record.tenant_id
        if record.template_version is None:
            abort(404)
        template = None
        if record.template_id is not None:
            template = owned(kind.model, record.template_id, tier)
        elif record.template_code is not None:
            template = db.session.scalar(
                select(kind.model).where(
                    kind.model.tenant_id == tier, kind.model.code == record.template_code
                )
            )
        if template is None:
            abort(404)
        return _version_page(template, record.template_version)

    return bp


def dry_run(
    kind: Kind[T], template: T, form: Form, values: Mapping[str, Any], *, always: bool = False
) -> template_dry_run.DryRun | None:
    """The dry run of the editor's content (None when its Liquid is unchanged and not
    ``always``); samples only for a user who may read the records."""
    new = tuple(values.get(name) for name in kind.sources)
    current = template_dry_run.sources_of(template)
    stricter = bool(values.get("strict_variables")) and not template.strict_variables
    if not always and not stricter and _normalised(new) == _normalised(current):
        return None
    return template_dry_run.run(
        db.session(),
        template,
        new,
        strict=bool(values.get("strict_variables")),
        samples=can(Permission.VIEW_RECORDS),
        # The Check button, with no sends yet: the sample variables stand in for them.
        sample=saved_sample(form) or template.sample_variables if always else None,
    )


def _normalised(sources: Sequence[str | None]) -> tuple[str, ...]:
    return tuple((source or "").replace("\r\n", "\n").strip() for source in sources)


def mark_test(kind: Kind[T], tenant_id: int, record_id: int, version: int | None) -> None:
    """A test send is marked on its record: a badge in lists and on its
    page, a filter that hides them, and a count apart in the quota's usage. ``version``: the
    template version it renders (part 3), whatever is saved before it is prepared."""
    model = PARTS[kind.channel].record
    db.session.execute(
        update(model)
        .where(model.id == record_id, model.tenant_id == tenant_id)
        .values(is_test=True, pinned_template_version=version)
    )


def _version_or_404(kind: Kind[T], template: T, number: int) -> Any:
    """The template's version ``number`` (tenant-scoped), else 404."""
    if not 1 <= number <= 2**31 - 1:
        abort(404)
    row = template_versions.version(
        db.session(), template.tenant_id, kind.channel.value, template.id, number
    )
    if row is None:
        abort(404)
    return row
