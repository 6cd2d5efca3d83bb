"""The OpenAPI 3 document of the JSON API: its paths and operations here, its schemas in
``openapi_schemas``; kept true by a schemathesis run in the tests."""

from __future__ import annotations

from typing import Any

from portal.web.machine.openapi_schemas import COMMON_RECORD, STREAM_ENUM, schemas


def _json(ref: str) -> dict[str, Any]:
    """A JSON body of the schema ``ref``."""
    return {"application/json": {"schema": {"$ref": ref}}}


_ERROR_RESPONSE = {
    "description": "Rejected; nothing was written",
    "content": _json("#/components/schemas/Error"),
}


def _errors(*codes: str) -> dict[str, Any]:
    return {code: _ERROR_RESPONSE for code in codes}


_UNAVAILABLE_RESPONSE = {
    "description": (
        "The database connection was lost (a restart, a failover): try again after Retry-After "
        "seconds. A request that may have been written says so: repeated with the same "
        "businessKey, it returns that record (duplicate: true) instead of writing another."
    ),
    "headers": {"Retry-After": {"schema": {"type": "integer"}}},
    "content": _json("#/components/schemas/Error"),
}


def _post(summary: str, body_ref: str, ok_ref: str) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "security": [{"apiKey": []}],
            "requestBody": {
                "required": True,
                "content": _json(body_ref),
            },
            "description": (
                "Needs the send scope. A request that could never be sent (an empty subject "
                "or body in place of the template's) is refused with 422 naming the field. A "
                "body over the size limit is 413, with a Content-Length or chunked."
            ),
            "responses": {
                "202": {
                    "description": "Accepted: written as Pending, delivered in the background",
                    "content": _json(ok_ref),
                },
                **_errors("400", "401", "403", "409", "413", "415", "422"),
                "503": _UNAVAILABLE_RESPONSE,
            },
        }
    }


def _get(summary: str, ok_ref: str) -> dict[str, Any]:
    return {
        "get": {
            "summary": summary,
            "security": [{"apiKey": []}],
            "description": "Needs the read scope.",
            "parameters": [_id_param(), _TENANT_PARAM],
            "responses": {
                "200": {
                    "description": "The record",
                    "content": _json(ok_ref),
                },
                **_errors("401", "403", "404", "422"),
            },
        }
    }


def _query(name: str, description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": name,
        "in": "query",
        "required": False,
        "description": description,
        "schema": schema,
    }


def _list(noun: str, record_ref: str) -> dict[str, Any]:
    """GET of a channel's records: newest first, filtered, in keyset pages."""
    mail = noun == "mail"
    to = "an email address" if mail else "a phone number in international form (+447911123456)"
    stamp = {"type": "string", "format": "date-time"}
    return {
        "get": {
            "summary": f"List {noun} records, newest first",
            "security": [{"apiKey": []}],
            "description": (
                "Needs the read scope. Each key may list API_LIST_PER_MINUTE times a minute "
                "(120 unless configured; 429 with Retry-After beyond). Pass nextCursor as "
                "cursor for the next page; the same filters must be given again."
            ),
            "parameters": [
                _TENANT_PARAM,
                _query("to", f"Only records to exactly {to}.", {"type": "string"}),
                _query(
                    "toPrefix",
                    "Only records to "
                    + ("addresses" if mail else "numbers (digits, with or without +)")
                    + " starting with this (at least 3 characters).",
                    {"type": "string", "minLength": 3, "maxLength": 320},
                ),
                _query("status", "Only records in this status.", COMMON_RECORD["status"]),
                _query(
                    "templateCode",
                    "Only records sent by this template code.",
                    {"type": "string", "minLength": 1, "maxLength": 100},
                ),
                _query(
                    "businessKey",
                    "Only the record with this business key.",
                    {"type": "string", "minLength": 1, "maxLength": 200},
                ),
                _query("createdFrom", "Created at or after this time.", stamp),
                _query("createdTo", "Created before this time.", stamp),
                _query(
                    "updatedFrom",
                    "Changed at or after this time (to sync without status callbacks).",
                    stamp,
                ),
                _query("stream", "Only records of this stream.", STREAM_ENUM),
                _query(
                    "limit",
                    "Records per page (default 50).",
                    {"type": "integer", "minimum": 1, "maximum": 500},
                ),
                _query(
                    "cursor",
                    "Where the page starts: a nextCursor this API gave.",
                    {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,40}$"},
                ),
            ],
            "responses": {
                "200": {
                    "description": "One page of records",
                    "content": {
                        "application/json": {
                            "schema": {
                                "type": "object",
                                "required": ["items", "nextCursor"],
                                "properties": {
                                    "items": {"type": "array", "items": {"$ref": record_ref}},
                                    "nextCursor": {
                                        "type": "string",
                                        "nullable": True,
                                        "description": "null on the last page",
                                    },
                                },
                            }
                        }
                    },
                },
                **_errors("401", "403", "404", "422", "429"),
            },
        }
    }


