"""Secrets at rest: SMTP passwords and provider tokens, encrypted with a key from settings.

The key is derived from SECRET_KEY with HKDF, so one setting protects sessions and stored
secrets without the two uses sharing key material. Ciphertexts are Fernet tokens (AES-128-CBC
with an HMAC), so a tampered column fails loudly instead of decrypting to garbage.
"""

from __future__ import annotations

import base64

from cryptography.fernet import Fernet, InvalidToken
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

_fernet: Fernet | None = None


class SecretUnavailable(RuntimeError):
    """A stored secret cannot be decrypted with the configured key."""


def configure(secret_key: str) -> None:
    """Derive the encryption key from the app's SECRET_KEY (called by create_app)."""
    global _fernet
    raw = HKDF(
        algorithm=hashes.SHA256(), length=32, salt=b"postroom-secretbox", info=b"secrets-at-rest"
    ).derive(secret_key.encode())
    _fernet = Fernet(base64.urlsafe_b64encode(raw))


def _box() -> Fernet:
    if _fernet is None:
        raise SecretUnavailable("secretbox is not configured; create the app first")
    return _fernet


def encrypt(plain: str) -> str:
    """Encrypt a secret for storage."""
    return _box().encrypt(plain.encode()).decode("ascii")


def decrypt(token: str) -> str:
    """Decrypt a stored secret; raises SecretUnavailable when the key does not fit."""
    try:
        return _box().decrypt(token.encode("ascii")).decode()
    except InvalidToken:
        raise SecretUnavailable("stored secret cannot be decrypted with this SECRET_KEY") from None
