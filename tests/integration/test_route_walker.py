"""The route walker: every route in ``url_map``, as every role of tenant A, with A's API key, as
the platform operator viewing A and with a platform API key, with tenant B's and the platform
tier's ids in every id field (path, query, form, JSON), with and without ``HX-Request``, plus
stray ``tenantId=``/``tenant_id=``. No 500, only refusals where the path names another tier's
row, no byte of another tier's data in any answer, and another tier's rows unchanged.

Parameters come from the url_map converters, the OpenAPI document and every ``name``,
``hx-vals`` and ``hx-include`` of A's rendered pages; one the walker cannot classify below
fails the test, so a new id parameter cannot slip past.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

import pytest
from flask import Flask
from sqlalchemy import select, update
from werkzeug.datastructures import MultiDict

from portal.extensions import db
from portal.models import AppUser, AuditAction, MailSendRecord, SmsSendRecord, Tenant
from portal.tenancy import PLATFORM_TENANT_ID
from tests.conftest import make_tenant
from tests.support import sweeps
from tests.support.route_walker import (
    PASSWORD,
    RECORDS,
    SEND_STATUSES,
    TEXT,
    Harvest,
    Identity,
    Outcome,
    Param,
    Walker,
    client_for,
    enum,
    fill,
    free_port,
    harvest_page,
    ids_of,
    marker,
    markers_in,
    openapi_fields,
    seed_tier,
    snapshot,
    snapshot_changes,
    text,
)
from tests.support.timing import machine_slowness

# On the reference machine (tests/support/timing.py); this many times longer on a slower one.
# CI's walk took 59 s on a 2 vCPU AMD EPYC that runs pure Python 2-3x slower.
BUDGET_S = 90

# Every parameter the walker may meet, by name (query, form, JSON, hx-vals). An id names rows
# of a kind (another tier's go in); a code or search names them by text; enums are each tried.
PARAMS: dict[str, Param] = {
    # ids
    "ids": ids_of(*RECORDS, multi=True),
    "shown": ids_of(*RECORDS, multi=True),
    "confirmed": ids_of(*RECORDS, joined=True),
    "id": ids_of(*RECORDS),
    "record_id": ids_of(*RECORDS),
    "recordId": ids_of(*RECORDS),
    "before": ids_of(*RECORDS),
    # the search results' keyset cursor, one per channel: an id or "end"
    "mail_before": ids_of(*RECORDS),
    "sms_before": ids_of(*RECORDS),
    "template_id": ids_of("mail_template", "sms_template"),
    "templateId": ids_of("mail_template", "sms_template"),
    "server_id": ids_of("mail_server"),
    "serverId": ids_of("mail_server"),
    "preferred_server_id": ids_of("mail_server"),
    "provider_id": ids_of("sms_provider"),
    "providerId": ids_of("sms_provider"),
    "route_id": ids_of("route"),
    "binding_id": ids_of("binding"),
    "key_id": ids_of("api_key"),
    "box_id": ids_of("receiver"),
    "config_id": ids_of("mail_server", "sms_provider"),
    "letter_id": ids_of("dead_letter"),
    "letter_ids": ids_of("dead_letter", multi=True),  # bulk dead-letter triage
    "suppression_id": ids_of("suppression"),
    "user_id": ids_of("user"),
    "event_id": ids_of("event"),
    # tenant selectors: another tenant's id for tenant identities; A's for platform ones
    "tenantId": Param("tenant"),
    "tenant_id": Param("tenant"),
    "tenant": Param("tenant"),
    # rows named by text: another tier's template code, recipient address or number
    "template": Param("code", of=("mail_template", "sms_template")),
    "templateCode": Param("code", of=("mail_template", "sms_template")),
    "code": text("walker-code"),  # a new template's code, as its author types it
    "q": Param("code", of=("search",)),
    "toPrefix": Param("code", of=("search",)),  # the API lists: another's address
    "actor": Param("code", of=("user_email",)),
    # enums
    "status": enum(*SEND_STATUSES),
    "confirm": enum("", "yes", "no"),
    "scope": enum("selected", "filter", "TENANT", "PLATFORM"),
    "view": enum("row", "page"),
    "outcome": enum("accepted", "failed"),
    "decision": enum("resolve", "discard", "Resolved", "Discarded"),
    "channel": enum("mail", "sms"),
    "security": enum("plain", "starttls", "ssl"),
    "provider": enum("http_json", "test", "twilio", "vonage"),
    "uncertain_policy": enum("retry", "hold"),
    "role": enum("tenant_admin", "support", "platform_operator"),
    "enabled": enum("on", "1", ""),
    "stream": enum("transactional", "broadcast", "bulk"),
    "is_default": enum("on", ""),
    "verify_tls": enum("on", ""),
    "read_receipt": enum("on", ""),
    "priority": enum("3", "1", "5"),
    "reason": enum("manual", "hard_bounce", "complaint"),
    "action": enum(*(a.value for a in AuditAction)),
    "all_tenants": enum("yes", ""),  # the all-tenants view's explicit choice
    "include_blocked": enum("yes", ""),  # bulk retry: also those that would fail again
    "planned_scope": enum("selected", "filter"),  # the scope a bulk confirmation was planned for
    "remove_password": enum("on", ""),
    "remove_secret": enum("on", ""),
    "remove_webhook_secret": enum("on", ""),
    # harmless free text, addresses, numbers and dates
    "name": TEXT,
    "subject": TEXT,
    "html": TEXT,
    "text": TEXT,
    "html_body": TEXT,
    "text_body": TEXT,
    "content": TEXT,
    "remark": TEXT,
    "detail": TEXT,
    "providerMessageId": TEXT,
    "businessKey": TEXT,
    "variables": text('{"name": "walker"}'),
    "metadata": text('{"order": "walker"}'),
    "from": text("2020-01-01"),
    "to": text("walker@example.com"),
    "cc": text("walker@example.com"),
    "bcc": text("walker@example.com"),
    "replyTo": text("walker@example.com"),
    "reply_to": text("walker@example.com"),
    "email": text("walker-new@example.com"),
    "address": text("walker-new@example.com"),
    "from_address": text("walker@example.com"),
    "from_name": TEXT,
    "username": TEXT,
    "password": text("wrong-password-1"),
    "host": text("127.0.0.1"),
    "port": text("1"),
    "phoneNumber": text("+447700900123"),
    "phone": text("+447700900123"),
    "country_code": text("GB"),
    "expiresAt": text("2099-01-01T00:00:00Z"),
    "attachments": TEXT,
    "contentType": text("text/plain"),
    "items": TEXT,
    "mail_monthly_limit": text("100"),
    "sms_monthly_limit": text("100"),
    "daily_send_limit": text("100"),
    "rate_limit_per_minute": text("10"),
    "base_url": text("http://127.0.0.1:1/"),
    "account_id": TEXT,
    "sender_id": TEXT,
    "secret": TEXT,
    "webhook_secret": TEXT,
    "folder": text("INBOX"),
    "external_template_id": TEXT,
    "signature": TEXT,
    "retry_window_s": text("60"),
    "settings": text("{}"),
    "country": text("GB"),
    "version": text("1"),  # a template's version as the editor loaded it (a stale save is 409)
    "strict_variables": enum("on", ""),
    "tests": enum("", "hide", "only"),  # the record lists' test-send filter
    "dry_run_seen": enum("", "yes"),  # a template save confirmed after its dry run
    # two template versions to compare
    "a": text("1"),
    "b": text("1"),
    "current_password": text("wrong-password-1"),
    # a preview's slot: a random token naming one editor's last preview in the session
    "preview_slot": text("walker"),
    # status callbacks: an endpoint's URL (nothing listens there), events, a replay's start
    "url": text("http://127.0.0.1:1/walker"),
    "events": enum("mail.sent", "sms.queued", "mail.accepted"),
    "since": text("2020-01-01T00:00"),
    # retention: days kept per channel
    "mail_days": text("30"),
    "sms_days": text("30"),
    # the inbox: notices by mail on (1) or off
    "on": enum("1", "0"),
    # the API lists: time filters, page size, a cursor
    "createdFrom": text("2020-01-01T00:00:00Z"),
    "createdTo": text("2099-01-01T00:00:00Z"),
    "updatedFrom": text("2020-01-01T00:00:00Z"),
    "limit": text("10"),
    "cursor": TEXT,
    # the machinery
    "csrf_token": Param("csrf"),
    "next": Param("next"),
    "file": Param("file"),
}

# Path parameters that are not ids: the walker fills them as said here.
PATH_PARAMS: dict[str, Param] = {
    "record_id": ids_of(*RECORDS),
    "template_id": ids_of("mail_template", "sms_template"),
    "server_id": ids_of("mail_server"),
    "provider_id": ids_of("sms_provider"),
    "route_id": ids_of("route"),
    "binding_id": ids_of("binding"),
    "key_id": ids_of("api_key"),
    "box_id": ids_of("receiver"),
    "config_id": ids_of("mail_server", "sms_provider"),
    "letter_id": ids_of("dead_letter"),
    "suppression_id": ids_of("suppression"),
    "user_id": ids_of("user"),
    "event_id": ids_of("event"),
    "endpoint_id": ids_of("callback_endpoint"),
    "delivery_id": ids_of("callback_delivery"),
    "notification_id": ids_of("notification"),
    "tenant_id": Param("tenant"),
    "index": Param("index"),
    "number": text("1"),  # a template's version number
    "channel": enum("mail", "sms"),
    "kind": enum("MailSendRecord", "SmsSendRecord"),
    "provider": enum("generic", "http_json", "test", "twilio", "vonage"),
    # a preview's slot: a random token naming one editor's last preview in the session
    "slot": text("walker"),
    # an invitation's one-time set-password token (the credential itself, not an id)
    "token": text("walker-not-a-token"),
}

# Routes not walked, by (method, rule), each with its reason; an entry whose rule has left
# url_map fails the test.
EXEMPT: dict[tuple[str, str], str] = {
    ("GET", "/static/<path:filename>"): "files under static/ (CSS, vendored htmx): no rows",
    ("GET", "/metrics"): "process counters only, no tenant rows; covered by test_metrics",
}

# Routes where platform identities legitimately see every tenant's rows (the operator's
# cross-tenant pages): the B-marker check is waived for them, for platform identities only.
PLATFORM_SEES_ALL: dict[tuple[str, str], str] = {}

# Session-ending routes run last, so the rest of the walk keeps its session.
LAST = {"auth.logout"}


def _sign_in(app: Flask, email: str) -> tuple[Any, str]:
    client = client_for(app)
    page = client.get("/auth/login").get_data(as_text=True)
    harvest = Harvest()
    harvest_page(app, harvest, "/auth/login", page)
    import re

    token = re.search(r'name="csrf_token" value="([^"]+)"', page)
    assert token is not None
    response = client.post(
        "/auth/login", data={"email": email, "password": PASSWORD, "csrf_token": token.group(1)}
    )
    assert response.status_code == 302, response.get_data(as_text=True)[:500]
    dashboard = client.get("/").get_data(as_text=True)
    harvest = Harvest()
    harvest_page(app, harvest, "/", dashboard)
    assert harvest.csrf, "no CSRF token in the dashboard's hx-headers"
    return client, harvest.csrf


def _discover(app: Flask, client: Any, csrf: str, own: Any, harvest: Harvest) -> None:
    """Render every GET route with A's ids, as htmx and not, then submit every harmless form
    found once (so step-two fragments, like a bulk action's confirmation, are seen too)."""
    adapter_rules = [r for r in app.url_map.iter_rules() if "GET" in (r.methods or ())]
    urls = []
    for rule in adapter_rules:
        if (("GET", rule.rule)) in EXEMPT or rule.endpoint == "static":
            continue
        args: dict[str, Any] = {}
        ok = True
        for name in rule.arguments:
            param = PATH_PARAMS.get(name)
            if param is None:
                ok = False
                break
            if param.kind == "id":
                kinds = [k for k in param.of if k.startswith("sms") == ("sms" in rule.rule)]
                args[name] = own.ids[(kinds or list(param.of))[0]][0]
            elif param.kind == "tenant":
                args[name] = own.tenant_id
            elif param.kind == "index":
                args[name] = 0
            else:
                args[name] = (param.values or (param.sample,))[0]
        if ok:
            urls.append(rule.build(args, append_unknown=False)[1])
    for url in urls:
        for hx in (False, True):
            response = client.get(url, headers={"HX-Request": "true"} if hx else {})
            if response.mimetype == "text/html":
                harvest_page(app, harvest, url, response.get_data(as_text=True))
    # Step two: submit each POST form found, with its own values (A's rows), once.
    seen: set[str] = set()
    for rule_key, fields in list(harvest.fields.items()):
        method, rule_text = rule_key.split(" ", 1)
        if method != "POST" or rule_key in seen:
            continue
        seen.add(rule_key)
        rule = next(r for r in app.url_map.iter_rules() if r.rule == rule_text)
        if any(
            w in rule.endpoint for w in ("delete", "logout", "tenants.", "deactivate", "revoke")
        ):
            continue
        if rule.arguments:
            continue  # forms on rows post to their own row; the page-level forms suffice here
        data = [(n, v[0] if v else "") for n, v in fields.items()]
        for name, values in fields.items():
            if name == "ids":
                data += [(name, v) for v in values[1:]]
        response = client.post(
            rule_text, data=MultiDict(data), headers={"HX-Request": "true", "X-CSRFToken": csrf}
        )
        if response.mimetype == "text/html":
            harvest_page(app, harvest, rule_key, response.get_data(as_text=True), rule_key)


@pytest.fixture
def world(app: Flask) -> Any:
    """Tenants A and B and the platform tier, each with every kind of row, B's and the
    platform tier's marked; A's users and key, the platform's operator and key."""
    port = free_port()
    a = make_tenant(marker("a"))
    b = make_tenant(marker("n"), marker("n"))
    platform = db.session.get(Tenant, PLATFORM_TENANT_ID)
    assert platform is not None
    old_name = platform.name
    platform.name = marker("n")
    db.session.commit()
    tiers = {
        "a": seed_tier(db.session, a.id, "a", port, ("tenant_admin", "support")),
        "b": seed_tier(db.session, b.id, "b", port, ("tenant_admin", "support")),
        "p": seed_tier(db.session, PLATFORM_TENANT_ID, "p", port, ("platform_operator",)),
    }
    _sent_through_the_platform_tier(tiers["a"], tiers["p"])
    yield tiers
    db.session.execute(update(Tenant).where(Tenant.id == PLATFORM_TENANT_ID).values(name=old_name))
    db.session.commit()


def _sent_through_the_platform_tier(own: Any, platform: Any) -> None:
    """A's records sent by the platform tier's server and provider (the fallback when A has
    none): A's record pages must name "the platform service", never the tier's config."""
    now = datetime.now(UTC)
    server_id, provider_id = platform.first("mail_server"), platform.first("sms_provider")
    mail = MailSendRecord(
        tenant_id=own.tenant_id,
        scope="PLATFORM",
        status="Sent",
        to_addrs=["platform-route@example.com"],
        server_id=server_id,
        server_config_id=server_id,
        updated_time=now,
    )
    sms = SmsSendRecord(
        tenant_id=own.tenant_id,
        scope="PLATFORM",
        status="Sent",
        phone_number="+447900000999",
        country_code="GB",
        provider_config_id=provider_id,
        provider_kind="http_json",
        updated_time=now,
    )
    for row, kind in ((mail, "mail_record"), (sms, "sms_record")):
        fill(row, "a")
        db.session.add(row)
        db.session.flush()
        own.ids[kind].append(row.id)
    db.session.commit()


@pytest.mark.long
@pytest.mark.timeout(BUDGET_S * 5)
def test_every_route_refuses_other_tiers_ids_and_shows_none_of_their_data(
    app: Flask,
    world: dict[str, Any],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Invitations are sent only with the portal's configured address, as in production; the
    # walk reaches the invitation form with it.
    settings = app.config["SETTINGS"].replace(public_base_url="https://portal.example.com")
    monkeypatch.setitem(app.config, "SETTINGS", settings)
    started = time.monotonic()
    own, theirs, platform = world["a"], world["b"], world["p"]

    # Every rule in url_map, less the exempt ones; a stale exemption fails.
    rules_now = {
        (m, r.rule)
        for r in app.url_map.iter_rules()
        for m in (r.methods or ()) - {"HEAD", "OPTIONS"}
    }
    stale = [key for key in list(EXEMPT) + list(PLATFORM_SEES_ALL) if key not in rules_now]
    assert not stale, f"exempt entries for rules no longer in url_map: {stale}"
    rules = sorted(
        (
            (m, r)
            for r in app.url_map.iter_rules()
            for m in sorted((r.methods or set()) - {"HEAD", "OPTIONS"})
            if (m, r.rule) not in EXEMPT
        ),
        key=lambda mr: (mr[1].endpoint in LAST, mr[1].rule, mr[0]),
    )

    # Sign in, and harvest field names from A's pages (as A's admin and as the operator).
    admin, admin_csrf = _sign_in(app, own.users["tenant_admin"])
    support, support_csrf = _sign_in(app, own.users["support"])
    operator, operator_csrf = _sign_in(app, platform.users["platform_operator"])

    def view_a(_endpoint: str = "tenants.update") -> None:
        if _endpoint == "tenants.update":
            response = operator.post(
                "/tenants/view", data={"tenant": str(own.tenant_id), "csrf_token": operator_csrf}
            )
            assert response.status_code == 302

    view_a()
    harvest = Harvest()
    _discover(app, admin, admin_csrf, own, harvest)
    _discover(app, operator, operator_csrf, own, harvest)
    view_a()
    document = client_for(app).get("/api/v1/openapi.json").get_json()
    openapi: dict[str, dict[str, Any]] = {}
    for key, info in openapi_fields(document).items():
        method, path = key.split(" ", 1)
        from tests.support.route_walker import match_rule

        target = match_rule(app, path.replace("{id}", "1"), method)
        assert target is not None, f"OpenAPI {key} matches no route"
        openapi[f"{method} {target[0].rule}"] = info

    # Classification: every name seen anywhere must be known.
    names = dict(harvest.names)
    for key, info in openapi.items():
        for name, _where in info["params"]:
            names.setdefault(name, f"OpenAPI {key}")
        for name in info["body"]:
            names.setdefault(name, f"OpenAPI {key} body")
    unknown = {n: w for n, w in names.items() if n not in PARAMS}
    unknown_path = {f"{r.rule}:{n}" for _, r in rules for n in r.arguments if n not in PATH_PARAMS}
    assert not unknown, f"parameters the walker cannot classify (add them to PARAMS): {unknown}"
    assert not unknown_path, f"path parameters not in PATH_PARAMS: {sorted(unknown_path)}"

    outcome = Outcome()
    walker = Walker(
        app=app,
        params=PARAMS,
        path_params=PATH_PARAMS,
        harvest=harvest,
        openapi=openapi,
        own=own,
        tiers={"b": theirs, "p": platform},
        outcome=outcome,
        waived=PLATFORM_SEES_ALL,
    )

    # Tenant identities: B's and the platform tier's rows must stay as they are.
    tenant_ids = {theirs.tenant_id, PLATFORM_TENANT_ID}
    before = snapshot(db.session, tenant_ids)
    db.session.rollback()
    tenant_identities = [
        Identity("tenant_admin", admin, platform=False, csrf=admin_csrf),
        Identity("support", support, platform=False, csrf=support_csrf),
        Identity("api_key", client_for(app), platform=False, token=own.api_token),
    ]
    # A quick run (make check) walks each route as one of A's two signed-in people, the two
    # taking turns; a full run (make test) walks every route as each of them.
    sessions = [i for i in tenant_identities if i.session]
    for identity in tenant_identities:
        if identity.session:
            walker.walk(identity, sweeps.share(rules, sessions.index(identity), len(sessions)))
        else:
            walker.walk(identity, rules)
    db.session.rollback()
    after = snapshot(db.session, tenant_ids)
    changes = snapshot_changes(before, after)
    # New platform-tier rows are allowed: an invitation is mailed through the platform tier's
    # own delivery path (a new Pending record, its recipient and its subject's search row);
    # existing rows may not change.
    outcome.problems += [
        f"ROW CHANGED by a tenant identity: {c}"
        for c in changes
        if not (
            ": added " in c
            and c.startswith(("mail_send_record ", "mail_send_recipient ", "mail_send_subject "))
            and "'tenant_id': -1" in c
        )
    ]

    # Platform identities viewing A: B's rows must stay as they are (the platform tier's own
    # may change: a platform key without tenantId= acts on its own tier).
    before_b = snapshot(db.session, {theirs.tenant_id})
    db.session.rollback()
    view_a()
    platform_identities = [
        Identity(
            "operator",
            operator,
            platform=True,
            csrf=operator_csrf,
            forbidden=frozenset("b"),
            after=view_a,
        ),
        Identity(
            "platform_key",
            client_for(app),
            platform=True,
            token=platform.api_token,
            forbidden=frozenset("b"),
        ),
    ]
    for identity in platform_identities:
        walker.walk(identity, rules)
    db.session.rollback()
    after_b = snapshot(db.session, {theirs.tenant_id})
    outcome.problems += [
        f"ROW CHANGED by a platform identity: {c}" for c in snapshot_changes(before_b, after_b)
    ]

    # Rows the walk wrote for A (a record naming B's template, say) must not show B's data.
    # A fresh admin of A: the walk signed A's users out (ending all their sessions) and may
    # have changed their passwords or roles through the users pages.
    checker = AppUser(tenant_id=own.tenant_id, email="recheck@a.example", role="tenant_admin")
    checker.set_password(PASSWORD)
    db.session.add(checker)
    db.session.commit()
    recheck, _ = _sign_in(app, checker.email)
    for model, prefix in ((MailSendRecord, "/mail-records/"), (SmsSendRecord, "/sms-records/")):
        for record_id in db.session.scalars(
            select(model.id).where(model.tenant_id == own.tenant_id)
        ):
            response = recheck.get(f"{prefix}{record_id}")
            leaked = sorted(m for m in markers_in(response) if m[2] in "bpn")
            if leaked or response.status_code != 200:
                outcome.problems.append(
                    f"A's record page {prefix}{record_id} -> {response.status_code} {leaked}"
                )
    # The lists of what the walk did in A (the operator's and the platform key's actions
    # among them): their actors are shown to A's people without the platform tier's names.
    pages = (
        "/audit/",
        "/users/",
        "/api-keys/",
        "/suppressions/",
        "/mail-records/",
        "/sms-records/",
    )
    for page in pages:
        for headers in ({}, {"HX-Request": "true"}):
            response = recheck.get(page, headers=headers)
            leaked = sorted(m for m in markers_in(response) if m[2] in "bpn")
            if leaked or response.status_code != 200:
                outcome.problems.append(f"A's {page} -> {response.status_code} {leaked}")
    db.session.rollback()

    elapsed = time.monotonic() - started
    with capsys.disabled():
        print(
            f"\nroute walker: {len(outcome.rules)} routes (method, rule), "
            f"{outcome.requests} requests in {elapsed:.1f} s; "
            + ", ".join(
                f"{name} {outcome.reached[name]}/{outcome.requests_by[name]} reached a view"
                for name in outcome.requests_by
            )
        )
        for problem in outcome.problems[:400]:
            print("  " + problem[:1200])
    assert not outcome.problems, f"{len(outcome.problems)} problems (printed above)"
    for identity in tenant_identities + platform_identities:
        # Keys reach only the JSON routes; sessions most of the portal.
        floor = 25 if identity.token else 200
        if sweeps.QUICK and identity in sessions:
            floor //= len(sessions)
        assert outcome.reached[identity.name] >= floor, (
            f"{identity.name}: only {outcome.reached[identity.name]} requests got past "
            "authentication, permission and CSRF checks; the walk proves little"
        )
    budget = BUDGET_S * machine_slowness()
    assert elapsed < budget, f"the walk took {elapsed:.0f} s (budget {budget:.0f} s)"
