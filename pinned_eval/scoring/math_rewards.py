"""miles' math rm types: `math`, `deepscaler`, `gemma_math` (and `boxed_math`), 1.0 / 0.0.

An answer is the content of the response's last `\\boxed{}` (`answers.last_boxed`); a response
without one scores 0.0, as does an empty label (miles: `not label`). A label is compared as
`str(label)`; a label that itself holds a `\\boxed{}` is reduced to its content.

`grade(given, truth)` is true when either
1. the two strings are equal after `mathd_normalize` (Hendrycks' MATH normalisation: `\\dfrac`,
   `\\left`, degrees, `\\$`, `%`, a `\\text{ unit}` tail, `k = ` prefixes, `\\sqrt3`, `\\frac12`,
   `a/b` for integers, `0.5` == `\\frac{1}{2}`), or
2. they are equal after `sympy_normalize` (text unwrapped, units/`%`/`$` dropped, integers
   canonical, LaTeX rendered to text by pylatexenc, lower case) or, element by element for tuples
   and intervals with the same brackets, symbolically equal: sympy simplifies `(truth)-(given)` to
   0. Not symbolic: two fractions `a/b` must be equal strings (an unreduced fraction is wrong), an
   integer only matches an integer, and an expression with more than two distinct letters or a
   power like `^{` is never evaluated.

- `math`: grade the response's answer.
- `deepscaler`: grade only the text after the last `</think>`, else the text between the first
  and second `###Response`; a response with neither scores 0.0.
- `gemma_math`: grade only the text after the last `<channel|>` (the whole response without one).
- `boxed_math`: pinned-eval grades the last box like `math`. miles' `boxed_` prefix hands the box's
  *content* to `math`, which then finds no box and scores 0.0 on every row: a documented divergence
  (docs/rewards.md), warned about when a config using it loads.

Safety: the sympy path parses model output only under the letter/power limits above (which miles
has too), so no name longer than two letters reaches `parse_expr`; pinned-eval also never
evaluates a literal `**` (a tower like `9**9**9` would hang the scorer; miles would hang).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from tokenize import TokenError
from typing import Any

import sympy
from pylatexenc.latex2text import LatexNodes2Text
from sympy.core.sympify import SympifyError
from sympy.parsing import sympy_parser

from pinned_eval.scoring.answers import Label, last_boxed

# ---------------------------------------------------------------------------- MATH normalisation


def _braced_fracs(s: str) -> str:
    """`\\frac12` -> `\\frac{1}{2}`, `\\frac1{72}` -> `\\frac{1}{72}`; a `\\frac` with fewer than two
    characters after it leaves the whole string unchanged; an empty one raises IndexError."""
    head, *parts = s.split("\\frac")
    out = head
    for part in parts:
        out += "\\frac"
        if part[0] == "{":
            out += part
            continue
        if len(part) < 2:
            return s
        a, b, rest = part[0], part[1], part[2:]
        out += "{" + a + "}" + (b + rest if b == "{" else "{" + b + "}" + rest)
    return out


def _int_slash_int(s: str) -> str:
    """`3/4` (two plain integers, nothing else) -> `\\frac{3}{4}`."""
    parts = s.split("/")
    if len(parts) == 2 and re.fullmatch(r"-?\d+", parts[0]) and re.fullmatch(r"-?\d+", parts[1]):
        a, b = int(parts[0]), int(parts[1])
        if s == f"{a}/{b}":
            return "\\frac{" + str(a) + "}{" + str(b) + "}"
    return s


def _braced_sqrts(s: str) -> str:
    """`\\sqrt3` -> `\\sqrt{3}`; an empty `\\sqrt` at the end raises IndexError."""
    head, *parts = s.split("\\sqrt")
    return head + "".join("\\sqrt" + (p if p[0] == "{" else "{" + p[0] + "}" + p[1:]) for p in parts)


class _Unnormalisable(Exception):
    """The MATH normaliser gives up: the (text-unwrapped) answer is compared as it is."""


def _strip(s: str) -> str:
    for old, new in (("\n", ""), ("\\!", ""), ("\\\\", "\\"), ("tfrac", "frac"), ("dfrac", "frac"),
                     ("\\left", ""), ("\\right", ""), ("^{\\circ}", ""), ("^\\circ", ""), ("\\$", "")):
        s = s.replace(old, new)
    if "\\text{ " in s:  # a unit on the right
        head, *tails = s.split("\\text{ ")
        if len(tails) != 1:
            raise _Unnormalisable
        s = head
    s = s.replace("\\%", "").replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:
        s = sides[1]
    try:
        s = _braced_fracs(_braced_sqrts(s).replace(" ", ""))
    except IndexError as exc:
        raise _Unnormalisable from exc
    return _int_slash_int("\\frac{1}{2}" if s == "0.5" else s)


def mathd_normalize(answer: str) -> str:
    """Hendrycks' MATH normalisation (see the module docstring); a lone `\\text{...}` is unwrapped."""
    answer = answer.strip()
    m = re.search(r"^\\text\{(?P<text>.+?)\}$", answer)
    if m is not None:
        answer = m.group("text").strip()
    try:
        return _strip(answer)
    except _Unnormalisable:
        return answer


