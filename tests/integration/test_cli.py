"""The flask commands through Flask's CliRunner, on PostgreSQL and SQLite: import-config,
seed-demo, create-user and create-api-key."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from argon2 import PasswordHasher
from click.testing import Result
from flask import Flask
from flask.testing import FlaskCliRunner
from sqlalchemy import func, select

from portal.extensions import db
from portal.models import (
    ApiKey,
    AppUser,
    Base,
    MailSendRecord,
    MailSendServerConfig,
    MailTemplate,
    SmsProviderConfig,
    SmsProviderRegion,
    SmsTemplate,
    SmsTemplateProviderBinding,
    Tenant,
    TenantMessageQuota,
)
from portal.models import tenant as tenant_models
from portal.tenancy import PLATFORM_TENANT_ID
from tests.conftest import make_tenant

ROOT = Path(__file__).resolve().parents[2]
DEMO_PATH = ROOT / "demo" / "demo-config.json"
Config = dict[str, Any]

# Section of the file -> table it fills.
SECTION_TABLES = {
    "tenants": "tenant",
    "users": "app_user",
    "apiKeys": "api_key",
    "mailServers": "mail_send_server_config",
    "smsProviders": "sms_provider_config",
    "smsRoutes": "sms_provider_region",
    "mailTemplates": "mail_template",
    "smsTemplates": "sms_template",
    "smsBindings": "sms_template_provider_binding",
    "quotas": "tenant_message_quota",
}


def demo() -> Config:
    data: Config = json.loads(DEMO_PATH.read_text())
    return data


def with_secrets() -> Config:
    """The demo plus secrets to store: an SMTP password and a provider's two secrets."""
    data = demo()
    server = next(s for s in data["mailServers"] if s["tenant"] != "platform")
    server |= {"username": "smtp-user", "password": "smtp-password-plain"}
    provider = next(p for p in data["smsProviders"] if p["tenant"] != "platform")
    provider |= {"secret": "sms-auth-token-plain", "webhookSecret": "sms-webhook-plain"}
    return data


@pytest.fixture
def runner(any_app: Flask) -> FlaskCliRunner:
    return any_app.test_cli_runner()


@pytest.fixture
def fast_hashing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cheap argon2 parameters for tests that import users many times; the tests of hashing
    itself keep the real parameters."""
    monkeypatch.setattr(
        tenant_models, "_hasher", PasswordHasher(time_cost=1, memory_cost=1024, parallelism=1)
    )


def invoke(runner: FlaskCliRunner, *args: str, input: str | None = None) -> Result:
    result = runner.invoke(args=list(args), input=input)
    # A command that raises anything but a ClickException (a traceback) is a bug, not a refusal.
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result


def write(tmp_path: Path, data: Any, name: str = "config.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data, indent=2))
    return path


def import_file(runner: FlaskCliRunner, path: Path) -> Result:
    return invoke(runner, "import-config", str(path))


def snapshot() -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every table, in primary-key order: "nothing changed" means this is equal."""
    db.session.expire_all()
    rows = {}
    for table in Base.metadata.sorted_tables:
        query = select(table).order_by(*table.primary_key.columns)
        rows[table.name] = [tuple(row) for row in db.session.execute(query)]
    db.session.rollback()  # end the read (on SQLite every transaction holds the write lock)
    return rows


def counts() -> dict[str, int]:
    return {name: len(rows) for name, rows in snapshot().items()}


def expected_counts(data: Config) -> dict[str, int]:
    wanted = {t.name: 0 for t in Base.metadata.sorted_tables}
    for section, table in SECTION_TABLES.items():
        wanted[table] = len(data.get(section, []))
    wanted["tenant"] += 1  # the platform tier's row is always there
    # On PostgreSQL, writing servers, providers, routes or bindings sets the
    # configuration epoch's one row (a trigger; migration 0016).
    configs = ("mailServers", "smsProviders", "smsRoutes", "smsBindings")
    if db.engine.dialect.name == "postgresql" and any(data.get(k) for k in configs):
        wanted["config_epoch"] = 1
    # Each imported template's first version.
    wanted["template_version"] = len(data.get("mailTemplates", [])) + len(
        data.get("smsTemplates", [])
    )
    return wanted


def tenant_ids() -> dict[str, int]:
    return {
        slug: tenant_id for slug, tenant_id in db.session.execute(select(Tenant.slug, Tenant.id))
    }


# --- import-config: a valid file ------------------------------------------------------------


