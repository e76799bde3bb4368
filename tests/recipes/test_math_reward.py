"""GSM8K answer extraction and checking: a table of completions against gold answers, including
answers that tried to fool the reward and inputs that made its number pattern quadratic."""

from fractions import Fraction

import pytest

from arctic_rl.recipes.rewards.math import MAX_DIGITS, extract_answer, gsm8k_gold, last_boxed, math_reward, parse_gold, parse_number

CASES = [  # (completion, gold, reward)
    ("She has 3 + 4 = 7 apples.\n#### 7", "7", 1.0),
    ("#### 1,234", "1234", 1.0),
    ("The total is \\boxed{1,234}.", "1234", 1.0),
    ("So the answer is $1,200.00.", "1200", 1.0),
    ("The answer is: 18 dollars", "18", 1.0),
    ("\\boxed{\\frac{3}{4}}", "0.75", 1.0),
    ("\\boxed{\\dfrac{1}{2}}", "1/2", 1.0),
    ("#### -5", "-5", 1.0),
    ("#### 25%", "25", 1.0),
    ("\\boxed{\\$18}", "18", 1.0),
    ("\\boxed{18 \\text{ dollars}}", "18", 1.0),
    ("first 12, then 40 so 52", "52", 1.0),  # last number fallback
    ("first 12, then 40 so 52", "12", 0.0),
    ("#### 7", "8", 0.0),
    ("\\boxed{7} but earlier #### 8", "8", 0.0),  # \boxed wins over ####
    ("\\boxed{3, 4}", "3", 0.0),  # two numbers in the box is not an answer
    ("#### 1,2", "12", 0.0),  # not a thousands separator
    ("no numbers here", "3", 0.0),
    ("", "3", 0.0),
    ("\\boxed{", "3", 0.0),  # unbalanced box
    ("#### 3/0", "3", 0.0),
    ("It costs 5.50 each. #### 5.5", "5.50", 1.0),
    # scientific notation is read as Python reads it, never as its mantissa
    ("The answer is 1e999999", "1", 0.0),  # an exponent past MAX_DIGITS is no answer (and no 10**999999)
    ("The answer is 12e3", "12", 0.0),
    ("The answer is 12e3", "12000", 1.0),
    ("12e3", "12", 0.0),
    ("#### 12e3", "12", 0.0),
    ("\\boxed{12e3}", "12000", 1.0),
    ("#### 2.5E-1", "1/4", 1.0),
    ("#### 1.5e+2", "150", 1.0),
    ("#### 1e4299", "1" + "0" * 4299, 1.0),
    ("#### " + "0" * 5000 + "7", "7", 1.0),  # leading zeros are not significant digits
    ("#### " + "7" * (MAX_DIGITS + 1), "7", 0.0),
]


@pytest.mark.parametrize("completion,gold,reward", CASES)
def test_math_reward(completion, gold, reward):
    assert math_reward(completion, gold) == reward


LONG = {  # name -> (completion, gold, reward): each took from 10 s to minutes with the quadratic pattern
    "minus then 80k spaces": ("-" + " " * 80_000, "1", 0.0),
    "21k whitespace": (" \t\n" * 7_000, "1", 0.0),
    "minus then 80k spaces after an answer": ("The answer is 4. -" + " " * 80_000, "4", 1.0),
    "80k spaces inside a box": ("\\boxed{-" + " " * 80_000 + "}", "1", 0.0),
    "after ####": ("#### -" + " " * 80_000 + "3", "3", 0.0),
    "100k digits": ("9" * 100_000, "9", 0.0),
    "20k numbers": ("1 " * 20_000 + "2", "2", 1.0),
}


@pytest.mark.timeout(5)  # the answers take milliseconds; the old pattern ran past this on each case
@pytest.mark.parametrize("name", LONG)
def test_linear_time_on_long_degenerate_completions(name):
    completion, gold, reward = LONG[name]
    assert math_reward(completion, gold) == reward


def test_a_gold_answer_past_the_int_string_limit_says_so():
    with pytest.raises(ValueError, match="has a 4301-digit number: over Python's int-string conversion limit of 4300 digits"):
        parse_gold("7" * 4301)
    assert parse_gold("7" * 4300) == int("7" * 4300)


@pytest.mark.parametrize("text,value", [
    ("1,234,567", Fraction(1234567)), ("-3/4", Fraction(-3, 4)), ("\\frac{6}{8}", Fraction(3, 4)),
    ("-\\frac{1}{2}", Fraction(-1, 2)), (".5", Fraction(1, 2)), ("$ 12.", Fraction(12)), ("12 cm", Fraction(12)),
    ("3 and 4", None), ("x", None), ("\\frac{1}{0}", None),
    ("12e3", Fraction(12000)), ("-1.5E-2", Fraction(-3, 200)), (".5e1", Fraction(5)), ("1e-4301", None),
])
def test_parse_number(text, value):
    assert parse_number(text) == value


def test_without_fallback_a_bare_number_is_no_answer():
    assert extract_answer("it is 52", last_number_fallback=False) is None
    assert math_reward("it is 52", "52", last_number_fallback=False) == 0.0


def test_nested_boxed_and_gsm8k_gold():
    assert last_boxed("\\boxed{\\frac{1}{2}} then \\boxed{\\frac{3}{4}}") == "\\frac{3}{4}"
    assert gsm8k_gold("Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 1,072") == "1072"
    with pytest.raises(ValueError, match="no '####'"):
        gsm8k_gold("72")
    with pytest.raises(ValueError, match="not a number"):
        math_reward("#### 1", "seven")
