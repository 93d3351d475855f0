"""What a name or path in a plan, a GPU catalog or a cluster file may hold: one line of printable text. Torch-free.

Such text reaches shell scripts (an sbatch script's comments and words), job folders, terminals and logs. A line
break would end a script comment and start a command; an escape sequence would rewrite a terminal; a bidirectional
override would make a path read as another (CVE-2021-42574, "Trojan Source"). So every character of Unicode's control
(Cc), format (Cf), surrogate (Cs) and line/paragraph separator (Zl, Zp) categories is refused, where the text is
read; what renders it still quotes it (llmctl.launch.shell), in case a value comes from elsewhere.
"""

from __future__ import annotations

import unicodedata

_REFUSED = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
_NAMES = {
    "\n": "a line break",
    "\r": "a carriage return",
    "\t": "a tab",
    "\x1b": "an escape, which starts a terminal control sequence",
    "\x7f": "a delete",
}


def refused_char(text: str) -> str | None:
    """The first character of `text` that a name or path may not hold, or None."""
    if text.isprintable():  # the common case, in C: printable excludes every refused category (and other spaces)
        return None
    return next((c for c in text if unicodedata.category(c) in _REFUSED), None)


def describe_char(c: str) -> str:
    """`U+000A (a line break)`: a character as an error line can show it."""
    name = _NAMES.get(c) or unicodedata.name(c, "").lower() or f"a {unicodedata.category(c)} character"
    return f"U+{ord(c):04X} ({name})"


def check_line(value: str, where: str = "") -> str:
    """`value` if it is one line of printable text; else ValueError naming the character (pydantic validators turn it
    into the plan's one error line)."""
    c = refused_char(value)
    if c is None:
        return value
    at = f"{where}: " if where else ""
    if c == "\x00":
        raise ValueError(f"{at}contains a NUL byte (\\x00), which no path or name can hold")
    raise ValueError(f"{at}contains {describe_char(c)}: a name or path is one line of printable text")
