"""The Back button: when htmx's history cache misses, htmx asks for the page again with
``HX-Request`` and ``HX-History-Restore-Request`` and swaps the answer in as the whole page.
Every page that answers an htmx request with a fragment must answer that one with the page
(one rule, ``forms.is_htmx``), and say that its answer varies on both headers."""

from __future__ import annotations

import pytest
from flask import Flask

from tests.integration.test_portal_records import (
    ADMIN,
    OPERATOR,
    World,
    cheap_passwords,
    signed_in,
    world,
)

__all__ = ["cheap_passwords", "world"]  # fixtures, imported for pytest

RESTORE = {"HX-Request": "true", "HX-History-Restore-Request": "true"}

# Pages that answer a plain htmx GET with a fragment of themselves.
PAGES = [(ADMIN, "/suppressions/"), (OPERATOR, "/suppressions/")]


@pytest.mark.parametrize(("who", "path"), PAGES)
def test_a_history_restore_gets_the_whole_page(
    app: Flask, world: World, who: str, path: str
) -> None:
    client, _ = signed_in(app, who, None)
    page = client.get(path)
    fragment = client.get(path, headers={"HX-Request": "true"})
    restored = client.get(path, headers=RESTORE)
    assert page.status_code == fragment.status_code == restored.status_code == 200
    assert "<html" in page.text
    assert "<html" not in fragment.text, "not a fragment page: take it out of PAGES"
    assert "<html" in restored.text, f"{path} answered a history restore with a fragment"
    assert {"HX-Request", "HX-History-Restore-Request"} <= set(fragment.vary), fragment.vary
