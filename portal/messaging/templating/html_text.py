"""A plain-text alternative of an HTML body (``html_to_text``), and the ``strip_html`` filter
templates get, both in linear time.

html.parser is quadratic on half-open markup ("<a<a<a..."), so the HTML, which is
tenant-made, is first cut into well-formed pieces in one linear pass."""

from __future__ import annotations

import re
from collections.abc import Iterator
from html.parser import HTMLParser

from liquid import Environment, Markup
from liquid.filter import with_environment

_SKIPPED = frozenset({"script", "style", "head", "title", "template"})
_PARAGRAPHS = frozenset(
    {"p", "h1", "h2", "h3", "h4", "h5", "h6", "blockquote", "pre", "table", "ul", "ol", "hr"}
)
_LINES = frozenset(
    {
        "address", "article", "aside", "dd", "div", "dl", "dt", "fieldset", "figcaption",
        "figure", "footer", "form", "header", "li", "main", "nav", "section", "tr",
    }
)  # fmt: skip
_WHITESPACE = re.compile(r"\s+")

# html.parser rescans to the end of the input from every "<" that does not finish a construct:
# "<a" repeated 80,000 times took 18 s, "<!--" repeated 80,000 times 42 s (Python 3.11). The
# HTML here is tenant-made, so it is first cut into pieces in one linear pass: text, comments
# (dropped), declarations (dropped), and tags that are complete with balanced quotes and no
# "<" outside their quoted values. What html.parser then sees always finishes what it starts.
_TAG = re.compile(r"""</?[A-Za-z][^<>'"]*(?:(?:"[^"]*"|'[^']*')[^<>'"]*)*>""")
_DECLARATION = re.compile(r"<[!?][^<>]*>")  # <!DOCTYPE ...>, <![CDATA[...]]>, <?xml ...?>
_TAG_NAME_OF = re.compile(r"</?([A-Za-z][^\s/>]*)")


def _html_pieces(html: str) -> Iterator[tuple[bool, str]]:
    """Split HTML into (is_tag, piece) in one pass; comments and declarations are left out."""
    pos = text_start = 0
    while (lt := html.find("<", pos)) >= 0:
        tag = None
        if html.startswith("<!--", lt):
            end = html.find("-->", lt + 4)
            resume = len(html) if end < 0 else end + 3  # an unclosed comment hides the rest
        elif match := _TAG.match(html, lt) or _DECLARATION.match(html, lt):
            resume = match.end()
            tag = match.group() if match.re is _TAG else None
        else:
            pos = lt + 1  # a "<" that starts nothing is text
            continue
        if lt > text_start:
            yield False, html[text_start:lt]
        if tag is not None:
            yield True, tag
        pos = text_start = resume
    if text_start < len(html):
        yield False, html[text_start:]


def _safe_html(html: str) -> str:
    """The same document with every stray "<" escaped and comments removed."""
    return "".join(
        piece if is_tag else piece.replace("<", "&lt;") for is_tag, piece in _html_pieces(html)
    )


@with_environment
def strip_html(value: object, *, environment: Environment) -> str:
    """python-liquid's strip_html (tags, comments, script and style removed), in linear time."""
    text = "" if value is None else str(value)
    kept: list[str] = []
    hidden = 0  # inside <script> or <style>
    for is_tag, piece in _html_pieces(text):
        if not is_tag:
            if not hidden:
                kept.append(piece)
            continue
        name = _TAG_NAME_OF.match(piece)
        if name and name.group(1).lower() in ("script", "style"):
            hidden = max(hidden + (-1 if piece.startswith("</") else 1), 0)
    stripped = "".join(kept)
    return Markup(stripped) if environment.autoescape and isinstance(value, Markup) else stripped


class _TextExtractor(HTMLParser):
    """Collects the visible text of an HTML document, with line breaks where blocks end."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self._pending = 0  # line breaks owed before the next text: 0, 1 or 2 (a blank line)
        self._skip_depth = 0
        self._links: list[tuple[str | None, int]] = []  # (href, index of the first part)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "body":
            self._skip_depth = 0  # a <head> whose end tag was left out must not hide the body
        if tag in _SKIPPED:
            self._skip_depth += 1
        if self._skip_depth:
            return
        if tag == "br":
            self._flush()
            self.parts.append("\n")
        elif tag in _PARAGRAPHS:
            self._break(2)
        elif tag in _LINES:
            self._break(1)
        elif tag in ("td", "th") and not self._pending:
            self.parts.append(" ")
        if tag == "li":
            self._flush()
            self.parts.append("- ")
        elif tag == "a":
            self._links.append((dict(attrs).get("href"), len(self.parts)))

    def handle_endtag(self, tag: str) -> None:
        if tag in _SKIPPED:
            self._skip_depth = max(self._skip_depth - 1, 0)
            return
        if self._skip_depth:
            return
        if tag == "a" and self._links:
            href, start = self._links.pop()
            self._end_link(href, start)
        elif tag in _PARAGRAPHS:
            self._break(2)
        elif tag in _LINES:
            self._break(1)

    def handle_data(self, data: str) -> None:
        if self._skip_depth:
            return
        text = _WHITESPACE.sub(" ", data)
        if text.strip():
            self._flush()
            self.parts.append(text)
        elif not self._pending:
            self.parts.append(" ")  # whitespace between inline elements still separates words

    def _break(self, lines: int) -> None:
        # Breaks are owed rather than written, so that nested or adjacent blocks
        # (</li><li>, </p><div>) give one break, not one per tag.
        self._pending = max(self._pending, lines)

    def _flush(self) -> None:
        if self._pending and self.parts:
            self.parts.append("\n" * self._pending)
        self._pending = 0

    def _end_link(self, href: str | None, start: int) -> None:
        url = (href or "").strip()
        if not url or url.startswith("#") or url.lower().startswith("javascript:"):
            return
        label = " ".join("".join(self.parts[start:]).split())
        shown = url.removeprefix("mailto:") if url.lower().startswith("mailto:") else url
        if not label:
            self._flush()
            self.parts.append(shown)
        elif label != shown:
            self.parts.append(f" ({shown})")


def html_to_text(html: str) -> str:
    """A plain-text alternative of an HTML body: visible text, links as "text (url)"."""
    parser = _TextExtractor()
    parser.feed(_safe_html(html))
    parser.close()
    lines = [" ".join(line.split()) for line in "".join(parser.parts).split("\n")]
    out: list[str] = []
    for line in lines:
        if line or (out and out[-1]):  # at most one blank line between paragraphs
            out.append(line)
    return "\n".join(out).strip()
