"""Tolerance patterns matched in time linear in the name: no regex can hang a compare.

A tolerance rule (``--tolerance REGEX=FLOOR``, a gate config's ``tolerance``) comes from
the user or from a repository under test, and the names it is matched against come from
dump files. Python's ``re`` backtracks: ``(a+)+$`` against 35 ``a`` and a ``!`` takes
longer than a CI job lives. Patterns are therefore parsed once by Python's own regex
parser (so the syntax is exactly ``re``'s) and

* matched by ``re`` itself when at most one part of the pattern repeats with a variable
  count (then backtracking is bounded by pattern length x name length), else
* compiled to a Thompson NFA and run as a Pike VM: every position of the name is visited
  once with the set of live states, so the cost is O(pattern x name) whatever the pattern.

What a linear matcher cannot do is refused when the rule is parsed, in one line:
backreferences, lookarounds, conditionals, and patterns over 1,024 characters or whose
counted repeats expand past 20,000 states.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from functools import lru_cache

if sys.version_info >= (3, 11):
    import re._constants as C  # noqa: N812 - the regex opcodes
    import re._parser as P  # noqa: N812
else:  # pragma: no cover - Python 3.10
    import sre_constants as C  # noqa: N812
    import sre_parse as P  # noqa: N812

MAX_PATTERN_CHARS = 1024
MAX_STATES = 20_000

_CATEGORY: dict[object, Callable[[str], bool]] = {
    C.CATEGORY_DIGIT: str.isdecimal, C.CATEGORY_NOT_DIGIT: lambda c: not c.isdecimal(),
    C.CATEGORY_SPACE: str.isspace, C.CATEGORY_NOT_SPACE: lambda c: not c.isspace(),
    C.CATEGORY_WORD: lambda c: c.isalnum() or c == "_", C.CATEGORY_NOT_WORD: lambda c: not (c.isalnum() or c == "_"),
}
_REPEATS = {C.MAX_REPEAT, C.MIN_REPEAT} | ({C.POSSESSIVE_REPEAT} if hasattr(C, "POSSESSIVE_REPEAT") else set())
_UNSUPPORTED = {C.GROUPREF: "a backreference", C.GROUPREF_EXISTS: "a conditional group", C.ASSERT: "a lookaround",
                C.ASSERT_NOT: "a lookaround"}


class PatternError(ValueError):
    """A pattern a tolerance rule cannot use (the message says why, in one line)."""


def _is_word(c: str) -> bool:
    return c.isalnum() or c == "_"


class _Prog:
    """Instructions: ("char", test) | ("split", a, b) | ("jmp", a) | ("at", kind) | ("match",)."""

    def __init__(self, ignorecase: bool) -> None:
        self.code: list[list[object]] = []
        self.icase = ignorecase
        self.variable_repeats = 0
        self.in_repeat = 0
        self.branch_in_repeat = False  # (a|a)* backtracks exponentially with a single repeat

    def emit(self, *ins: object) -> int:
        if len(self.code) >= MAX_STATES:
            raise PatternError(f"expands past {MAX_STATES} states (counted repeats too large)")
        self.code.append(list(ins))
        return len(self.code) - 1

    def char(self, test: Callable[[str], bool], negate: bool = False) -> None:
        """A one-character test; ``negate`` applies after case folding (``(?i)[^a]`` refuses A too)."""
        if self.icase:
            base = test
            test = lambda c: base(c) or base(c.lower()) or base(c.upper())  # noqa: E731
        if negate:
            pos = test
            test = lambda c: not pos(c)  # noqa: E731
        self.emit("char", test)

    def seq(self, items: P.SubPattern | list) -> None:
        for op, av in items:
            self.item(op, av)

    def item(self, op: object, av: object) -> None:  # noqa: C901 - one branch per opcode
        if op in _UNSUPPORTED:
            raise PatternError(f"holds {_UNSUPPORTED[op]}, which a linear-time matcher cannot evaluate")
        if op is C.LITERAL:
            ch = chr(av)  # type: ignore[arg-type]
            self.char(lambda c, ch=ch: c == ch)
        elif op is C.NOT_LITERAL:
            ch = chr(av)  # type: ignore[arg-type]
            self.char(lambda c, ch=ch: c == ch, negate=True)
        elif op is C.ANY:
            self.char(lambda c: c != "\n")
        elif op is C.IN:
            self.char(*_charset(av))  # type: ignore[arg-type]
        elif op is C.CATEGORY:
            self.char(_CATEGORY[av])
        elif op is C.AT:
            self.emit("at", av)
        elif op is C.SUBPATTERN:
            _group, add, _del, sub = av  # type: ignore[misc]
            if add & re.IGNORECASE and not self.icase:
                self.icase = True
                self.seq(sub)
                self.icase = False
            else:
                self.seq(sub)
        elif getattr(C, "ATOMIC_GROUP", None) is not None and op is C.ATOMIC_GROUP:
            self.seq(av)  # type: ignore[arg-type]  # same language; only backtracking differs
        elif op is C.BRANCH:
            self.branch(av[1])  # type: ignore[index]
        elif op in _REPEATS:
            lo, hi, sub = av  # type: ignore[misc]
            self.repeat(lo, hi, sub)
        else:
            raise PatternError(f"uses {op}, which tolerance patterns do not support")

    def branch(self, alts: list) -> None:
        self.branch_in_repeat |= self.in_repeat > 0
        jumps = []
        for k, alt in enumerate(alts):
            if k < len(alts) - 1:
                split = self.emit("split", 0, 0)
                self.code[split][1] = len(self.code)
                self.seq(alt)
                jumps.append(self.emit("jmp", 0))
                self.code[split][2] = len(self.code)
            else:
                self.seq(alt)
        for j in jumps:
            self.code[j][1] = len(self.code)

    def repeat(self, lo: int, hi: int, sub: P.SubPattern) -> None:
        self.in_repeat += 1
        try:
            self._repeat(lo, hi, sub)
        finally:
            self.in_repeat -= 1

    def _repeat(self, lo: int, hi: int, sub: P.SubPattern) -> None:
        for _ in range(lo):
            self.seq(sub)
        if hi == C.MAXREPEAT:
            self.variable_repeats += 1
            split = self.emit("split", 0, 0)
            self.code[split][1] = len(self.code)
            self.seq(sub)
            self.emit("jmp", split)
            self.code[split][2] = len(self.code)
            return
        if hi > lo:
            self.variable_repeats += 1
        ends = []
        for _ in range(hi - lo):
            ends.append(self.emit("split", 0, 0))
            self.code[ends[-1]][1] = len(self.code)
            self.seq(sub)
        for s in ends:
            self.code[s][2] = len(self.code)


def _charset(items: list) -> tuple[Callable[[str], bool], bool]:
    """(the class's positive test, whether it is negated)."""
    tests: list[Callable[[str], bool]] = []
    negate = False
    for op, av in items:
        if op is C.NEGATE:
            negate = True
        elif op is C.LITERAL:
            tests.append(lambda c, ch=chr(av): c == ch)
        elif op is C.RANGE:
            lo, hi = av
            tests.append(lambda c, lo=lo, hi=hi: lo <= ord(c) <= hi)
        elif op is C.CATEGORY:
            tests.append(_CATEGORY[av])
        elif op is C.NOT_LITERAL:
            tests.append(lambda c, ch=chr(av): c != ch)
        else:
            raise PatternError(f"uses {op} inside a character class, which tolerance patterns do not support")
    return (lambda c: any(t(c) for t in tests)), negate


def _at(kind: object, s: str, i: int) -> bool:
    if kind in (C.AT_BEGINNING, C.AT_BEGINNING_STRING):
        return i == 0
    if kind in (C.AT_END, C.AT_END_STRING):
        return i == len(s)
    if kind in (C.AT_BOUNDARY, C.AT_NON_BOUNDARY):
        left = i > 0 and _is_word(s[i - 1])
        right = i < len(s) and _is_word(s[i])
        return (left != right) == (kind is C.AT_BOUNDARY)
    return False


class SafePattern:
    """``fullmatch`` of a tolerance pattern, never slower than O(pattern x name)."""

    def __init__(self, pattern: str) -> None:
        if len(pattern) > MAX_PATTERN_CHARS:
            raise PatternError(f"is {len(pattern)} characters, over the {MAX_PATTERN_CHARS}-character bound")
        try:
            self.regex = re.compile(pattern)
            tree = P.parse(pattern)
        except re.error as exc:
            raise PatternError(f"is not a regular expression: {exc}") from None
        except RecursionError:
            raise PatternError("is nested too deeply") from None
        prog = _Prog(bool(self.regex.flags & re.IGNORECASE))
        try:
            prog.seq(tree)
        except RecursionError:
            raise PatternError("is nested too deeply") from None
        prog.emit("match")
        self.pattern = pattern
        self.code = prog.code
        # re's own backtracking is bounded by pattern x name with one variable repeat and no
        # alternation under a repeat; everything else runs on the NFA
        self.backtrack_safe = prog.variable_repeats <= 1 and not prog.branch_in_repeat

    def fullmatch(self, s: str) -> bool:
        if self.backtrack_safe:
            return self.regex.fullmatch(s) is not None
        return self._pike(s)

    def _pike(self, s: str) -> bool:
        code = self.code
        current = self._closure([0], s, 0)
        for i, c in enumerate(s):
            nxt = [pc + 1 for pc in current if code[pc][0] == "char" and code[pc][1](c)]  # type: ignore[operator]
            if not nxt:
                return False
            current = self._closure(nxt, s, i + 1)
        return any(code[pc][0] == "match" for pc in current)

    def _closure(self, starts: list[int], s: str, i: int) -> list[int]:
        """The states reachable from ``starts`` without consuming a character, at position i."""
        code, seen, out, stack = self.code, set(), [], list(reversed(starts))
        while stack:
            pc = stack.pop()
            if pc in seen:
                continue
            seen.add(pc)
            ins = code[pc]
            op = ins[0]
            if op == "jmp":
                stack.append(ins[1])  # type: ignore[arg-type]
            elif op == "split":
                stack += [ins[2], ins[1]]  # type: ignore[list-item]
            elif op == "at":
                if _at(ins[1], s, i):
                    stack.append(pc + 1)
            else:
                out.append(pc)
        return out


@lru_cache(maxsize=256)
def compile_pattern(pattern: str) -> SafePattern:
    return SafePattern(pattern)
