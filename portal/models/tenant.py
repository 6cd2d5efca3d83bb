"""Tenants, users and API keys."""

from __future__ import annotations

import hashlib
import secrets
from datetime import datetime

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError
from sqlalchemy import (
    Boolean,
    CheckConstraint,
    ForeignKey,
    Index,
    Integer,
    String,
    text,
)
from sqlalchemy.orm import Mapped, mapped_column

from portal.models.base import Base, BigId, UTCDateTime, db_now
from portal.models.enums import Role

_hasher = PasswordHasher()

API_KEY_PREFIX = "pk_"


DEFAULT_API_SCOPES = "send read"


class Tenant(Base):
    """A customer of the service; id -1 is the platform tier."""

    __tablename__ = "tenant"
    __table_args__ = (
        CheckConstraint("id = -1 OR id >= 1", name="tenant_id_range"),
        # SQLite would hand out max(id)+1 = 0 after the platform row; AUTOINCREMENT's sequence
        # (seeded at 0 by the migration) starts real tenants at 1.
        {"sqlite_autoincrement": True},
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    slug: Mapped[str] = mapped_column(String(64), unique=True)
    name: Mapped[str] = mapped_column(String(200))
    is_active: Mapped[bool] = mapped_column(Boolean, default=True, server_default=text("true"))
    # Days a settled record is kept after its last change; None: forever, unless
    # RETENTION_DAYS_DEFAULT says otherwise. At least 2, past the resend window.
    mail_retention_days: Mapped[int | None] = mapped_column(Integer)
    sms_retention_days: Mapped[int | None] = mapped_column(Integer)
    # ISO 3166 alpha-2: how a national phone number typed in the search box is read (issue
    # 14); None: the platform's DEFAULT_COUNTRY.
    country: Mapped[str | None] = mapped_column(String(2))
    created_time: Mapped[datetime] = mapped_column(UTCDateTime, server_default=db_now())
    updated_time: Mapped[datetime] = mapped_column(
        UTCDateTime, server_default=db_now(), onupdate=db_now()
    )


# The one password rule (sign-in, invitations, one's own change, create-user, import-config).
# Sign-in reads at most MAX_PASSWORD_CHARS characters.
MIN_PASSWORD_CHARS = 8
MAX_PASSWORD_CHARS = 1024


def password_problem(password: str) -> str | None:
    """What is wrong with ``password`` as a new password ("must be ..."), or None."""
    if len(password) < MIN_PASSWORD_CHARS:
        return f"must be at least {MIN_PASSWORD_CHARS} characters"
    if len(password) > MAX_PASSWORD_CHARS:
        return f"must be at most {MAX_PASSWORD_CHARS:,} characters"
    return None


class AppUser(Base):
    """A person who signs in to the portal."""

    __tablename__ = "app_user"
    __table_args__ = (
        CheckConstraint(
            "role IN ('platform_operator', 'tenant_admin', 'support')", name="app_user_role"
        ),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenant.id"), index=True)
    email: Mapped[str] = mapped_column(String(320), unique=True)
    name: Mapped[str] = mapped_column(String(200), default="")
    password_hash: Mapped[str] = mapped_column(String(200))
    role: Mapped[str] = mapped_column(String(32))
    is_active: Mapped[bool] = mapped_column(Boolean, default=True, server_default=text("true"))
    last_login_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # New inbox notices of the user's tier are mailed to them too (migration 0020).
    notices_by_mail: Mapped[bool] = mapped_column(
        Boolean, default=False, server_default=text("false")
    )
    # Bumped by sign-out and by every change of password, role, tenant or active flag; a
    # session remembers the generation it signed in with and ends when they differ.
    session_generation: Mapped[int] = mapped_column(default=0, server_default=text("0"))
    # An invitation or reset: the SHA-256 of a one-time set-password token, and its expiry.
    password_token_hash: Mapped[str | None] = mapped_column(String(64), unique=True)
    password_token_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    created_time: Mapped[datetime] = mapped_column(UTCDateTime, server_default=db_now())
    updated_time: Mapped[datetime] = mapped_column(
        UTCDateTime, server_default=db_now(), onupdate=db_now()
    )

    def set_password(self, password: str) -> None:
        """Store an argon2 hash of ``password``."""
        self.password_hash = _hasher.hash(password)

    def end_sessions(self) -> None:
        """End every session of this user, in every process, at its next request."""
        self.session_generation = (self.session_generation or 0) + 1

    def check_password(self, password: str) -> bool:
        """True when ``password`` matches; rehashes when argon2's parameters have changed."""
        try:
            _hasher.verify(self.password_hash, password)
        except (VerificationError, InvalidHashError):
            return False
        if _hasher.check_needs_rehash(self.password_hash):
            self.set_password(password)
        return True

    @property
    def role_enum(self) -> Role:
        return Role(self.role)

    # The user protocol flask-login expects (is_active is the column above).
    @property
    def is_authenticated(self) -> bool:
        return True

    @property
    def is_anonymous(self) -> bool:
        return False

    def get_id(self) -> str:
        return str(self.id)


def hash_api_token(token: str) -> str:
    """SHA-256 of an API token: tokens are long and random, so a slow hash buys nothing."""
    return hashlib.sha256(token.encode()).hexdigest()


def new_api_token() -> str:
    """A new API token: 256 random bits, URL-safe, with a recognisable prefix."""
    return API_KEY_PREFIX + secrets.token_urlsafe(32)


class ApiKey(Base):
    """A tenant's API key; only its SHA-256 digest is stored."""

    __tablename__ = "api_key"
    __table_args__ = (Index("idx_api_key_tenant", "tenant_id"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenant.id"))
    name: Mapped[str] = mapped_column(String(200))
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))
    created_by: Mapped[str | None] = mapped_column(String(320))
    created_time: Mapped[datetime] = mapped_column(UTCDateTime, server_default=db_now())
    last_used_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # Space-separated ApiScope values; keys made before scopes existed have both.
    scopes: Mapped[str] = mapped_column(
        String(64), default=DEFAULT_API_SCOPES, server_default=DEFAULT_API_SCOPES
    )

    @property
    def scope_set(self) -> frozenset[str]:
        return frozenset(self.scopes.split())

    def set_token(self, token: str) -> None:
        """Keep the digest and a short prefix for recognising the key in lists."""
        self.token_hash = hash_api_token(token)
        self.prefix = token[:10]
