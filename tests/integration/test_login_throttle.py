"""The sign-in throttle: at most 5 password checks per (address typed, client) and 30 per address
per 15 minutes, counted before the check so parallel guesses cannot overrun it; in the database
(login_throttle) when Redis cannot be reached. A lock-out looks the same for every address."""

from __future__ import annotations

import re
import socket
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
from argon2 import PasswordHasher
from flask import Flask, g
from flask.testing import FlaskClient
from sqlalchemy import func, select, update

from portal.extensions import db
from portal.models import AppUser, AuditAction, AuditEvent, LoginThrottle, db_now_plus
from portal.models import tenant as tenant_models
from tests.conftest import make_tenant

PASSWORD = "throttle-test-password-1"
EMAIL = "ann@acme.example.com"


# Each test starts with no attempts counted in Redis (redis_client flushes its db).
pytestmark = pytest.mark.usefixtures("redis_client")


@pytest.fixture(params=["redis", "database"])
def store(request: pytest.FixtureRequest, app: Flask, monkeypatch: pytest.MonkeyPatch) -> str:
    """Where the throttle counts: Redis, or the database with the app's Redis on a closed port."""
    if request.param == "database":
        _redis_unreachable(app, monkeypatch)
    return str(request.param)


@pytest.fixture
def fast_hashing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cheap argon2 parameters where the race is not the point (the parallel test keeps the
    real ones: a slow check is what let parallel guesses through)."""
    monkeypatch.setattr(
        tenant_models, "_hasher", PasswordHasher(time_cost=1, memory_cost=1024, parallelism=1)
    )


def _redis_unreachable(flask_app: Flask, monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again when the block ends: nothing listens
    settings = flask_app.config["SETTINGS"].replace(redis_url=f"redis://127.0.0.1:{port}/0")
    monkeypatch.setitem(flask_app.config, "SETTINGS", settings)


@pytest.fixture
def checks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every password check made (AppUser.check_password, called through)."""
    made: list[str] = []
    lock = threading.Lock()
    real: Callable[[AppUser, str], bool] = AppUser.check_password

    def counted(self: AppUser, password: str) -> bool:
        with lock:
            made.append(self.email or "(dummy)")
        return real(self, password)

    monkeypatch.setattr(AppUser, "check_password", counted)
    return made


def make_user(email: str = EMAIL) -> AppUser:
    found = AppUser(email=email, role="tenant_admin", tenant_id=make_tenant("acme").id)
    found.set_password(PASSWORD)
    db.session.add(found)
    db.session.commit()
    return found


def attempt(
    flask_app: Flask, email: str, password: str, client_address: str = "127.0.0.1"
) -> tuple[int, str]:
    """One sign-in from a fresh browser at ``client_address``: (status, body)."""
    g.pop("csrf_token", None)  # in a test's app context, g outlives a request
    client: FlaskClient = flask_app.test_client()
    client.environ_base["REMOTE_ADDR"] = client_address
    page = client.get("/auth/login").text
    token = re.search(r'name="csrf_token" value="([^"]+)"', page).group(1)  # type: ignore[union-attr]
    response = client.post(
        "/auth/login", data={"email": email, "password": password, "csrf_token": token}
    )
    return response.status_code, response.text


def in_parallel(flask_app: Flask, jobs: list[tuple[str, str, str]]) -> list[int]:
    """Run sign-in attempts (email, password, client) from threads, released together."""
    barrier = threading.Barrier(len(jobs))

    def one(job: tuple[str, str, str]) -> int:
        email, password, client_address = job
        client = flask_app.test_client()
        client.environ_base["REMOTE_ADDR"] = client_address
        page = client.get("/auth/login").text
        token = re.search(r'name="csrf_token" value="([^"]+)"', page).group(1)  # type: ignore[union-attr]
        barrier.wait()
        data = {"email": email, "password": password, "csrf_token": token}
        return client.post("/auth/login", data=data).status_code

    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(one, jobs))


