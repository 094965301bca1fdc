"""The one way a value reaches generated code: as a literal or as inert text, never pasted.

Every string that a user can influence (a model source name, a path, a flavor, a function or class name, a
--model-arg) and that ends up in a generated file goes through one of these:

- `py_str(value)`: a Python string literal (repr: quotes, backslashes, newlines escaped);
- `py_text(value)`: text for a docstring or a comment, where no escape sequence is read (printable, no
  quotes, backslashes or shell metacharacters; newlines become spaces);
- `shell_word(value)`: one shell word (shlex.quote: `$()`, backticks and quotes stay literal).

The templates put values only in these places; tests/test_faults_inject.py feeds quotes, newlines and `$()`
through every such field and checks that the generated files parse and run nothing.
"""

from __future__ import annotations

import shlex

_UNSAFE_IN_TEXT = frozenset("\"'`\\$")


def py_str(value: str) -> str:
    """`value` as a Python string literal that evaluates back to exactly `value`."""
    return repr(str(value))


def py_text(value: str) -> str:
    """`value` made inert inside a docstring, a comment or a shell comment: printable characters only,
    quotes, backslashes, backticks and `$` replaced by `_`, line breaks by spaces."""
    out = []
    for ch in str(value):
        if ch in "\r\n\t":
            out.append(" ")
        elif not ch.isprintable() or ch in _UNSAFE_IN_TEXT:
            out.append("_")
        else:
            out.append(ch)
    return "".join(out)


def shell_word(value: str) -> str:
    """`value` as one shell word that expands to exactly `value` (shlex.quote)."""
    return shlex.quote(str(value))
