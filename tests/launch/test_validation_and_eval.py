"""Validation as a user runs it, on shards in Megatron's indexed format:
``mpiexec -n 2 hpctrain-train`` with a 70/30 blend, ``data.split`` and
``trainer.eval_every`` writes the validation loss (per source too) and
perplexity to ``metrics.jsonl`` at the steps it validates and at the end,
and ``data_wait_s`` at every step; ``model.vocab_size=auto`` takes the
shards' recorded vocabulary. ``hpctrain-eval`` then validates the saved
checkpoint at another layout (tp 2), while another process holds the
directory's lock as a running training job would, and finds the run's last
validation loss; without a checkpoint or without validation data it stops
with one line and status 2."""
import json
import math
import subprocess
import sys

import numpy as np
import pytest
from test_layout_commands import MPIEXEC, SMALL, _launch

from hpctrain.data.indexed import IndexedWriter

pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec")

VOCAB = 300


def _shards(root):
    rng = np.random.default_rng(3)
    for name, count, (low, high) in (("books", 60, (1, 150)), ("web", 60, (150, VOCAB))):
        prefix = f"{root}/{name}"
        with IndexedWriter(prefix, np.uint16) as w:
            for _ in range(count):
                w.add_document(np.append(rng.integers(low, high, size=int(rng.integers(5, 60))), 0))
        with open(prefix + ".json", "w") as f:  # what hpctrain-prepare writes beside a shard
            json.dump({"vocab_size": VOCAB, "eos_id": 0}, f)
    return (f"data.blend=[{{paths:[{root}/books],weight:0.7,name:books}},"
            f"{{paths:[{root}/web],weight:0.3,name:web}}]")


def _errors(text):
    return [line for line in text.splitlines() if line.startswith("hpctrain: error:")]


def test_validation_in_training_and_hpctrain_eval_at_another_layout(tmp_path):
    data = ["data=indexed", _shards(tmp_path), "data.split=0.1", "model.vocab_size=auto", "trainer.eval_batches=2",
            f"checkpoint.dir={tmp_path}/ckpt", "trainer.progress=off", *SMALL]
    r = _launch(2, "hpctrain-train", *data, "trainer.steps=4", "trainer.eval_every=2", "checkpoint.every=4",
                f"hydra.run.dir={tmp_path}/train")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "train" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert [("val_loss" in row) for row in rows] == [False, True, False, True]
    for row in (rows[1], rows[3]):
        assert {"val_loss.books", "val_loss.web"} <= set(row)
        assert row["val_ppl"] == pytest.approx(math.exp(row["val_loss"]), rel=1e-9)
        assert row["val_loss"] == pytest.approx(0.7 * row["val_loss.books"] + 0.3 * row["val_loss.web"], rel=1e-9)
    assert all(row["data_wait_s"] >= 0 for row in rows)
    log = (tmp_path / "train" / "train.log").read_text()
    assert "step 4: validation loss" in log and "(books " in log, log
    assert f"model.vocab_size=auto: {VOCAB}, the data tokenizer's vocabulary" in r.stderr
    _the_run_reads_back_with_its_vocabulary(tmp_path / "train")

    # as while the training job still runs: another process holds the checkpoint directory's lock,
    # which hpctrain-eval (it saves nothing) does not need
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom hpctrain_h5ckpt import lock\n"
                               "lock.acquire(sys.argv[1])\nprint('held', flush=True)\ntime.sleep(600)",
                               f"{tmp_path}/ckpt"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        # another optimizer than the one that saved (AdamW): eval takes no step, so it is not refused
        e = _launch(2, "hpctrain-eval", *data, "parallel.tp=2", "optim=lars", "checkpoint.resume=auto",
                    f"hydra.run.dir={tmp_path}/eval")
    finally:
        holder.kill()
        holder.wait()
    assert e.returncode == 0, e.stderr[-3000:]
    assert "nothing to resume from" not in e.stderr and "in use" not in e.stderr, e.stderr
    found = json.loads((tmp_path / "eval" / "validation.json").read_text())
    assert found["step"] == 4
    for key in ("val_loss", "val_loss.books", "val_loss.web"):
        # the same weights and batches at tp 2 instead of dp 2: fp32 sums in another order
        assert found[key] == pytest.approx(rows[3][key], rel=1e-6), key
    assert not (tmp_path / "eval" / "metrics.jsonl").exists()  # no training step ran

    empty = [o for o in data if not o.startswith("checkpoint.dir=")] + [f"checkpoint.dir={tmp_path}/empty"]
    none = _launch(2, "hpctrain-eval", *empty, "checkpoint.resume=auto", f"hydra.run.dir={tmp_path}/none")
    assert none.returncode == 2, none.stderr[-3000:]
    [line] = _errors(none.stderr)
    assert f"checkpoint.resume=auto found no checkpoint in {tmp_path}/empty" in line, line
    assert "nothing to resume from" not in none.stderr and not (tmp_path / "empty").exists(), none.stderr

    bad = _launch(2, "hpctrain-eval", "trainer.progress=off", *SMALL, f"checkpoint.dir={tmp_path}/ckpt",
                  "checkpoint.resume=auto", f"hydra.run.dir={tmp_path}/bad")
    assert bad.returncode == 2, bad.stderr[-3000:]
    [line] = _errors(bad.stderr)
    assert "hpctrain-eval needs validation data: data.source=indexed with data.split=<fraction>" in line, line
    assert "Traceback" not in bad.stderr


