"""ZoRRo beside its rivals (verl's PrefixGrouper, AReaL's tree training, unsloth's PrefixGrouper port) and the naive
batch, on one GPU, in one process.

The same Qwen3-1.7B-shaped model (random weights, bf16, non-reentrant activation checkpointing), the same batches, the
same work per step: forward + backward of the sum of every response token's log-prob. Each rival runs through its own
installed package; a side whose package does not import is recorded under ``versions`` and left out.

- ``naive``: ``arctic_rl.modules.models.response_logprobs``, every prompt repeated for each of its G responses (SDPA).
- ``zorro``: ``arctic_rl.zorro.zorro_response_logprobs`` with ``attention_backend="cudnn"`` (the fastest backend in
  BENCHMARKS "ZoRRo Train"), Liger's kernels on when ``liger-kernel`` is installed; on tree batches
  ``dedup="tree"`` on flex (every shared prefix once; cudnn has no trees).
- ``prefix_grouper``: the package's public API as its README describes it: ``PrefixGrouper.from_ungrouped_masks``,
  ``concat_input``, position ids restarting after the prompt for every response, ``PrefixGrouper.forward`` with an
  attention adapter inside the model's attention (registered through transformers' ``AttentionInterface``), and
  ``split_output(include_prefix_last=1)`` on the logits. Its adapter runs torch's SDPA: the package's own transformers
  hook needs the ``flash_attn`` package (``flash_attention_2``), which this machine's image lacks. With no padding, the
  adapter calls SDPA without a mask (prefix: causal; suffix: lower-right causal, both on the flash kernel); with ragged
  responses it passes a boolean mask (SDPA's memory-efficient kernel), as transformers' own SDPA path would.
- ``areal_tree``: AReaL's tree training (``benchmarks/rivals_areal.py``): its trie packing, FlexAttention tree mask
  and packed-tree log-probs, as its FSDP engine runs them.
- ``unsloth_pg``: unsloth's PrefixGrouper port (``benchmarks/rivals_unsloth.py``): its group layout, FlexAttention
  shared-prefix kernel and log-prob extraction, as its GRPO grad path runs them.

Tree cases (``--tree-cases``): ``benchmarks/zorro_tree.py``'s multi-turn batch (prompts x b1 first turns x b2 second
turns). ZoRRo and AReaL share every common prefix (the prompt and each first turn); PrefixGrouper and unsloth's port
have one prefix level per group (their APIs take a prompt and whole responses), so they share the prompt and run each
first turn once per branch.

Errors: at a short shape of the same model (flat and tree), each side in bf16 against the naive side in fp32 (max
|d log-prob|, and the relative norm of the gradient difference over all parameters). On the CPU the FlexAttention sides
(AReaL, unsloth) are checked forward only: torch has no FlexAttention backward there.

    python benchmarks/rivals_gpu.py --out rivals.json                    # the H200 run (split it: see BENCHMARKS)
    python benchmarks/rivals_gpu.py --model tiny --device cpu --cases '[[2,4,64,32,0]]' --tree-cases '[[2,2,2,64,16]]'
    python benchmarks/rivals_gpu.py --model tiny --device cpu --cases '[]' --tree-cases '[]' --error-dtype float32
    python benchmarks/rivals_gpu.py --model tiny --cases '[]' --tree-cases '[]' --error-dtype float32  # fp32, GPU
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.zorro_train import SHAPES, measure, train_step  # noqa: E402
from benchmarks.rivals_areal import AREAL_ATTENTION, areal_response_logprobs, register_areal  # noqa: E402
from benchmarks.rivals_unsloth import UNSLOTH_ATTENTION, register_unsloth, unsloth_response_logprobs  # noqa: E402
from benchmarks.zorro_tree import tree_batch  # noqa: E402
from arctic_rl.modules.models import response_logprobs  # noqa: E402
from arctic_rl.zorro import zorro_response_logprobs  # noqa: E402

# [prompts, G, prompt tokens, response tokens, ragged]: ragged 1 draws each response's length in [R/4, R]
CASES = [[2, 8, 4096, 512, 0], [1, 16, 8192, 1024, 0], [8, 8, 1024, 1024, 0], [2, 8, 4096, 512, 1]]
# [prompts, b1, b2, prompt tokens, turn tokens]: benchmarks/zorro_tree.py's multi-turn tree (prompt, b1 first turns, b2
# second turns from each): prompts x b1 x b2 sequences whose responses share their first turn b2 ways
TREE_CASES = [[4, 4, 4, 2048, 256]]
PG_ATTENTION = "arctic_rl_benchmark_prefix_grouper"
FLEX_SIDES = {"areal_tree", "unsloth_pg"}  # FlexAttention inside: torch has no FlexAttention backward on the CPU


def make_batch(n: int, g: int, p: int, r: int, ragged: int, vocab: int, device: str, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (p,), generator=gen).tolist() for _ in range(n)]
    ids = torch.randint(1, vocab, (n * g, r), generator=gen)
    mask = torch.ones(n * g, r)
    if ragged:
        lengths = torch.randint(max(1, r // 4), r + 1, (n * g,), generator=gen)
        mask = (torch.arange(r)[None, :] < lengths[:, None]).float()
    return [prompts[i // g] for i in range(n * g)], (ids * mask.long()).to(device), mask.to(device)


def _pg_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, prefix_grouper=None, **kwargs):
    """transformers attention function: the grouped row's attention through ``PrefixGrouper.forward``."""

    def attend(q, k, v, key_mask):  # q [b, h, lq, d], k/v [b, hkv, lk, d], key_mask [b, lk] (True: a token)
        lq, lk = q.shape[2], k.shape[2]
        if bool(key_mask.all()):
            if lq == lk:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=True)
            else:
                from torch.nn.attention.bias import causal_lower_right

                out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(lq, lk), scale=scaling, enable_gqa=True)
        else:  # suffix queries right-padded after a prefix of lk - lq keys (left-padded when it is the prefix call)
            offset = lk - lq
            qi = torch.arange(lq, device=q.device)[:, None]
            kj = torch.arange(lk, device=q.device)[None, :]
            allowed = (kj < offset) | (kj - offset <= qi) if offset else kj <= qi
            allowed = allowed[None, None] & key_mask[:, None, None, :]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2)  # [b, l, h, d], as PrefixGrouper.group takes it

    return prefix_grouper.forward(attend, query, key, value), None


