"""Whatever is typed into the search box or the list filters, the records pages answer with a
page, never a 500 (the search box, tried with hostile input): a NUL, which PostgreSQL
refuses in a query outright, is a 422 saying what to change; so is every other control
character. A recipient page's token with a NUL is a 404 like any unknown token."""

from __future__ import annotations

import pytest
from flask import Flask

from tests.integration.test_portal_records import (
    ADMIN,
    OPERATOR,
    SUPPORT,
    World,
    cheap_passwords,
    signed_in,
    world,
)
from tests.support.sweeps import share

__all__ = ["cheap_passwords", "world"]  # fixtures, imported for pytest

TYPED = [
    "",
    " ",
    "%",
    "_",
    "%%@%",
    "a" * 5000,
    "@",
    "@@",
    "<>",
    "+",
    "++44",
    "+4479111234567890123",
    "0",
    "-1",
    "99999999999999999999999",
    "07911 123456",
    "447911000001",
    "ü@ü.de",
    "@example.com",
    "carol@",
    "'; DROP TABLE mail_send_record; --",
    "\u202e",
    "😀",
    "a b c d e f g h i j k l m n o p",
    "<abc@x>",
    "%(x)s",
    "$1",
    "\\%",
]
CONTROL = ["\x00", "carol\x00@example.com", "ann@example.com\x1b", "\x7f"]
PAGES = ("/search/", "/mail-records/", "/sms-records/")
FIELDS = ("q", "template", "status", "from", "to", "before", "mail_before", "sms_before", "tests")


ROLES = [SUPPORT, ADMIN, OPERATOR]


@pytest.mark.long
@pytest.mark.parametrize("who", ROLES)
def test_nothing_typed_into_a_filter_is_a_500(app: Flask, world: World, who: str) -> None:
    client, _ = signed_in(app, who, None)
    broken = []
    # Every input as every role; a quick run tries each input as one role of the three.
    for typed in share(TYPED + CONTROL, ROLES.index(who), len(ROLES)):
        for path in (*PAGES, "/"):
            for name in FIELDS:
                status = client.get(path, query_string={name: typed}).status_code
                if status >= 500:
                    broken.append((path, name, typed[:30], status))
    assert not broken, repr(broken)


@pytest.mark.parametrize("typed", CONTROL)
@pytest.mark.parametrize("path", PAGES)
def test_a_control_character_in_the_search_box_says_what_to_change(
    app: Flask, world: World, path: str, typed: str
) -> None:
    client, _ = signed_in(app, SUPPORT, None)
    response = client.get(path, query_string={"q": typed})
    assert response.status_code == 422, response.text
    assert "no control characters" in response.text


@pytest.mark.parametrize("token", ["%00", "a%00b", "0" * 64, "x", "a" * 3000])
def test_a_broken_recipient_token_is_a_404(app: Flask, world: World, token: str) -> None:
    client, _ = signed_in(app, SUPPORT, None)
    assert client.get(f"/recipients/{token}").status_code == 404