def test_import_demo_creates_everything(runner: FlaskCliRunner) -> None:
    data = demo()
    result = import_file(runner, DEMO_PATH)
    assert result.exit_code == 0, result.output
    assert "created" in result.output
    assert "updated" not in result.output
    assert counts() == expected_counts(data)

    ids = tenant_ids()
    assert ids["platform"] == PLATFORM_TENANT_ID
    for entry in data["tenants"]:
        tenant = db.session.get(Tenant, ids[entry["slug"]])
        assert tenant is not None
        assert (tenant.name, tenant.is_active) == (entry["name"], entry.get("active", True))

    for entry in data["users"]:
        user = db.session.scalar(select(AppUser).where(AppUser.email == entry["email"]))
        assert user is not None, entry["email"]
        assert (user.tenant_id, user.role, user.name) == (
            ids[entry["tenant"]],
            entry["role"],
            entry["name"],
        )
        assert user.password_hash != entry["password"]
        assert entry["password"] not in user.password_hash
        assert user.password_hash.startswith("$argon2id$")
        assert user.check_password(entry["password"])
        assert not user.check_password(entry["password"] + "x")

    stored_keys = db.session.execute(select(*ApiKey.__table__.columns)).all()
    for entry in data["apiKeys"]:
        digest = hashlib.sha256(entry["token"].encode()).hexdigest()
        key = db.session.scalar(select(ApiKey).where(ApiKey.token_hash == digest))
        assert key is not None
        assert (key.tenant_id, key.name) == (ids[entry["tenant"]], entry["name"])
        # Only the digest is stored: the token is in no column of any api_key row.
        for row in stored_keys:
            assert all(entry["token"] not in str(value) for value in row)

    for entry in data["mailServers"]:
        server = db.session.scalar(
            select(MailSendServerConfig).where(
                MailSendServerConfig.tenant_id == ids[entry["tenant"]],
                MailSendServerConfig.name == entry["name"],
            )
        )
        assert server is not None
        assert (server.host, server.port, server.security) == (
            entry["host"],
            entry["port"],
            entry["security"],
        )
        assert server.from_address == entry["fromAddress"]
        assert server.is_default is entry.get("isDefault", False)
        assert server.daily_send_limit == entry.get("dailySendLimit")
        assert server.rate_limit_per_minute == entry.get("rateLimitPerMinute")

    for entry in data["smsProviders"]:
        provider = db.session.scalar(
            select(SmsProviderConfig).where(
                SmsProviderConfig.tenant_id == ids[entry["tenant"]],
                SmsProviderConfig.name == entry["name"],
            )
        )
        assert provider is not None
        assert provider.provider == entry["provider"]

    for entry in data["smsRoutes"]:
        route = db.session.execute(
            select(SmsProviderRegion, SmsProviderConfig.name)
            .join(SmsProviderConfig, SmsProviderConfig.id == SmsProviderRegion.provider_id)
            .where(
                SmsProviderRegion.tenant_id == ids[entry["tenant"]],
                SmsProviderRegion.country_code == entry["country"],
            )
        ).one()
        assert route[1] == entry["provider"]
        assert route[0].priority == entry["priority"]

    for entry in data["mailTemplates"]:
        template = db.session.scalar(
            select(MailTemplate).where(
                MailTemplate.tenant_id == ids[entry["tenant"]], MailTemplate.code == entry["code"]
            )
        )
        assert template is not None
        assert (template.subject, template.html_body, template.text_body) == (
            entry["subject"],
            entry.get("html"),
            entry.get("text"),
        )

    for entry in data["smsTemplates"]:
        sms_template = db.session.scalar(
            select(SmsTemplate).where(
                SmsTemplate.tenant_id == ids[entry["tenant"]], SmsTemplate.code == entry["code"]
            )
        )
        assert sms_template is not None
        assert sms_template.content == entry["content"]

    for entry in data["smsBindings"]:
        binding = db.session.execute(
            select(SmsTemplateProviderBinding, SmsTemplate.code)
            .join(SmsTemplate, SmsTemplate.id == SmsTemplateProviderBinding.template_id)
            .where(SmsTemplateProviderBinding.tenant_id == ids[entry["tenant"]])
        ).one()
        assert binding[1] == entry["template"]
        assert binding[0].country_code == entry.get("country")
        assert binding[0].external_template_id == entry["externalTemplateId"]
        assert binding[0].signature == entry["signature"]

    for entry in data["quotas"]:
        quota = db.session.scalar(
            select(TenantMessageQuota).where(TenantMessageQuota.tenant_id == ids[entry["tenant"]])
        )
        assert quota is not None
        assert (quota.mail_monthly_limit, quota.sms_monthly_limit) == (
            entry["mailMonthlyLimit"],
            entry["smsMonthlyLimit"],
        )


