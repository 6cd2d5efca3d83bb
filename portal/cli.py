"""Flask commands: import-config, create-user, end-sessions, create-api-key, seed-demo.

Changing a user here (import-config's password, role, tenant or active flag) ends that user's
portal sessions through the attribute event in portal.web.auth, which create_app loads.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
from email_validator import EmailNotValidError
from flask import Flask
from sqlalchemy import func, select, update

from portal.extensions import db
from portal.importer import ConfigImportError, import_config, tenant_by_slug
from portal.messaging.records.addresses import typed_email
from portal.models import ApiKey, ApiScope, AppUser, Role, Tenant
from portal.models.tenant import DEFAULT_API_SCOPES, new_api_token, password_problem
from portal.tenancy import PLATFORM_TENANT_ID

DEMO_CONFIG = Path(__file__).resolve().parent.parent / "demo" / "demo-config.json"


def register(app: Flask) -> None:
    """Attach the commands to the app's CLI."""
    app.cli.add_command(import_config_command)
    app.cli.add_command(create_user)
    app.cli.add_command(end_sessions)
    app.cli.add_command(create_api_key)
    app.cli.add_command(seed_demo)


def _load(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise click.ClickException(f"cannot read {path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise click.ClickException(
            f"{path} is not valid JSON: line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None


def _import(path: Path, smtp_port: int | None = None) -> str:
    data = _load(path)
    if smtp_port is not None and isinstance(data, dict):
        # The demo's servers point at the local sink; follow it to the port it was given.
        for server in data.get("mailServers", []):
            if isinstance(server, dict) and server.get("host") == "127.0.0.1":
                server["port"] = smtp_port
    try:
        report = import_config(db.session(), data)
        db.session.commit()
    except ConfigImportError as exc:
        db.session.rollback()
        raise click.ClickException(f"{path}: {exc} (nothing was written)") from None
    return report.summary()


@click.command("import-config")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
def import_config_command(file: Path) -> None:
    """Upsert tenants, users, keys, servers, providers, routes, templates, bindings, quotas."""
    click.echo(_import(file))


@click.command("seed-demo")
@click.option("--if-empty", is_flag=True, help="Only when no tenant exists yet.")
@click.option("--smtp-port", type=int, default=None, help="Port of the local SMTP sink.")
def seed_demo(if_empty: bool, smtp_port: int | None) -> None:
    """Load the demo configuration (demo/demo-config.json)."""
    if if_empty:
        count = db.session.scalar(select(func.count()).select_from(Tenant).where(Tenant.id > 0))
        if count:
            click.echo("demo: the database already has tenants; not loading the demo")
            return
    click.echo(_import(DEMO_CONFIG, smtp_port))


def _tenant_id(slug: str) -> int:
    tenant_id = tenant_by_slug(db.session(), slug)
    if tenant_id is None:
        raise click.ClickException(f"no tenant with slug {slug!r}")
    return tenant_id


@click.command("create-user")
@click.option("--email", required=True)
@click.option("--tenant", "tenant_slug", required=True, help="Tenant slug, or 'platform'.")
@click.option("--role", type=click.Choice([r.value for r in Role]), required=True)
@click.option("--name", default="")
@click.password_option()
def create_user(email: str, tenant_slug: str, role: str, name: str, password: str) -> None:
    """Create a portal user."""
    tenant_id = _tenant_id(tenant_slug)
    if role == Role.PLATFORM_OPERATOR and tenant_id != PLATFORM_TENANT_ID:
        raise click.ClickException("platform_operator users belong to the platform tier")
    if role != Role.PLATFORM_OPERATOR and tenant_id == PLATFORM_TENANT_ID:
        raise click.ClickException("the platform tier's users are platform_operator users")
    try:
        email = typed_email(email)
    except EmailNotValidError as exc:
        raise click.ClickException(f"{email!r} is not a valid email address: {exc}") from None
    if (problem := password_problem(password)) is not None:
        raise click.ClickException(f"the password {problem}")
    if db.session.scalar(select(AppUser.id).where(AppUser.email == email)):
        raise click.ClickException(f"a user with email {email} already exists")
    user = AppUser(email=email, tenant_id=tenant_id, role=role, name=name)
    user.set_password(password)
    db.session.add(user)
    db.session.commit()
    click.echo(f"created user {user.email} ({role})")


@click.command("end-sessions")
@click.option("--email", default=None, help="The user whose sessions end.")
@click.option("--all", "everyone", is_flag=True, help="Every user's sessions end.")
def end_sessions(email: str | None, everyone: bool) -> None:
    """Sign a user (or everyone) out of the portal in every browser, at their next request.

    Rotating SECRET_KEY is not the way: it also derives the key of the stored secrets.
    """
    if everyone == (email is not None):
        raise click.ClickException("give either --email or --all")
    if everyone:
        # A bulk update bypasses the ORM event, so it bumps the generation itself.
        result = db.session.execute(
            update(AppUser).values(session_generation=AppUser.session_generation + 1)
        )
        db.session.commit()
        click.echo(f"ended the sessions of {result.rowcount} user(s)")  # type: ignore[attr-defined]
        return
    assert email is not None
    user = db.session.scalar(select(AppUser).where(AppUser.email == email.strip().lower()))
    if user is None:
        raise click.ClickException(f"no user with email {email}")
    user.end_sessions()
    db.session.commit()
    click.echo(f"ended the sessions of {user.email}")


@click.command("create-api-key")
@click.option("--tenant", "tenant_slug", required=True, help="Tenant slug, or 'platform'.")
@click.option("--name", required=True)
@click.option(
    "--scope",
    "scopes",
    multiple=True,
    type=click.Choice([scope.value for scope in ApiScope]),
    help="What the key may do (repeat for both); default: send and read.",
)
def create_api_key(tenant_slug: str, name: str, scopes: tuple[str, ...]) -> None:
    """Create an API key and print its token once (only a digest is stored)."""
    tenant_id = _tenant_id(tenant_slug)
    token = new_api_token()
    chosen = " ".join(s.value for s in ApiScope if s.value in scopes) or DEFAULT_API_SCOPES
    key = ApiKey(tenant_id=tenant_id, name=name, created_by="cli", scopes=chosen)
    key.set_token(token)
    db.session.add(key)
    db.session.commit()
    click.echo(token)
    click.echo("Keep this token now: it cannot be shown again.", err=True)
    sys.stdout.flush()
