"""How much of each sweep a run makes: in full for ``make test``, a share for ``make check``.

A sweep is a test that tries many generated or listed inputs against one rule (Hypothesis
examples, schemathesis cases, every typed string in every filter as every role). ``make test``
(CI) runs every sweep in full. ``make check``, the command a developer runs after every change,
sets ``POSTROOM_SWEEPS=quick``: every test still runs and asserts the same, on fewer generated
examples, and a listed sweep split over its parametrised runs covers each input once instead of
once per run. Nothing else changes between the two.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")

QUICK = os.environ.get("POSTROOM_SWEEPS", "full") == "quick"

# Hypothesis examples kept by a quick run: a fifth, and never fewer than this.
QUICK_SHARE = 5
QUICK_FLOOR = 10


def examples(full: int) -> int:
    """``max_examples`` for a Hypothesis test that makes ``full`` examples in a full run."""
    if not QUICK:
        return full
    return min(full, max(QUICK_FLOOR, full // QUICK_SHARE))


def share(items: Sequence[T], index: int, of: int) -> list[T]:
    """The items run ``index`` of ``of`` parametrised runs tries.

    Every item in a full run; in a quick run, every ``of``-th item starting at ``index``, so
    the ``of`` runs together still try each item once.
    """
    if not QUICK:
        return list(items)
    return [item for position, item in enumerate(items) if position % of == index]
