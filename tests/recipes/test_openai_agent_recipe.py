"""The OpenAI agent recipe's calculator (``recipes/openai_agent.py``): arithmetic through ``ast`` only, errors answered
as text the model reads; and its agent loop over a scripted stand-in for the model's replies (a fake of the chat
endpoint, which is not what this file tests: the real endpoint and SDK run in ``tests/rollout/test_agent_rollout.py``)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from arctic_rl.recipes.openai_agent import MAX_TURNS, calculate, calculator_agent


@pytest.mark.parametrize("expression, value", [
    ("3 + 4 * 2", "11"), ("(3 + 4) * 2", "14"), ("7 / 2", "3.5"), ("8 / 2", "4"), ("2 ** 10", "1024"), ("2^3", "8"),
    ("-5 + 2", "-3"), ("17 // 5", "3"), ("17 % 5", "2"), ("1.5 * 4", "6"), ("1 / 3", "0.333333"),
])
def test_the_calculator_evaluates_arithmetic(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize("expression, error", [
    ("__import__('os').system('true')", "only numbers"), ("1 / 0", "division by zero"), ("2 ** 1000", "whole exponents up to 64"),
    ("", "give an expression"), (None, "give an expression"), ("1 +", "error:"), ("x * 2", "only numbers"), ("9" * 300, "over 200"),
])
def test_the_calculator_answers_bad_expressions_with_an_error_message(expression, error):
    answer = calculate(expression)
    assert answer.startswith("error:") and error in answer


class ScriptedModel:
    """A fake of the chat endpoint's ``client``: answers each request with the next scripted message; records the
    messages it was sent."""

    def __init__(self, replies):
        self.replies, self.sent = list(replies), []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    async def create(self, **request):
        self.sent.append([dict(m) for m in request["messages"]])
        content, calls = self.replies.pop(0)
        tool_calls = [SimpleNamespace(id=f"c{i}", function=SimpleNamespace(name="calculate", arguments=json.dumps(a)))
                      for i, a in enumerate(calls)] or None
        message = SimpleNamespace(content=content, tool_calls=tool_calls,
                                  model_dump=lambda **kw: {"role": "assistant", "content": content})
        return SimpleNamespace(choices=[SimpleNamespace(message=message)])


def test_the_agent_runs_the_calls_and_scores_the_final_answer():
    model = ScriptedModel([("", [{"expression": "48 / 2"}]), ("", [{"expression": "48 + 24"}]), ("So #### 72", [])])
    assert asyncio.run(calculator_agent(model, {"prompt": "How many clips?", "answer": "72"})) == 1.0
    assert [m["content"] for m in model.sent[2] if m["role"] == "tool"] == ["24", "72"]
    wrong = ScriptedModel([("#### 71", [])])
    assert asyncio.run(calculator_agent(wrong, {"prompt": "How many clips?", "answer": "72"})) == 0.0
    looping = ScriptedModel([("", [{"expression": "1"}])] * MAX_TURNS)
    assert asyncio.run(calculator_agent(looping, {"prompt": "?", "answer": "1"})) == 0.0  # never answers
    bad_arguments = ScriptedModel([("", [{"expr": "1"}]), ("#### 1", [])])
    assert asyncio.run(calculator_agent(bad_arguments, {"prompt": "?", "answer": "1"})) == 1.0
    assert model.sent and bad_arguments.sent[1][-1]["content"].startswith("error: give an expression")
