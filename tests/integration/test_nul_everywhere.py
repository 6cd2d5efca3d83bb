"""A NUL in any parameter of any portal page, as the operator viewing a tenant and as that
tenant's admin: a refusal or a page, never a 500. PostgreSQL refuses a NUL in a query
outright, so a value that reaches a query unchecked is a 500. This walks every GET and POST
rule of ``url_map`` outside the JSON API and webhooks (test_api_isolation covers those) with
every parameter name the route walker knows set to a text with a NUL in it; a path's integer
ids are the viewed tenant's failed mail or SMS, its text arguments get the NUL too
(one of a fixed list's choices: the first)."""

from __future__ import annotations

from typing import Any

import pytest
from flask import Flask
from werkzeug.routing import AnyConverter, IntegerConverter, Rule

from tests.integration.test_portal_records import (
    ADMIN,
    OPERATOR,
    World,
    cheap_passwords,
    signed_in,
    world,
)
from tests.integration.test_route_walker import PARAMS

__all__ = ["cheap_passwords", "world"]  # fixtures, imported for pytest

NUL = "walker\x00text"
OUTSIDE = ("/api/", "/static/", "/webhooks/", "/metrics", "/openapi", "/health", "/auth/logout")


def _path(app: Flask, rule: Rule, world: World) -> str:
    record = world.sms if "sms" in rule.rule else world.mail
    arguments: dict[str, Any] = {}
    for name, converter in rule._converters.items():
        if isinstance(converter, IntegerConverter):
            arguments[name] = record
        elif isinstance(converter, AnyConverter):
            arguments[name] = sorted(converter.items)[0]
        else:
            arguments[name] = NUL
    return app.url_map.bind("localhost").build(rule.endpoint, arguments)


@pytest.mark.parametrize("who", [OPERATOR, ADMIN])
def test_a_nul_in_any_parameter_is_never_a_500(app: Flask, world: World, who: str) -> None:
    client, token = signed_in(app, who, world.acme if who == OPERATOR else None)
    values = {name: NUL for name in PARAMS}
    answered = 0
    broken = []
    for rule in app.url_map.iter_rules():
        if rule.rule.startswith(OUTSIDE):
            continue
        path = _path(app, rule, world)
        for method in sorted((rule.methods or set()) & {"GET", "POST"}):
            if method == "GET":
                response = client.get(path, query_string=values)
            else:
                response = client.post(path, data={**values, "csrf_token": token})
            answered += response.status_code < 500
            if response.status_code >= 500:
                broken.append((method, rule.rule, response.status_code))
    assert not broken, repr(broken)
    assert answered > 100  # the walk reached the portal's routes
