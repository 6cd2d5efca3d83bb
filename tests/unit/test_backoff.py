"""Back-off: 30 s doubling with ±50 % jitter, a floor for rate limits; a provider's Retry-After,
capped, is the wait exactly."""

from __future__ import annotations

import random

import pytest

from portal.config import Settings
from portal.messaging.sending.backoff import (
    BackoffPolicy,
    DeadLetter,
    Fail,
    Retry,
    RetryDecision,
    describe,
)
from portal.messaging.sending.classify import ErrorCategory

NO_JITTER = BackoffPolicy(jitter=0.0)


def delay_of(decision: RetryDecision) -> float:
    assert isinstance(decision, Retry), decision
    return decision.delay_s


def test_sequence_without_jitter_is_the_seed_table() -> None:
    delays = [delay_of(NO_JITTER.decide(ErrorCategory.TRANSIENT, n)) for n in range(5)]
    assert delays == [30.0, 60.0, 120.0, 240.0, 480.0]


def test_jitter_stays_within_half_either_way() -> None:
    policy = BackoffPolicy()
    rng = random.Random(1234)
    for retries in range(5):
        nominal = 30.0 * 2**retries
        draws = [
            delay_of(policy.decide(ErrorCategory.TRANSIENT, retries, rng=rng)) for _ in range(500)
        ]
        assert all(0.5 * nominal <= d <= 1.5 * nominal for d in draws)
        # Seeded, so this is deterministic: the draws really spread over the range.
        assert min(draws) < 0.6 * nominal
        assert max(draws) > 1.4 * nominal


def test_same_seed_same_delays() -> None:
    policy = BackoffPolicy()
    first = policy.decide(ErrorCategory.UNKNOWN, 2, rng=random.Random(7))
    second = policy.decide(ErrorCategory.UNKNOWN, 2, rng=random.Random(7))
    assert first == second


def test_quota_waits_at_least_the_floor() -> None:
    rng = random.Random(5)
    for retries in range(4):  # 30..240 s nominal, all below the 300 s floor even with jitter
        assert delay_of(BackoffPolicy().decide(ErrorCategory.QUOTA, retries, rng=rng)) >= 300.0
    assert delay_of(NO_JITTER.decide(ErrorCategory.QUOTA, 0)) == 300.0
    # Past the floor the exponential wait still applies.
    assert delay_of(NO_JITTER.decide(ErrorCategory.QUOTA, 4)) == 480.0


def test_retry_after_is_the_wait_exactly() -> None:
    assert delay_of(NO_JITTER.decide(ErrorCategory.TRANSIENT, 0, retry_after_s=90.0)) == 90.0
    # Shorter than our own wait: the provider's word wins, and no jitter is added.
    assert delay_of(NO_JITTER.decide(ErrorCategory.TRANSIENT, 3, retry_after_s=5.0)) == 5.0
    jittered = BackoffPolicy()
    assert delay_of(jittered.decide(ErrorCategory.UNKNOWN, 2, retry_after_s=7.5)) == 7.5


def test_retry_after_is_capped() -> None:
    decision = NO_JITTER.decide(ErrorCategory.TRANSIENT, 0, retry_after_s=86_400.0)
    assert delay_of(decision) == 3600.0
    infinite = NO_JITTER.decide(ErrorCategory.TRANSIENT, 0, retry_after_s=float("inf"))
    assert delay_of(infinite) == 3600.0


def test_a_quota_retry_after_of_65_s_waits_65_s_not_the_floor() -> None:
    # The 5-minute floor of seed 000 applies only when the provider gives no Retry-After.
    assert delay_of(NO_JITTER.decide(ErrorCategory.QUOTA, 0, retry_after_s=65.0)) == 65.0
    assert delay_of(NO_JITTER.decide(ErrorCategory.QUOTA, 0)) == 300.0
    policy = BackoffPolicy(jitter=0.0, retry_after_cap_s=60.0)
    assert delay_of(policy.decide(ErrorCategory.QUOTA, 0, retry_after_s=1000.0)) == 60.0


def test_retry_after_does_not_outlive_the_retries() -> None:
    assert BackoffPolicy().decide(ErrorCategory.QUOTA, 5, retry_after_s=10.0) == DeadLetter()
    assert BackoffPolicy().decide(ErrorCategory.AUTH, 0, retry_after_s=10.0) == Fail()


def test_from_settings_caps_by_retry_after_max() -> None:
    settings = Settings(
        database_url="sqlite://", redis_url=None, secret_key="k", retry_after_cap_s=120.0
    )
    policy = BackoffPolicy.from_settings(settings).decide(
        ErrorCategory.QUOTA, 0, retry_after_s=500.0
    )
    assert delay_of(policy) == 120.0


@pytest.mark.parametrize("bad", [0.0, -5.0, float("nan")])
def test_meaningless_retry_after_is_ignored(bad: float) -> None:
    assert delay_of(NO_JITTER.decide(ErrorCategory.TRANSIENT, 1, retry_after_s=bad)) == 60.0


@pytest.mark.parametrize(
    "category", [ErrorCategory.TRANSIENT, ErrorCategory.QUOTA, ErrorCategory.UNKNOWN]
)
def test_dead_letter_after_max_retries(category: ErrorCategory) -> None:
    policy = BackoffPolicy()
    assert isinstance(policy.decide(category, 4), Retry)
    assert policy.decide(category, 5) == DeadLetter()
    assert policy.decide(category, 6) == DeadLetter()  # a manual retry of a dead letter


@pytest.mark.parametrize(
    "category",
    [
        ErrorCategory.PERMANENT,
        ErrorCategory.INVALID_INPUT,
        ErrorCategory.AUTH,
        ErrorCategory.CONFIG,
    ],
)
@pytest.mark.parametrize("retries", [0, 3, 5, 9])
def test_non_retryable_fails_at_once(category: ErrorCategory, retries: int) -> None:
    assert BackoffPolicy().decide(category, retries) == Fail()


def test_zero_max_retries_dead_letters_the_first_temporary_failure() -> None:
    assert BackoffPolicy(max_retries=0).decide(ErrorCategory.TRANSIENT, 0) == DeadLetter()


def test_absurd_retry_counts_stay_finite() -> None:
    policy = BackoffPolicy(max_retries=10_000, jitter=0.0)
    assert delay_of(policy.decide(ErrorCategory.TRANSIENT, 5_000)) < float("inf")


def test_from_settings() -> None:
    settings = Settings(
        database_url="sqlite://",
        redis_url=None,
        secret_key="k",
        max_retries=3,
        backoff_base_s=0.2,
        quota_retry_floor_s=0.5,
        retry_after_cap_s=2.0,
    )
    policy = BackoffPolicy.from_settings(settings)
    assert policy == BackoffPolicy(
        max_retries=3, base_s=0.2, quota_floor_s=0.5, retry_after_cap_s=2.0, jitter=0.5
    )


@pytest.mark.parametrize(
    "kwargs", [{"max_retries": -1}, {"base_s": -1.0}, {"jitter": 1.5}, {"jitter": -0.1}]
)
def test_invalid_policy_is_rejected(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must"):
        BackoffPolicy(**kwargs)  # type: ignore[arg-type]


def test_describe() -> None:
    assert describe(Retry(62.44)) == "retry in 62.4 s"
    assert describe(Fail()) == "failed: a retry would not help"
    assert describe(DeadLetter()) == "dead letter: retries used up"
