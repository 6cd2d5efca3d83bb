"""Mail records: search, filters, keyset pages, detail, the message as sent, retry (one and
bulk) and bulk cancel.

The machinery is channel-neutral (a ``Kind``, whose views ``routes`` makes); the box reads
text as every search box does (``search_box``: an address or part of one, a subject word, an
id), kept to mail; what is mail's own is the columns a row shows and the detail page.
"""

from __future__ import annotations

from flask import Blueprint, make_response, render_template
from flask.typing import ResponseReturnValue

from portal.models import Channel
from portal.web.access import Permission, can, requires, viewed_tenant
from portal.web.records.kind import find_record
from portal.web.records.record_page import config_names, show_context
from portal.web.records.routes import add_routes, records_kind
from portal.web.security import sandboxed

bp = Blueprint("mail_records", __name__, url_prefix="/mail-records")


MAIL = records_kind(
    Channel.MAIL,
    noun="mail",
    search_label="Email address or subject",
    search_hint="carol@example.com, carol, @example.com, a word of the subject, a record id, "
    "Message-ID or business key.",
    preview_heading="Subject",
    list_columns=("to_addrs", "cc_addrs", "bcc_addrs", "subject", "rendered_subject"),
)
add_routes(bp, MAIL)

# --- mail's views ------------------------------------------------------------------------------


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
