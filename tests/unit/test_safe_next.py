"""safe_next: the one check of a ``next`` URL. Only same-site relative paths pass; anything a
browser could read as another site (after dropping tabs and newlines and reading a backslash
as a slash) gives the fallback."""

from __future__ import annotations

import pytest

from portal.web.security import safe_next

FALLBACK = "/dashboard/"


@pytest.mark.parametrize(
    "target",
    [
        "/",
        "/mail-records/",
        "/mail-records/?status=Failed&page=2",
        "/mail-records/42#timeline",
        "/search?q=a%20b",
        "/path/with:colon",
    ],
)
def test_same_site_paths_pass(target: str) -> None:
    assert safe_next(target, FALLBACK) == target


@pytest.mark.parametrize(
    "target",
    [
        None,
        "",
        "//evil.example",
        "///evil.example",
        "/\t/evil.example",
        "/\n/evil.example",
        "/\r\n/evil.example",
        "\t//evil.example",
        "/\\evil.example",
        "\\\\evil.example",
        "/%5cevil.example",
        "/%09/evil.example",
        "/%0d%0aevil.example",
        "/%0d%0aSet-Cookie:x=1",
        "/%2f/evil.example",
        "https://evil.example",
        "https:evil.example",
        "javascript:alert(1)",
        "evil.example",
        "mail-records/",
        " /mail-records/",
        "/x\x7f",
        "/" + "a" * 3000,
    ],
)
def test_anything_else_gives_the_fallback(target: str | None) -> None:
    assert safe_next(target, FALLBACK) == FALLBACK
