"""The OpenAPI 3 document of the JSON API, kept true by a schemathesis run in the tests."""

from __future__ import annotations

from typing import Any, cast

from portal.messaging.records.diagnosis import Reason
from portal.messaging.records.validation import MAX_BATCH, MAX_RECIPIENTS

_EMAIL_LIST = {
    "oneOf": [
        {"type": "string", "format": "email"},
        {
            "type": "array",
            "items": {"type": "string", "format": "email"},
            "maxItems": MAX_RECIPIENTS,
        },
    ]
}
_NULLABLE_STR = {"type": "string", "nullable": True}
_NULLABLE_TIME = {"type": "string", "format": "date-time", "nullable": True}
_NULLABLE_INT = {"type": "integer", "nullable": True}

_ERROR_RESPONSE = {
    "description": "Rejected; nothing was written",
    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
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
    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
}


def _post(summary: str, body_ref: str, ok_ref: str) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "security": [{"apiKey": []}],
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": body_ref}}},
            },
            "description": (
                "Needs the send scope. A request that could never be sent (an empty subject "
                "or body in place of the template's) is refused with 422 naming the field. A "
                "body over the size limit is 413, with a Content-Length or chunked."
            ),
            "responses": {
                "202": {
                    "description": "Accepted: written as Pending, delivered in the background",
                    "content": {"application/json": {"schema": {"$ref": ok_ref}}},
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
                    "content": {"application/json": {"schema": {"$ref": ok_ref}}},
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
                _query(
                    "status", "Only records in this status.", cast(Any, _COMMON_RECORD["status"])
                ),
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
                _query("stream", "Only records of this stream.", _STREAM_ENUM),
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


_STREAM_ENUM: dict[str, Any] = {"type": "string", "enum": ["transactional", "broadcast"]}

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
                "content": {"application/json": {"schema": {"$ref": ok_ref}}},
            },
            **_errors(*errors),
        },
    }
    if body_ref is not None:
        operation["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": body_ref}}},
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
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/RetryBody"}}},
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
                    "content": {
                        "application/json": {"schema": {"$ref": "#/components/schemas/Usage"}}
                    },
                },
                **_errors("401", "403", "404", "422"),
            },
        }
    }


_COMMON_RECORD = {
    "id": {"type": "integer"},
    "status": {
        "type": "string",
        "enum": [
            "Pending",
            "Sending",
            "Sent",
            "Retry",
            "Failed",
            "DeadLetter",
            "Cancelled",
            "Suppressed",
            "Uncertain",
        ],
    },
    "scope": {"type": "string", "enum": ["TENANT", "PLATFORM"]},
    "stream": {"type": "string", "enum": ["transactional", "broadcast"]},
    "retryCount": {"type": "integer"},
    "nextRetryAt": _NULLABLE_TIME,
    "errorCode": _NULLABLE_STR,
    "errorMessage": _NULLABLE_STR,
    "traceId": _NULLABLE_STR,
    "businessKey": _NULLABLE_STR,
    "templateCode": _NULLABLE_STR,
    "templateVersion": {
        "type": "integer",
        "nullable": True,
        "description": "The version of the template the message was prepared with (null "
        "before preparation, or when no template is used).",
    },
    "test": {
        "type": "boolean",
        "description": "A test send from the template editor (charged like any send).",
    },
    "providerMessageId": _NULLABLE_STR,
    "preparedAt": _NULLABLE_TIME,
    "sentAt": _NULLABLE_TIME,
    "expiresAt": _NULLABLE_TIME,
    "metadata": {"type": "object", "nullable": True},
    "ambiguous": {
        "type": "boolean",
        "description": (
            "An attempt may have been accepted without our knowing (no answer in time, a "
            "lost connection, a stuck send): the message may have gone out even if the "
            "status says otherwise. Never cleared once true; such records are listed for a "
            "decision in the portal."
        ),
    },
    "createdTime": {"type": "string", "format": "date-time"},
    "updatedTime": {"type": "string", "format": "date-time"},
}


# Why a retry now would fail again: a record's diagnosis (messaging.records.diagnosis.Reason).
_REASON: dict[str, Any] = {"type": "string", "enum": [r.value for r in Reason]}

