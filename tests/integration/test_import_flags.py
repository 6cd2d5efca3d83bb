"""``import-config`` never undoes what people did in the portal: a flag the
file omits keeps its stored value (new rows get the default), a revoked key stays revoked and
is reported, a change to a user ends their sessions, and API key scopes (real PostgreSQL,
through the CLI as an operator runs it)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from argon2 import PasswordHasher
from click.testing import Result
from flask import Flask
from flask.testing import FlaskCliRunner
from sqlalchemy import select

from portal.extensions import db
from portal.models import (
    ApiKey,
    AppUser,
    MailReceiveConfig,
    MailSendServerConfig,
    MailTemplate,
    SmsProviderConfig,
    SmsTemplate,
    Tenant,
)
from portal.models import tenant as tenant_models

TOKEN = "pk_import_flags_token_0123456789"


@pytest.fixture
def runner(app: Flask, monkeypatch: pytest.MonkeyPatch) -> FlaskCliRunner:
    # Cheap argon2 parameters: these tests import users many times.
    monkeypatch.setattr(
        tenant_models, "_hasher", PasswordHasher(time_cost=1, memory_cost=1024, parallelism=1)
    )
    return app.test_cli_runner()


def config() -> dict[str, Any]:
    """One row per section, every flag and uncertainPolicy left out."""
    return {
        "tenants": [{"slug": "acme", "name": "Acme"}],
        "users": [
            {
                "email": "admin@acme.example.com",
                "role": "tenant_admin",
                "tenant": "acme",
                "password": "first-password",
            }
        ],
        "apiKeys": [{"tenant": "acme", "name": "main", "token": TOKEN}],
        "mailServers": [
            {
                "tenant": "acme",
                "name": "relay",
                "host": "smtp.example.com",
                "fromAddress": "no-reply@acme.example.com",
            }
        ],
        "smsProviders": [{"tenant": "acme", "name": "sms", "provider": "test"}],
        "mailTemplates": [{"tenant": "acme", "code": "welcome", "subject": "Hi", "text": "Hi"}],
        "smsTemplates": [{"tenant": "acme", "code": "otp", "content": "Code {{ code }}"}],
        "mailReceivers": [
            {"tenant": "acme", "name": "bounces", "host": "imap.example.com", "username": "u"}
        ],
    }


def run(runner: FlaskCliRunner, tmp_path: Path, data: dict[str, Any]) -> Result:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    result = runner.invoke(args=["import-config", str(path)])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    db.session.expire_all()
    return result


def imported(runner: FlaskCliRunner, tmp_path: Path, data: dict[str, Any]) -> str:
    result = run(runner, tmp_path, data)
    assert result.exit_code == 0, result.output
    return result.output


def one(model: Any) -> Any:
    row = db.session.scalar(select(model))
    assert row is not None
    return row


def test_a_key_revoked_in_the_portal_stays_revoked_and_the_import_says_so(
    runner: FlaskCliRunner, tmp_path: Path
) -> None:
    imported(runner, tmp_path, config())
    key = one(ApiKey)
    revoked = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
    key.revoked_at = revoked
    db.session.commit()
    output = imported(runner, tmp_path, config())
    assert "apiKeys[0]: revoked; left revoked" in output
    key = one(ApiKey)
    assert key.revoked_at == revoked
    # The rest of the file still went in.
    assert "users: 1 updated" in output


def test_flags_the_file_omits_keep_what_was_set_in_the_portal(
    runner: FlaskCliRunner, tmp_path: Path
) -> None:
    imported(runner, tmp_path, config())
    # What people changed in the portal (and the CLI) since the first import.
    acme = db.session.scalar(select(Tenant).where(Tenant.slug == "acme"))
    assert acme is not None
    acme.is_active = False
    one(AppUser).is_active = False
    server = one(MailSendServerConfig)
    server.enabled, server.is_default, server.verify_tls = False, True, False
    server.read_receipt, server.uncertain_policy = True, "hold"
    provider = one(SmsProviderConfig)
    provider.enabled, provider.is_default, provider.uncertain_policy = False, True, "hold"
    one(MailTemplate).enabled = False
    one(SmsTemplate).enabled = False
    box = one(MailReceiveConfig)
    box.enabled, box.verify_tls = False, False
    db.session.commit()

    imported(runner, tmp_path, config())

    acme = db.session.scalar(select(Tenant).where(Tenant.slug == "acme"))
    assert acme is not None
    assert acme.is_active is False
    assert one(AppUser).is_active is False
    server = one(MailSendServerConfig)
    assert (server.enabled, server.is_default, server.verify_tls) == (False, True, False)
    assert (server.read_receipt, server.uncertain_policy) == (True, "hold")
    provider = one(SmsProviderConfig)
    assert (provider.enabled, provider.is_default, provider.uncertain_policy) == (
        False,
        True,
        "hold",
    )
    assert one(MailTemplate).enabled is False
    assert one(SmsTemplate).enabled is False
    box = one(MailReceiveConfig)
    assert (box.enabled, box.verify_tls) == (False, False)


def test_new_rows_get_the_defaults_and_a_flag_the_file_gives_wins(
    runner: FlaskCliRunner, tmp_path: Path
) -> None:
    imported(runner, tmp_path, config())
    assert db.session.scalar(select(Tenant.is_active).where(Tenant.slug == "acme")) is True
    assert one(AppUser).is_active is True
    server = one(MailSendServerConfig)
    assert (server.enabled, server.is_default, server.verify_tls) == (True, False, True)
    assert (server.read_receipt, server.uncertain_policy) == (False, "retry")
    provider = one(SmsProviderConfig)
    assert (provider.enabled, provider.is_default, provider.uncertain_policy) == (
        True,
        False,
        "retry",
    )
    assert one(MailTemplate).enabled is True
    assert one(MailReceiveConfig).enabled is True
    assert one(ApiKey).scopes == "send read"

    server.enabled = False
    db.session.commit()
    data = config()
    data["mailServers"][0]["enabled"] = True
    data["mailServers"][0]["uncertainPolicy"] = "hold"
    imported(runner, tmp_path, data)
    server = one(MailSendServerConfig)
    assert (server.enabled, server.uncertain_policy) == (True, "hold")


def test_a_change_to_a_user_ends_their_sessions_and_no_change_does_not(
    runner: FlaskCliRunner, tmp_path: Path
) -> None:
    imported(runner, tmp_path, config())
    generation = one(AppUser).session_generation
    imported(runner, tmp_path, config())
    assert one(AppUser).session_generation == generation  # the same file: signed in still

    steps: list[dict[str, Any]] = [
        {"password": "a-new-password"},
        {"role": "support"},
        {"active": False},
    ]
    data = config()
    for change in steps:
        data["users"][0] |= change
        imported(runner, tmp_path, data)
        now = one(AppUser).session_generation
        assert now > generation, change
        generation = now


def test_api_key_scopes_are_validated_kept_when_omitted_and_default_to_both(
    runner: FlaskCliRunner, tmp_path: Path
) -> None:
    data = config()
    data["apiKeys"][0]["scopes"] = ["read", "send"]
    imported(runner, tmp_path, data)
    assert one(ApiKey).scopes == "send read"
    data["apiKeys"][0]["scopes"] = ["send"]
    imported(runner, tmp_path, data)
    assert one(ApiKey).scopes == "send"
    imported(runner, tmp_path, config())  # omitted: the stored scopes stay
    assert one(ApiKey).scopes == "send"
    for wrong in (["write"], [], "send", [1], None):
        data["apiKeys"][0]["scopes"] = wrong
        result = run(runner, tmp_path, data)
        assert result.exit_code != 0, wrong
        assert "apiKeys[0]: scopes must be a non-empty list of 'send', 'read'" in result.output
    assert one(ApiKey).scopes == "send"
