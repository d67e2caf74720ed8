"""Render strings that come from files inert, one helper per output kind.

Tensor names, metadata values, file names, check names and serve commands are written by
whoever wrote the file; a CI job runs us on someone else's files. Every such string goes
through the helper of the output it lands in, so that it is shown, never obeyed:

============  ===========================================================================
``term``      terminal and CI logs: C0/C1 controls (ESC, BEL, CR, newline ...) and bidi
              overrides shown as ``\\x1b``-style escapes, ``::`` and ``##[`` broken (the
              GitHub runner reads a line starting with ``::`` after leading blanks, and
              ``##[`` *anywhere* in a line, as a workflow command). Wrap the result in
              ``rich.text.Text`` (:func:`text`): a ``str`` handed to rich is parsed as
              markup, so ``[/]`` crashes and ``[link=...]`` emits a hyperlink.
``json_log``  JSON printed to stdout (``--json -``): ``::`` and ``##[`` inside strings
              written as ``\\u003a`` / ``\\u0023``, the same data for a JSON parser.
``xml``       JUnit: drops what XML 1.0 cannot hold (ElementTree escapes ``<&>"`` itself but
              writes a raw ``\\x1b``, which makes the document unparseable).
``md``        GitHub Markdown (step summary): every ASCII punctuation character
              backslash-escaped (inert for Markdown, HTML *and* a shell that sources the
              file: ``;``, ``$``, backticks, ``&``, ``<``, ``>``, ``|``), no newline (a table
              row is one line), no controls.
``uri``       SARIF ``artifactLocation.uri``: percent-encoded, relative or ``file://``.
``html``      HTML text and attributes.
``mpl``       matplotlib text: ``$`` escaped so no mathtext is parsed, no controls.
``annotation_*``  GitHub workflow-command data and properties (percent-encoding).
============  ===========================================================================

This module imports nothing from the package so that every layer (errors included) can
use it.
"""

from __future__ import annotations

import html as _html
import re
import string
from pathlib import Path
from typing import Any
from urllib.parse import quote

# C0 (all of it, newline and tab included), DEL, C1, the Unicode bidi / line controls that
# reorder or split what a reader sees (CVE-2021-42574 "Trojan Source"), and lone surrogates
# (a file name's undecodable bytes): no output encoding can carry them, so printing one raised
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\u200e\u200f\u061c\ufeff"
                      "\ud800-\udfff]")
_JSON_RAW = re.compile("[\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\u200e\u200f\u061c\ufeff]")
_XML_BAD = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x84\x86-\x9f\ud800-\udfff\ufffe\uffff]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
_MD_PUNCT = frozenset(string.punctuation)  # CommonMark: any ASCII punctuation may be backslash-escaped
# the runner's two workflow-command syntaxes (actions/runner src/Runner.Common/ActionCommand.cs:
# TryParseV2 wants "::" after leading blanks, TryParse finds "##[" anywhere in the line);
# "#" is broken so that no "##[" survives, even where two escaped strings meet
_LEGACY = re.compile(r"#(?=#\[)|^#(?=\[)|(?<=#)#$")


def _show(m: re.Match[str]) -> str:
    c = m.group(0)
    return _NAMED.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")


def controls(s: Any) -> str:
    """``s`` with every control character shown as a backslash escape (``\\x1b``, ``\\n``)."""
    return _CONTROL.sub(_show, "" if s is None else str(s))


def term(s: Any, multiline: bool = False) -> str:
    """A string safe to print on a terminal or into a CI log, on one line.

    Controls are escaped (so no ESC sequence, no BEL, no line break), and every ``:`` that
    starts the string or touches another ``:`` becomes ``\\x3a``, so that no line — even one
    wrapped by the terminal renderer — can start with ``::`` and be taken as a workflow
    command by GitHub Actions. ``multiline`` keeps newlines (a finding message of ours
    may span lines); each line is then treated as a start.
    """
    if multiline:
        return "\n".join(term(line) for line in ("" if s is None else str(s)).split("\n"))
    t = controls(s)
    if ":" in t:
        t = re.sub(r"(?<=:):|:(?=:)|^:", "\\\\x3a", t)
    if "#" in t:
        t = _LEGACY.sub("\\\\x23", t)
    return t


