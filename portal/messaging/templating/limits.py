"""How much one template may take (``TemplateLimits``), the limits this process renders with
(``configure``, ``configured_limits``), and the ceiling a template saved before them is held
to (``stored_ceiling``)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from liquid import Environment

if TYPE_CHECKING:
    from portal.config import Settings


@dataclass(frozen=True)
class TemplateLimits:
    """Resource limits for rendering one template; the defaults suit mail and SMS bodies."""

    source_max_chars: int = 50_000
    # Counted before parsing: with all of them at their limit, a 50,000-character
    # template parses in about 15 ms, where 200,000 characters of `assign` lines took 0.6 s.
    tags_max: int = 350  # {{ }} and {% %}, and each line of a {% liquid %} tag
    expression_tokens_max: int = 2_500  # names, path segments, values and operators in all
    path_segments_max: int = 32  # in one variable path: a.b[0].c is 4
    nesting_max: int = 20  # blocks inside blocks, or parentheses inside parentheses
    variables_max_bytes: int = 64 * 1024  # JSON-encoded, UTF-8
    variables_max_depth: int = 32
    loop_iterations: int = 10_000  # per loop nest (python-liquid's own limit)
    total_iterations: int = 10_000  # across the whole render (python-liquid: per loop nest)
    # A little over the default mail body limit (1 MiB), so that an over-long render is
    # reported by the content check as CONTENT_INVALID rather than as a template failure.
    output_max_chars: int = 1_100_000
    work_max_chars: int = 10_000_000  # everything written or built by filters, in total
    list_max_items: int = 100_000
    namespace_max_bytes: int = 4_400_000  # assigned variables, by sys.getsizeof
    context_depth: int = 30
    int_max_bits: int = 256
    render_timeout_s: float = 0.25

    @classmethod
    def from_settings(cls, settings: Settings) -> TemplateLimits:
        """Limits that follow the settings for template size, variables and body length."""
        output = max(settings.mail_body_max_chars + settings.mail_body_max_chars // 20, 1)
        return cls(
            source_max_chars=settings.template_max_chars,
            variables_max_bytes=settings.variables_max_bytes,
            output_max_chars=output,
            work_max_chars=max(10 * output, cls.work_max_chars),
            namespace_max_bytes=4 * output,
        )


DEFAULT_LIMITS = TemplateLimits()
_configured: list[TemplateLimits] = []


def configure(settings: Settings) -> None:
    """Use limits that follow the settings in this process (create_app calls this)."""
    _configured[:] = [TemplateLimits.from_settings(settings)]


def configured_limits() -> TemplateLimits:
    """The limits set by ``configure``, or the defaults before it is called."""
    return _configured[0] if _configured else DEFAULT_LIMITS


def stored_ceiling(limits: TemplateLimits) -> TemplateLimits:
    """What a saved template may reach at send time: one saved before the limits (or before
    they were lowered) keeps working while within twice them, and the old 200,000 characters,
    which still parses well inside the render deadline; beyond that it fails before parsing."""
    return replace(
        limits,
        source_max_chars=max(2 * limits.source_max_chars, 200_000),
        tags_max=2 * limits.tags_max,
        expression_tokens_max=2 * limits.expression_tokens_max,
        path_segments_max=2 * limits.path_segments_max,
        nesting_max=min(2 * limits.nesting_max, Environment.block_nesting_limit),
    )
