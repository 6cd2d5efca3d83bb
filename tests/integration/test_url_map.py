"""The portal's URL rules are an interface (operators' scripts, tenants' applications, bookmarks):
every (methods, rule) pair of ``url_map`` is listed in ``tests/data/url_map.txt``, so a move of
the page modules that changes one, or a route added or dropped without meaning to, fails here.

A deliberate change edits that file in the same commit."""

from __future__ import annotations

from pathlib import Path

from flask import Flask

URL_MAP = Path(__file__).parent.parent / "data" / "url_map.txt"
IMPLIED = {"HEAD", "OPTIONS"}  # Werkzeug adds them to GET rules and every rule


def rules_of(app: Flask) -> list[str]:
    """``url_map`` as the file lists it: a line a rule, its methods then its rule, sorted."""
    lines = {
        f"{' '.join(sorted((rule.methods or set()) - IMPLIED))}\t{rule.rule}"
        for rule in app.url_map.iter_rules()
        if rule.endpoint != "static"
    }
    return sorted(lines)


def test_url_rules_are_the_listed_ones(sqlite_app: Flask) -> None:
    listed = [line for line in URL_MAP.read_text().splitlines() if line]
    now = rules_of(sqlite_app)
    added = sorted(set(now) - set(listed))
    dropped = sorted(set(listed) - set(now))
    assert (added, dropped) == ([], []), f"url_map changed; if meant, update {URL_MAP.name}"
    assert listed == now, f"keep {URL_MAP.name} sorted (and free of duplicates)"