def json_log(text: str) -> str:
    """Serialised JSON made inert for a CI log (``--json -``): the same data for any parser.

    A JSON document printed to stdout lands in the job log line by line; a string value
    holding ``::error::`` or ``##[set-output ...]`` would be a workflow command there. Both
    sequences can only occur inside JSON strings, where ``\\u003a``/``\\u0023`` decode to
    the same characters.
    """
    text = _JSON_RAW.sub(lambda m: f"\\u{ord(m.group(0)):04x}", text)  # DEL, C1, bidi: raw in JSON, not in a log
    return text.replace("::", ":\\u003a").replace("##[", "#\\u0023[")


def text(s: Any, style: str = "", multiline: bool = False) -> Any:
    """``rich.text.Text`` of :func:`term` (markup never parsed)."""
    from rich.text import Text

    return Text(term(s, multiline), style=style)


def xml(s: Any) -> str:
    """Text for an XML 1.0 attribute or element: characters XML cannot hold are escaped.

    Newlines and tabs stay (they are legal, and JUnit bodies are multi-line); ESC and the
    other C0 controls become ``\\x1b``-style escapes. ElementTree escapes markup.
    """
    return _XML_BAD.sub(_show, "" if s is None else str(s))


def md(s: Any, br: bool = False) -> str:
    """Inline Markdown for GitHub: markup inert, one line.

    Every ASCII punctuation character is backslash-escaped (CommonMark renders ``\\<`` as
    a literal ``<``, never a tag; ``\\|`` does not split a table cell; ``:`` so no
    autolink) and controls are shown escaped. HTML entities are not used: ``&lt;`` read by
    a shell is ``&`` (run in the background) followed by a command, while a shell reads
    ``\\;``, ``\\$``, ``\\```, ``\\&``, ``\\<`` as the plain characters, so a summary
    written where a shell sources it runs nothing a name spelled. Newlines become ``<br>``
    with ``br`` (a multi-line message in a table cell) and a space otherwise.
    """
    raw = "" if s is None else str(s)
    out = []
    for line in raw.split("\n"):
        out.append("".join("\\" + c if c in _MD_PUNCT else c for c in controls(line)))
    return ("<br>" if br else " ").join(out)


def md_code(s: Any) -> str:
    """A name shown as code in Markdown: ``<code>`` with escaped content (a backtick inside
    a code span cannot be escaped, so no code span is used)."""
    return f"<code>{md(s)}</code>"


def uri(path: str | Path, base: Path | None = None) -> str:
    """A SARIF ``artifactLocation.uri``: relative to ``base`` when inside it, else ``file://``.

    Percent-encoded (RFC 3986), so a name with spaces, ``#``, ``?``, ``%`` or controls is
    one well-formed URI that a viewer resolves to that file.
    """
    p = Path(str(path))
    if base is not None:
        try:
            rel = p.resolve().relative_to(base.resolve()).as_posix()
            return quote(rel, safe="/")
        except (ValueError, OSError):
            pass
    if p.is_absolute():
        return "file://" + quote(p.as_posix(), safe="/")
    return quote(p.as_posix(), safe="/")


def html(s: Any) -> str:
    """HTML text or attribute value: markup escaped (quotes too), controls shown escaped."""
    return _html.escape(controls(s), quote=True)


def mpl(s: Any) -> str:
    """matplotlib text: ``$`` escaped (no mathtext parsing of a name), controls shown escaped."""
    return controls(s).replace("$", r"\$")


def annotation_data(s: Any) -> str:
    """The message of a GitHub workflow command (after ``::``): newlines percent-encoded."""
    t = _CONTROL.sub(lambda m: m.group(0) if m.group(0) in "\n\r" else _show(m), "" if s is None else str(s))
    t = t.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")
    return _LEGACY.sub("%23", t) if "#" in t else t  # "##[" anywhere in the line is the runner's legacy syntax


def annotation_prop(s: Any) -> str:
    """A property value of a workflow command (``file=``, ``title=``): ``:`` and ``,`` too."""
    return annotation_data(s).replace(":", "%3A").replace(",", "%2C")

