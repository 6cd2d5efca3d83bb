"""Security headers: a CSP with no unsafe-inline or unsafe-eval, and the usual hardening."""

from __future__ import annotations

from urllib.parse import unquote, urlsplit

from flask import Flask, Response

CSP = "; ".join(
    [
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data:",
        "font-src 'self'",
        "connect-src 'self'",
        "frame-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    ]
)

# Rendered tenant HTML (previews, messages as sent): no scripts, no remote loads, inline
# styles allowed (mail HTML lives on them), shown only inside our own pages' iframes.
SANDBOX_CSP = (
    "default-src 'none'; style-src 'unsafe-inline'; img-src data:; font-src data:; "
    "frame-ancestors 'self'; sandbox"
)


def init_app(app: Flask) -> None:
    @app.after_request
    def _headers(response: Response) -> Response:
        response.headers.setdefault("Content-Security-Policy", CSP)
        response.headers.setdefault("X-Content-Type-Options", "nosniff")
        response.headers.setdefault("Referrer-Policy", "same-origin")
        response.headers.setdefault("Cross-Origin-Opener-Policy", "same-origin")
        if "frame-ancestors 'self'" not in response.headers["Content-Security-Policy"]:
            response.headers.setdefault("X-Frame-Options", "DENY")
        if response.mimetype == "text/html":
            response.headers.setdefault("Cache-Control", "no-store")
        return response


def sandboxed(response: Response) -> Response:
    """Mark a response of rendered tenant HTML as sandboxed."""
    response.headers["Content-Security-Policy"] = SANDBOX_CSP
    response.headers["X-Frame-Options"] = "SAMEORIGIN"
    return response


def safe_next(target: str | None, fallback: str) -> str:
    """The one check of a ``next`` URL (sign-in, the tenant switcher, the record pages).

    Only same-site relative paths pass. Browsers read a backslash as a slash and drop tabs and
    newlines, so a path with any of them could still leave the site ("/", tab, "/evil.example"
    becomes "//evil.example"): those are refused, encoded or not, as are "//host" and
    "scheme:" forms. Anything refused gives ``fallback``.
    """
    if not target or not target.startswith("/") or len(target) > 2048:
        return fallback
    for form in (target, unquote(target)):
        if "\\" in form or any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in form):
            return fallback
        if form.startswith("//"):
            return fallback
    parts = urlsplit(target)
    if parts.scheme or parts.netloc:
        return fallback
    return target