@pytest.mark.usefixtures("fast_hashing")
def test_secrets_are_stored_encrypted(runner: FlaskCliRunner, tmp_path: Path) -> None:
    result = import_file(runner, write(tmp_path, with_secrets()))
    assert result.exit_code == 0, result.output
    server = db.session.scalar(
        select(MailSendServerConfig).where(MailSendServerConfig.username == "smtp-user")
    )
    assert server is not None
    assert server.password_encrypted
    assert "smtp-password-plain" not in server.password_encrypted
    assert server.password == "smtp-password-plain"
    provider = db.session.scalar(
        select(SmsProviderConfig).where(SmsProviderConfig.secret_encrypted.is_not(None))
    )
    assert provider is not None
    assert provider.secret_encrypted
    assert provider.webhook_secret_encrypted
    assert "sms-auth-token-plain" not in provider.secret_encrypted
    assert "sms-webhook-plain" not in provider.webhook_secret_encrypted
    assert provider.secret == "sms-auth-token-plain"
    assert provider.webhook_secret == "sms-webhook-plain"
    # No plain secret anywhere in the database.
    text = repr(snapshot())
    for plain in ("smtp-password-plain", "sms-auth-token-plain", "sms-webhook-plain"):
        assert plain not in text


def ids(rows: dict[str, list[tuple[Any, ...]]]) -> dict[str, list[Any]]:
    return {table: [row[0] for row in table_rows] for table, table_rows in rows.items()}


@pytest.mark.usefixtures("fast_hashing")
@pytest.mark.parametrize("config", ["demo", "with-secrets"])
def test_second_import_keeps_rows_and_ids(
    runner: FlaskCliRunner, tmp_path: Path, config: str
) -> None:
    path = DEMO_PATH if config == "demo" else write(tmp_path, with_secrets())
    first = import_file(runner, path)
    assert first.exit_code == 0, first.output
    before = snapshot()
    second = import_file(runner, path)
    assert second.exit_code == 0, second.output
    assert "updated" in second.output
    assert "created" not in second.output
    after = snapshot()
    assert ids(after) == ids(before)
    # Everything but the server and provider configs is byte-for-byte the same (see below).
    changing = {"mail_send_server_config", "sms_provider_config"}
    assert {t: r for t, r in after.items() if t not in changing} == {
        t: r for t, r in before.items() if t not in changing
    }


@pytest.mark.usefixtures("fast_hashing")
def test_second_import_changes_nothing(runner: FlaskCliRunner) -> None:
    assert import_file(runner, DEMO_PATH).exit_code == 0
    before = snapshot()
    assert import_file(runner, DEMO_PATH).exit_code == 0
    assert snapshot() == before  # same rows, same ids, same values, same timestamps


@pytest.mark.usefixtures("fast_hashing")
def test_second_import_with_secrets_changes_nothing(runner: FlaskCliRunner, tmp_path: Path) -> None:
    path = write(tmp_path, with_secrets())
    assert import_file(runner, path).exit_code == 0
    before = snapshot()
    assert import_file(runner, path).exit_code == 0
    assert snapshot() == before


@pytest.mark.usefixtures("fast_hashing")
def test_import_updates_changed_values_in_place(runner: FlaskCliRunner, tmp_path: Path) -> None:
    assert import_file(runner, DEMO_PATH).exit_code == 0
    ids_before = ids(snapshot())
    data = demo()
    data["tenants"][0]["name"] = "Renamed Ltd"
    data["quotas"][0]["mailMonthlyLimit"] = 42
    data["users"][1]["password"] = "a-brand-new-password"
    result = import_file(runner, write(tmp_path, data))
    assert result.exit_code == 0, result.output
    assert ids(snapshot()) == ids_before
    tenant = db.session.scalar(select(Tenant).where(Tenant.slug == data["tenants"][0]["slug"]))
    assert tenant is not None
    assert tenant.name == "Renamed Ltd"
    quota = db.session.scalar(
        select(TenantMessageQuota).where(TenantMessageQuota.tenant_id == tenant.id)
    )
    assert quota is not None
    assert quota.mail_monthly_limit == 42
    user = db.session.scalar(select(AppUser).where(AppUser.email == data["users"][1]["email"]))
    assert user is not None
    assert user.check_password("a-brand-new-password")