_TENANT_PARAM: dict[str, Any] = {
    "name": "tenantId",
    "in": "query",
    "required": False,
    "description": (
        "The tenant whose records the request reaches. A platform-tier key (and an operator "
        "viewing every tenant) chooses any tenant with it; for any other caller it may only "
        "name the caller's own tenant, and another answers 404, as another tenant's id does."
    ),
    "schema": {"type": "integer"},
}


def _id_param() -> dict[str, Any]:
    return {
        "name": "id",
        "in": "path",
        "required": True,
        "schema": {"type": "integer", "minimum": 0},
    }


def _action(
    summary: str, ok_ref: str, *, body_ref: str | None = None, errors: tuple[str, ...] = ()
) -> dict[str, Any]:
    """A POST on a record (``with an id``) or on a list of them (``body_ref``)."""
    operation: dict[str, Any] = {
        "summary": summary,
        "description": "Needs the send scope (a key), or the Retry permission (a session).",
        "security": [{"apiKey": []}],
        "parameters": [_TENANT_PARAM],
        "responses": {
            "200": {
                "description": "Done",
                "content": _json(ok_ref),
            },
            **_errors(*errors),
        },
    }
    if body_ref is not None:
        operation["requestBody"] = {
            "required": True,
            "content": _json(body_ref),
        }
    return {"post": operation}


def _cancel_one(channel: str) -> dict[str, Any]:
    operation = _action(
        f"Cancel one {channel} record (Pending or Retry, no ambiguous earlier attempt)",
        "#/components/schemas/Cancelled",
        errors=("401", "403", "404", "409", "422"),
    )
    operation["post"]["parameters"] = [_id_param(), _TENANT_PARAM]
    return operation


def _cancel_many(channel: str) -> dict[str, Any]:
    return _action(
        f"Cancel many {channel} records; the others are skipped with a reason",
        "#/components/schemas/BulkCancelled",
        body_ref="#/components/schemas/Ids",
        errors=("400", "401", "403", "404", "413", "415", "422"),
    )


def _resolve(channel: str) -> dict[str, Any]:
    operation = _action(
        f"Resolve an Uncertain {channel} record (its tenant's keys and admins, platform "
        "operators); never resends",
        "#/components/schemas/Resolved",
        body_ref="#/components/schemas/Resolution",
        errors=("400", "401", "403", "404", "409", "413", "415", "422"),
    )
    operation["post"]["parameters"] = [_id_param(), _TENANT_PARAM]
    return operation


_RETRY_TEXT = (
    " A manual retry counts as a retry. A record past its expiresAt is refused (409, code "
    "expired) unless the body gives a new, later expiresAt; a record stopped by its resend "
    "window (RETRY_WINDOW_EXPIRED) starts a new window. Uncertain records are never retried: "
    "resolve them. A record with an ambiguous earlier attempt (ambiguous: true) may be "
    "delivered twice if retried. wouldFailAgain lists the records requeued whose diagnosis "
    "says they would fail again (reasonCode: a full quota, a missing template or binding, no "
    "server or provider, one that is down, every recipient suppressed or refused, ...): they "
    "are requeued all the same and will fail again unless that changes first; each says why "
    "and what to change."
)


def _retry_one(kind: str) -> dict[str, Any]:
    operation = _action(
        f"Requeue one {kind} (Pending, Retry, Failed, DeadLetter: Retry due now)",
        "#/components/schemas/Retried",
        errors=("400", "401", "403", "404", "409", "415", "422"),
    )
    operation["post"]["description"] += _RETRY_TEXT
    operation["post"]["requestBody"] = {
        "required": False,
        "content": _json("#/components/schemas/RetryBody"),
    }
    operation["post"]["parameters"] = [
        {
            "name": "id",
            "in": "query",
            "required": True,
            "schema": {"type": "integer", "minimum": 1},
        },
        _TENANT_PARAM,
    ]
    return operation


