"""What the cascade's ``cudnn`` kernel relies on in torch's private cuDNN attention ops, checked on a GPU:

1. ``aten._scaled_dot_product_cudnn_attention`` returns the natural-log log-sum-exp ``[B, H, L, 1]``
   fp32, accepts strided ``[B, S, H, D]``-ordered views and native GQA;
2. its backward, given the *merged* output and log-sum-exp of two key halves, returns that half's
   exact share of the gradient (errors against an fp64 reference, next to the error of cuDNN's own
   backward);
3. per-layer fwd+bwd of a hand-built cuDNN cascade on the benchmark layouts (an upper bound for
   ``DenseBatched``, which adds the merge and reassembly).

    PYTHONPATH=$PWD python3 benchmarks/probes/cudnn_dense_semantics.py    # writes $OUT or ./cudnn_probe.json

Run of 2026-11-29 (H200, torch 2.11, cuDNN 9.19): lse error 8e-7 (natural log), GQA ok; merged backward
dq / dk / dv errors 2.5e-3 / 1.9e-3 / 1.4e-3 vs 1.9e-3 for cuDNN's own backward (gradients of scale 0.6);
cascade 3.46 / 2.59 / 9.72 / 37.69 ms per layer.
"""
import json, traceback, torch
from benchmarks.probes.zorro_attention_kernels import bench
aten = torch.ops.aten
dev = "cuda"
torch.manual_seed(0)
R = {}
def log(k, v):
    R[k] = v; print(json.dumps({k: v}), flush=True)

def fwd(q, k, v, causal, scale):
    o = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    return o[0], o[1], (o[6], o[7], o[2], o[3], o[4], o[5])
BIAS = [None]
def bwd(do, q, k, v, out, lse, aux, causal, scale):
    seed, off, cq, ck, mq, mk = aux
    return aten._scaled_dot_product_cudnn_attention_backward(do, q, k, v, out, lse, seed, off, BIAS[0], cq, ck, mq, mk, 0.0, causal, scale=scale)

def ref(q, k, v, causal, scale):
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    if causal:
        L, S = s.shape[-2:]
        s = s.masked_fill(~torch.ones(L, S, dtype=torch.bool, device=dev).tril(), float("-inf"))
    return torch.softmax(s, -1) @ v.double(), torch.logsumexp(s, -1)