_DIAGNOSIS: dict[str, Any] = {
    "type": "object",
    "description": "One record's GET only: what happened, whether sending it again now would "
    "fail the same way and why, what to do and which role can; the portal's record page "
    "says the same.",
    "required": ["cause", "wouldFailAgain", "action", "who"],
    "properties": {
        "cause": {"type": "string"},
        "wouldFailAgain": {
            "type": "object",
            "required": ["value", "reason", "why"],
            "properties": {
                "value": {"type": "boolean"},
                "reason": _REASON | {"nullable": True},
                "why": {"type": "string", "nullable": True},
            },
        },
        "action": {"type": "string"},
        "who": {"type": "string", "enum": ["support", "tenant_admin", "platform_operator"]},
    },
}


def _attempts(route: str, what: str) -> dict[str, Any]:
    """``attempts`` of one record: every attempt that reached the transport, oldest first."""
    return {
        "type": "array",
        "description": (
            "Every attempt that reached the server or provider, oldest first. A deferral "
            "that never reached it (a rate limit, a server marked down) is not an attempt."
        ),
        "items": {
            "type": "object",
            "required": ["number", "startedAt", "finishedAt", "outcome", "ambiguous"],
            "properties": {
                "number": {"type": "integer", "minimum": 1},
                "startedAt": {"type": "string", "format": "date-time"},
                "finishedAt": {"type": "string", "format": "date-time"},
                "durationMs": _NULLABLE_INT,
                "outcome": {
                    "type": "string",
                    "enum": ["sent", "retry", "failed", "dead_letter", "uncertain", "swept"],
                    "description": "swept: the worker stopped mid-send; the stuck-send sweep "
                    "moved the record on.",
                },
                "ambiguous": {"type": "boolean"},
                "code": {
                    "type": "string",
                    "nullable": True,
                    "description": what,
                },
                "message": _NULLABLE_STR,
                route: {
                    "type": "string",
                    "nullable": True,
                    "description": f"The {route}'s name (a platform one is named as the "
                    f"platform {'mail' if route == 'server' else 'SMS'} service).",
                },
                "providerMessageId": _NULLABLE_STR,
                "worker": {
                    "type": "string",
                    "nullable": True,
                    "description": "The worker process (host:pid); platform operators only.",
                },
            },
        },
    }


_METADATA = {
    "type": "object",
    "maxProperties": 20,
    "description": (
        "Your own key/values (at most 20 keys and 2 KB as JSON), returned on GET and in "
        "status callbacks."
    ),
}

_MAIL_BODY = (
    "html, text or both. Without a template at least one of them must hold more than white "
    "space. With a template, giving either replaces both of the template's bodies (html alone: "
    "its text part is made from it), so the ones given may not all be empty or white space "
    "only (422, naming the first given): leave both out, or null, to use the template's body."
)

