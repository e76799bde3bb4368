"""The OpenAI agent recipe for real models: an ``openai``-SDK tool-calling loop with a calculator, trained by ``fit``
on GSM8K (``recipes/openai_agent``). The agent does not know arctic-rl: it is an ordinary loop over
``client.chat.completions.create`` with ``tools``, which ``fit`` runs against its OpenAI-compatible endpoint
(``model.rollout.agent``, docs/agents.md). The model's chat template renders the tools and the calls (Qwen3:
``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, which the endpoint returns as ``tool_calls``).

The calculator evaluates arithmetic only (numbers, ``+ - * / // % **``, parentheses), through Python's ``ast``, never
``eval``; a bad expression is answered with an error message the model can read, not an exception.
"""

from __future__ import annotations

import ast
import json
import operator
from fractions import Fraction

from arctic_rl.modules.grpo import GRPOModule
from arctic_rl.recipes.rewards.math import math_reward

MAX_TURNS = 6
MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
TOOLS = [{"type": "function", "function": {
    "name": "calculate", "description": "Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}


def calculate(expression: str) -> str:
    """The value of an arithmetic ``expression`` as text (an integer when it is one), or ``"error: ..."``."""
    if not isinstance(expression, str) or not expression.strip():
        return "error: give an expression, e.g. (3 + 4) * 2"
    if len(expression) > MAX_EXPRESSION_CHARS:
        return f"error: the expression is over {MAX_EXPRESSION_CHARS} characters"
    try:
        value = _value(ast.parse(expression.replace("^", "**"), mode="eval").body)
    except ZeroDivisionError:
        return "error: division by zero"
    except (SyntaxError, ValueError, TypeError) as e:
        return f"error: {e}" if str(e) else "error: not an arithmetic expression"
    return str(value.numerator) if value.denominator == 1 else f"{float(value):.6g}"


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _value(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow):
            if right.denominator != 1 or abs(right) > MAX_EXPONENT:
                raise ValueError(f"only whole exponents up to {MAX_EXPONENT}")
            return left ** int(right)
        return Fraction(_BINARY[type(node.op)](left, right))
    raise ValueError("only numbers, + - * / // % ** and parentheses")


async def calculator_agent(client, row: dict) -> float:
    """Ask, run the calculator calls, ask again, until the model answers without a call (at most ``MAX_TURNS``
    requests); the reward is 1.0 when the final answer (``#### n``) equals the row's ``answer``."""
    messages = [{"role": "user", "content": row["prompt"]}]
    message = None
    for _ in range(MAX_TURNS):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            try:
                expression = json.loads(call.function.arguments).get("expression", "")
            except (ValueError, AttributeError):
                expression = None
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(expression)})
    else:
        return 0.0  # still calling after MAX_TURNS requests: no answer
    return math_reward(message.content or "", str(row["answer"]), last_number_fallback=False)


class CalculatorAgentGRPO(GRPOModule):
    """GRPO on GSM8K with the calculator agent (the reward is the agent's); correct = the episode's final ``#### n``
    is the gold number."""

    def is_correct(self, prompts: list[str], completions: list[str], answer: list[str], **columns) -> list[bool]:
        return [math_reward(c, a, last_number_fallback=False) == 1.0 for c, a in zip(completions, answer)]