@pytest.mark.usefixtures("fast_hashing")
def test_route_priority_zero_is_kept(runner: FlaskCliRunner, tmp_path: Path) -> None:
    data = demo()
    data["smsRoutes"] = [{**data["smsRoutes"][0], "priority": 0}]
    assert import_file(runner, write(tmp_path, data)).exit_code == 0
    assert db.session.scalar(select(SmsProviderRegion.priority)) == 0


@pytest.mark.usefixtures("fast_hashing")
def test_imported_api_key_authenticates(any_app: Flask, runner: FlaskCliRunner) -> None:
    assert import_file(runner, DEMO_PATH).exit_code == 0
    entry = demo()["apiKeys"][0]
    response = any_app.test_client().post(
        "/api/v1/mail",
        json={"to": ["ann@example.com"], "subject": "Hi", "text": "Hello"},
        headers={"Authorization": f"Bearer {entry['token']}"},
    )
    assert response.status_code == 202, response.json
    record = db.session.get(MailSendRecord, response.json["id"])  # type: ignore[index]
    assert record is not None
    assert record.tenant_id == tenant_ids()[entry["tenant"]]


# --- import-config: an invalid file is rejected whole -----------------------------------------

Mutation = Callable[[Config], Any]


def _set(section: str, index: int, **fields: Any) -> Mutation:
    def mutate(data: Config) -> None:
        data[section][index].update(fields)

    return mutate


def _append(section: str, **fields: Any) -> Mutation:
    def mutate(data: Config) -> None:
        data[section].append(fields)

    return mutate


def _section(section: str, value: Any) -> Mutation:
    def mutate(data: Config) -> None:
        data[section] = value

    return mutate


NEW_USER = {"email": "new@acme.example.com", "tenant": "acme", "role": "support"}