_STREAM = {
    "type": "string",
    "enum": ["transactional", "broadcast"],
    "description": (
        "The message stream. Transactional work (one person's receipt, a password reset) is "
        "claimed first; broadcast (newsletters, campaigns) never takes every worker while "
        "transactional work is due. Not given: the template's default when a template is "
        "named, else transactional. Any other value is refused (422, field stream)."
    ),
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
            "schemas": {
                "MailRequest": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["to"],
                    "properties": {
                        "to": _EMAIL_LIST,
                        "cc": _EMAIL_LIST,
                        "bcc": _EMAIL_LIST,
                        "replyTo": {"type": "string", "format": "email"},
                        "subject": {
                            "type": "string",
                            "minLength": 1,
                            "maxLength": 998,
                            "description": (
                                "One line. Required without a template; with one, given it "
                                "replaces the template's subject. Empty or white space only "
                                "is refused (422): leave it out, or null, to use the "
                                "template's."
                            ),
                        },
                        "html": {"type": "string", "description": _MAIL_BODY},
                        "text": {"type": "string", "description": _MAIL_BODY},
                        "templateId": {"type": "integer", "minimum": 1},
                        "templateCode": {"type": "string", "minLength": 1, "maxLength": 100},
                        "variables": {"type": "object"},
                        "serverId": {"type": "integer", "minimum": 1},
                        "priority": {"type": "integer", "minimum": 1, "maximum": 5},
                        "scope": {"type": "string", "enum": ["TENANT", "PLATFORM"]},
                        "businessKey": {"type": "string", "minLength": 1, "maxLength": 200},
                        "expiresAt": {"type": "string", "format": "date-time"},
                        "stream": _STREAM,
                        "metadata": _METADATA,
                        "attachments": {
                            "type": "array",
                            "maxItems": 20,
                            "items": {
                                "type": "object",
                                "additionalProperties": False,
                                "required": ["name", "content"],
                                "properties": {
                                    "name": {"type": "string"},
                                    "contentType": {"type": "string", "nullable": True},
                                    "content": {"type": "string", "format": "byte"},
                                },
                            },
                        },
                    },
                },
                "SmsRequest": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["phoneNumber"],
                    "properties": {
                        "phoneNumber": {"type": "string", "example": "+447812345678"},
                        "content": {
                            "type": "string",
                            "maxLength": 1600,
                            "description": (
                                "The SMS text. Required without templateCode; with one, "
                                "given it replaces the template's content (empty, or null, "
                                "uses the template's). White space only is refused (422): "
                                "it would send nothing."
                            ),
                        },
                        "templateCode": {"type": "string", "maxLength": 100},
                        "variables": {"type": "object"},
                        "scope": {"type": "string", "enum": ["TENANT", "PLATFORM"]},
                        "businessKey": {"type": "string", "minLength": 1, "maxLength": 200},
                        "expiresAt": {"type": "string", "format": "date-time"},
                        "stream": _STREAM,
                        "metadata": _METADATA,
                    },
                },
                "MailBatch": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["items"],
                    "properties": {
                        "items": {
                            "type": "array",
                            "minItems": 1,
                            "maxItems": MAX_BATCH,
                            "items": {"$ref": "#/components/schemas/MailRequest"},
                        }
                    },
                },
                "SmsBatch": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["items"],
                    "properties": {
                        "items": {
                            "type": "array",
                            "minItems": 1,
                            "maxItems": MAX_BATCH,
                            "items": {"$ref": "#/components/schemas/SmsRequest"},
                        }
                    },
                },
                "Accepted": {
                    "type": "object",
                    "required": ["id", "duplicate"],
                    "properties": {"id": {"type": "integer"}, "duplicate": {"type": "boolean"}},
                },
                "BatchAccepted": {
                    "type": "object",
                    "required": ["items"],
                    "properties": {
                        "items": {
                            "type": "array",
                            "items": {"$ref": "#/components/schemas/Accepted"},
                        }
                    },
                },
                "Ids": {
                    "type": "object",
                    "required": ["ids"],
                    "properties": {
                        "ids": {
                            "type": "array",
                            "maxItems": 1000,
                            "items": {"type": "integer", "minimum": 1},
                        }
                    },
                },
                "RetryBody": {
                    "type": "object",
                    "properties": {
                        "expiresAt": {
                            "type": "string",
                            "format": "date-time",
                            "description": "A new, later expiry: needed to retry an expired "
                            "record.",
                        }
                    },
                },
                "RetryIds": {
                    "type": "object",
                    "required": ["ids"],
                    "properties": {
                        "ids": {
                            "type": "array",
                            "maxItems": 1000,
                            "items": {"type": "integer", "minimum": 1},
                        },
                        "expiresAt": {
                            "type": "string",
                            "format": "date-time",
                            "description": "The new expiry of every record requeued; expired "
                            "records are skipped without it.",
                        },
                    },
                },
                "Cancelled": {
                    "type": "object",
                    "required": ["id", "status"],
                    "properties": {
                        "id": {"type": "integer"},
                        "status": {"type": "string", "enum": ["Cancelled"]},
                    },
                },
                "Skipped": {
                    "type": "array",
                    "description": "The ids not acted on, each with the reason",
                    "items": {
                        "type": "object",
                        "required": ["id", "reason"],
                        "properties": {"id": {"type": "integer"}, "reason": {"type": "string"}},
                    },
                },
                "BulkCancelled": {
                    "type": "object",
                    "required": ["cancelled", "cancelledIds", "skipped"],
                    "properties": {
                        "cancelled": {"type": "integer"},
                        "cancelledIds": {"type": "array", "items": {"type": "integer"}},
                        "skipped": {"$ref": "#/components/schemas/Skipped"},
                    },
                },
                "Retried": {
                    "type": "object",
                    "required": ["id", "status", "requeued", "wouldFailAgain"],
                    "properties": {
                        "id": {"type": "integer"},
                        "status": {"type": "string", "enum": ["Retry"]},
                        "requeued": {"type": "integer"},
                        "wouldFailAgain": {"$ref": "#/components/schemas/WouldFailAgain"},
                    },
                },
                "BulkRetried": {
                    "type": "object",
                    "required": ["requeued", "requeuedIds", "skipped", "wouldFailAgain"],
                    "properties": {
                        "requeued": {"type": "integer"},
                        "requeuedIds": {"type": "array", "items": {"type": "integer"}},
                        "skipped": {"$ref": "#/components/schemas/Skipped"},
                        "wouldFailAgain": {"$ref": "#/components/schemas/WouldFailAgain"},
                    },
                },
                "WouldFailAgain": {
                    "type": "array",
                    "description": "Of the records requeued, those whose cause is still there, "
                    "as the portal's Retry says: the error code they failed with and why a "
                    "retry now fails again, ending with what to change first.",
                    "items": {
                        "type": "object",
                        "required": ["id", "code", "reasonCode", "reason"],
                        "properties": {
                            "id": {"type": "integer"},
                            "code": {"type": "string", "nullable": True},
                            "reasonCode": _REASON,
                            "reason": {
                                "type": "string",
                                "example": "the quota of Globex is full (5 of 5); raise it first",
                            },
                        },
                    },
                },
                "Diagnosis": _DIAGNOSIS,
                "Usage": {
                    "type": "object",
                    "required": ["tenantId", "month", "mail", "sms"],
                    "properties": {
                        "tenantId": {"type": "integer"},
                        "month": {"type": "string"},
                        "mail": {"$ref": "#/components/schemas/UsageOfChannel"},
                        "sms": {"$ref": "#/components/schemas/UsageOfChannel"},
                    },
                },
                "UsageOfChannel": {
                    "type": "object",
                    "required": ["used", "limit"],
                    "properties": {
                        "used": {"type": "integer"},
                        "limit": {"type": "integer", "nullable": True},
                    },
                },
                "Resolution": {
                    "type": "object",
                    "required": ["outcome"],
                    "properties": {
                        "outcome": {"type": "string", "enum": ["accepted", "failed"]},
                        "providerMessageId": {"type": "string", "maxLength": 200},
                        "reason": {"type": "string"},
                    },
                },
                "Resolved": {
                    "type": "object",
                    "required": ["id", "status"],
                    "properties": {
                        "id": {"type": "integer"},
                        "status": {"type": "string", "enum": ["Sent", "Failed"]},
                        "providerMessageId": _NULLABLE_STR,
                    },
                },
                "Error": {
                    "type": "object",
                    "required": ["error"],
                    "properties": {
                        "error": {
                            "type": "object",
                            "required": ["code", "message"],
                            "properties": {
                                "code": {"type": "string"},
                                "field": {"type": "string", "nullable": True},
                                "message": {"type": "string"},
                                "index": {"type": "integer"},
                                "missing": {
                                    "type": "array",
                                    "items": {"type": "string"},
                                    "description": (
                                        "missing_variables: the variables the template needs "
                                        "that the request does not give"
                                    ),
                                },
                            },
                        }
                    },
                },
                "MailRecord": {
                    "type": "object",
                    "required": ["id", "status", "to"],
                    "properties": _COMMON_RECORD
                    | {
                        "to": {"type": "array", "items": {"type": "string"}},
                        "cc": {"type": "array", "items": {"type": "string"}},
                        "bcc": {"type": "array", "items": {"type": "string"}},
                        "subject": _NULLABLE_STR,
                        "templateId": _NULLABLE_INT,
                        "serverId": _NULLABLE_INT,
                        "diagnosis": {"$ref": "#/components/schemas/Diagnosis"},
                        "attempts": _attempts(
                            "server", "The SMTP reply code with its enhanced code ('451 4.7.1')."
                        ),
                    },
                },
                "SmsRecord": {
                    "type": "object",
                    "required": ["id", "status", "phoneNumber"],
                    "properties": _COMMON_RECORD
                    | {
                        "phoneNumber": {"type": "string"},
                        "countryCode": _NULLABLE_STR,
                        "content": _NULLABLE_STR,
                        "providerId": _NULLABLE_INT,
                        "diagnosis": {"$ref": "#/components/schemas/Diagnosis"},
                        "attempts": _attempts(
                            "provider",
                            "The HTTP status followed by the provider's own code ('400 21211'), "
                            "or our code when no HTTP answer came (TIMEOUT, NETWORK_ERROR).",
                        ),
                    },
                },
            },
        },
    }
