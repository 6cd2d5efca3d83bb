"""Mail addresses and phone numbers in the one form the service keeps them: a mail address as
email_validator normalises it (the common ASCII case without its full walk), a phone number in
E.164 with its country.

Acceptance validates recipients with these, and suppression, template test sends and the
records search normalise what people type with the same functions, so an address is never
read two ways.
"""

from __future__ import annotations

import functools
from typing import Any

import phonenumbers
from email_validator import EmailNotValidError, validate_email
from email_validator.rfc_constants import (
    CASE_INSENSITIVE_MAILBOX_NAMES,
    DOT_ATOM_TEXT,
    EMAIL_MAX_LENGTH,
)


class AddressError(ValueError):
    """Not an address or number we can send to: which input (``field``), why, and a code."""

    def __init__(self, field: str, message: str, code: str = "invalid"):
        super().__init__(message)
        self.field = field
        self.message = message
        self.code = code


def email_address(value: Any, name: str) -> str:
    """``value`` as the normalised address we send to, or ``AddressError`` naming ``name``."""
    if not isinstance(value, str):
        raise AddressError(name, f"{name} must be an email address string")
    if len(value) > 320 or "\r" in value or "\n" in value:
        raise AddressError(name, f"{name} is not a valid email address")
    quick = _plain_email(value)
    if quick is not None:
        return quick
    try:
        return validate_email(value, check_deliverability=False).normalized
    except EmailNotValidError as exc:
        raise AddressError(name, f"{name} is not a valid email address: {exc}") from None


def typed_email(value: str) -> str:
    """An address people type for the portal to keep (a user's, a From or Reply-To):
    email_validator's normalized form lower-cased whole, so that it is one mailbox and one
    account whatever case it was typed in. ``EmailNotValidError`` when it is not an address."""
    return validate_email(value, check_deliverability=False).normalized.lower()


_CASE_INSENSITIVE = frozenset(CASE_INSENSITIVE_MAILBOX_NAMES)


@functools.lru_cache(maxsize=4096)
def _email_domain(domain: str) -> tuple[str, str] | None:
    """email_validator's (normalized, ASCII) form of a domain, or None when it refuses it."""
    try:
        checked = validate_email("a@" + domain, check_deliverability=False)
    except EmailNotValidError:
        return None
    if checked.ascii_domain is None:
        return None
    return checked.domain, checked.ascii_domain


def _plain_email(value: str) -> str | None:
    """The common case, without email_validator's full walk: an ASCII dot-atom local part (kept
    as given, as email_validator keeps it) at a domain it accepts (checked once per domain
    and remembered). The same normalized address as validate_email's; None for anything
    else (quoted, Unicode or special local parts, refused domains, lengths near the limit),
    which then takes the full validation and its error message."""
    local, at, domain = value.rpartition("@")
    if not at or not DOT_ATOM_TEXT.match(local) or local.lower() in _CASE_INSENSITIVE:
        return None
    checked = _email_domain(domain)
    if checked is None:
        return None
    normalized = f"{local}@{checked[0]}"
    for form in (value, normalized, f"{local}@{checked[1]}"):
        if len(form.encode()) > EMAIL_MAX_LENGTH:
            return None
    return normalized


def parse_phone_number(raw: Any, field_name: str = "phoneNumber") -> tuple[str, str | None]:
    """E.164 and the ISO country of a number written in international form."""
    if not isinstance(raw, str) or not raw.strip():
        raise AddressError(field_name, f"{field_name} is required", "required")
    if len(raw) > 32:
        raise AddressError(field_name, f"{field_name} is not a valid phone number")
    try:
        number = phonenumbers.parse(raw, None)
    except phonenumbers.NumberParseException:
        raise AddressError(
            field_name, f"{field_name} must be in international form, e.g. +447812345678"
        ) from None
    if not phonenumbers.is_valid_number(number):
        raise AddressError(field_name, f"{field_name} is not a valid phone number")
    e164 = phonenumbers.format_number(number, phonenumbers.PhoneNumberFormat.E164)
    region = phonenumbers.region_code_for_number(number)
    # Non-geographic numbers (+800, +882, ...) have the pseudo-region "001": no country to
    # route by, so they take the tier's default providers.
    return e164, region if region and len(region) == 2 and region.isalpha() else None