def register_prefix_grouper() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(PG_ATTENTION, _pg_attention)
    try:
        from transformers.masking_utils import AttentionMaskInterface

        AttentionMaskInterface.register(PG_ATTENTION, lambda *args, **kwargs: None)  # the adapter builds its own
    except ImportError:
        pass


def pg_response_logprobs(model, prompts, response_ids, response_mask, temperature, _entropy=False, _k=0, **_):
    """Response log-probs ``[N, R]`` through PrefixGrouper (each run of equal consecutive prompts is one group)."""
    from prefix_grouper import PrefixGrouper

    unique, sizes = [], []
    for prompt in prompts:
        if unique and prompt is unique[-1]:
            sizes[-1] += 1
        else:
            unique.append(prompt)
            sizes.append(1)
    device = response_ids.device
    prompt_ids = torch.tensor(unique, device=device)
    prompt_mask = torch.ones_like(prompt_ids, dtype=torch.bool)
    suffix_mask = response_mask.bool()
    grouper = PrefixGrouper.from_ungrouped_masks(prompt_mask, suffix_mask, sizes, device=device, padding_mode="right")
    input_ids = grouper.concat_input(prompt_ids, prompt_mask, response_ids, suffix_mask)
    positions = torch.zeros_like(input_ids)  # every response's positions continue from the end of its prompt
    for row, info in enumerate(grouper.group_info.info_list):
        p_len = info.prefix_len
        flat = torch.cat([torch.arange(p_len)] + [torch.arange(p_len, p_len + s) for s in info.suffix_lens])
        positions[row, : len(flat)] = flat.to(device)
    logits = model(input_ids=input_ids, position_ids=positions, prefix_grouper=grouper, use_cache=False).logits
    _, _, suffix_logits, _ = grouper.split_output(logits, include_prefix_last=1)
    del logits
    longest = suffix_logits.shape[1] - 1  # the longest response: split_output's suffix rows hold that many + 1
    targets = grouper.convert_padding(response_ids, suffix_mask, padding_mode="right")[:, :longest]
    rows = []
    for i in range(suffix_logits.shape[0]):  # one row at a time in fp32 (the whole row batch would double the logits)
        scores = suffix_logits[i, :-1].float() / temperature
        rows.append(scores.gather(-1, targets[i].unsqueeze(-1)).squeeze(-1) - scores.logsumexp(-1))
    logprobs = F.pad(torch.stack(rows), (0, response_ids.shape[1] - longest))
    return logprobs * response_mask, None


