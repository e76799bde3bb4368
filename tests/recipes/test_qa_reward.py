"""QA rewards: normalisation, exact match, token F1 and the alias-best combined reward, table-driven."""

import pytest

from arctic_rl.recipes.rewards.qa import exact_match, extract_final_answer, normalize_answer, qa_reward, token_f1


@pytest.mark.parametrize("text,normal", [
    ("The Eiffel Tower!", "eiffel tower"), ("  an   Apple, a day ", "apple day"), ("U.S.A.", "usa"),
    ("Theatre", "theatre"), ("", ""),
])
def test_normalize_answer(text, normal):
    assert normalize_answer(text) == normal


@pytest.mark.parametrize("pred,gold,em,f1", [
    ("the Eiffel Tower", "Eiffel Tower", 1.0, 1.0),
    ("Eiffel", "Eiffel Tower", 0.0, 2 / 3),
    ("tower eiffel", "Eiffel Tower", 0.0, 1.0),  # F1 is a bag of tokens
    ("Paris France", "Paris", 0.0, 2 / 3),
    ("yes", "no", 0.0, 0.0),
    ("yes", "Yes.", 1.0, 1.0),
    ("yes indeed", "yes", 0.0, 0.0),  # yes/no must match exactly
    ("", "Paris", 0.0, 0.0),
    ("the", "a", 1.0, 0.0),  # both normalise to nothing: EM counts it, F1 has no tokens
])
def test_exact_match_and_f1(pred, gold, em, f1):
    assert exact_match(pred, gold) == em
    assert token_f1(pred, gold) == pytest.approx(f1)


@pytest.mark.parametrize("completion,answer", [
    ("Doc 2 says so.\nAnswer: Barack Obama", "Barack Obama"),
    ("answer: x\nmore thinking\nFinal answer: y", "y"),
    ("thinking...\n\nObama\n", "Obama"),
    ("", ""),
])
def test_extract_final_answer(completion, answer):
    assert extract_final_answer(completion) == answer


@pytest.mark.parametrize("completion,aliases,reward", [
    ("Answer: Obama", ["Barack Obama", "Obama"], 1.0),  # best alias
    ("Answer: Barack Hussein Obama", ["Barack Obama"], 0.5 * 0 + 0.5 * 0.8),
    ("Answer: Lincoln", ["Barack Obama", "Obama"], 0.0),
    ("Answer: Obama", [], 0.0),
])
def test_qa_reward_best_over_aliases(completion, aliases, reward):
    assert qa_reward(completion, aliases) == pytest.approx(reward)
    assert qa_reward(completion, aliases, em_weight=1.0) == (1.0 if reward == 1.0 else 0.0)


LONG = {  # name -> (completion, aliases, reward): the first two took 10 s to minutes with \s* at each line start
    "20k newlines": ("\n" * 20_000, ["Paris"], 0.0),
    "10k blank lines of a space": (" \n" * 10_000 + "Paris", ["Paris"], 1.0),
    "answer then 80k spaces": ("Answer:" + " " * 80_000 + "Paris", ["Paris"], 1.0),
    "80k tabs then an answer line": ("\t" * 80_000 + "Answer: Paris", ["Paris"], 1.0),
}


@pytest.mark.timeout(5)  # milliseconds each now
@pytest.mark.parametrize("name", LONG)
def test_linear_time_on_long_degenerate_completions(name):
    completion, aliases, reward = LONG[name]
    assert qa_reward(completion, aliases) == reward
