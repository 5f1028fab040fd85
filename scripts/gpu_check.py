"""GPU paths of the MoE layer and the context-parallel attention, in one
process on one CUDA device (no MPI needed): run on a GPU node with
``python scripts/gpu_check.py`` from the repository root.

With torch's deterministic algorithms on (as the trainer sets them), it
checks on CUDA that:

- the MoE layer (dropless and with a capacity, softmax and sigmoid
  routers, shared experts) runs forward and backward, gives the CPU
  layer's output and gradients (fp32: 1e-4 relative plus 1e-5 of the
  largest element: GPU matrix products reassociate), and gives
  bit-identical results on a second run;
- under bf16 autocast its router still computes in fp32;
- the chunk-pair attention with online-softmax merge (ring attention's
  arithmetic) gives sdpa's causal output and gradients for a zigzag split.

Prints one line per check and exits 1 if any fails.
"""
from __future__ import annotations

import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path[:0] = [os.path.join(os.path.dirname(__file__), "..", "plugins"), os.path.join(os.path.dirname(__file__), "..")]

from hpctrain.data.sequence import SequenceLayout as Layout  # noqa: E402
from hpctrain.model.aux import collect_aux_losses  # noqa: E402

from hpctrain_cp.blocks import block_backward, block_forward, expand_kv, merge, pair_kind, reduce_kv  # noqa: E402
from hpctrain_moe.config import MoEConfig  # noqa: E402
from hpctrain_moe.layer import MoE  # noqa: E402

FAILED = []


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name} {detail}", flush=True)
    if not ok:
        FAILED.append(name)


def close(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-4, atol_scale: float = 1e-5) -> bool:
    a, b = a.detach().cpu().float(), b.detach().cpu().float()
    return bool(torch.allclose(a, b, rtol=rtol, atol=atol_scale * float(b.abs().max()) + 1e-12))


def moe_run(device: str, **kw):
    torch.manual_seed(0)
    layer = MoE(64, 96, MoEConfig(**kw))
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.1)
    layer = layer.to(device)
    x = torch.randn(4, 32, 64, generator=torch.Generator().manual_seed(1)).to(device).requires_grad_()
    with collect_aux_losses() as aux:
        out = layer(x)
    (out.square().mean() + aux.total()).backward()
    grads = {n: p.grad.detach().clone() for n, p in layer.named_parameters()}
    return out.detach(), x.grad.detach(), grads


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check", file=sys.stderr)
        return 2
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}", flush=True)
    for kw in (dict(num_experts=8, top_k=2), dict(num_experts=8, top_k=2, capacity_factor=0.5),
               dict(num_experts=8, top_k=1, router="sigmoid", shared_experts=1)):
        try:
            cpu, gpu, again = moe_run("cpu", **kw), moe_run("cuda", **kw), moe_run("cuda", **kw)
        except Exception as e:  # noqa: BLE001 - report and go on: one failure should not hide the others
            check(f"moe {kw}", False, f"raised {type(e).__name__}: {e}")
            continue
        same = close(gpu[0], cpu[0]) and close(gpu[1], cpu[1]) and all(close(gpu[2][n], cpu[2][n]) for n in cpu[2])
        check(f"moe {kw} equals cpu", same)
        bitwise = torch.equal(gpu[0], again[0]) and all(torch.equal(gpu[2][n], again[2][n]) for n in gpu[2])
        check(f"moe {kw} deterministic", bitwise)
    torch.manual_seed(0)
    layer = MoE(64, 96, MoEConfig(num_experts=4, top_k=2)).cuda()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.1)
    seen = []
    layer.router.register_forward_hook(lambda m, a, o: None)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = layer.router.logits(torch.randn(8, 64, device="cuda"), layer.router.weight)
        seen.append(logits.dtype)
        out = layer(torch.randn(2, 8, 64, device="cuda"))
    check("moe router fp32 under bf16 autocast", seen == [torch.float32] and torch.isfinite(out).all().item())

    # ring attention's arithmetic on CUDA, zigzag cp=2 simulated in one process
    b, h, hk, t, d, cp = 2, 8, 2, 256, 64, 2
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, n, t, d, generator=g).cuda().requires_grad_() for n in (h, hk, hk))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    dout = torch.randn_like(want)
    want.backward(dout)
    layout, chunk, scale = Layout.zigzag(cp), t // (2 * cp), 1 / math.sqrt(d)
    kx, vx = expand_kv(k.detach(), h), expand_kv(v.detach(), h)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(kx), torch.zeros_like(vx)
    ok = True
    for rank in range(cp):
        rows = layout.positions(rank, chunk).cuda()
        qr = q.detach()[:, :, rows]
        outs, lses = [], []
        for i, a in enumerate(layout.chunks[rank]):
            out = lse = None
            for c in range(2 * cp):
                kind = pair_kind(a, c)
                if kind:
                    o, o_lse = block_forward(qr[:, :, i * chunk:(i + 1) * chunk], kx[:, :, c * chunk:(c + 1) * chunk],
                                             vx[:, :, c * chunk:(c + 1) * chunk], scale, kind == "causal")
                    out, lse = merge(out, lse, o, o_lse)
            outs.append(out)
            lses.append(lse)
        out, lse = torch.cat(outs, 2), torch.cat(lses, 2)
        ok &= close(out, want.detach()[:, :, rows])
        gr = dout[:, :, rows]
        delta = (gr * out).sum(-1)
        for i, a in enumerate(layout.chunks[rank]):
            qs = slice(i * chunk, (i + 1) * chunk)
            for c in range(2 * cp):
                kind = pair_kind(a, c)
                if kind:
                    ks = slice(c * chunk, (c + 1) * chunk)
                    g_q, g_k, g_v = block_backward(qr[:, :, qs], kx[:, :, ks], vx[:, :, ks], scale, kind == "causal",
                                                   lse[:, :, qs], gr[:, :, qs], delta[:, :, qs])
                    dq[:, :, rows[qs]] += g_q
                    dk[:, :, ks] += g_k
                    dv[:, :, ks] += g_v
    ok &= close(dq, q.grad) and close(reduce_kv(dk, hk), k.grad) and close(reduce_kv(dv, hk), v.grad)
    check("ring attention chunk pairs equal sdpa on cuda (outputs, dq, dk, dv)", ok)
    print(f"{len(FAILED)} failed" if FAILED else "all checks passed", flush=True)
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