def build_model(shape: str, device: str, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """``benchmarks/zorro_train.py``'s model (the same seed, config and checkpointing) on ``device``."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**SHAPES[shape], tie_word_embeddings=True, max_position_embeddings=65536, rope_theta=1e6)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(device, dtype)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model.train()


def with_attention(model, name: str):
    model.config._attn_implementation = name
    for module in model.modules():
        if hasattr(module, "config") and module is not model:
            module.config._attn_implementation = name
    return model


SIDES = {  # side -> (log-prob function, attention implementation, kwargs)
    "naive": (response_logprobs, "sdpa", {}),
    "zorro": (zorro_response_logprobs, "sdpa", {"attention_backend": "cudnn"}),
    "prefix_grouper": (pg_response_logprobs, PG_ATTENTION, {}),
    "areal_tree": (areal_response_logprobs, AREAL_ATTENTION, {}),
    "unsloth_pg": (unsloth_response_logprobs, UNSLOTH_ATTENTION, {}),
}
REGISTER = {"prefix_grouper": lambda: (register_prefix_grouper(), _version("prefix-grouper"))[1],
            "areal_tree": register_areal, "unsloth_pg": register_unsloth}


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


def register(sides: list[str]) -> tuple[list[str], dict]:
    """Import each rival and register its attention; (the sides that import, {side: version or why not})."""
    ok, versions = [], {}
    for side in sides:
        try:
            versions[side] = REGISTER[side]() if side in REGISTER else "arctic_rl"
            ok.append(side)
        except Exception as e:  # not installed, or its import fails: recorded, the side left out
            versions[side] = f"unavailable: {type(e).__name__}: {str(e)[:300]}"
    return ok, versions


def side_kwargs(side: str, tree: bool, device: str, zorro_backend: str, areal_max_tokens: int = 0) -> dict:
    """A side's keyword arguments for a flat batch (``tree`` False) or a multi-turn tree batch."""
    kw = dict(SIDES[side][2])
    if side == "zorro":
        kw["attention_backend"] = zorro_backend
        if tree:  # every shared prefix once: the prefix-tree path (flex on the GPU; cudnn has no trees)
            kw.update(dedup="tree", attention_backend="flex" if device == "cuda" else "sdpa")
    if side == "areal_tree" and areal_max_tokens:
        kw["max_tokens"] = areal_max_tokens
    return kw


def errors(shape: str, device: str, batch, sides: list[str], kwargs: dict, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Each side in ``dtype`` against the naive side in fp32, same weights and batch: max |d log-prob|, grad rel. error.

    On the CPU a FlexAttention side is checked forward only: torch has no FlexAttention backward there."""
    reference = with_attention(build_model(shape, device, torch.float32), "sdpa")
    train_step(response_logprobs, reference, batch)
    with torch.no_grad():
        want = response_logprobs(reference, *batch, 1.0, False, 0)[0]
    grads = {n: p.grad.float() for n, p in reference.named_parameters()}
    norm = torch.sqrt(sum((g ** 2).sum() for g in grads.values())).item()
    out = {}
    for side in sides:
        fn, attention, _ = SIDES[side]
        kw = kwargs[side]
        model = with_attention(build_model(shape, device, dtype), attention)
        model.load_state_dict({k: v.to(dtype) for k, v in reference.state_dict().items()})
        forward_only = device == "cpu" and side in FLEX_SIDES
        try:
            if not forward_only:
                train_step(fn, model, batch, **kw)
            with torch.no_grad():
                got = fn(model, *batch, 1.0, False, 0, **kw)[0]
            out[side] = {"max_abs_logprob_err": float(f"{(got.float() - want).abs().max().item():.3g}")}
            if forward_only:
                out[side]["grad_rel_err"] = "not checked: torch has no FlexAttention backward on the CPU"
            else:
                diff = torch.sqrt(sum(((p.grad.float() - grads[n]) ** 2).sum() for n, p in model.named_parameters()))
                out[side]["grad_rel_err"] = float(f"{diff.item() / norm:.3g}")
        except Exception as e:  # a refusal is a result
            out[side] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        del model
        gc.collect()
    return out


def run_case(args, case: list[int], tree: bool, sides: list[str], models: dict, kwargs: dict) -> dict:
    """Time one case on every side: {side: seconds, peak GiB, times} or the side's error."""
    vocab = SHAPES[args.model]["vocab_size"]
    batch = tree_batch(*case, vocab, args.device) if tree else make_batch(*case, vocab, args.device)
    row = {"tree" if tree else "case": case}
    for side in sides:
        fn, kw = SIDES[side][0], kwargs[side]
        try:
            if args.device == "cuda":
                t, mem, times = measure(fn, models[side], batch, 1, args.iters, **kw)
            else:
                t, mem, times = _cpu_time(fn, models[side], batch, kw, side in FLEX_SIDES), 0.0, []
            row[side] = {"s": round(t, 4), "peak_gib": round(mem, 1), "times": [round(x, 4) for x in times]}
            if args.device == "cpu" and side in FLEX_SIDES:
                row[side]["forward_only"] = True
        except Exception as e:
            row[side] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            models[side].zero_grad(set_to_none=True)
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    rivals = [row[s]["s"] for s in sides if s not in ("zorro", "naive") and "s" in row.get(s, {})
              and not row[s].get("forward_only")]
    if "s" in row.get("zorro", {}) and rivals:
        row["zorro_speedup_over_best_rival"] = round(min(rivals) / row["zorro"]["s"], 2)
    if "s" in row.get("zorro", {}) and "s" in row.get("naive", {}):
        row["zorro_speedup_over_naive"] = round(row["naive"]["s"] / row["zorro"]["s"], 2)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="1.7b", choices=sorted(SHAPES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--cases", default=json.dumps(CASES), help="JSON list of [prompts, G, P, R, ragged]")
    parser.add_argument("--tree-cases", default=json.dumps(TREE_CASES), help="JSON list of [prompts, b1, b2, P, T]")
    parser.add_argument("--error-case", default="[1,4,512,128,1]", help="the shape of the error check ([] off)")
    parser.add_argument("--tree-error-case", default="[2,2,2,256,64]", help="the tree shape of the error check ([] off)")
    parser.add_argument("--error-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="the sides' dtype in the error check (float32: exactness against the naive fp32 side)")
    parser.add_argument("--sides", default="naive,zorro,prefix_grouper,areal_tree,unsloth_pg")
    parser.add_argument("--areal-max-tokens", type=int, default=0,
                        help="AReaL's max_tokens_per_mb (0: the whole trie up to 32768 tokens, else 32768)")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=480.0, help="stop starting new cases past this")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    start = time.monotonic()
    sides, versions = register(args.sides.split(","))
    liger = False
    if args.device == "cuda":
        try:
            import liger_kernel  # noqa: F401

            liger = True
        except ImportError:
            pass
    zorro_backend = "cudnn" if args.device == "cuda" else "auto"  # auto on CPU: masked SDPA
    kwargs = {tree: {s: side_kwargs(s, tree, args.device, zorro_backend, args.areal_max_tokens) for s in sides}
              for tree in (False, True)}
    result = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__,
              "liger": liger, "versions": versions, "rows": [], "zorro_backend": zorro_backend,
              "command": " ".join(sys.argv)}
    vocab, dtype = SHAPES[args.model]["vocab_size"], getattr(torch, args.error_dtype)
    if json.loads(args.error_case):
        batch = make_batch(*json.loads(args.error_case), vocab, args.device)
        result["errors"] = errors(args.model, args.device, batch, sides, kwargs[False], dtype)
        print(json.dumps({"errors": result["errors"]}), flush=True)
    if json.loads(args.tree_error_case):
        batch = tree_batch(*json.loads(args.tree_error_case), vocab, args.device)
        result["tree_errors"] = errors(args.model, args.device, batch, sides, kwargs[True], dtype)
        print(json.dumps({"tree_errors": result["tree_errors"]}), flush=True)
    models = {}
    for side in sides:
        model = with_attention(build_model(args.model, args.device), SIDES[side][1])
        if side == "zorro" and liger:
            from arctic_rl.liger import apply_liger

            apply_liger(model)
        models[side] = model
    cases = [(c, False) for c in json.loads(args.cases)] + [(c, True) for c in json.loads(args.tree_cases)]
    for case, tree in cases:
        if time.monotonic() - start > args.budget_s:
            result["rows"].append({"tree" if tree else "case": case, "skipped": "time budget"})
            continue
        row = run_case(args, case, tree, sides, models, kwargs[tree])
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


def _cpu_time(fn, model, batch, kw, forward_only: bool = False) -> float:
    begin = time.perf_counter()
    if forward_only:  # no FlexAttention backward on the CPU
        with torch.no_grad():
            fn(model, *batch, 1.0, False, 0, **kw)
    else:
        train_step(fn, model, batch, **kw)
    return time.perf_counter() - begin


if __name__ == "__main__":
    main()
