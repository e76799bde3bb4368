"""Environments of multi-turn rollouts (``multi_turn.py``): what answers the policy between its turns.

An :class:`Environment` is one episode's state, made fresh for each sample (``N = prompts x G`` per batch) as
``cls(tokenizer=..., **env_args)``:

- ``reset(row)`` gets the dataset row (``prompt``, ``prompt_token_ids`` and the other columns) and returns the
  first context as token ids (usually ``row["prompt_token_ids"]``);
- ``step(generated_ids, text)`` gets the token ids the policy generated this turn (ending with one of
  ``stop_token_ids``) and their text, and returns a :class:`StepResult`: the observation as token ids (appended
  to the context as they are, and masked out of the loss), a reward, and whether the episode is done.

A turn that ends with EOS (or runs out of tokens) ends the episode without a ``step``: that was the answer.

Token-in / token-out: the context is a token list that only grows by appending the engine's generated ids and
the environment's observation ids; nothing is decoded and re-encoded. ``text`` is a decode of this turn for
parsing only.

:class:`ToolEnvironment` builds an environment from plain Python functions (tools). Call format, in the
policy's text: ``<tool> name args </tool>``. The turn ends at the stop string (``</tool>``, which must be one
token of the vocabulary: the engines stop on token ids); the parser takes the text after the last ``<tool>``
of the turn (or, when the turn has none, of the context since the last observation, so a prompt may open the
call), splits off the first word as the tool's name and passes the rest, stripped, as ``args``. The result
(a string) is formatted with ``observation_template`` and tokenized once. An unknown tool name is answered
with an error observation (the episode goes on); a tool that raises, runs past the time limit or returns
something other than a string or a ``StepResult`` (:class:`BadOutput`), or an observation over the token cap,
ends the episode (``multi_turn.py`` counts these faults).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from arctic_rl.errors import ConfigError


@dataclass
class StepResult:
    """What an environment answers to one turn."""

    observation_ids: list[int]  # appended to the context (masked out of the loss); may be empty
    reward: float = 0.0  # this step's reward; an episode's environment reward is the sum over its steps
    done: bool = False  # end the episode after this observation
    info: dict[str, Any] = field(default_factory=dict)  # free-form (the tool called, ...), kept in the episode's record


class BadOutput(Exception):
    """Raised by an environment's ``step`` whose own parts answered something unusable (a tool that returned
    neither a string nor a ``StepResult``): the episode ends with the ``bad_output`` fault, the message its detail."""


class Environment(Protocol):
    """One episode's environment (see the module docstring). Made per sample as ``cls(tokenizer=..., **env_args)``."""

    stop_token_ids: tuple[int, ...]  # tokens that end a turn (besides EOS): the engine stops there and ``step`` runs

    def reset(self, row: dict[str, Any]) -> list[int]:
        """The first context (token ids) of the episode of dataset row ``row``."""
        ...

    def step(self, generated_ids: list[int], text: str) -> StepResult:
        """Answer the turn the policy just generated (``generated_ids``, ending with a stop token; ``text``: its decode)."""
        ...


class ToolEnvironment:
    """An environment from plain Python functions. Subclass it and set ``tools``, or pass ``tools`` (a dict
    name -> function, or the functions, named by ``__name__``). A tool is ``fn(args: str) -> str``; one that
    has a parameter named ``row`` is also passed the episode's dataset row (its columns), so a tool can know what
    the prompt does not show. A tool may return a :class:`StepResult` instead of a string: it is the step's
    answer as it is (its observation ids, reward and ``done``), say an ``answer`` tool that scores and ends the
    episode.

    Args:
        tokenizer: the policy's tokenizer (observations are tokenized with it, once).
        tools: the tools (see above); None: the class's ``tools``.
        call_start: the text that opens a call.
        stop: the text that closes a call and ends the turn; must be one token of the vocabulary.
        observation_template: how a tool's result is shown (``{}``: the result).

    Its steps give no reward (0.0) unless a tool returns a ``StepResult``: the module's ``reward`` scores the
    finished completion; subclass and override :meth:`step` for other per-step rewards.
    """

    tools: dict[str, Callable[..., Any]] | None = None

    def __init__(self, tokenizer, tools: dict[str, Callable[..., Any]] | list[Callable[..., Any]] | None = None,
                 call_start: str = "<tool>", stop: str = "</tool>", observation_template: str = "<obs> {} </obs>") -> None:
        tools = tools if tools is not None else type(self).tools
        if not tools:
            raise ConfigError(f"{type(self).__name__} has no tools: pass tools=... or set the class attribute 'tools'")
        self.tools = dict(tools) if isinstance(tools, dict) else {fn.__name__: fn for fn in tools}
        self.tokenizer, self.call_start, self.stop, self.template = tokenizer, call_start, stop, observation_template
        self.stop_token_ids = (single_token_id(tokenizer, stop, "stop"),)
        self.row: dict[str, Any] = {}
        self.since_observation: list[int] = []  # the context since the last observation (where a call may open)

    def reset(self, row: dict[str, Any]) -> list[int]:
        self.row = row
        self.since_observation = list(row["prompt_token_ids"])
        return list(row["prompt_token_ids"])

    def step(self, generated_ids: list[int], text: str) -> StepResult:
        self.since_observation.extend(generated_ids)
        name, args = self.parse_call(text)
        self.since_observation = []
        if name not in self.tools:
            return StepResult(self.observe(f"unknown tool {name}"), info={"tool": name, "error": "unknown tool"})
        result = self.call(name, args)
        if isinstance(result, StepResult):  # the tool sets the step's reward or ends the episode (an answer tool)
            return result
        if not isinstance(result, str):
            raise BadOutput(f"tool {name!r} returned {type(result).__name__} {str(result)[:80]!r}, not a str (or a StepResult)")
        return StepResult(self.observe(result), info={"tool": name})

    def parse_call(self, text: str) -> tuple[str, str]:
        """``(tool name, args)`` of the call that ``text`` (this turn) closes (see the module docstring)."""
        body = text.rsplit(self.stop, 1)[0]
        if self.call_start not in body:  # the call opened earlier in the context (say, by the prompt)
            body = self.tokenizer.decode(self.since_observation, skip_special_tokens=False).rsplit(self.stop, 1)[0]
        words = body.rsplit(self.call_start, 1)[-1].strip().split(maxsplit=1)
        return (words[0] if words else ""), (words[1].strip() if len(words) > 1 else "")

    def call(self, name: str, args: str) -> Any:
        """Tool ``name``'s result for ``args`` (passed the episode's row when it has a ``row`` parameter)."""
        fn = self.tools[name]
        return fn(args, row=self.row) if "row" in inspect.signature(fn).parameters else fn(args)

    def observe(self, result: str) -> list[int]:
        """The observation's token ids: ``observation_template`` around ``result``, tokenized once."""
        return list(self.tokenizer.encode(self.template.format(result), add_special_tokens=False))


def single_token_id(tokenizer, text: str, what: str) -> int:
    """The id of ``text`` when it is exactly one token of ``tokenizer``; a ``ConfigError`` naming ``what`` otherwise."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    unk = getattr(tokenizer, "unk_token_id", None)
    if len(ids) != 1 or ids[0] == unk:
        raise ConfigError(f"model.rollout.environment.env_args.{what} {text!r} must be one token of the tokenizer (it encodes"
                          f" as {ids}): the engines stop on token ids; add it to the vocabulary or pick another")
    return ids[0]
