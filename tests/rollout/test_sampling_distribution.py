"""Both rollout engines sample from the trainer's distribution: ``softmax(logits / T)`` of the model's own
forward, restricted to the top-p nucleus and renormalised, at the first token and at later positions.

Each case draws 2,000 completions (4 prompts x 500) from a real engine (vLLM, transformers' ``generate``
path), seeded per sample (as rollouts are) and unseeded, at temperature 1 and 0.7 and with top-p 0.8, and
runs chi-square goodness-of-fit tests against the model's own forward:

- first tokens, per prompt, against the processed distribution after the prompt;
- later tokens (positions 2-6, every sample) by their randomised probability integral transform: with the
  model's conditional distribution ``p(. | prefix)`` in token-id order, ``u = F(x - 1) + V p(x)`` (V
  uniform) is uniform on [0, 1] exactly when ``x`` was drawn from ``p(. | prefix)``; 20 equal bins.

The model is the quickstart's tiny Qwen3 with its final norm scaled so its next-token distributions are
far from uniform and far from one-hot (entropy 2-3 nats; ln 33 = 3.5): a wrong temperature or nucleus then moves
mass by many standard errors. Seeds are fixed, so each p-value is a fixed number; the threshold 1e-4
leaves room for the multiple tests and is still far above what a real sampling error gives (p < 1e-20 for
a temperature off by 10%, checked below on the trainer side of the test itself).
"""

from __future__ import annotations

import pytest
import torch

from arctic_rl.rollout.engines.base import SamplingConfig
from arctic_rl.tasks.toy import write_tiny_model

pytestmark = pytest.mark.slow

PROMPTS = ["echo 7 :", "the say x echo 6 :", "x 3", "copy digit 1 now :"]
N, MAX_TOKENS, ALPHA = 500, 6, 1e-4
CASES = {  # name: (temperature, top_p, seeded)
    "t1_seeded": (1.0, 1.0, True),
    "t1_unseeded": (1.0, 1.0, False),
    "t07_seeded": (0.7, 1.0, True),
    "topp08_seeded": (1.0, 0.8, True),
    "t07_topp08_unseeded": (0.7, 0.8, False),
}


