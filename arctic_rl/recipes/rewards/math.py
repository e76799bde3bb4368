"""Math answer rewards: pull the final answer out of a completion (``\\boxed{}``, ``#### n``, "the
answer is n", else the last number) and compare it with the gold answer as an exact rational number.

Numbers are read with thousands separators (``1,234``), signs, decimals, percent and dollar signs,
scientific notation as Python reads it (``12e3`` is 12000, ``2.5E-1`` is 1/4), ``a/b`` and
``\\frac{a}{b}`` fractions, so ``$1,200.00``, ``1200`` and ``\\boxed{1200}`` all match.

Bounds, so that no completion can fool or stall the reward:

- linear time in the completion's length: every pattern allows at most one space between a sign and
  its digits and has no nested unbounded repeats (a run of 80k spaces costs one pass, not 80k);
- a number of more than ``MAX_DIGITS`` (4,300, Python's int-string conversion limit,
  ``sys.get_int_max_str_digits()``) significant digits, or with an exponent beyond ±4,300, is not
  read as an answer: ``1e999999`` never equals a gold answer and never builds a huge integer. A gold
  answer past the limit is a ``ValueError`` that names it.
- the recipes run it per sample in worker processes under a time limit (``rewards/pool.py``).

Why not ``math-verify`` (the parser TRL and open-r1 use)? Tried (0.9.0, 2026-12-01): it reads
``12e3`` as 12 and "The answer is 1e999999" as 1, the two answers this reward must refuse; its time
limit is ``signal.alarm`` (main thread only, and it replaces the process's SIGALRM handler), while
rollouts here may be scored on a background thread; and it adds sympy, ``latex2sympy2_extended``
(pinned ``==1.11.0``) and an ANTLR runtime for GSM8K's integer answers. Symbolic answers (MATH,
AIME) would be a reason to add it, behind an extra and inside the same worker pool.
"""

from __future__ import annotations

import re
from fractions import Fraction

MAX_DIGITS = 4300  # Python's default int-string conversion limit (sys.get_int_max_str_digits())
_EXPONENT = r"(?:[eE][+-]?\d+)?"
_NUMBER = re.compile(  # one whitespace at most between a sign and its digits, so runs of spaces cost one pass
    r"-?\s?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?" + _EXPONENT + r"(?:\s*/\s*\d+)?"  # 1,234.5  12e3  3/4
    r"|-?\.\d+" + _EXPONENT  # .5
)
_FRAC = re.compile(r"^(-?)\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}$")
_ANSWER_IS = re.compile(r"answer\s+is\s*:?\s*([^\n]*)", re.IGNORECASE)
_DECIMAL = re.compile(r"(-?)(\d*)(?:\.(\d*))?(?:e([+-]?\d+))?", re.IGNORECASE)


def last_boxed(text: str) -> str | None:
    """Contents of the last ``\\boxed{...}`` (or ``\\fbox{...}``), nested braces balanced; None if absent."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, j = 1, i
    while j < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        j += 1
    return text[i : j - 1] if depth == 0 else None


def parse_number(text: str) -> Fraction | None:
    """The one number ``text`` spells (``"$1,234.50"``, ``"-3/4"``, ``"\\frac{1}{2}"``, ``"25%"`` -> 25,
    ``"12e3"`` -> 12000), or None when it holds no number, more than one, or one past ``MAX_DIGITS``."""
    s = text.strip().rstrip(".").replace("\\!", "").replace("\\,", "").replace("{,}", ",")
    s = re.sub(r"\\text\{[^{}]*\}|\\(?:mathrm|textbf)\{([^{}]*)\}", r"\1", s).replace("\\$", "").replace("\\%", "")
    s = s.strip(" $%")
    frac = _FRAC.match(s)
    if frac:
        num, den = parse_number(frac.group(2)), parse_number(frac.group(3))
        if num is None or den is None or den == 0:
            return None
        return -(num / den) if frac.group(1) else num / den
    found = _NUMBER.findall(s)
    if len(found) != 1 or _NUMBER.sub("", s).strip(" $%") and not _only_units(_NUMBER.sub("", s)):
        return None
    return _to_fraction(found[0])


def parse_gold(gold: str) -> Fraction:
    """The gold answer as a number; ``ValueError`` saying why when it is none (or too long to read)."""
    value = parse_number(gold)
    if value is not None:
        return value
    longest = max((len(run) for run in re.findall(r"\d+", gold)), default=0)
    if longest > MAX_DIGITS:
        raise ValueError(f"gold answer {gold[:20]!r}... has a {longest}-digit number: over Python's int-string conversion"
                         f" limit of {MAX_DIGITS} digits (sys.get_int_max_str_digits()), which this reward keeps; shorten it")
    raise ValueError(f"gold answer {gold[:80]!r} is not a number")


def _only_units(rest: str) -> bool:
    """What is left around a number is a unit word or two ("dollars", "cm"), not another quantity."""
    return bool(re.fullmatch(r"[\sA-Za-z.]{0,20}", rest))


def _to_fraction(token: str) -> Fraction | None:
    """A ``_NUMBER`` match as an exact number; None past ``MAX_DIGITS`` digits or exponent, or for ``x/0``."""
    token = re.sub(r"[\s,]", "", token)
    if "/" in token:
        num, den = token.split("/")
        num_value, den_value = _to_fraction(num), _to_fraction(den)
        return None if num_value is None or not den_value else num_value / den_value
    sign, whole, decimals, exponent = _DECIMAL.fullmatch(token).groups()  # every _NUMBER match has this shape
    whole, decimals = whole.lstrip("0"), (decimals or "").rstrip("0")
    if len(whole) + len(decimals) > MAX_DIGITS or (exponent and (len(exponent) > 6 or abs(int(exponent)) > MAX_DIGITS)):
        return None
    value = Fraction(int(whole + decimals or "0"), 10 ** len(decimals)) * Fraction(10) ** int(exponent or 0)
    return -value if sign else value


def extract_answer(completion: str, last_number_fallback: bool = True) -> Fraction | None:
    """The completion's final answer: the last ``\\boxed{}``, else after the last ``####``, else after
    the last "answer is", else (when ``last_number_fallback``) the last number anywhere."""
    boxed = last_boxed(completion)
    if boxed is not None:
        return parse_number(boxed)
    if "####" in completion:
        tail = completion.rsplit("####", 1)[1].strip().splitlines()
        return parse_number(tail[0]) if tail else None
    stated = _ANSWER_IS.findall(completion)
    if stated:
        numbers = _NUMBER.findall(stated[-1])
        return _to_fraction(numbers[0]) if numbers else None
    if last_number_fallback:
        numbers = _NUMBER.findall(completion)
        return _to_fraction(numbers[-1]) if numbers else None
    return None


def gsm8k_gold(answer: str) -> str:
    """The final answer of a GSM8K ``answer`` field (worked solution ending ``#### 72``): ``"72"``."""
    if "####" not in answer:
        raise ValueError(f"not a GSM8K answer (no '####'): {answer[-80:]!r}")
    return answer.rsplit("####", 1)[1].strip().replace(",", "")


def math_reward(completion: str, gold: str, last_number_fallback: bool = True) -> float:
    """1.0 when the completion's final answer equals ``gold`` as a number, else 0.0. Raises
    ``ValueError`` when ``gold`` is not a number (``parse_gold``)."""
    want = parse_gold(gold)
    got = extract_answer(completion, last_number_fallback)
    return 1.0 if got is not None and got == want else 0.0