def _retry_many(kind: str) -> dict[str, Any]:
    operation = _action(
        f"Requeue many {kind}s; the others are skipped with a reason",
        "#/components/schemas/BulkRetried",
        body_ref="#/components/schemas/RetryIds",
        errors=("400", "401", "403", "404", "413", "415", "422"),
    )
    operation["post"]["description"] += _RETRY_TEXT
    return operation


def _quota_usage() -> dict[str, Any]:
    return {
        "get": {
            "summary": "This month's usage of a tenant's quota bucket and the ceilings in force",
            "description": "Needs the read scope (a key) or the quota permission (a session).",
            "security": [{"apiKey": []}],
            "parameters": [_TENANT_PARAM],
            "responses": {
                "200": {
                    "description": "The usage",
                    "content": _json("#/components/schemas/Usage"),
                },
                **_errors("401", "403", "404", "422"),
            },
        }
    }


def openapi_document() -> dict[str, Any]:
    """The whole document."""
    document = _document()
    # Acceptance treats an optional field sent as null like one left out; say so.
    for name in ("MailRequest", "SmsRequest"):
        schema = document["components"]["schemas"][name]
        for field, spec in schema["properties"].items():
            if field not in schema.get("required", []):
                schema["properties"][field] = _nullable(spec)
    return document


def _nullable(spec: dict[str, Any]) -> dict[str, Any]:
    if "oneOf" in spec:
        return {"oneOf": spec["oneOf"], "nullable": True}
    return spec | {"nullable": True}


def _document() -> dict[str, Any]:
    return {
        "openapi": "3.0.3",
        "info": {
            "title": "Postroom delivery API",
            "version": "1",
            "description": (
                "Hand mail and SMS to the delivery service. Accepted messages are written as "
                "Pending and sent in the background; read a record to follow it."
            ),
        },
        "paths": {
            "/api/v1/mail": _post(
                "Accept one mail",
                "#/components/schemas/MailRequest",
                "#/components/schemas/Accepted",
            )
            | _list("mail", "#/components/schemas/MailRecord"),
            "/api/v1/mail/batch": _post(
                "Accept up to 500 mails, all or none",
                "#/components/schemas/MailBatch",
                "#/components/schemas/BatchAccepted",
            ),
            "/api/v1/sms": _post(
                "Accept one SMS", "#/components/schemas/SmsRequest", "#/components/schemas/Accepted"
            )
            | _list("SMS", "#/components/schemas/SmsRecord"),
            "/api/v1/sms/batch": _post(
                "Accept up to 500 SMS, all or none",
                "#/components/schemas/SmsBatch",
                "#/components/schemas/BatchAccepted",
            ),
            "/api/v1/mail/{id}": _get("Read one mail record", "#/components/schemas/MailRecord"),
            "/api/v1/sms/{id}": _get("Read one SMS record", "#/components/schemas/SmsRecord"),
            "/api/v1/mail/{id}/cancel": _cancel_one("mail"),
            "/api/v1/sms/{id}/cancel": _cancel_one("SMS"),
            "/api/v1/mail/cancel": _cancel_many("mail"),
            "/api/v1/sms/cancel": _cancel_many("SMS"),
            "/api/v1/mail/{id}/resolve": _resolve("mail"),
            "/api/v1/sms/{id}/resolve": _resolve("SMS"),
            # The seed's operator endpoints, at their old paths.
            "/MailSendRecord/retry": _retry_one("MailSendRecord"),
            "/SmsSendRecord/retry": _retry_one("SmsSendRecord"),
            "/MailSendRecord/retryByIds": _retry_many("MailSendRecord"),
            "/SmsSendRecord/retryByIds": _retry_many("SmsSendRecord"),
            "/TenantMessageQuota/usage": _quota_usage(),
        },
        "components": {
            "securitySchemes": {"apiKey": {"type": "http", "scheme": "bearer"}},
            "schemas": schemas(),
        },
    }