# ---------------------------------------------------------------------------- sympy normalisation

_UNITS = ("degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day", "week",
          "month", "year", "foot", "feet", "inch", "yard")
_LATEX_SYMBOLS = (("√", "sqrt"), ("π", "pi"), ("∞", "inf"), ("∪", "U"), ("·", "*"), ("×", "*"))
_THOUSANDS_COMMA = re.compile(r"(\d)(,)(\d\d\d)($|\D)")
_BRACKETS = "()[]"


def _float_or_none(s: str) -> float | None:
    try:
        return float(s)
    except ValueError:
        return None


def _near_int(x: float) -> bool:
    return x == x and abs(x) != float("inf") and abs(x - round(x)) <= 1e-7


def _drop_thousands_commas(s: str) -> str:
    while (nxt := _THOUSANDS_COMMA.sub(r"\1\3\4", s)) != s:
        s = nxt
    return s


def _int_string(s: str) -> bool:
    x = _float_or_none(_drop_thousands_commas(s))
    return x is not None and _near_int(x)


def _latex_to_text(expr: str) -> str:
    expr = expr.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac").replace("\\frac", " \\frac")
    expr = LatexNodes2Text().latex_to_text(expr)
    for old, new in _LATEX_SYMBOLS:
        expr = expr.replace(old, new)
    return expr.strip()


def sympy_normalize(expr: str) -> str:
    """PRM800K-style normalisation ahead of the symbolic comparison (see the module docstring)."""
    m = re.search(r"^\\text\{(?P<text>.+?)\}$", expr)
    if m is not None:
        expr = m.group("text")
    for old, new in (("\\%", "%"), ("\\$", "$"), ("$", ""), ("%", ""), (" or ", " , "), (" and ", " , "),
                     ("million", "*10^6"), ("billion", "*10^9"), ("trillion", "*10^12")):
        expr = expr.replace(old, new)
    for unit in _UNITS:
        expr = re.sub(f"{unit}(es)?(s)? *(\\^[0-9]+)?", "", expr)
    expr = re.sub(r"\^ *\\circ", "", expr)
    if expr[:1] == "{" and expr[-1:] == "}":
        expr = expr[1:-1]
    expr = re.sub(r",\\! *", "", expr)
    x = _float_or_none(expr)
    if x is not None and _near_int(x):
        expr = str(round(x))
    if "\\" in expr:
        expr = _latex_to_text(expr)
    expr = re.sub("- *", "-", expr)
    expr = re.sub("([0-9]) +([0-9])", r"\1+\2", expr)  # a mixed number: 7 3/4 -> 7+3/4
    expr = expr.replace(" ", "").replace("{", "").replace("}", "").lower()
    if _int_string(expr):
        expr = str(int(float(expr.replace(",", ""))))
    return expr


