"""What a request names, checked against its tier before acceptance writes it
(``acceptance``): its template (by code an enabled one, by id any; a strict one's needed
variables; its default stream) and a mail's server.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from portal.messaging.records.validation import (
    AcceptanceError,
    MailRequest,
    MissingVariables,
    SmsRequest,
)
from portal.messaging.templating import checks as template_checks
from portal.models import MailTemplate, SmsTemplate
from portal.models.record import Stream
from portal.tenancy import PLATFORM_TENANT_ID


def resolve_streams(
    session: Session,
    template: type[MailTemplate] | type[SmsTemplate],
    requests: Sequence[MailRequest | SmsRequest],
) -> None:
    """Fill in the stream of requests that name none: their template's default (one query
    per owner for the batch's templates), else transactional."""
    wanted: dict[int, tuple[set[str], set[int]]] = {}
    for req in requests:
        template_id = _template_id(req)
        if req.stream is None and (req.template_code is not None or template_id is not None):
            codes, ids = wanted.setdefault(req.tenant_id, (set(), set()))
            if req.template_code is not None:
                codes.add(req.template_code)
            if template_id is not None:
                ids.add(template_id)
    by_code: dict[tuple[int, str], str] = {}
    by_id: dict[tuple[int, int], str] = {}
    for owner, (codes, ids) in wanted.items():
        named = or_(template.code.in_(codes), template.id.in_(ids))
        rows = session.execute(
            select(template.id, template.code, template.stream).where(
                template.tenant_id == owner, named
            )
        )
        for found_id, code, stream in rows:
            by_code[(owner, code)] = stream
            by_id[(owner, found_id)] = stream
    for req in requests:
        if req.stream is not None:
            continue
        tid = _template_id(req)
        found = None
        if req.template_code is not None:
            found = by_code.get((req.tenant_id, req.template_code))
        elif tid is not None:
            found = by_id.get((req.tenant_id, tid))
        req.stream = found or Stream.TRANSACTIONAL.value


def _template_id(req: MailRequest | SmsRequest) -> int | None:
    return req.template_id if isinstance(req, MailRequest) else None


def _session_fetch(session: Session) -> template_checks.Fetch:
    """Template look-ups on the session's connection (in its transaction: a template the
    caller added and has not committed is seen)."""
    if session.new or session.dirty or session.deleted:
        session.flush()
    connection = session.connection()
    qmark = connection.dialect.paramstyle == "qmark"

    def fetch(sql: str, params: tuple[Any, ...]) -> tuple[Any, ...] | None:
        row = connection.exec_driver_sql(sql.replace("%s", "?") if qmark else sql, params)
        found = row.fetchone()
        return None if found is None else tuple(found)

    return fetch


def fetcher_of(session: Session) -> Callable[[], template_checks.Fetch]:
    """``_session_fetch`` made at the first template look-up (none for plain sends)."""
    made: list[template_checks.Fetch] = []

    def fetcher() -> template_checks.Fetch:
        if not made:
            made.append(_session_fetch(session))
        return made[0]

    return fetcher


def check_template(
    fetcher: Callable[[], template_checks.Fetch], req: MailRequest | SmsRequest
) -> None:
    """The request's template as it would be used now: by code an enabled one in
    the scope's tier (else 422 naming templateCode), by id any of the tier's (else 422 naming
    templateId: a test send of a disabled template stays possible); a strict template's
    needed variables given (else 422 missing_variables). Sets the request's stream from the
    template when it names none. ``fetcher`` gives the look-up, called only when needed."""
    template_id = _template_id(req)
    code = req.template_code
    if template_id is None and code is None:
        return
    fetch = fetcher()
    mail = isinstance(req, MailRequest)
    channel = "mail" if mail else "sms"
    if template_id is not None:
        facts = template_checks.by_id(fetch, channel, req.tenant_id, template_id)
        if facts is None:
            raise AcceptanceError("not_found", "templateId", "no such template")
    else:
        assert code is not None
        facts = template_checks.by_code(fetch, channel, req.tenant_id, code)
        if facts is None or not facts.enabled:
            where = "the platform tier" if req.tenant_id == PLATFORM_TENANT_ID else "this tenant"
            raise AcceptanceError(
                "not_found",
                "templateCode",
                f"no enabled {'mail' if mail else 'SMS'} template with code {code!r} in {where}",
            )
    if req.stream is None:
        req.stream = facts.stream
    if not facts.strict:
        return
    if isinstance(req, MailRequest):
        missing = facts.missing(
            req.variables,
            subject=req.subject is None,
            body=req.html is None and req.text is None,
        )
    else:
        missing = facts.missing(req.variables, subject=False, body=not req.content)
    if missing:
        raise MissingVariables(missing)


_SERVER_SQL = "SELECT 1 FROM mail_send_server_config WHERE id = %s AND tenant_id = %s"


def check_server(
    fetcher: Callable[[], template_checks.Fetch], req: MailRequest | SmsRequest
) -> None:
    """A mail's serverId must exist in the send scope's tier (else: as if it did not), read
    on the connection ``fetcher`` gives (the session's, or the API's autocommit one)."""
    if not isinstance(req, MailRequest) or req.server_id is None:
        return
    if fetcher()(_SERVER_SQL, (req.server_id, req.tenant_id)) is None:
        raise AcceptanceError("not_found", "serverId", "no such mail server")