def failed_rows() -> int:
    db.session.commit()
    return int(
        db.session.scalar(
            select(func.count())
            .select_from(AuditEvent)
            .where(AuditEvent.action == AuditAction.SIGN_IN_FAILED)
        )
        or 0
    )


@pytest.mark.parametrize("email", [EMAIL, "nobody@acme.example.com"])
@pytest.mark.real_hashing
def test_parallel_wrong_passwords_get_five_checks(
    app: Flask, store: str, checks: list[str], email: str
) -> None:
    make_user()
    statuses = in_parallel(app, [(email, "wrong password", "127.0.0.1")] * 24)
    assert len(checks) == 5
    assert sorted(statuses) == [422] * 5 + [429] * 19
    # One audit row per check, and one for the lock-out: not one per refused guess.
    assert failed_rows() == 6


def test_thirty_checks_per_address_from_any_number_of_clients(
    app: Flask, store: str, checks: list[str], fast_hashing: None
) -> None:
    make_user()
    jobs = [(EMAIL, "wrong password", f"10.0.0.{i}") for i in range(7) for _ in range(5)]
    statuses = in_parallel(app, jobs)
    assert len(checks) == 30
    assert statuses.count(429) == 5
    # A new client with the right password: still locked out, and no check made.
    assert attempt(app, EMAIL, PASSWORD, "10.0.0.99")[0] == 429
    assert len(checks) == 30


def test_a_lock_out_looks_the_same_for_known_and_unknown_addresses(
    app: Flask, store: str, checks: list[str], fast_hashing: None
) -> None:
    make_user()
    unknown = "nobody@acme.example.com"
    answers = {}
    for email in (EMAIL, unknown):
        for _ in range(5):
            assert attempt(app, email, "wrong password")[0] == 422
        status, body = attempt(app, email, "wrong password")
        assert status == 429
        token = re.search(r'name="csrf_token" value="([^"]+)"', body).group(1)  # type: ignore[union-attr]
        answers[email] = body.replace(token, "token").replace(email, "address")
    assert answers[EMAIL] == answers[unknown]
    assert "Too many failed attempts" in answers[EMAIL]
    # The right password during a lock-out is not even checked.
    assert attempt(app, EMAIL, PASSWORD)[0] == 429
    assert len(checks) == 10


def test_a_successful_sign_in_clears_this_clients_count(
    app: Flask, store: str, checks: list[str], fast_hashing: None
) -> None:
    make_user()
    for _ in range(2):
        for _ in range(4):
            assert attempt(app, EMAIL, "wrong password")[0] == 422
        assert attempt(app, EMAIL, PASSWORD)[0] == 302
    assert len(checks) == 10


def test_the_database_count_starts_again_when_its_window_ends(
    app: Flask, checks: list[str], fast_hashing: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    _redis_unreachable(app, monkeypatch)
    make_user()
    for _ in range(5):
        assert attempt(app, EMAIL, "wrong password")[0] == 422
    assert attempt(app, EMAIL, PASSWORD)[0] == 429
    db.session.execute(update(LoginThrottle).values(window_start=db_now_plus(-901)))
    db.session.commit()
    assert attempt(app, EMAIL, PASSWORD)[0] == 302
    # The ended windows were purged; the sign-in cleared its own client's count.
    keys = db.session.scalars(select(LoginThrottle.key).order_by(LoginThrottle.key)).all()
    assert keys == [f"login:email:{EMAIL}", "login:from:127.0.0.1"]


def test_the_database_count_works_on_each_dialect(
    any_app: Flask, checks: list[str], fast_hashing: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    _redis_unreachable(any_app, monkeypatch)
    make_user()
    for _ in range(5):
        assert attempt(any_app, EMAIL, "wrong password")[0] == 422
    assert attempt(any_app, EMAIL, PASSWORD)[0] == 429
    assert len(checks) == 5
    attempts = db.session.scalar(
        select(LoginThrottle.attempts).where(LoginThrottle.key == f"login:email:{EMAIL}")
    )
    assert attempts == 6