@pytest.fixture(scope="module")
def peaked_model_dir(tmp_path_factory):
    """The tiny Qwen3 with its final RMSNorm weight x 3: logits x 3, next-token entropy about 2-3 nats (ln 33 = 3.5)."""
    from transformers import AutoModelForCausalLM

    out = write_tiny_model(tmp_path_factory.mktemp("peaked"), seed=3)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.mul_(3.0)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def reference(peaked_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(peaked_model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(peaked_model_dir)


@pytest.fixture(scope="module", params=["vllm", "transformers"])
def engine(request, peaked_model_dir):
    if request.param == "vllm":
        from arctic_rl.rollout.engines.vllm.engine import VLLMEngine

        eng = VLLMEngine(str(peaked_model_dir), dtype="float32", max_model_len=64, seed=0)
    else:
        from arctic_rl.rollout.engines.transformers.engine import TransformersEngine

        eng = TransformersEngine(str(peaked_model_dir))
    yield eng
    eng.shutdown()


def processed_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """``softmax(logits / T)`` restricted to the smallest top-probability set whose mass reaches ``top_p``
    (vLLM's and transformers' nucleus), renormalised; float64."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    if top_p >= 1.0:
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)
    keep = (sorted_p.cumsum(-1) - sorted_p) < top_p  # the tokens before it hold less than top_p
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_p * keep)
    return kept / kept.sum(-1, keepdim=True)


def chisquare(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's chi-square goodness-of-fit p-value (``len - 1`` degrees of freedom), float64."""
    statistic = ((observed - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor((len(observed) - 1) / 2.0, dtype=torch.float64), statistic / 2))


def chi_square_p(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Chi-square p-value of ``counts`` against ``expected_probs`` (bins expecting < 5 merged into one)."""
    total = counts.sum().item()
    expected = expected_probs * total
    small = expected < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    if exp[-1] == 0:  # nothing merged
        obs, exp = obs[:-1], exp[:-1]
    assert counts[expected_probs == 0].sum() == 0, "sampled a token outside the nucleus (probability 0)"
    if len(obs) < 2:  # a nucleus of one token: every draw is it (checked just above)
        return 1.0
    return chisquare(obs, exp * obs.sum() / exp.sum())


def draw(engine, tokenizer, temperature, top_p, seeded):
    prompt_ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    if not seeded:
        torch.manual_seed(1234)  # the transformers engine's unseeded draws use the process's random state
    sampling = SamplingConfig(n=N, max_tokens=MAX_TOKENS, temperature=temperature, top_p=top_p,
                              seed=11 if seeded else None)
    return prompt_ids, engine.generate(prompt_ids, sampling)


@pytest.mark.parametrize("case", list(CASES))
def test_engine_samples_from_the_trainers_distribution(case, engine, reference):
    temperature, top_p, seeded = CASES[case]
    model, tokenizer = reference
    prompt_ids, outputs = draw(engine, tokenizer, temperature, top_p, seeded)
    generator = torch.Generator().manual_seed(0)
    pit = []
    for ids, completions in zip(prompt_ids, outputs):
        assert len(completions) == N
        rows = torch.zeros(N, len(ids) + MAX_TOKENS, dtype=torch.long)  # right-padded: causal attention ignores it
        rows[:, : len(ids)] = torch.tensor(ids)
        lengths = torch.tensor([len(c.token_ids) for c in completions])
        for i, c in enumerate(completions):
            rows[i, len(ids) : len(ids) + len(c.token_ids)] = torch.tensor(c.token_ids)
        with torch.no_grad():  # the model's own forward: p(. | prompt, completion[:j]) at column len(ids) - 1 + j
            probs = processed_probs(model(rows).logits[:, len(ids) - 1 : -1], temperature, top_p)  # [N, MAX_TOKENS, V]
        tokens = rows[:, len(ids):]
        first = tokens[:, 0]
        p_first = chi_square_p(torch.bincount(first, minlength=probs.shape[-1]), probs[0, 0])
        assert p_first > ALPHA, f"{case}, prompt {tokenizer.decode(ids)!r}: first tokens p={p_first:.2e}"
        later = torch.arange(MAX_TOKENS)[None, :].expand(N, -1)
        real = (later >= 1) & (later < lengths[:, None])  # generated tokens after the first
        cdf_below = torch.cat([probs.new_zeros(N, MAX_TOKENS, 1), probs.cumsum(-1)], -1).gather(2, tokens[..., None]).squeeze(-1)
        own = probs.gather(2, tokens[..., None]).squeeze(-1)
        assert (own[real] > 0).all(), f"{case}: a later token outside the nucleus"
        noise = torch.rand(int(real.sum()), generator=generator, dtype=torch.float64)
        pit.append(cdf_below[real] + noise * own[real])
    u = torch.cat(pit)
    assert len(u) > 4 * N  # most samples run past their first token
    counts = torch.histc(u, bins=20, min=0.0, max=1.0)
    p_later = chisquare(counts, torch.full_like(counts, len(u) / 20))
    assert p_later > ALPHA, f"{case}: later tokens' PIT p={p_later:.2e} over {len(u)} tokens"


def test_the_check_rejects_a_sampler_off_by_ten_percent_in_temperature(reference):
    """The test's own power: first tokens drawn at T=1.1 from the model fail against T=1."""
    model, tokenizer = reference
    ids = tokenizer(PROMPTS[0])["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1]
    draws = torch.multinomial(processed_probs(logits, 1.1, 1.0), 4 * N, replacement=True,
                              generator=torch.Generator().manual_seed(0))
    assert chi_square_p(torch.bincount(draws, minlength=len(logits)), processed_probs(logits, 1.0, 1.0)) < 1e-6
