"""The flex path's wrapper (block masks per window, soft-cap ``score_mod``, sinks from the
log-sum-exp, padding of unpadded cascade rows) equals the plain-torch ``eager_attention`` with the
dense mask, float64 on CPU. FlexAttention has no CPU backward and compiled flex needs a GPU, so
this runs flex's eager forward; gradients are checked on the GPU (``test_gpu_families.py``)."""

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

from arctic_rl.zorro import attention
from arctic_rl.zorro.attention import eager_attention, flex_layer_attention
from arctic_rl.zorro.features import AttentionFeatures
from arctic_rl.zorro.packed_mask import PackedMask
from arctic_rl.zorro.packing import pack_shared_prompts

PROMPTS = [[1] * 37, [2] * 130, [1] * 37, [3] * 5, [2] * 130]
LENGTHS = [20, 64, 90, 7, 1]


def packed(prompts_first: bool) -> PackedMask:
    ids = torch.ones(len(PROMPTS), max(LENGTHS), dtype=torch.long)
    layout = pack_shared_prompts(PROMPTS, ids, LENGTHS, pad_to_multiple=1 if prompts_first else 128, prompts_first=prompts_first)
    return PackedMask.of(layout, "sdpa", (AttentionFeatures(),), "test")


@pytest.mark.parametrize("prompts_first", [False, True], ids=["flex_row", "cascade_row_padded_for_flex"])
@pytest.mark.parametrize("window,softcap,sinks", [(None, None, False), (50, None, False), (None, 2.0, False),
                                                   (33, None, True), (None, None, True), (17, 1.5, True)])
def test_flex_wrapper_equals_eager(monkeypatch, prompts_first, window, softcap, sinks):
    monkeypatch.setattr(attention, "compiled_flex_attention", lambda: flex_attention)  # eager flex on CPU
    mask = packed(prompts_first)
    t = mask.num_tokens
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, t, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, t, 16, generator=g, dtype=torch.float64) for _ in range(2))
    sink = torch.randn(4, generator=g, dtype=torch.float64) if sinks else None
    with torch.no_grad():
        want = eager_attention(q, k, v, mask.dense_mask(window), 0.25, softcap, sink)
        got = flex_layer_attention(q, k, v, mask.block_mask(window), 0.25, softcap, sink)
    assert got.shape == want.shape == (1, t, 4, 16)
    real = mask.segment_ids >= 0  # padding rows of the flex row are never read
    atol = 1e-7 if sinks else 1e-10  # flex returns its log-sum-exp in fp32 even for float64 inputs
    torch.testing.assert_close(got[0, real], want[0, real], atol=atol, rtol=0)


def test_eager_sinks_match_an_explicit_extra_key():
    """A sink is one more logit per head with a zero value: append it as a key and compare."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=g, dtype=torch.float64) for _ in range(3))
    sink = torch.randn(2, generator=g, dtype=torch.float64)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    scores = torch.cat([(q @ k.transpose(-1, -2) * 0.5).masked_fill(~causal, float("-inf")),
                        sink.view(1, 2, 1, 1).expand(1, 2, 6, 1)], -1)
    want = (scores.softmax(-1)[..., :-1] @ v).transpose(1, 2)
    torch.testing.assert_close(eager_attention(q, k, v, None, 0.5, None, sink), want, atol=1e-12, rtol=0)


def test_eager_without_mask_is_causal_aligned_to_the_last_key():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 2, 2, 4, generator=g, dtype=torch.float64)  # 2 new queries after 3 cached keys
    k, v = (torch.randn(1, 2, 5, 4, generator=g, dtype=torch.float64) for _ in range(2))
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    torch.testing.assert_close(eager_attention(q, k, v, None, 0.5, 3.0), eager_attention(q, k, v, mask, 0.5, 3.0))
