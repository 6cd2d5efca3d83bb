"""The run command's defaults (scripts/run.py): one delivery process per core on PostgreSQL,
each with at least four mail workers."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def run_script(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    spec = importlib.util.spec_from_file_location("run_script", ROOT / "scripts" / "run.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module.os, "cpu_count", lambda: 2)
    return module


@pytest.mark.parametrize(
    ("workers", "processes"), [(None, "1"), ("4", "1"), ("7", "1"), ("8", "2"), ("16", "2")]
)
@pytest.mark.parametrize("url", ["postgresql+psycopg://db/postroom", "postgres://db/postroom"])
def test_one_process_per_core_with_four_mail_workers_each(
    run_script: ModuleType, url: str, workers: str | None, processes: str
) -> None:
    env = {"DATABASE_URL": url}
    if workers is not None:
        env["MAIL_SEND_CONCURRENCY"] = workers

    run_script.default_processes(env)

    assert env["DELIVERY_PROCESSES"] == processes


def test_the_embedded_sqlite_delivers_in_one_process(run_script: ModuleType) -> None:
    for env in (
        {"MAIL_SEND_CONCURRENCY": "8"},
        {"DATABASE_URL": "sqlite:///instance/postroom.db", "MAIL_SEND_CONCURRENCY": "8"},
    ):
        run_script.default_processes(env)

        assert "DELIVERY_PROCESSES" not in env


def test_a_count_given_is_kept(run_script: ModuleType) -> None:
    env = {
        "DATABASE_URL": "postgresql://db/postroom",
        "MAIL_SEND_CONCURRENCY": "8",
        "DELIVERY_PROCESSES": "3",
    }

    run_script.default_processes(env)

    assert env["DELIVERY_PROCESSES"] == "3"
