"""A conservative check for catastrophic-backtracking shapes in tokenizer.json regexes.

`tokenizers` runs Split/Replace patterns with Oniguruma, a backtracking engine. A repeated group
whose body can match the same text in more than one way (`(a+)+`, `(\\w+\\s?)+`, `((a)+)+`,
`(?:a|a)+`) takes exponential time; Oniguruma's retry limit then panics inside Rust. Real
pre-tokenizers (GPT-2, Llama 3, Qwen, ...) never repeat such a group, so refusing the shape
costs nothing. A group is *repeated* when followed by `+`, `*`, `{n,}` or `{n,m}` with m > 1;
its body is *ambiguous* when it holds any quantifier (`?` included), or an alternation whose
branches are not distinct plain literals (no branch a prefix of another).
"""

from __future__ import annotations

import re

__all__ = ["nested_quantifier"]

_COUNTED = re.compile(r"\{(\d*)(,?)(\d*)\}")
_GROUP_HEAD = re.compile(r"\?(?:P?<[A-Za-z_]\w*>|'[A-Za-z_]\w*'|[=!:>]|<[=!]|[imsx-]*:?)")
_PLAIN_ESCAPES = frozenset("rntfv\\.-/()[]{}|*+?^$'\" ")


class _Group:
    __slots__ = ("start", "quantified", "branches", "current")

    def __init__(self, start: int) -> None:
        self.start = start
        self.quantified = False  # the body holds a quantifier (nested groups included)
        self.branches: list[str | None] = []  # None: a branch that is not a plain literal
        self.current: str | None = ""

    def end_branch(self) -> None:
        self.branches.append(self.current)
        self.current = ""

    def add_literal(self, text: str) -> None:
        if self.current is not None:
            self.current += text

    def spoil(self) -> None:
        self.current = None

    def ambiguous(self) -> bool:
        if self.quantified:
            return True
        if len(self.branches) < 2:
            return False
        if any(b is None for b in self.branches):
            return True
        lits = [str(b) for b in self.branches]
        return any(
            i != j and b.startswith(a) for i, a in enumerate(lits) for j, b in enumerate(lits)
        )


def _quantifier_at(p: str, i: int) -> tuple[int, bool] | None:
    """(length, repeats) of a quantifier starting at p[i], or None."""
    if i >= len(p):
        return None
    c = p[i]
    if c in "+*":
        return 1, True
    if c == "?":
        return 1, False
    m = _COUNTED.match(p, i) if c == "{" else None
    if m and (m.group(1) or m.group(3)):
        lo, comma, hi = m.groups()
        top = hi if comma else lo
        return m.end() - i, not top or int(top) > 1
    return None


def _skip_class(p: str, i: int) -> int:
    """Index after the character class opening at p[i] (nested Oniguruma classes allowed)."""
    depth, i = 1, i + 1
    if i < len(p) and p[i] == "^":
        i += 1
    if i < len(p) and p[i] == "]":
        i += 1
    while i < len(p) and depth:
        if p[i] == "\\":
            i += 2
            continue
        depth += {"[": 1, "]": -1}.get(p[i], 0)
        i += 1
    return i


def _skip_escape(p: str, i: int) -> tuple[int, str | None]:
    """Index after the escape at p[i] and its literal text (None if it is a class or anchor)."""
    c = p[i + 1] if i + 1 < len(p) else ""
    if c in "pPxkgu" and i + 2 < len(p) and p[i + 2] in "{<'":
        close = {"{": "}", "<": ">", "'": "'"}[p[i + 2]]
        end = p.find(close, i + 3)
        return (len(p) if end < 0 else end + 1), None
    if c in _PLAIN_ESCAPES:
        return i + 2, "\\" + c
    return i + 2, None


def nested_quantifier(pattern: str) -> bool:
    """True when ``pattern`` repeats a group whose body is ambiguous (see the module doc)."""
    stack = [_Group(0)]
    i = 0
    while i < len(pattern):
        c = pattern[i]
        top = stack[-1]
        if c == "\\":
            i, lit = _skip_escape(pattern, i)
            top.add_literal(lit) if lit is not None else top.spoil()
            continue
        if c == "[":
            i = _skip_class(pattern, i)
            top.spoil()
        elif c == "(":
            stack.append(_Group(i))
            i += 1
            if pattern.startswith("?", i):  # (?:  (?i:  (?=  (?<name> ...: skip the header
                m = _GROUP_HEAD.match(pattern, i)
                i = m.end() if m else i + 1
            continue
        elif c == ")" and len(stack) > 1:
            group = stack.pop()
            group.end_branch()
            q = _quantifier_at(pattern, i + 1)
            if q is not None and q[1] and group.ambiguous():
                return True
            stack[-1].spoil()
            stack[-1].quantified |= group.quantified or q is not None
            i += 1 + (q[0] if q else 0)
            continue
        elif c == "|":
            top.end_branch()
            i += 1
            continue
        elif (q := _quantifier_at(pattern, i)) is not None:
            top.quantified = True
            top.spoil()
            i += q[0]
            if i < len(pattern) and pattern[i] in "?+":  # lazy / possessive suffix
                i += 1
            continue
        elif c in ".^$":
            top.spoil()
        else:
            top.add_literal(c)
        i += 1
    return False
