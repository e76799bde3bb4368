"""Math answer rewards: pull the final answer out of a completion (``\\boxed{}``, ``#### n``, "the
answer is n", else the last number) and compare it with the gold answer as an exact rational number.

Numbers are read with thousands separators (``1,234``), signs, decimals, percent and dollar signs,
``a/b`` and ``\\frac{a}{b}`` fractions, so ``$1,200.00``, ``1200`` and ``\\boxed{1200}`` all match.
"""

from __future__ import annotations

import re
from fractions import Fraction

_NUMBER = re.compile(
    r"-?\s*(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?"  # 1,234.5  12  3/4
    r"|-?\.\d+"  # .5
)
_FRAC = re.compile(r"^(-?)\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}$")
_ANSWER_IS = re.compile(r"answer\s+is\s*:?\s*([^\n]*)", re.IGNORECASE)


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
    """The one number ``text`` spells (``"$1,234.50"``, ``"-3/4"``, ``"\\frac{1}{2}"``, ``"25%"`` -> 25),
    or None when it holds no number or more than one."""
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


def _only_units(rest: str) -> bool:
    """What is left around a number is a unit word or two ("dollars", "cm"), not another quantity."""
    return bool(re.fullmatch(r"[\sA-Za-z.]{0,20}", rest))


def _to_fraction(token: str) -> Fraction | None:
    token = token.replace(",", "").replace(" ", "")
    try:
        if "/" in token:
            num, den = token.split("/")
            return Fraction(Fraction(num), Fraction(den)) if Fraction(den) != 0 else None
        return Fraction(token)
    except (ValueError, ZeroDivisionError):
        return None


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
    """1.0 when the completion's final answer equals ``gold`` as a number, else 0.0."""
    want = parse_number(gold)
    if want is None:
        raise ValueError(f"gold answer {gold!r} is not a number")
    got = extract_answer(completion, last_number_fallback)
    return 1.0 if got is not None and got == want else 0.0
