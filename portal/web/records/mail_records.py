"""Mail records: search by address or subject, filters, keyset pages, detail, the message as sent,
retry (one and bulk) and bulk cancel.

The machinery is the channel-neutral ``pages``; what is mail's own is the search (an address
goes through ``mail_send_recipient``'s index, a subject is looked for in a bounded window of
recent records), the columns a row shows and the detail page.
"""

from __future__ import annotations

from flask import Blueprint, make_response, render_template
from flask.typing import ResponseReturnValue
from sqlalchemy import ColumnElement, or_, select

from portal.models import (
    Channel,
    MailSendRecipient,
    MailSendRecord,
    MailSendServerConfig,
)
from portal.web.access import Permission, can, requires, viewed_tenant
from portal.web.records.pages import (
    Kind,
    Search,
    bulk_cancel_view,
    bulk_retry_view,
    config_names,
    escape_like,
    find_record,
    index_view,
    resend_one,
    retry_one,
    show_context,
    tenant_scope,
    window_floor,
)
from portal.web.security import sandboxed

bp = Blueprint("mail_records", __name__, url_prefix="/mail-records")


def _mail_search(q: str, tenant: int | None, before: int | None) -> Search:
    if "@" in q:
        address = q.lower()
        recipients = select(MailSendRecipient.record_id).where(
            tenant_scope(MailSendRecipient.tenant_id, tenant),
            MailSendRecipient.address == address,
        )
        if before is not None:  # keeps the index range scan short on older pages too
            recipients = recipients.where(MailSendRecipient.record_id < before)
        return Search([MailSendRecord.id.in_(recipients)], f"to, cc or bcc {address}")
    pattern = f"%{escape_like(q)}%"
    floor = window_floor(MailSendRecord, tenant, before)
    clauses: list[ColumnElement[bool]] = [
        or_(
            MailSendRecord.rendered_subject.ilike(pattern, escape="\\"),
            MailSendRecord.subject.ilike(pattern, escape="\\"),
        )
    ]
    if floor is not None:
        clauses.append(MailSendRecord.id >= floor)
    return Search(clauses, f"subject containing “{q}”", floor)


MAIL = Kind(
    blueprint="mail_records",
    model=MailSendRecord,
    channel=Channel.MAIL,
    config=MailSendServerConfig,
    platform_service="platform mail service",
    title="Mail records",
    noun="mail",
    search_label="Email address or subject",
    search_hint="An exact address finds every mail to, cc or bcc it; other text searches "
    "subjects of recent mail.",
    preview_heading="Subject",
    search=_mail_search,
    list_columns=(
        "to_addrs",
        "cc_addrs",
        "bcc_addrs",
        "subject",
        "rendered_subject",
    ),
)

# --- mail's views ------------------------------------------------------------------------------


@bp.get("/")
@requires(Permission.VIEW_RECORDS)
def index() -> ResponseReturnValue:
    """Mail records, newest first: search by address or subject, filters, keyset pages."""
    return index_view(MAIL)


@bp.get("/<int:record_id>")
@requires(Permission.VIEW_RECORDS)
def show(record_id: int) -> ResponseReturnValue:
    """Everything about one mail, what happened and what to do, and the message as sent."""
    record = find_record(MAIL, record_id, viewed_tenant(allow_all=True))
    context = show_context(MAIL, record)
    servers = config_names(MAIL, record, [record.server_config_id, record.server_id])
    recipients = [
        ("To", record.to_addrs or []),
        ("Cc", record.cc_addrs or []),
        ("Bcc", record.bcc_addrs or []),
    ]
    return render_template(
        "mail_records/show.html",
        servers=servers,
        recipients=[(k, v) for k, v in recipients if v],
        has_html=bool(record.rendered_html or record.html_body),
        can_retry=can(Permission.RETRY),
        **context,
    )


@bp.get("/<int:record_id>/rendered")
@requires(Permission.VIEW_RECORDS)
def rendered(record_id: int) -> ResponseReturnValue:
    """The HTML part as sent (or as given, before preparation), for the sandboxed iframe."""
    record = find_record(MAIL, record_id, viewed_tenant(allow_all=True))
    html = record.rendered_html or record.html_body
    if not html:
        html = "<p>This mail has no HTML part.</p>"
    response = make_response(html)
    response.mimetype = "text/html"
    return sandboxed(response)


@bp.post("/<int:record_id>/retry")
@requires(Permission.RETRY)
def retry(record_id: int) -> ResponseReturnValue:
    """Requeue one mail (Pending, Retry, Failed, DeadLetter): due now, claimed by version."""
    return retry_one(MAIL, record_id)


@bp.post("/<int:record_id>/resend")
@requires(Permission.RESOLVE)  # a decision on an uncertain outcome, as Resolve is
def resend(record_id: int) -> ResponseReturnValue:
    """Send an uncertain mail again as a new message, after a confirm page."""
    return resend_one(MAIL, record_id)


@bp.post("/retry")
@requires(Permission.RETRY)
def bulk_retry() -> ResponseReturnValue:
    """Retry selected mail or all matching the filter: confirm with counts, then requeue."""
    return bulk_retry_view(MAIL)


@bp.post("/cancel")
@requires(Permission.RETRY)  # as the record page's Cancel: whoever may retry may cancel
def bulk_cancel() -> ResponseReturnValue:
    """Cancel selected mail or all matching the filter that is still queued, by version."""
    return bulk_cancel_view(MAIL)
