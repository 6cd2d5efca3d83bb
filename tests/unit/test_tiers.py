"""Every test file belongs to a tier: the folder under tests/ it lies in says what it needs."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import TIERS, tier_of

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_file_is_in_a_tier() -> None:
    files = sorted(TESTS.rglob("test_*.py"))
    assert len(files) > 100  # the walk found the suite
    homeless = [str(f.relative_to(TESTS)) for f in files if tier_of(f) is None]
    assert not homeless, f"test files in no tier ({', '.join(TIERS)}): {homeless}"


def test_a_file_outside_the_tier_folders_has_no_tier(tmp_path: Path) -> None:
    assert tier_of(TESTS / "test_stray.py") is None
    assert tier_of(TESTS / "support" / "test_stray.py") is None
    assert tier_of(TESTS / "integration" / "test_api.py") == "integration"
