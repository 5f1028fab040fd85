"""``hpctrain.eager``'s start-up side: a run that compiles nothing never loads
torch's compiler, and ``prepare`` gives torch back its own wrappers before
anything compiles. Each check runs in a fresh interpreter: this test process
has loaded dynamo already (the compile tests), and then there is nothing to defer."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

RUN_AND_REPORT = """
import atexit, sys
atexit.register(lambda: print("torch._dynamo loaded:", "torch._dynamo" in sys.modules,
                              "torch._inductor loaded:", "torch._inductor" in sys.modules))
from hpctrain.cli import entry
sys.argv = ["hpctrain-train"] + sys.argv[1:]
entry()
"""


def _python(script: str, *args: str, cwd=None) -> str:
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args], capture_output=True, text=True,
                         timeout=300, cwd=cwd)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout


@pytest.mark.parametrize("overrides", [
    # deterministic (the default) without inductor's flag, the model built on meta, AdamW, a checkpoint
    ("checkpoint.every=2",),
    ("optim=muon",),  # hpctrain's own optimizer class, torch's functional AdamW inside
])
def test_a_run_that_compiles_nothing_never_loads_torchs_compiler(tmp_path, overrides):
    out = _python(RUN_AND_REPORT, "trainer.steps=2", "trainer.progress=off", f"hydra.run.dir={tmp_path}/run",
                  f"checkpoint.dir={tmp_path}/ckpt", *overrides, cwd=tmp_path)
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2  # it trained
    assert "torch._dynamo loaded: False torch._inductor loaded: False" in out


def test_the_plain_steps_match_torchs_and_prepare_puts_torchs_wrappers_back():
    out = _python("""
        import sys, torch
        from hpctrain import eager

        Adam, AdamW, SGD = torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD
        torch_step = {c: vars(c)["step"] for c in (Adam, SGD)}  # (AdamW steps with Adam's)
        torch_add_group = torch.optim.Optimizer.add_param_group.__wrapped__
        assert eager.defer_torch_marks() > 0

        def train(opt, model, steps=3):
            for _ in range(steps):
                model(torch.randn(4, 8)).square().sum().backward()
                opt.step()
                opt.zero_grad()
            return [p.detach().clone() for p in model.parameters()]

        def fresh(opt_cls, **kw):
            torch.manual_seed(0)
            model = torch.nn.Linear(8, 8)
            return opt_cls(model.parameters(), lr=0.1, **kw), model

        kinds = ((AdamW, {}), (SGD, {"momentum": 0.9}))
        plain = {c: train(*fresh(c, **kw)) for c, kw in kinds}
        print("after plain steps, dynamo loaded:", "torch._dynamo" in sys.modules)
        print("plain steps in place:", all(vars(c)["step"] is not s for c, s in torch_step.items()))
        built, model = fresh(SGD)  # an optimizer built before prepare keeps its step hooks
        calls = []
        built.register_step_pre_hook(lambda *a: calls.append("pre"))
        torch.manual_seed(1)
        def closure():
            built.zero_grad()
            loss = model(torch.randn(4, 8)).square().sum()
            loss.backward()
            return loss
        print("closure's loss returned:", isinstance(built.step(closure), torch.Tensor))

        eager.prepare()
        built.step(closure)
        print("hook still runs:", calls == ["pre", "pre"])
        print("torch's steps back:", vars(SGD)["step"].__wrapped__ is torch_step[SGD]
              and vars(AdamW)["step"].__wrapped__ is torch_step[Adam] and vars(Adam)["step"] is torch_step[Adam])
        print("torch's marks back:", "__dynamo_disable" not in torch_add_group.__dict__)
        for c, kw in kinds:
            same = all(torch.equal(a, b) for a, b in zip(train(*fresh(c, **kw)), plain[c]))
            print(c.__name__, "same parameters:", same, "grad mode kept:", torch.is_grad_enabled())
    """)
    assert "after plain steps, dynamo loaded: False" in out, out
    assert "plain steps in place: True" in out and "closure's loss returned: True" in out, out
    assert "hook still runs: True" in out, out
    assert "torch's steps back: True" in out and "torch's marks back: True" in out, out
    assert "AdamW same parameters: True grad mode kept: True" in out, out
    assert "SGD same parameters: True grad mode kept: True" in out, out


def test_a_step_taken_by_the_plain_step_builds_no_graph():
    """torch's wrapper steps with gradients off (unless ``differentiable``): the
    parameter update must not be recorded by autograd."""
    out = _python("""
        import torch
        from hpctrain import eager
        eager.defer_torch_marks()
        model = torch.nn.Linear(4, 4)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        print("grad_fn after step:", [p.grad_fn for p in model.parameters()],
              "state has grad:", any(t.requires_grad for s in opt.state.values() for t in s.values()))
    """)
    assert "grad_fn after step: [None, None] state has grad: False" in out, out


def test_the_heap_is_scanned_again_only_after_a_module_loaded():
    """A test session or a sweep builds many runs in one process: each run's
    ``defer_torch_marks`` must not walk the whole heap again (it cost more than the
    start-up it saves), but a module loaded since may hold new torch wrappers."""
    out = _python("""
        import gc, sys
        from hpctrain import eager
        scans = []
        real = gc.get_objects
        gc.get_objects = lambda *a, **k: scans.append(1) or real(*a, **k)
        eager.defer_torch_marks(); eager.defer_torch_marks()
        print("scans for two calls:", len(scans))
        import colorsys  # a module loaded since: wrappers may have come with it
        eager.defer_torch_marks()
        print("scans after an import:", len(scans))
    """)
    assert "scans for two calls: 1" in out and "scans after an import: 2" in out, out