# Each case edits a copy of the demo, so valid entries (tenants, earlier users...) come before
# the invalid one in the same file; the message names the entry and nothing is written.
INVALID = [
    pytest.param(
        _set("users", 1, role="admin"),
        "users[1]: role must be one of platform_operator, tenant_admin, support",
        id="bad-role",
    ),
    pytest.param(
        _set("apiKeys", 1, tenant="nope"),
        "apiKeys[1]: tenant 'nope' does not exist",
        id="unknown-tenant",
    ),
    pytest.param(
        _set("smsRoutes", 0, country="gb"),
        "smsRoutes[0]: country must be an ISO 3166 two-letter code",
        id="lower-case-country",
    ),
    pytest.param(
        _set("smsRoutes", 0, country="GBR"),
        "smsRoutes[0]: country must be a string of at most 2 characters",
        id="three-letter-country",
    ),
    pytest.param(
        _set("smsBindings", 0, country="1X"),
        "smsBindings[0]: country must be an ISO 3166 two-letter code",
        id="binding-country",
    ),
    pytest.param(
        _set("mailTemplates", 1, html="<ul>{% for item in items %}<li>{{ item }}</li>"),
        "mailTemplates[1]: html does not compile",
        id="unclosed-for",
    ),
    pytest.param(
        _set("mailTemplates", 0, subject="Hi {{ name | no_such_filter }}"),
        "mailTemplates[0]: subject does not compile",
        id="unknown-filter",
    ),
    pytest.param(
        _set("smsTemplates", 0, content="Code {{ code "),
        "smsTemplates[0]: content does not compile",
        id="sms-template",
    ),
    pytest.param(
        _append("users", **NEW_USER | {"role": "platform_operator"}, password="long-enough-1"),
        "users[4]: platform_operator users belong to the platform tier",
        id="operator-in-tenant",
    ),
    pytest.param(
        _append("users", **NEW_USER | {"tenant": "platform"}, password="long-enough-1"),
        "users[4]: platform_operator users belong to the platform tier",
        id="support-in-platform",
    ),
    pytest.param(
        _append("users", **NEW_USER, password="short"),
        "users[4]: password (at least 8 characters) is required",
        id="short-password",
    ),
    pytest.param(
        _append("users", **NEW_USER),
        "users[4]: password (at least 8 characters) is required",
        id="no-password",
    ),
    pytest.param(
        _set("users", 0, email="not-an-email"),
        "users[0]: email is not a valid email address",
        id="bad-email",
    ),
    pytest.param(
        _set("mailServers", 1, port=70000),
        "mailServers[1]: port must be a whole number from 1 to 65535",
        id="port-range",
    ),
    pytest.param(
        _set("mailServers", 1, port=True),
        "mailServers[1]: port must be a whole number from 1 to 65535",
        id="port-bool",
    ),
    pytest.param(
        _set("mailServers", 0, security="tls"),
        "mailServers[0]: security must be one of plain, starttls, ssl",
        id="security",
    ),
    pytest.param(
        _set("mailServers", 0, fromAddress=None),
        "mailServers[0]: a mail server needs a fromAddress or a username",
        id="no-sender",
    ),
    pytest.param(
        _set("smsProviders", 1, provider="carrier-pigeon"),
        "smsProviders[1]: provider must be one of",
        id="provider-kind",
    ),
    pytest.param(
        _set("smsProviders", 0, baseUrl="ftp://sms.example.com"),
        "smsProviders[0]: baseUrl must start with http:// or https://",
        id="base-url",
    ),
    pytest.param(
        _append("tenants", slug="Bad Slug", name="Bad"),
        "tenants[3]: slug must be lower-case letters, digits and dashes",
        id="bad-slug",
    ),
    pytest.param(
        _append("tenants", slug="platform", name="Impostor"),
        "tenants[3]: slug must be lower-case letters, digits and dashes, not 'platform'",
        id="platform-slug",
    ),
    pytest.param(
        _set("apiKeys", 1, token="pk_short"),
        "apiKeys[1]: token must be at least 24 characters",
        id="short-token",
    ),
    pytest.param(
        lambda d: d["apiKeys"].append(
            {"tenant": "globex", "name": "stolen", "token": d["apiKeys"][0]["token"]}
        ),
        "apiKeys[2]: this token is already used by another key",
        id="token-reused",
    ),
    pytest.param(
        _set("quotas", 0, mailMonthlyLimit=-1),
        "quotas[0]: mailMonthlyLimit must be a whole number from 0",
        id="negative-quota",
    ),
    pytest.param(
        _set("quotas", 2, mailLimit=5),
        "quotas[2]: unknown field 'mailLimit'",
        id="unknown-field",
    ),
    pytest.param(
        _set("mailTemplates", 0, preferredServer="local-sink"),
        "mailTemplates[0]: server 'local-sink' does not exist in that tenant",
        id="another-tiers-server",
    ),
    pytest.param(
        _set("smsRoutes", 0, provider="test-provider"),
        "smsRoutes[0]: provider 'test-provider' does not exist in that tenant",
        id="another-tiers-provider",
    ),
    pytest.param(
        _set("smsBindings", 0, template="missing"),
        "smsBindings[0]: SMS template 'missing' does not exist in that tenant",
        id="unknown-template",
    ),
    pytest.param(
        lambda d: d.__setitem__("widgets", []), "unknown section 'widgets'", id="unknown-section"
    ),
    pytest.param(_section("users", {"a": 1}), "users must be a list", id="section-not-list"),
    pytest.param(
        lambda d: d["users"].insert(1, "admin@acme.example.com"),
        "users[1]: must be an object",
        id="entry-not-object",
    ),
    pytest.param(lambda d: [d], "the file must hold a JSON object", id="file-not-object"),
]


@pytest.mark.usefixtures("fast_hashing")
@pytest.mark.parametrize("preloaded", [False, True], ids=["empty", "preloaded"])
@pytest.mark.parametrize(("mutate", "message"), INVALID)
def test_invalid_file_names_the_entry_and_writes_nothing(
    runner: FlaskCliRunner, tmp_path: Path, mutate: Mutation, message: str, preloaded: bool
) -> None:
    if preloaded:
        assert import_file(runner, DEMO_PATH).exit_code == 0
    data = demo()
    # Valid changes before the invalid entry must not be written either.
    data["tenants"][0]["name"] = "Changed Before The Error"
    data["tenants"].append({"slug": "written-before-the-error", "name": "Early"})
    replaced = mutate(data)
    path = write(tmp_path, replaced if replaced is not None else data)
    before = snapshot()
    result = import_file(runner, path)
    assert result.exit_code == 1, result.output
    assert message in result.output
    assert str(path) in result.output
    assert "nothing was written" in result.output
    assert snapshot() == before


