"""The quickstart's toy task, built entirely offline: a word-level tokenizer, a tiny Qwen3 config and
a verifiable "echo the digit" task.

Each prompt is ``"echo 7 :"`` (a digit among filler words); the policy earns, for each of its
first ``RESPONSE_SLOTS`` tokens, 1/RESPONSE_SLOTS when the token is that digit. A randomly
initialised model scores about 1/vocab; a model that learned to copy scores 1.0. Small enough to
learn on 2 CPU cores in a couple of minutes, yet it needs attention to the prompt, so it exercises the
whole GRPO path (rollouts, rewards, advantages, policy loss, weight sync).

``python -m arctic_rl.tasks.toy DIR`` writes the tokenizer and ``train.jsonl`` / ``val.jsonl`` into DIR.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from arctic_rl.modules.grpo import GRPOModule

DIGITS = [str(d) for d in range(10)]
FILLER = ["the", "a", "echo", "copy", "say", "digit", "please", "now", "x", "y", "z", ":", "!", "?"]
SPECIAL = ["<pad>", "<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "user", "assistant", "system", "\n"]
RESPONSE_SLOTS = 8
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def build_tokenizer(extra_words: tuple[str, ...] = (), words: tuple[str, ...] | None = None):
    """A whitespace word-level tokenizer over the task's words (``words``; default: the digits and the filler) and
    ``extra_words``, after the special tokens, built in memory (no hub)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = tuple(DIGITS + FILLER) if words is None else words
    vocab = {tok: i for i, tok in enumerate(SPECIAL + list(words) + list(extra_words))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        unk_token="<unk>",
        eos_token="<|endoftext|>",
        bos_token=None,
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_qwen3_config(vocab_size: int) -> dict:
    """A ~0.3M-parameter Qwen3 (head_dim 32 so vLLM's CPU attention kernels accept it)."""
    return {
        "model_type": "qwen3",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "max_position_embeddings": 128,
        "tie_word_embeddings": True,
    }


def make_rows(n: int, seed: int) -> list[dict]:
    """``n`` prompts ``"<filler...> echo D :"`` with ``answer = D``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        digit = rng.choice(DIGITS)
        filler = " ".join(rng.choice(FILLER[:-3]) for _ in range(rng.randint(0, 3)))
        rows.append({"prompt": f"{filler} echo {digit} :".strip(), "answer": digit})
    return rows


def write_task(out_dir: str | Path, num_train: int = 512, num_val: int = 64, seed: int = 0) -> Path:
    """Write ``tokenizer/``, ``train.jsonl`` and ``val.jsonl`` under ``out_dir``; returns it."""
    return save_task(out_dir, build_tokenizer(), {"train": make_rows(num_train, seed), "val": make_rows(num_val, seed + 1)})


def save_task(out_dir: str | Path, tokenizer, splits: dict[str, list[dict]]) -> Path:
    """Write ``tokenizer/`` and one ``NAME.jsonl`` per split (a row a line) under ``out_dir`` (made if missing);
    returns it. The toy tasks' ``write_task`` all end here."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out / "tokenizer")
    for name, rows in splits.items():
        with open(out / f"{name}.jsonl", "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    return out


def write_tiny_model(out_dir: str | Path, seed: int = 0, extra_tokens: tuple[str, ...] = ()) -> Path:
    """The quickstart's tiny Qwen3 with the toy tokenizer (plus ``extra_tokens``), fp32 weights drawn from
    ``seed``, written as a ``save_pretrained`` directory (what vLLM, transformers and the service load)."""
    import torch

    from arctic_rl.modules.models import build_causal_lm

    out = Path(out_dir)
    tokenizer = build_tokenizer()
    tokenizer.add_tokens(list(extra_tokens))
    torch.manual_seed(seed)
    build_causal_lm(tiny_qwen3_config(len(tokenizer)), "float32").save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def echo_score(completion: str, answer: str) -> float:
    """Fraction of the first ``RESPONSE_SLOTS`` words of ``completion`` equal to ``answer``."""
    words = completion.split()[:RESPONSE_SLOTS]
    return sum(w == answer for w in words) / RESPONSE_SLOTS


class EchoDigitGRPO(GRPOModule):
    """GRPO on the echo-the-digit task: partial credit per correct slot; correct = first word right."""

    def reward(self, prompts: list[str], completions: list[str], answer: list[str], **columns) -> list[float]:
        return [echo_score(c, a) for c, a in zip(completions, answer)]

    def is_correct(self, prompts: list[str], completions: list[str], answer: list[str], **columns) -> list[bool]:
        return [echo_score(c, a) == 1.0 for c, a in zip(completions, answer)]


if __name__ == "__main__":
    print(write_task(sys.argv[1] if len(sys.argv) > 1 else "data/toy"))
