"""Back-off: turn a failure's category and the retries so far into Retry, Fail or DeadLetter.

The decision is a closed union so that whoever carries it out matches it exhaustively
(`assert_never`): adding a fourth outcome is then a type error everywhere it is handled.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias, assert_never

from portal.messaging.sending.classify import ErrorCategory, is_retryable

if TYPE_CHECKING:
    from portal.config import Settings


@dataclass(frozen=True)
class Retry:
    """Try again after `delay_s` seconds."""

    delay_s: float


@dataclass(frozen=True)
class Fail:
    """Stop now: a retry would fail the same way."""


@dataclass(frozen=True)
class DeadLetter:
    """Stop: the failure was temporary, but the retries are used up."""


RetryDecision: TypeAlias = Retry | Fail | DeadLetter

# Beyond this exponent the wait is already centuries; capping it keeps the float finite when
# an operator configures an absurd max_retries.
_MAX_EXPONENT = 40

# Shared so that jitter differs between workers without each one seeding its own generator.
_RNG = random.Random()


@dataclass(frozen=True)
class BackoffPolicy:
    """Exponential back-off with jitter and a floor for rate limits; a provider's Retry-After,
    capped, replaces both."""

    max_retries: int = 5
    base_s: float = 30.0
    quota_floor_s: float = 300.0
    retry_after_cap_s: float = 3600.0
    jitter: float = 0.5

    def __post_init__(self) -> None:
        """Reject settings that would make delays negative or meaningless."""
        if self.max_retries < 0:
            raise ValueError(f"max_retries must not be negative, got {self.max_retries}")
        if self.base_s < 0 or self.quota_floor_s < 0 or self.retry_after_cap_s < 0:
            raise ValueError("back-off durations must not be negative")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"jitter must be between 0 and 1, got {self.jitter}")

    @classmethod
    def from_settings(cls, settings: Settings) -> BackoffPolicy:
        """The policy the settings describe (tests shorten the durations instead of sleeping)."""
        return cls(
            max_retries=settings.max_retries,
            base_s=settings.backoff_base_s,
            quota_floor_s=settings.quota_retry_floor_s,
            retry_after_cap_s=settings.retry_after_cap_s,
        )

    def used_up(self, retries_so_far: int) -> bool:
        """Whether a record that has been retried ``retries_so_far`` times gets no more
        automatic retries (the one rule for the back-off and the stuck-send sweep)."""
        return retries_so_far >= self.max_retries

    def decide(
        self,
        category: ErrorCategory,
        retries_so_far: int,
        *,
        retry_after_s: float | None = None,
        rng: random.Random | None = None,
    ) -> RetryDecision:
        """Decide what happens after a failed attempt; `retries_so_far` excludes this one.

        A positive `retry_after_s` (the provider's Retry-After) is the wait, capped by
        `retry_after_cap_s`; otherwise the exponential wait, at least the quota floor for QUOTA.
        """
        if not is_retryable(category):
            return Fail()
        if self.used_up(retries_so_far):
            return DeadLetter()
        if retry_after_s is not None and not math.isnan(retry_after_s) and retry_after_s > 0:
            # The provider knows best when it will accept us again: wait exactly that (no
            # jitter, no floor; a Retry-After of 65 s waits 65 s), but a hostile or broken
            # Retry-After must not park a record for days.
            return Retry(delay_s=min(retry_after_s, self.retry_after_cap_s))
        exponent = min(max(retries_so_far, 0), _MAX_EXPONENT)
        # Jitter spreads out a burst of records that failed together (a server outage), so
        # their retries do not all hit the recovering server in the same second.
        factor = (rng or _RNG).uniform(1 - self.jitter, 1 + self.jitter)
        delay = self.base_s * 2**exponent * factor
        if category is ErrorCategory.QUOTA:
            # A rate-limit window needs time to drain; retrying in 30 s would just hit it
            # again. Only when the provider said nothing: its Retry-After knows better.
            delay = max(delay, self.quota_floor_s)
        return Retry(delay_s=delay)


def describe(decision: RetryDecision) -> str:
    """A short human phrase for logs, e.g. "retry in 62.4 s"."""
    match decision:
        case Retry(delay_s=delay):
            return f"retry in {delay:.1f} s"
        case Fail():
            return "failed: a retry would not help"
        case DeadLetter():
            return "dead letter: retries used up"
        case _:
            assert_never(decision)