@pytest.mark.usefixtures("fast_hashing")
def test_moving_a_user_to_another_tenant_is_refused(runner: FlaskCliRunner, tmp_path: Path) -> None:
    assert import_file(runner, DEMO_PATH).exit_code == 0
    data = demo()
    index = next(i for i, u in enumerate(data["users"]) if u["tenant"] == "acme")
    data["users"][index]["tenant"] = "globex"
    before = snapshot()
    result = import_file(runner, write(tmp_path, data))
    assert result.exit_code == 1
    assert f"users[{index}]: this user already belongs to another tenant" in result.output
    assert snapshot() == before


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{\n  "tenants": [\n    {"slug": "acme",, "name": "A"}\n  ]\n}', "line 3 column 21"),
        ('{\n  "tenants": []\n', "line 3 column 1"),
        ("", "line 1 column 1"),
    ],
    ids=["double-comma", "truncated", "empty"],
)
def test_malformed_json_names_line_and_column(
    runner: FlaskCliRunner, tmp_path: Path, content: str, message: str
) -> None:
    path = tmp_path / "broken.json"
    path.write_text(content)
    before = snapshot()
    result = import_file(runner, path)
    assert result.exit_code == 1
    assert "is not valid JSON" in result.output
    assert message in result.output
    assert snapshot() == before


def test_unreadable_or_missing_file(runner: FlaskCliRunner, tmp_path: Path) -> None:
    path = tmp_path / "latin1.json"
    path.write_bytes(b'{"tenants": [{"slug": "caf\xe9", "name": "x"}]}')
    before = snapshot()
    unreadable = import_file(runner, path)
    assert unreadable.exit_code == 1
    assert "cannot read" in unreadable.output
    missing = import_file(runner, tmp_path / "nope.json")
    assert missing.exit_code == 2
    assert "does not exist" in missing.output
    assert snapshot() == before


# --- seed-demo --------------------------------------------------------------------------------


@pytest.mark.usefixtures("fast_hashing")
def test_seed_demo_if_empty_loads_once(runner: FlaskCliRunner) -> None:
    first = invoke(runner, "seed-demo", "--if-empty")
    assert first.exit_code == 0, first.output
    assert "created" in first.output
    assert counts() == expected_counts(demo())
    before = snapshot()
    second = invoke(runner, "seed-demo", "--if-empty")
    assert second.exit_code == 0, second.output
    assert "not loading the demo" in second.output
    assert snapshot() == before


def test_seed_demo_if_empty_leaves_a_database_with_tenants_alone(runner: FlaskCliRunner) -> None:
    make_tenant("existing")
    db.session.commit()
    before = snapshot()
    result = invoke(runner, "seed-demo", "--if-empty")
    assert result.exit_code == 0
    assert "not loading the demo" in result.output
    assert snapshot() == before


@pytest.mark.usefixtures("fast_hashing")
def test_seed_demo_without_the_flag_is_an_idempotent_import(runner: FlaskCliRunner) -> None:
    assert invoke(runner, "seed-demo").exit_code == 0
    before = snapshot()
    again = invoke(runner, "seed-demo")
    assert again.exit_code == 0
    assert "updated" in again.output
    assert "created" not in again.output
    assert ids(snapshot()) == ids(before)


@pytest.mark.usefixtures("fast_hashing")
def test_seed_demo_points_local_servers_at_the_given_smtp_port(runner: FlaskCliRunner) -> None:
    result = invoke(runner, "seed-demo", "--if-empty", "--smtp-port", "2600")
    assert result.exit_code == 0, result.output
    local = [s for s in demo()["mailServers"] if s["host"] == "127.0.0.1"]
    ports = db.session.scalars(
        select(MailSendServerConfig.port).where(MailSendServerConfig.host == "127.0.0.1")
    ).all()
    assert ports == [2600] * len(local)


# --- create-user ------------------------------------------------------------------------------


def users() -> list[tuple[str, int, str]]:
    db.session.expire_all()
    return db.session.execute(
        select(AppUser.email, AppUser.tenant_id, AppUser.role).order_by(AppUser.id)
    ).all()  # type: ignore[return-value]


def create_user(
    runner: FlaskCliRunner, email: str, tenant: str, role: str, password: str | None = None
) -> Result:
    args = ["create-user", "--email", email, "--tenant", tenant, "--role", role]
    if password is not None:
        return invoke(runner, *args, "--password", password)
    return invoke(runner, *args)


