"""``hpctrain-plan`` end to end: ranking, output, calibration and bad input."""
from __future__ import annotations

import json

import pytest

from hpctrain.planner.cli import main
from hpctrain.planner.plan import make_plan

LLAMA_64 = ["model=llama3-8b", "cluster=h100-80gb", "cluster.gpus=64", "trainer.global_batch_size=512",
            "trainer.seq_len=8192"]
GPT2_8 = ["model=gpt2-124m", "cluster=a100-80gb", "trainer.global_batch_size=64", "trainer.seq_len=1024"]


def _run(capsys, *argv: str):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def llama_json():
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(LLAMA_64 + ["--json", "--top", "20"])
    assert code == 0
    return json.loads(buf.getvalue())


def test_llama3_8b_on_64_h100_ranks_fitting_layouts(llama_json):
    plan = llama_json
    assert plan["model"]["params"] == 8_030_261_248
    # a known GPU's preset bandwidth is the line rate, scaled by NCCL's measured efficiency (cluster.py)
    assert plan["cluster"]["gpus"] == 64 and plan["cluster"]["sources"]["intra_busbw"] == "datasheet x NCCL efficiency"
    layouts = plan["layouts"]
    assert 0 < plan["fitting"] <= plan["considered"] and len(layouts) == 20
    steps = [e["time"]["total"] for e in layouts]
    # ranked by step time rounded to 3 significant digits (ties go to the simpler layout: search._rank_key)
    assert [float(f"{x:.3g}") for x in steps] == sorted(float(f"{x:.3g}") for x in steps)
    for e in layouts:
        lay = e["layout"]
        assert lay["tp"] * lay["cp"] * lay["ep"] * lay["dp"] * lay["pp"] == 64
        assert e["fits"] and e["memory"]["total"] <= plan["cluster"]["usable_bytes"]
        assert 0 < e["mfu"] < 1 and 0 <= e["bubble_fraction"] < 1
        # the step also holds the optimizer step (memory-bound, after the last backward) and what hidden
        # communication costs the compute beside it
        parts = (e["time"]["compute"] + e["time"]["bubble"] + sum(e["time"]["exposed"].values())
                 + e["time"]["optimizer"] + e["time"]["contention"])
        assert parts == pytest.approx(e["time"]["total"])
    best = plan["best"]
    lay = best["estimate"]["layout"]
    for key in ("tp", "cp", "ep", "dp", "pp"):
        assert f"parallel.{key}={lay[key]}" in best["overrides"]
    assert f"trainer.micro_batch_size={lay['micro_batch']}" in best["overrides"]
    assert best["command"].startswith("srun --nodes=8 --ntasks-per-node=8 ")
    assert "model=llama3-8b" in best["command"]
    # every key the planner emits is in the schema, and training accepts the layout as printed
    assert best["not_in_schema"] == [] and best["train_problems"] == []


def test_text_output_has_table_and_command(capsys):
    code, out, _ = _run(capsys, *GPT2_8, "--top", "3")
    assert code == 0
    for column in ("weights", "grads", "optim", "activ", "total GB", "step s", "bubble%", "MFU%"):
        assert column in out
    assert "run it with:" in out and "hpctrain-train model=gpt2-124m" in out
    assert out.count("\n") < 40


def test_calibration_replaces_datasheet_numbers(tmp_path, capsys):
    slow = tmp_path / "cal.json"
    slow.write_text(json.dumps({"matmul_tflops": 100, "intra_busbw_gbs": 100, "inter_busbw_gbs": 10}))
    plain = make_plan(GPT2_8)
    calibrated = make_plan(GPT2_8, str(slow))
    cluster = calibrated[3]
    assert cluster.matmul_flops == 100e12 and cluster.peak_flops == 312e12
    # a known GPU's default is its measured matmul rate (hardware.py), not an assumption
    assert (cluster.sources["matmul_tflops"] == "calibration"
            and plain[3].sources["matmul_tflops"] == "measured (MAMF table, sustained clock)")
    assert calibrated[0].best.time.total > plain[0].best.time.total

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"matmul_tflop": 100}))
    code, _, err = _run(capsys, *GPT2_8, "--calibration", str(bad))
    assert code == 2 and "unknown key(s) matmul_tflop" in err and "matmul_tflops" in err


