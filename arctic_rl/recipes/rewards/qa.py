"""Question-answering rewards: SQuAD-style answer normalisation, exact match and token F1, each the
best over a question's answer aliases, read from the completion's final answer line. Linear time in
the completion's length; the multi-hop QA task runs it per sample under a time limit (``pool.py``)."""

from __future__ import annotations

import re
import string
from collections import Counter

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)
# [ \t], not \s: a \s* at each line start would run over every following blank line (quadratic on "\n" * 20k)
_ANSWER_LINE = re.compile(r"^[ \t]*(?:final[ \t]+)?answer[ \t]*:[ \t]*(.+)$", re.IGNORECASE | re.MULTILINE)


def normalize_answer(text: str) -> str:
    """Lower case, drop punctuation and the articles a/an/the, collapse whitespace (the SQuAD/HotpotQA
    evaluation scripts' normalisation)."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, gold: str) -> float:
    """1.0 when both normalise to the same string."""
    return float(normalize_answer(prediction) == normalize_answer(gold))


def token_f1(prediction: str, gold: str) -> float:
    """F1 over the bags of normalised tokens; yes/no/noanswer must match exactly (as in HotpotQA)."""
    pred, ref = normalize_answer(prediction), normalize_answer(gold)
    if pred in ("yes", "no", "noanswer") or ref in ("yes", "no", "noanswer"):
        return float(pred == ref)
    pred_tokens, ref_tokens = pred.split(), ref.split()
    common = sum((Counter(pred_tokens) & Counter(ref_tokens)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred_tokens), common / len(ref_tokens)
    return 2 * precision * recall / (precision + recall)


def extract_final_answer(completion: str) -> str:
    """The text after the last ``Answer:`` line, else the last non-empty
    line: models are prompted to end with ``Answer: <short answer>``."""
    found = _ANSWER_LINE.findall(completion)
    if found:
        return found[-1].strip()
    lines = [line for line in completion.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def best_over_aliases(metric, prediction: str, aliases: list[str]) -> float:
    """``max(metric(prediction, alias))`` over the aliases; 0.0 for none."""
    return max((metric(prediction, alias) for alias in aliases), default=0.0)


def answer_score(prediction: str, aliases: list[str], em_weight: float = 0.5) -> float:
    """``em_weight * EM + (1 - em_weight) * F1`` of an answer, each the best over ``aliases``: dense enough for
    GRPO (partial credit for partial spans), 1.0 only for an exact answer."""
    em = best_over_aliases(exact_match, prediction, aliases)
    f1 = best_over_aliases(token_f1, prediction, aliases)
    return em_weight * em + (1 - em_weight) * f1


def qa_reward(completion: str, aliases: list[str], em_weight: float = 0.5) -> float:
    """:func:`answer_score` of the completion's final answer (:func:`extract_final_answer`)."""
    return answer_score(extract_final_answer(completion), aliases, em_weight)
