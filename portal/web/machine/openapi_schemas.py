"""The OpenAPI document's schemas (``components.schemas``): the requests the JSON API takes,
the records and answers it gives, and the pieces they share."""

from __future__ import annotations

from typing import Any

from portal.messaging.records.diagnosis.reasons import Reason
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
_SCOPE = {"type": "string", "enum": ["TENANT", "PLATFORM"]}
STREAM_ENUM: dict[str, Any] = {"type": "string", "enum": ["transactional", "broadcast"]}
_IDS = {"type": "array", "maxItems": 1000, "items": {"type": "integer", "minimum": 1}}

COMMON_RECORD: dict[str, Any] = {
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
    "scope": _SCOPE,
    "stream": STREAM_ENUM,
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


# Why a retry now would fail again: a record's diagnosis (``diagnosis.reasons.Reason``).
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

_STREAM = STREAM_ENUM | {
    "description": (
        "The message stream. Transactional work (one person's receipt, a password reset) is "
        "claimed first; broadcast (newsletters, campaigns) never takes every worker while "
        "transactional work is due. Not given: the template's default when a template is "
        "named, else transactional. Any other value is refused (422, field stream)."
    ),
}

# What a mail and an SMS request both take, after their own fields.
_SEND_OPTIONS = {
    "scope": _SCOPE,
    "businessKey": {"type": "string", "minLength": 1, "maxLength": 200},
    "expiresAt": {"type": "string", "format": "date-time"},
    "stream": _STREAM,
    "metadata": _METADATA,
}


def _batch(request_ref: str) -> dict[str, Any]:
    """Up to MAX_BATCH requests, accepted all or none."""
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["items"],
        "properties": {
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": MAX_BATCH,
                "items": {"$ref": request_ref},
            }
        },
    }


def _complete(properties: dict[str, Any]) -> dict[str, Any]:
    """An object whose every property is always there."""
    return {"type": "object", "required": list(properties), "properties": properties}


def schemas() -> dict[str, Any]:
    """``components.schemas`` of the document, built afresh on each call."""
    return {
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
                **_SEND_OPTIONS,
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
                **_SEND_OPTIONS,
            },
        },
        "MailBatch": _batch("#/components/schemas/MailRequest"),
        "SmsBatch": _batch("#/components/schemas/SmsRequest"),
        "Accepted": _complete({"id": {"type": "integer"}, "duplicate": {"type": "boolean"}}),
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
            "properties": {"ids": _IDS},
        },
        "RetryBody": {
            "type": "object",
            "properties": {
                "expiresAt": {
                    "type": "string",
                    "format": "date-time",
                    "description": "A new, later expiry: needed to retry an expired record.",
                }
            },
        },
        "RetryIds": {
            "type": "object",
            "required": ["ids"],
            "properties": {
                "ids": _IDS,
                "expiresAt": {
                    "type": "string",
                    "format": "date-time",
                    "description": "The new expiry of every record requeued; expired "
                    "records are skipped without it.",
                },
            },
        },
        "Cancelled": _complete(
            {
                "id": {"type": "integer"},
                "status": {"type": "string", "enum": ["Cancelled"]},
            }
        ),
        "Skipped": {
            "type": "array",
            "description": "The ids not acted on, each with the reason",
            "items": {
                "type": "object",
                "required": ["id", "reason"],
                "properties": {"id": {"type": "integer"}, "reason": {"type": "string"}},
            },
        },
        "BulkCancelled": _complete(
            {
                "cancelled": {"type": "integer"},
                "cancelledIds": {"type": "array", "items": {"type": "integer"}},
                "skipped": {"$ref": "#/components/schemas/Skipped"},
            }
        ),
        "Retried": _complete(
            {
                "id": {"type": "integer"},
                "status": {"type": "string", "enum": ["Retry"]},
                "requeued": {"type": "integer"},
                "wouldFailAgain": {"$ref": "#/components/schemas/WouldFailAgain"},
            }
        ),
        "BulkRetried": _complete(
            {
                "requeued": {"type": "integer"},
                "requeuedIds": {"type": "array", "items": {"type": "integer"}},
                "skipped": {"$ref": "#/components/schemas/Skipped"},
                "wouldFailAgain": {"$ref": "#/components/schemas/WouldFailAgain"},
            }
        ),
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
        "Usage": _complete(
            {
                "tenantId": {"type": "integer"},
                "month": {"type": "string"},
                "mail": {"$ref": "#/components/schemas/UsageOfChannel"},
                "sms": {"$ref": "#/components/schemas/UsageOfChannel"},
            }
        ),
        "UsageOfChannel": _complete(
            {
                "used": {"type": "integer"},
                "limit": {"type": "integer", "nullable": True},
            }
        ),
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
            "properties": COMMON_RECORD
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
            "properties": COMMON_RECORD
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
    }