def test_create_user_with_a_password_option(runner: FlaskCliRunner) -> None:
    acme = make_tenant("acme")
    db.session.commit()
    result = create_user(runner, "Ada@Acme.Example.com", "acme", "tenant_admin", "correct-horse")
    assert result.exit_code == 0, result.output
    assert "created user ada@acme.example.com (tenant_admin)" in result.output
    user = db.session.scalar(select(AppUser))
    assert user is not None
    assert (user.email, user.tenant_id, user.role) == (
        "ada@acme.example.com",
        acme.id,
        "tenant_admin",
    )
    assert user.password_hash.startswith("$argon2id$")
    assert user.check_password("correct-horse")


def test_create_user_prompts_for_the_password_twice(runner: FlaskCliRunner) -> None:
    result = invoke(
        runner,
        "create-user",
        "--email",
        "olive@postroom.example.com",
        "--tenant",
        "platform",
        "--role",
        "platform_operator",
        input="operator-pass-1\noperator-pass-1\n",
    )
    assert result.exit_code == 0, result.output
    assert "Repeat for confirmation" in result.output
    assert "operator-pass-1" not in result.output  # a hidden prompt echoes nothing
    user = db.session.scalar(select(AppUser))
    assert user is not None
    assert user.tenant_id == PLATFORM_TENANT_ID
    assert user.check_password("operator-pass-1")


def test_create_user_repeats_the_prompt_when_the_passwords_differ(
    runner: FlaskCliRunner,
) -> None:
    result = invoke(
        runner,
        "create-user",
        "--email",
        "sam@acme.example.com",
        "--tenant",
        "acme",
        "--role",
        "support",
        input="first-password\nsecond-password\nfinal-password\nfinal-password\n",
    )
    # No tenant 'acme' yet: the passwords are asked first, then the tenant is refused.
    assert result.exit_code == 1
    assert "do not match" in result.output
    assert "no tenant with slug 'acme'" in result.output
    assert users() == []


@pytest.mark.usefixtures("fast_hashing")
@pytest.mark.parametrize(
    ("email", "tenant", "role", "password", "message"),
    [
        (
            "op@acme.example.com",
            "acme",
            "platform_operator",
            "long-enough-1",
            "platform_operator users belong to the platform tier",
        ),
        (
            "sup@postroom.example.com",
            "platform",
            "support",
            "long-enough-1",
            "the platform tier's users are platform_operator users",
        ),
        ("new@acme.example.com", "acme", "support", "short", "at least 8 characters"),
        ("taken@acme.example.com", "acme", "support", "long-enough-1", "already exists"),
        ("TAKEN@acme.example.com", "acme", "support", "long-enough-1", "already exists"),
        ("x@nowhere.example.com", "nowhere", "support", "long-enough-1", "no tenant with slug"),
    ],
    ids=[
        "operator-in-tenant",
        "tenant-role-in-platform",
        "short-password",
        "duplicate",
        "duplicate-other-case",
        "unknown-tenant",
    ],
)
def test_create_user_refusals_write_nothing(
    runner: FlaskCliRunner, email: str, tenant: str, role: str, password: str, message: str
) -> None:
    make_tenant("acme")
    db.session.commit()
    taken = create_user(runner, "taken@acme.example.com", "acme", "support", "long-enough-1")
    assert taken.exit_code == 0, taken.output
    before = users()
    result = create_user(runner, email, tenant, role, password)
    assert result.exit_code == 1, result.output
    assert message in result.output
    assert users() == before


def test_create_user_unknown_role_is_a_usage_error(runner: FlaskCliRunner) -> None:
    make_tenant("acme")
    db.session.commit()
    result = create_user(runner, "a@acme.example.com", "acme", "superuser", "long-enough-1")
    assert result.exit_code == 2
    assert "superuser" in result.output
    assert users() == []


def test_create_user_rejects_an_invalid_email(runner: FlaskCliRunner) -> None:
    make_tenant("acme")
    db.session.commit()
    result = create_user(runner, "not an email", "acme", "support", "long-enough-1")
    assert result.exit_code == 1
    assert users() == []


@pytest.mark.usefixtures("fast_hashing")
def test_one_account_per_mailbox_whatever_the_case(runner: FlaskCliRunner, tmp_path: Path) -> None:
    data = demo()
    data["users"] = [
        {
            "email": "Ada@acme.example.com",
            "tenant": "acme",
            "role": "support",
            "password": "long-enough-1",
        }
    ]
    assert import_file(runner, write(tmp_path, data)).exit_code == 0
    result = create_user(runner, "ada@acme.example.com", "acme", "support", "long-enough-2")
    assert result.exit_code == 1
    assert len(users()) == 1


# --- create-api-key ---------------------------------------------------------------------------


