"""The message as sent: an attempt's ``.eml``, and a page with its headers.

The file is rebuilt from the frozen record (what preparation froze: subject, bodies, Reply-To,
priority, attachments, Message-ID) by the transport's own code (``pipeline.outgoing_mail`` and
``message_bytes``), with the attempt's Date. Bcc is never in it (the transport keeps Bcc
in the envelope only), nor are recipients the suppression list left out. The From comes from
the server as it is now: the headers page warns when the server was saved after the attempt.
"""

from __future__ import annotations

from dataclasses import replace
from email.parser import BytesHeaderParser
from email.policy import default as default_policy
from typing import Any

from flask import Blueprint, Response, abort, render_template
from flask.typing import ResponseReturnValue
from sqlalchemy import select

from portal.extensions import db
from portal.messaging.sending.pipeline import frozen_mail, outgoing_mail
from portal.messaging.sending.preparation import SUPPRESSED
from portal.messaging.sending.transports.mail_message import message_bytes
from portal.models import MailSendServerConfig, SendAttempt
from portal.tenancy import PLATFORM_TENANT_ID, names_config
from portal.web.access import Permission, is_operator, requires, viewed_tenant
from portal.web.records.kind import find_record
from portal.web.records.mail_records import MAIL

bp = Blueprint("mail_attempts", __name__, url_prefix="/mail-records")


def _rebuilt(record_id: int, number: int) -> tuple[Any, SendAttempt, bytes | None, list[str]]:
    """(record, attempt, the .eml's bytes or None, warnings); 404 for a record the viewer may
    not see or an attempt it does not have."""
    record = find_record(MAIL, record_id, viewed_tenant(allow_all=True))
    if not 1 <= number <= 1_000_000:
        abort(404)
    attempt = db.session.scalar(
        select(SendAttempt).where(
            SendAttempt.channel == "mail",
            SendAttempt.record_id == record.id,
            SendAttempt.number == number,
        )
    )
    if attempt is None:
        abort(404)
    warnings: list[str] = []
    if record.prepared_at is None or record.message_id_header is None:
        return record, attempt, None, ["This mail was never prepared, so there is no message."]
    config = db.session.scalar(
        select(MailSendServerConfig).where(
            MailSendServerConfig.id == record.server_config_id,
            MailSendServerConfig.tenant_id.in_([record.tenant_id, PLATFORM_TENANT_ID]),
        )
    )
    if config is None:
        warnings.append(
            "The mail server it went through has been deleted, so its From cannot be shown."
        )
        return record, attempt, None, warnings
    if config.updated_time and config.updated_time > attempt.started_at:
        named = names_config(config.tenant_id, is_operator())
        server = f"The server {config.name!r}" if named else "The platform mail server"
        warnings.append(
            f"{server} was saved after this attempt "
            f"({config.updated_time:%Y-%m-%d %H:%M} UTC): the From shown is its current one, "
            "which may differ from what was sent."
        )
    left_out = {
        address: str(why[1]) if isinstance(why, list) and len(why) > 1 else ""
        for address, why in (record.refused_recipients or {}).items()
        if isinstance(why, list) and why and why[0] == SUPPRESSED
    }
    mail = replace(
        outgoing_mail(record, frozen_mail(record), config, left_out), date=attempt.started_at
    )
    try:
        data = message_bytes(mail)
    except ValueError as exc:
        return record, attempt, None, [f"The message cannot be rebuilt: {exc}."]
    return record, attempt, data, warnings


@bp.get("/<int:record_id>/attempts/<int:number>.eml")
@requires(Permission.VIEW_RECORDS)
def eml(record_id: int, number: int) -> ResponseReturnValue:
    """The attempt's message as a file (message/rfc822)."""
    _record, _attempt, data, warnings = _rebuilt(record_id, number)
    if data is None:
        abort(404, description=" ".join(warnings))
    response = Response(data, mimetype="message/rfc822")
    response.headers["Content-Disposition"] = (
        f'attachment; filename="mail-{record_id}-attempt-{number}.eml"'
    )
    response.headers["X-Content-Type-Options"] = "nosniff"
    return response


@bp.get("/<int:record_id>/attempts/<int:number>")
@requires(Permission.VIEW_RECORDS)
def headers(record_id: int, number: int) -> ResponseReturnValue:
    """The attempt's message headers, with the download and any warning."""
    record, attempt, data, warnings = _rebuilt(record_id, number)
    fields: list[tuple[str, str]] = []
    if data is not None:
        parsed = BytesHeaderParser(policy=default_policy).parsebytes(data)
        fields = [(name, str(value)) for name, value in parsed.items()]
    return render_template(
        "mail_records/attempt.html",
        record=record,
        attempt=attempt,
        fields=fields,
        warnings=warnings,
        downloadable=data is not None,
    )
