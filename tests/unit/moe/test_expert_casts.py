"""Under bf16 autocast the experts' weights are cast once per forward, not once per run: a
forward whose rows reach each expert in several runs (one per source rank, as after the
all-to-all) saves one bf16 copy of the local weights for backward, and computes what the
per-run casts computed."""
import torch

from hpctrain_moe.experts import GroupedExperts

D, H, E = 16, 24, 4


def _saved_bf16_weight_bytes(experts, rows, segments):
    """Bytes of bf16 tensors of an expert weight's shape saved for backward by one forward."""
    shapes = {tuple(experts.w1.shape[1:]), tuple(experts.w2.shape[1:]), tuple(experts.w1.shape),
              tuple(experts.w2.shape)}
    saved = {}

    def pack(t):
        if t.dtype == torch.bfloat16 and tuple(t.shape) in shapes:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = experts(rows, segments)
    return out, sum(saved.values())


def test_each_expert_is_cast_once_per_forward_whatever_the_runs():
    torch.manual_seed(0)
    experts = GroupedExperts(D, H, E)
    for w in experts.parameters():
        torch.nn.init.normal_(w, std=0.1)
    sources = 4
    segments = [(e, 3) for _ in range(sources) for e in range(E)]  # every expert reached by every source
    rows = torch.randn(sum(n for _, n in segments), D, requires_grad=True)
    out, saved = _saved_bf16_weight_bytes(experts, rows, segments)
    weights = sum(w.numel() for w in experts.parameters()) * 2  # one bf16 copy of each stack
    assert saved == weights, (saved, weights)  # per-run casts saved sources x this

    # the same numbers as casting each run's slice (what autocast did)
    want, at = [], 0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for e, n in segments:
            x = rows[at:at + n]
            h = torch.nn.functional.silu(torch.nn.functional.linear(x, experts.w1[e])) * \
                torch.nn.functional.linear(x, experts.w3[e])
            want.append(torch.nn.functional.linear(h, experts.w2[e]))
            at += n
    assert torch.equal(out, torch.cat(want))