@pytest.mark.parametrize("argv,expected", [
    (["model=llama3-1t", "cluster=h100-80gb"], ["unknown model preset 'llama3-1t'", "llama3-405b", "model.d_model"]),
    (["cluster=dgx-b300"], ["unknown cluster preset 'dgx-b300'", "h100-80gb"]),
    (["cluster=local"], ["does not say cluster.gpus, cluster.gpus_per_node, cluster.gpu_mem_gb, cluster.peak_tflops",
                         "cluster=h100-80gb"]),
    (["cluster=h100-80gb", "cluster.gpus=16", "cluster.inter_bw_gbs=500"],
     ["cluster.inter_bw_gbs=500 is larger than cluster.intra_bw_gbs=450", "swap"]),
    (["cluster=h100-80gb", "cluster.gpus=16", "cluster.inter_bw_gbs=0"], ["does not say cluster.inter_bw_gbs"]),
    (["cluster=h100-80gb", "cluster.gpus=12"], ["cluster.gpus=12 is not a whole number of 8-GPU nodes"]),
    (["cluster=h100-80gb", "cluster.gpus=16", "parallel.pipeline.layers=[a,b]"],
     ["parallel.pipeline.layers=[a,b]: give auto or the blocks of each pipeline stage"]),
    (["model=tiny", "cluster=h100-80gb", "cluster.gpus=16", "parallel.pp=2", "parallel.pipeline.layers=[1,2]"],
     ["parallel.pipeline.layers=1,2: needs 2 counts", "adding up to model.n_layers=2",
      "parallel.pipeline.layers in {[1,1]} instead of the pinned [1,2]"]),
])
def test_bad_input_says_what_is_missing(capsys, argv, expected):
    code, out, err = _run(capsys, *argv)
    assert code == 2 and out == ""
    for text in expected:
        assert text in err


def test_impossible_cluster_names_the_smallest_change(capsys):
    code, _, err = _run(capsys, "model=llama3-8b", "cluster=h100-80gb", "cluster.gpu_mem_gb=24",
                        "trainer.seq_len=4096", "trainer.global_batch_size=64",
                        "parallel.tp=1", "parallel.pp=1", "parallel.cp=1")
    assert code == 2
    # cluster.gpu_mem_gb is GiB (the marketed "GB" of HBM parts, cluster.py): 24 GiB x 0.9 = 23.2 GB usable
    assert "no layout fits in 23.2 GB usable per GPU (24 GiB x usable fraction)" in err
    assert "needs >= 1.08x more GPU memory (cluster.gpu_mem_gb >= 26)" in err
    assert "or cluster.gpus >= 16" in err
    assert "parallel.tp in {2, 4, 8} instead of the pinned 1" in err


def test_batch_no_layout_can_split(capsys):
    code, _, err = _run(capsys, "model=gpt2-124m", "cluster=h100-80gb", "cluster.gpus=16",
                        "trainer.global_batch_size=2", "parallel.tp=1", "parallel.pp=1", "parallel.cp=1")
    assert code == 2 and "no layout of 16 GPUs" in err and "is not divisible by dp(16)" in err
    # the smallest batch some layout splits is named, whatever rule each candidate broke first
    assert "valid with: trainer.global_batch_size=16 (" in err


def test_a_batch_too_small_for_the_gpus_names_the_batch(capsys):
    """A CPU-sized default batch on 2048 GPUs: every candidate breaks some rule (cp's chunk size most
    often), but the change to make is the batch."""
    code, _, err = _run(capsys, "model=gpt2-124m", "cluster=h100-80gb", "cluster.gpus=2048",
                        "trainer.global_batch_size=16")
    assert code == 2 and "valid with: trainer.global_batch_size=" in err
    size = int(err.split("valid with: trainer.global_batch_size=")[1].split()[0])
    assert size > 16 and main(["model=gpt2-124m", "cluster=h100-80gb", "cluster.gpus=2048",
                                f"trainer.global_batch_size={size}", "--top", "1"]) == 0


def test_knob_pins(capsys):
    plan = make_plan(GPT2_8, knob_pins={"zero": 1, "recompute": "full"})[0]
    assert {(e.layout.zero, e.layout.recompute) for e in plan.ranked} == {(1, "full")}
    code, _, err = _run(capsys, *GPT2_8, "--pin", "zero=5")
    assert code == 2 and "--pin zero=5: use zero=0..3" in err


def test_knob_config_keys_pin_like_pin(capsys):
    """The knobs' config keys (what the printed command uses) pin them too."""
    plan = make_plan(GPT2_8 + ["parallel.zero.stage=1", "model.recompute=full"])[0]
    assert {(e.layout.zero, e.layout.recompute) for e in plan.ranked} == {(1, "full")}
    code, out, _ = _run(capsys, *GPT2_8, "model.recompute=full")
    assert code == 0 and out.count("model.recompute=full") == 1  # in the command once, not twice
    code, _, err = _run(capsys, *GPT2_8, "model.recompute=sometimes")
    assert code == 2 and "model.recompute=sometimes: use zero=0..3, recompute=none|selective|full" in err
