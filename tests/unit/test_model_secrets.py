"""The secrets a configuration keeps encrypted (``portal.models.channels.Secret``): the same rule
for a mail server's password and an SMS provider's two secrets."""

from __future__ import annotations

import pytest

from portal.models import MailSendServerConfig, SmsProviderConfig, secretbox


@pytest.fixture(autouse=True)
def key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(secretbox, "_fernet", None)  # the process's own key comes back after
    secretbox.configure("unit-test-key")


@pytest.mark.parametrize(
    ("model", "name"),
    [
        (MailSendServerConfig, "password"),
        (SmsProviderConfig, "secret"),
        (SmsProviderConfig, "webhook_secret"),
    ],
)
def test_a_secret_is_stored_encrypted_and_read_decrypted(model: type, name: str) -> None:
    row = model()
    column = f"{name}_encrypted"
    assert getattr(row, name) is None
    setattr(row, name, "s3cret")
    stored = getattr(row, column)
    assert stored
    assert "s3cret" not in stored
    assert getattr(row, name) == "s3cret"

    setattr(row, name, "s3cret")  # the same value: the ciphertext stays (no change to save)
    assert getattr(row, column) == stored
    setattr(row, name, "other")
    assert getattr(row, column) != stored
    assert getattr(row, name) == "other"

    secretbox.configure("a-new-key")  # SECRET_KEY changed: unreadable, and a new value replaces it
    with pytest.raises(secretbox.SecretUnavailable):
        getattr(row, name)
    setattr(row, name, "other")
    assert getattr(row, name) == "other"

    setattr(row, name, None)
    assert getattr(row, column) is None
    setattr(row, name, "")
    assert getattr(row, column) is None
