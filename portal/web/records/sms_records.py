"""SMS records: search by phone number, filters, keyset pages, detail, retry (one and bulk), bulk
cancel.

The pages work exactly as mail's (both are a ``Kind``, whose views ``routes`` makes); what
differs is what a row and the detail show; the box reads text as every search box does
(``search_box``), kept to SMS.
"""

from __future__ import annotations

from flask import Blueprint, render_template
from flask.typing import ResponseReturnValue

from portal.models import Channel
from portal.web.access import Permission, can, requires, viewed_tenant
from portal.web.records.kind import find_record
from portal.web.records.record_page import config_names, show_context
from portal.web.records.routes import add_routes, records_kind

bp = Blueprint("sms_records", __name__, url_prefix="/sms-records")


SMS = records_kind(
    Channel.SMS,
    noun="text message",
    search_label="Phone number",
    search_hint="+447400123456, 447400123456, or as written in your country (07400 123456); "
    "a record id, provider message id or business key.",
    preview_heading="Message",
    list_columns=("phone_number", "content", "rendered_content"),
)
add_routes(bp, SMS)


@bp.get("/<int:record_id>")
@requires(Permission.VIEW_RECORDS)
def show(record_id: int) -> ResponseReturnValue:
    """Everything about one text message, what happened and what to do."""
    record = find_record(SMS, record_id, viewed_tenant(allow_all=True))
    names = config_names(SMS, record, [record.provider_config_id])
    provider = names.get(record.provider_config_id) if record.provider_config_id else None
    return render_template(
        "sms_records/show.html",
        provider=provider,
        can_retry=can(Permission.RETRY),
        **show_context(SMS, record),
    )