# 1. semantics
try:
    B, H, S, D = 2, 4, 256, 128
    q, k, v = (torch.randn(B, H, S, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
    for causal in (False, True):
        out, lse, aux = fwd(q, k, v, causal, D ** -0.5)
        ro, rl = ref(q, k, v, causal, D ** -0.5)
        log(f"sem_causal{causal}", dict(out_shape=list(out.shape), out_stride=list(out.stride()), lse_shape=list(lse.shape), lse_dtype=str(lse.dtype),
            out_err=(out.double() - ro).abs().max().item(), lse_err=(lse.double().reshape(rl.shape) - rl).abs().max().item(),
            lse_err_log2=(lse.double().reshape(rl.shape) - rl / 0.6931471805599453).abs().max().item()))
    # strided input: [B, S, H, D] transposed
    qs = torch.randn(B, S, H, D, device=dev, dtype=torch.bfloat16).transpose(1, 2)
    out, lse, aux = fwd(qs, k, v, True, D ** -0.5)
    log("strided_ok", dict(out_stride=list(out.stride()), err=(out.double() - ref(qs, k, v, True, D ** -0.5)[0]).abs().max().item()))
except Exception as e:
    log("sem_error", traceback.format_exc()[-1500:])
try:
    k2 = torch.randn(B, 2, S, D, device=dev, dtype=torch.bfloat16)
    out, lse, aux = fwd(q, k2, k2, True, D ** -0.5)
    torch.cuda.synchronize()
    log("gqa_native", dict(err=(out.double() - ref(q, k2.repeat_interleave(2, 1), k2.repeat_interleave(2, 1), True, D ** -0.5)[0]).abs().max().item()))
except Exception as e:
    log("gqa_native_error", repr(e)[:600])

# 2/3. backward with own and merged stats
def merged_check(bias_choice):
    BIAS[0] = bias_choice
    B, H, Sq, Sk, D = 1, 4, 384, 512, 128
    scale = D ** -0.5
    q = torch.randn(B, H, Sq, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(B, H, Sk, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(B, H, Sk, D, device=dev, dtype=torch.bfloat16)
    do = torch.randn(B, H, Sq, D, device=dev, dtype=torch.bfloat16)
    qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
    o = torch.softmax((qr @ kr.transpose(-1, -2)) * scale, -1) @ vr
    o.backward(do.double())
    # own stats, full
    out, lse, aux = fwd(q, k, v, False, scale)
    dq, dk, dv = bwd(do, q, k, v, out, lse, aux, False, scale)
    own = max((a.double() - b.grad).abs().max().item() for a, b in zip((dq, dk, dv), (qr, kr, vr)))
    # two parts merged
    h = 256
    o1, l1, a1 = fwd(q, k[:, :, :h].contiguous(), v[:, :, :h].contiguous(), False, scale)
    o2, l2, a2 = fwd(q, k[:, :, h:].contiguous(), v[:, :, h:].contiguous(), False, scale)
    l1f, l2f = l1.float(), l2.float()
    lm = torch.logaddexp(l1f, l2f)
    w1, w2 = torch.exp(l1f - lm), torch.exp(l2f - lm)
    shape = lambda w: w.reshape(B, H, Sq, 1)
    om = (o1.float() * shape(w1) + o2.float() * shape(w2)).to(torch.bfloat16)
    lm = lm.reshape(l1.shape).to(l1.dtype).contiguous()
    om_c = om.contiguous()
    g1 = bwd(do, q, k[:, :, :h].contiguous(), v[:, :, :h].contiguous(), om_c, lm, a1, False, scale)
    g2 = bwd(do, q, k[:, :, h:].contiguous(), v[:, :, h:].contiguous(), om_c, lm, a2, False, scale)
    dqm = g1[0].double() + g2[0].double()
    dkm = torch.cat([g1[1], g2[1]], 2).double(); dvm = torch.cat([g1[2], g2[2]], 2).double()
    merged = dict(out=(om.double() - o).abs().max().item(), dq=(dqm - qr.grad).abs().max().item(), dk=(dkm - kr.grad).abs().max().item(), dv=(dvm - vr.grad).abs().max().item())
    return dict(own_grad_err=own, merged=merged, grad_scale=max(x.grad.abs().max().item() for x in (qr, kr, vr)))
for name, choice in (("None", None), ("empty", torch.empty(0, device=dev))):
    try:
        log(f"bwd_bias_{name}", merged_check(choice))
        break
    except Exception as e:
        log(f"bwd_bias_{name}_error", traceback.format_exc()[-800:])

# 4. cascade on cuDNN, per layer fwd+bwd, equal lengths, prompts-first packed [T, H, D] as the model gives
Hq, Hkv, D = 16, 8, 128
for case in ([2, 8, 4096, 512], [2, 8, 1024, 1024], [1, 16, 8192, 1024], [1, 16, 16384, 2048]):
    n, G, P, Rr = case
    try:
        T = n * (P + G * Rr); Tp = n * P; scale = D ** -0.5
        q = torch.randn(T, Hq, D, device=dev, dtype=torch.bfloat16)
        k = torch.randn(T, Hkv, D, device=dev, dtype=torch.bfloat16)
        v = torch.randn(T, Hkv, D, device=dev, dtype=torch.bfloat16)
        do = torch.randn(T, Hq, D, device=dev, dtype=torch.bfloat16)
        def step():
            ke = k.repeat_interleave(Hq // Hkv, 1); ve = v.repeat_interleave(Hq // Hkv, 1)
            bh = lambda x, b, L: x.view(b, L, Hq, D).transpose(1, 2)
            qp, kp, vp = bh(q[:Tp], n, P), bh(ke[:Tp], n, P), bh(ve[:Tp], n, P)
            qr_, kr_, vr_ = bh(q[Tp:], n * G, Rr), bh(ke[Tp:], n * G, Rr), bh(ve[Tp:], n * G, Rr)
            qg = bh(q[Tp:], n, G * Rr)
            op, lp, ap = fwd(qp, kp, vp, True, scale)
            orr, lr, ar = fwd(qr_, kr_, vr_, True, scale)
            ob, lb, ab = fwd(qg, kp, vp, False, scale)
            lrf = lr.float().reshape(n, G, Hq, Rr).transpose(1, 2).reshape(n, Hq, G * Rr)
            lbf = lb.float().reshape(n, Hq, G * Rr)
            lm = torch.logaddexp(lrf, lbf)
            orr_g = orr.transpose(1, 2).reshape(n, G * Rr, Hq, D).transpose(1, 2)
            om = (orr_g.float() * torch.exp(lrf - lm)[..., None] + ob.float() * torch.exp(lbf - lm)[..., None]).to(torch.bfloat16)
            # backward
            dop = bh(do[:Tp], n, P); dor = bh(do[Tp:], n * G, Rr); dog = bh(do[Tp:], n, G * Rr)
            gp = bwd(dop, qp, kp, vp, op, lp, ap, True, scale)
            om_r = om.transpose(1, 2).reshape(n * G, Rr, Hq, D).transpose(1, 2)
            lm_r = lm.reshape(n, Hq, G, Rr).transpose(1, 2).reshape(lr.shape).contiguous()
            gr = bwd(dor, qr_, kr_, vr_, om_r, lm_r, ar, True, scale)
            gb = bwd(dog, qg, kp, vp, om, lm.reshape(lb.shape).contiguous(), ab, False, scale)
            return gp, gr, gb
        ms = round(bench(step), 3)
        pairs = n * (P * (P + 1) // 2 + G * (Rr * P + Rr * (Rr + 1) // 2))
        log(f"cudnn_cascade_{case}", dict(ms=ms, tflops=round(3.5 * 4 * Hq * D * pairs / ms / 1e9, 1)))
    except Exception as e:
        log(f"cudnn_cascade_{case}_error", traceback.format_exc()[-1200:])
json.dump(R, open(__import__("os").environ.get("OUT", ".") + "/cudnn_probe.json", "w"), indent=1)