def _the_run_reads_back_with_its_vocabulary(run):
    """The run records the config it trained with (``resolved_config.yaml``: the number ``auto`` became),
    so its report and ``hpctrain-plan --compare`` model the model it trained (they failed on ``auto``)."""
    import yaml

    from hpctrain.planner.cli import main as plan
    from hpctrain.report.cli import main as report

    assert yaml.safe_load((run / "resolved_config.yaml").read_text())["model"]["vocab_size"] == VOCAB
    assert yaml.safe_load((run / ".hydra" / "config.yaml").read_text())["model"]["vocab_size"] == "auto"
    assert plan(["--compare", str(run), "cluster=cpu-8"]) == 0
    assert report([str(run), "-o", str(run / "report.html")]) == 0
    page = (run / "report.html").read_text()
    assert "cannot model" not in page and "vocab_size=auto" not in page


def test_the_readme_data_example(tmp_path):
    """README "Data": a JSON Lines corpus (gzip) and a tokenizer.json (a BPE
    trained here) through ``mpirun -n 2 hpctrain-prepare``, then training on
    the manifest with ``model.vocab_size=auto``, ``data.split`` and
    validation, then ``hpctrain-eval`` on the checkpoint."""
    import gzip

    from test_prepare_under_mpiexec import LINES, _bpe, _mpiexec

    tok = _bpe(tmp_path / "tokenizer.json")
    (tmp_path / "corpus").mkdir()
    for part in range(2):
        with gzip.open(tmp_path / "corpus" / f"part{part}.jsonl.gz", "wt") as f:
            for i in range(150):
                f.write(json.dumps({"text": "\n".join(LINES[(part * 150 + i) * 3:(part * 150 + i + 1) * 3])}) + "\n")
    p = _mpiexec([f"{tmp_path}/corpus/*.jsonl.gz", "--tokenizer", tmp_path / "tokenizer.json", "--text-key", "text",
                  "-o", tmp_path / "data" / "corpus"])
    assert p.returncode == 0, p.stderr[-3000:]
    data = ["data=indexed", f"data.paths=[{tmp_path}/data/corpus.json]", "model.vocab_size=auto", "data.split=0.05",
            f"checkpoint.dir={tmp_path}/ckpt", "trainer.progress=off", *SMALL]
    r = _launch(2, "hpctrain-train", *data, "trainer.steps=3", "trainer.eval_every=2", "trainer.eval_batches=2",
                "checkpoint.every=3", f"hydra.run.dir={tmp_path}/train")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"model.vocab_size=auto: {tok.get_vocab_size()}, the data tokenizer's vocabulary" in r.stderr
    rows = [json.loads(line) for line in (tmp_path / "train" / "metrics.jsonl").read_text().splitlines()]
    assert [("val_loss" in row) for row in rows] == [False, True, True]
    e = _launch(2, "hpctrain-eval", *data, "trainer.eval_batches=2", "checkpoint.resume=auto",
                f"hydra.run.dir={tmp_path}/eval")
    assert e.returncode == 0, e.stderr[-3000:]
    found = json.loads((tmp_path / "eval" / "validation.json").read_text())
    assert found["step"] == 3 and found["val_loss"] == pytest.approx(rows[-1]["val_loss"], rel=1e-6)