def test_create_api_key_prints_a_token_that_authenticates(
    any_app: Flask, runner: FlaskCliRunner
) -> None:
    acme = make_tenant("acme")
    db.session.commit()
    result = invoke(runner, "create-api-key", "--tenant", "acme", "--name", "ci")
    assert result.exit_code == 0, result.output
    token = result.stdout.strip()
    assert token.startswith("pk_")
    assert len(token) >= 40
    assert "\n" not in token
    assert "cannot be shown again" in result.stderr

    key = db.session.scalar(select(ApiKey))
    assert key is not None
    assert (key.tenant_id, key.name, key.created_by) == (acme.id, "ci", "cli")
    assert key.token_hash == hashlib.sha256(token.encode()).hexdigest()
    for row in db.session.execute(select(*ApiKey.__table__.columns)):
        assert all(token not in str(value) for value in row)

    client = any_app.test_client()
    mail = {"to": ["ann@example.com"], "subject": "Hello", "text": "Hi"}
    accepted = client.post("/api/v1/mail", json=mail, headers={"Authorization": f"Bearer {token}"})
    assert accepted.status_code == 202, accepted.json
    record = db.session.get(MailSendRecord, accepted.json["id"])  # type: ignore[index]
    assert record is not None
    assert record.tenant_id == acme.id
    wrong = client.post("/api/v1/mail", json=mail, headers={"Authorization": f"Bearer {token}x"})
    assert wrong.status_code == 401


def test_create_api_key_for_an_unknown_tenant_writes_nothing(runner: FlaskCliRunner) -> None:
    result = invoke(runner, "create-api-key", "--tenant", "nowhere", "--name", "ci")
    assert result.exit_code == 1
    assert "no tenant with slug 'nowhere'" in result.output
    assert result.stdout == ""
    assert db.session.scalar(select(func.count()).select_from(ApiKey)) == 0


def test_create_api_key_takes_its_scopes(any_app: Flask, runner: FlaskCliRunner) -> None:
    make_tenant("acme")
    db.session.commit()
    token = invoke(
        runner, "create-api-key", "--tenant", "acme", "--name", "reader", "--scope", "read"
    ).stdout.strip()
    key = db.session.scalar(select(ApiKey).where(ApiKey.name == "reader"))
    assert key is not None
    assert key.scope_set == {"read"}
    client = any_app.test_client()
    mail = {"to": ["ann@example.com"], "subject": "Hello", "text": "Hi"}
    refused = client.post("/api/v1/mail", json=mail, headers={"Authorization": f"Bearer {token}"})
    assert refused.status_code == 403
    assert refused.json["error"]["code"] == "insufficient_scope"  # type: ignore[index]
    both = invoke(runner, "create-api-key", "--tenant", "acme", "--name", "both")
    assert both.exit_code == 0
    key = db.session.scalar(select(ApiKey).where(ApiKey.name == "both"))
    assert key is not None
    assert key.scope_set == {"send", "read"}
    bad = invoke(runner, "create-api-key", "--tenant", "acme", "--name", "x", "--scope", "admin")
    assert bad.exit_code == 2
    assert "--scope" in bad.output


def test_each_api_key_is_new(runner: FlaskCliRunner) -> None:
    make_tenant("acme")
    db.session.commit()
    tokens = {
        invoke(runner, "create-api-key", "--tenant", "acme", "--name", "k").stdout.strip()
        for _ in range(3)
    }
    assert len(tokens) == 3
    assert db.session.scalar(select(func.count()).select_from(ApiKey)) == 3


def test_mail_receivers_are_imported_with_the_password_encrypted(
    any_app: Flask, tmp_path: Path
) -> None:
    from portal.models import MailReceiveConfig

    data = {
        "tenants": [{"slug": "acme", "name": "Acme"}],
        "mailReceivers": [
            {
                "tenant": "acme",
                "name": "bounces",
                "host": "imap.example.com",
                "username": "bounces@acme.example.com",
                "password": "imap-secret-1",
            }
        ],
    }
    path = tmp_path / "receivers.json"
    path.write_text(json.dumps(data))
    result = any_app.test_cli_runner().invoke(args=["import-config", str(path)])
    assert result.exit_code == 0, result.output
    row = db.session.scalar(select(MailReceiveConfig))
    assert row is not None
    assert (row.port, row.security, row.folder) == (993, "ssl", "INBOX")
    assert row.secret == "imap-secret-1"
    assert "imap-secret-1" not in (row.secret_encrypted or "")