def _evaluable(expr: str) -> bool:
    letters = {c for c in expr.replace("sqrt", "").replace("frac", "") if c.isalpha()}
    if len(letters) > 2 or "^{" in expr or "^(" in expr:
        return False
    if "**" in expr:  # pinned-eval's guard: `9**9**9` would hang the scorer (miles has none)
        return False
    return re.search(r"\^[0-9]+\^|\^[0-9][0-9]+", expr) is None


_TRANSFORMS = (*sympy_parser.standard_transformations, sympy_parser.implicit_multiplication_application)
# what parsing/simplifying model output may raise: each means "not shown equal"
_SYMPY_FAILURES = (SympifyError, SyntaxError, TokenError, TypeError, ValueError, AttributeError,
                   NameError, ZeroDivisionError, OverflowError, RecursionError, IndexError, KeyError)


def symbolically_equal(truth: str, given: str) -> bool:
    """True when sympy simplifies `(truth)-(given)` to 0 (only for `_evaluable` expressions)."""
    expr = f"({truth})-({given})"
    if not _evaluable(expr):
        return False
    try:
        return bool(sympy.simplify(sympy_parser.parse_expr(expr.replace("^", "**"), transformations=_TRANSFORMS)) == 0)
    except _SYMPY_FAILURES:
        return False


def _elements(expr: str) -> list[str]:
    """The elements of a tuple/interval `(a,b)` / `[a,b)`, else `[expr]` (thousands commas kept)."""
    expr = _drop_thousands_commas(expr)
    if not expr:
        return []
    if len(expr) > 2 and expr[0] in _BRACKETS and expr[-1] in _BRACKETS and not any(c in expr[1:-1] for c in _BRACKETS):
        return [e.strip() for e in expr[1:-1].split(",")]
    return [expr]


def _fraction(expr: str) -> bool:
    return re.search(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$", expr) is not None


def _elements_equal(truth: str, given: str) -> bool:
    if _fraction(truth) and _fraction(given):
        return truth == given  # unreduced fractions are not accepted
    if _int_string(truth) != _int_string(given):
        return False
    return symbolically_equal(truth, given)


def grade(given: str, truth: str) -> bool:
    """See the module docstring."""
    if mathd_normalize(given) == mathd_normalize(truth):
        return True
    t, g = sympy_normalize(truth), sympy_normalize(given)
    if t == g:
        return True
    if not g:
        return False
    t_elems, g_elems = _elements(t), _elements(g)
    if len(t_elems) > 1 and (t[0] != g[0] or t[-1] != g[-1]):
        return False
    if len(t_elems) != len(g_elems):
        return False
    return all(_elements_equal(a, b) for a, b in zip(t_elems, g_elems, strict=True))


# ---------------------------------------------------------------------------- rm types


def _truth(label: Label) -> str | None:
    text = str(label)
    return last_boxed(text) if "\\boxed" in text else text


def math_answer(response: str, label: Label, metadata: Mapping[str, Any] | None = None) -> float:
    """miles' `math`: 1.0 iff the last box of the response grades equal to the label."""
    if not label:
        return 0.0
    truth, given = _truth(label), last_boxed(response)
    if given is None or truth is None:
        return 0.0
    return 1.0 if grade(given, truth) else 0.0


def deepscaler(response: str, label: Label, metadata: Mapping[str, Any] | None = None) -> float:
    """miles' `deepscaler`: grade the text after the last `</think>` (else after `###Response`)."""
    if "</think>" in response:
        solution = response.split("</think>")[-1]
    elif "###Response" in response:
        solution = response.split("###Response")[1]
    else:
        return 0.0
    given = last_boxed(solution)
    if given is None or label == "":
        return 0.0
    truth = _truth(label)
    return 1.0 if truth is not None and grade(given, truth) else 0.0


def gemma_math(response: str, label: Label, metadata: Mapping[str, Any] | None = None) -> float:
    """miles' `gemma_math`: grade the text after the last `<channel|>` (the whole response without one)."""
    return math_answer(response.split("<channel|>")[-1], label, metadata)


def boxed_math(response: str, label: Label, metadata: Mapping[str, Any] | None = None) -> float:
    """pinned-eval's `boxed_math`: the same grade as `math` (miles scores 0.0: see the module docstring)."""
    return math_answer(response, label, metadata)
