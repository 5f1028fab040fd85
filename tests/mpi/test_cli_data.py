"""The data commands as ``mpiexec -n 2`` runs them, in this session's two
ranks (tests/mpi/cli_session.py; formerly real launches in
tests/launch/test_prepare_under_mpiexec.py, test_token_files_under_mpiexec.py
and test_validation_and_eval.py, whose counts are written for 2 ranks):

- ``hpctrain-prepare`` with real tokenizers (a BPE trained here with
  ``tokenizers`` on the built-in corpus, a SentencePiece model trained here;
  nothing downloaded) on JSON Lines, Parquet and text inputs: each rank
  writes a Megatron-format shard, rank 0 the manifest, and every document
  in the shards is the tokenizer's own encoding of the input document, with
  BOS where the tokenizer defines one and EOS after it. A bad line on one
  rank ends the job on every rank with one error line and no output.
- A truncated or odd-sized token file stops the job before step 1 with
  status 2 and one line (the file cut under a running job is
  tests/launch/test_token_files_under_mpiexec.py).
- Validation with a 70/30 blend of indexed shards, ``data.split`` and
  ``trainer.eval_every``; ``hpctrain-eval`` at another layout (tp 2) while
  another process holds the directory's lock; the README "Data" example.
"""
import gzip
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cli_session import command, metrics, run_main, train

from hpctrain.data.embedded import generate_corpus
from hpctrain.data.indexed import IndexedDataset, IndexedWriter

pytestmark = pytest.mark.mpi(min_size=2)
tokenizers = pytest.importorskip("tokenizers")
spm = pytest.importorskip("sentencepiece")
pa = pytest.importorskip("pyarrow")
zstandard = pytest.importorskip("zstandard")

LINES = generate_corpus(120000, seed=21).decode().splitlines()
SMALL = ["trainer.global_batch_size=8", "trainer.micro_batch_size=1", "trainer.seq_len=32"]


@pytest.fixture
def tmp(world, shared_tmp, monkeypatch):
    """shared_tmp as a Path, and the working directory."""
    monkeypatch.chdir(shared_tmp)
    return Path(shared_tmp)


def _on_rank_0(world, make):
    """``make()`` on rank 0 (it writes the inputs), its result on every rank."""
    got = make() if world.Get_rank() == 0 else None
    return world.bcast(got, root=0)


def _prepare(world, capfd, args):
    argv = [str(a) for a in args]
    return run_main(world, capfd, lambda: command("hpctrain-prepare")(argv))


def _documents(count, start, per=4):
    return ["\n".join(LINES[start + i * per: start + (i + 1) * per]) for i in range(count)]


def _shards(manifest_path):
    """[(shard prefix, its input files, its documents' ids)] in the manifest's order."""
    manifest = json.loads(manifest_path.read_text())
    out = []
    for shard in manifest["shards"]:
        ds = IndexedDataset(str(manifest_path.parent / shard["prefix"]))
        assert (ds.num_documents, ds.num_tokens) == (shard["num_documents"], shard["num_tokens"])
        out.append((shard["prefix"], shard["inputs"], [ds.document(d).tolist() for d in range(ds.num_documents)]))
    return manifest, out


def _bpe(path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(LINES, trainer)
    # BOS the way Llama's tokenizer.json says it: its post-processor puts <s> before every text
    tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    tok.save(str(path))
    return tok


def _bpe_on_rank_0(world, path):
    """The BPE tokenizer, trained on rank 0 and loaded on every rank."""
    from tokenizers import Tokenizer

    _on_rank_0(world, lambda: (_bpe(path), None)[1])
    return Tokenizer.from_file(str(path))


# -- hpctrain-prepare ---------------------------------------------------------------------------

def test_bpe_on_jsonl_and_parquet_two_ranks(world, capfd, tmp):
    import pyarrow.parquet as pq

    tok = _bpe_on_rank_0(world, tmp / "tokenizer.json")
    eos = tok.token_to_id("</s>")

    def write_inputs():
        inputs = {}  # path -> its documents, in order

        def jsonl(name, docs, opener=open):
            with opener(tmp / name, "wt") as f:
                for d in docs:
                    f.write(json.dumps({"id": len(d), "content": d}) + "\n")
            inputs[str(tmp / name)] = docs

        jsonl("a.jsonl", _documents(120, 0))
        jsonl("b.jsonl.gz", _documents(60, 500), gzip.open)
        with zstandard.open(tmp / "c.jsonl.zst", "wt") as f:
            for d in _documents(40, 800):
                f.write(json.dumps({"content": d}) + "\n")
        inputs[str(tmp / "c.jsonl.zst")] = _documents(40, 800)
        for name, start in (("d.parquet", 1000), ("e.parquet", 1400)):
            docs = _documents(90, start, per=3)
            pq.write_table(pa.table({"content": docs}), tmp / name, row_group_size=25)
            inputs[str(tmp / name)] = docs
        return inputs

    inputs = _on_rank_0(world, write_inputs)
    j = _prepare(world, capfd, [*inputs, "-o", tmp / "out" / "corpus", "--tokenizer", tmp / "tokenizer.json",
                                "--text-key", "content", "--workers", "2"])
    assert j.codes == [0, 0], j.out
    manifest, shards = _shards(tmp / "out" / "corpus.json")
    assert [s[0] for s in shards] == ["corpus_00000", "corpus_00001"]  # one shard per rank
    assert sorted(p for s in shards for p in s[1]) == sorted(inputs)  # every file, on one rank each
    expected_total = 0
    for prefix, files, got in shards:
        want = [tok.encode(d).ids + [eos] for f in files for d in inputs[f]]  # document for document, in input order
        assert got == want, prefix
        assert all(ids[0] == tok.token_to_id("<s>") for ids in got)
        expected_total += sum(map(len, want))
        own = json.loads((tmp / "out" / f"{prefix}.json").read_text())
        assert own["num_documents"] == len(want) and own["manifest"] == "corpus.json"
    assert manifest["num_tokens"] == expected_total and manifest["num_documents"] == sum(map(len, inputs.values()))
    assert (manifest["vocab_size"], manifest["bos_id"], manifest["eos_id"], manifest["dtype"]) == \
        (tok.get_vocab_size(), tok.token_to_id("<s>"), eos, "uint16")
    assert manifest["tokenizer"] == {"kind": "huggingface", "name": "tokenizer.json",
                                     "path": str(tmp / "tokenizer.json")}
    # rank 0 alone reports: one summary, no line from another rank
    assert j.out.count("hpctrain-prepare: wrote") == 1 and "error" not in j.out, j.out
    assert j.outputs[1].strip() == "", j.outputs[1]
    assert not list((tmp / "out").glob("*.tmp"))


def test_sentencepiece_on_text_two_ranks(world, capfd, tmp):
    def write_inputs():
        spm.SentencePieceTrainer.train(sentence_iterator=iter(LINES), model_prefix=str(tmp / "sp"), vocab_size=180,
                                       model_type="bpe", minloglevel=2)
        inputs = {}
        for k in range(3):
            docs = _documents(30 + 10 * k, 300 * k)
            (tmp / "txt").mkdir(exist_ok=True)
            (tmp / "txt" / f"part{k}.txt").write_text("\n\n".join(docs) + "\n")
            inputs[str(tmp / "txt" / f"part{k}.txt")] = docs
        return inputs

    inputs = _on_rank_0(world, write_inputs)
    sp = spm.SentencePieceProcessor(model_file=str(tmp / "sp.model"))
    j = _prepare(world, capfd, [tmp / "txt", "-o", tmp / "sp_out", "--tokenizer", tmp / "sp.model",
                                "--text-documents", "blank-line"])
    assert j.codes == [0, 0], j.out
    manifest, shards = _shards(tmp / "sp_out.json")
    assert len(shards) == 2 and (manifest["bos_id"], manifest["eos_id"]) == (sp.bos_id(), sp.eos_id())
    for prefix, files, got in shards:
        assert got == [sp.encode(d, add_bos=True, add_eos=True) for f in files for d in inputs[f]], prefix


def test_a_bad_line_on_one_rank_ends_every_rank_with_one_line(world, capfd, tmp):
    good, bad = tmp / "good.jsonl", tmp / "bad.jsonl"

    def write_inputs():
        good.write_text("".join(json.dumps({"text": d}) + "\n" for d in _documents(400, 0)))
        bad.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"txt": "no key"}) + "\n")

    _on_rank_0(world, write_inputs)
    j = _prepare(world, capfd, [good, bad, "-o", tmp / "out" / "c"])
    assert j.codes == [2, 2], j.out
    errors = [line for line in j.out.splitlines() if "error" in line.lower() and "hpctrain" in line]
    assert errors == [f"hpctrain: error: input {bad} line 2 has no key 'text' (its keys: txt); pass "
                      f"--text-key KEY, or fix the line"], j.out
    assert "Traceback" not in j.out
    assert not (tmp / "out").exists() or not list((tmp / "out").iterdir())  # no shard, no manifest


# -- damaged token files ------------------------------------------------------------------------

@pytest.mark.parametrize("size,fragment", [(6000, "found 6000 (3000 tokens)"),
                                           (11999, "found 11999 (not a whole number of 2-byte tokens)")],
                         ids=["truncated-by-half", "odd-sized"])
def test_a_damaged_token_file_stops_every_rank_before_step_1(world, capfd, tmp, size, fragment):
    from hpctrain.data.prepare import prepare

    out = tmp / "t.bin"

    def write_inputs():
        (tmp / "in.txt").write_bytes(generate_corpus(6000, seed=7))
        prepare(str(tmp / "in.txt"), str(out))
        os.truncate(out, size)

    _on_rank_0(world, write_inputs)
    j = train(world, capfd, ["data=tokens", f"data.path={out}", "trainer.steps=2"], tmp / "run",
              quiet=["trainer.progress=off"])
    assert j.codes == [2, 2], j.out
    [line] = j.errors("")
    assert f"hpctrain: error: data.path={out} is truncated: expected 12000 bytes (6000 uint16 tokens" in line, line
    assert fragment in line and "copy it again, or re-run hpctrain-prepare" in line, line
    assert "Traceback" not in j.out and not (tmp / "run" / "metrics.jsonl").exists()


# -- validation and hpctrain-eval ---------------------------------------------------------------

VOCAB = 300


def _shards_70_30(root):
    rng = np.random.default_rng(3)
    for name, count, (low, high) in (("books", 60, (1, 150)), ("web", 60, (150, VOCAB))):
        prefix = f"{root}/{name}"
        with IndexedWriter(prefix, np.uint16) as w:
            for _ in range(count):
                w.add_document(np.append(rng.integers(low, high, size=int(rng.integers(5, 60))), 0))
        with open(prefix + ".json", "w") as f:  # what hpctrain-prepare writes beside a shard
            json.dump({"vocab_size": VOCAB, "eos_id": 0}, f)


def _blend(root):
    return (f"data.blend=[{{paths:[{root}/books],weight:0.7,name:books}},"
            f"{{paths:[{root}/web],weight:0.3,name:web}}]")


def test_validation_in_training_and_hpctrain_eval_at_another_layout(world, capfd, tmp):
    _on_rank_0(world, lambda: _shards_70_30(tmp))
    data = ["data=indexed", _blend(tmp), "data.split=0.1", "model.vocab_size=auto", "trainer.eval_batches=2",
            f"checkpoint.dir={tmp}/ckpt", *SMALL]
    q = ["trainer.progress=off"]
    r = train(world, capfd, [*data, "trainer.steps=4", "trainer.eval_every=2", "checkpoint.every=4"],
              tmp / "train", quiet=q)
    assert r.codes == [0, 0], r.out[-3000:]
    rows = metrics(tmp / "train")
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert [("val_loss" in row) for row in rows] == [False, True, False, True]
    for row in (rows[1], rows[3]):
        assert {"val_loss.books", "val_loss.web"} <= set(row)
        assert row["val_ppl"] == pytest.approx(math.exp(row["val_loss"]), rel=1e-9)
        assert row["val_loss"] == pytest.approx(0.7 * row["val_loss.books"] + 0.3 * row["val_loss.web"], rel=1e-9)
    assert all(row["data_wait_s"] >= 0 for row in rows)
    log = (tmp / "train" / "train.log").read_text()
    assert "step 4: validation loss" in log and "(books " in log, log
    assert f"model.vocab_size=auto: {VOCAB}, the data tokenizer's vocabulary" in r.out
    if world.Get_rank() == 0:
        _the_run_reads_back_with_its_vocabulary(tmp / "train")
    world.Barrier()

    # as while the training job still runs: another process holds the checkpoint directory's lock,
    # which hpctrain-eval (it saves nothing) does not need
    holder = None
    if world.Get_rank() == 0:
        holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom hpctrain_h5ckpt import lock\n"
                                   "lock.acquire(sys.argv[1])\nprint('held', flush=True)\ntime.sleep(600)",
                                   f"{tmp}/ckpt"], stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "held"
    try:
        # another optimizer than the one that saved (AdamW): eval takes no step, so it is not refused
        e = train(world, capfd, [*data, "parallel.tp=2", "optim=lars", "checkpoint.resume=auto"], tmp / "eval",
                  quiet=q, evaluate=True)
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
    assert e.codes == [0, 0], e.out[-3000:]
    assert "nothing to resume from" not in e.out and "in use" not in e.out, e.out
    found = json.loads((tmp / "eval" / "validation.json").read_text())
    assert found["step"] == 4
    for key in ("val_loss", "val_loss.books", "val_loss.web"):
        # the same weights and batches at tp 2 instead of dp 2: fp32 sums in another order
        assert found[key] == pytest.approx(rows[3][key], rel=1e-6), key
    assert not (tmp / "eval" / "metrics.jsonl").exists()  # no training step ran

    empty = [o for o in data if not o.startswith("checkpoint.dir=")] + [f"checkpoint.dir={tmp}/empty"]
    none = train(world, capfd, [*empty, "checkpoint.resume=auto"], tmp / "none", quiet=q, evaluate=True)
    assert none.codes == [2, 2], none.out[-3000:]
    [line] = none.errors()
    assert f"checkpoint.resume=auto found no checkpoint in {tmp}/empty" in line, line
    assert "nothing to resume from" not in none.out and not (tmp / "empty").exists(), none.out

    bad = train(world, capfd, [*SMALL, f"checkpoint.dir={tmp}/ckpt", "checkpoint.resume=auto"], tmp / "bad",
                quiet=q, evaluate=True)
    assert bad.codes == [2, 2], bad.out[-3000:]
    [line] = bad.errors()
    assert "hpctrain-eval needs validation data: data.source=indexed with data.split=<fraction>" in line, line
    assert "Traceback" not in bad.out


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


def test_the_readme_data_example(world, capfd, tmp):
    """README "Data": a JSON Lines corpus (gzip) and a tokenizer.json (a BPE
    trained here) through ``mpirun -n 2 hpctrain-prepare``, then training on
    the manifest with ``model.vocab_size=auto``, ``data.split`` and
    validation, then ``hpctrain-eval`` on the checkpoint."""
    tok = _bpe_on_rank_0(world, tmp / "tokenizer.json")

    def write_inputs():
        (tmp / "corpus").mkdir()
        for part in range(2):
            with gzip.open(tmp / "corpus" / f"part{part}.jsonl.gz", "wt") as f:
                for i in range(150):
                    f.write(json.dumps({"text": "\n".join(LINES[(part * 150 + i) * 3:(part * 150 + i + 1) * 3])})
                            + "\n")

    _on_rank_0(world, write_inputs)
    p = _prepare(world, capfd, [f"{tmp}/corpus/*.jsonl.gz", "--tokenizer", tmp / "tokenizer.json", "--text-key",
                                "text", "-o", tmp / "data" / "corpus"])
    assert p.codes == [0, 0], p.out[-3000:]
    data = ["data=indexed", f"data.paths=[{tmp}/data/corpus.json]", "model.vocab_size=auto", "data.split=0.05",
            f"checkpoint.dir={tmp}/ckpt", *SMALL]
    q = ["trainer.progress=off"]
    r = train(world, capfd, [*data, "trainer.steps=3", "trainer.eval_every=2", "trainer.eval_batches=2",
                             "checkpoint.every=3"], tmp / "train", quiet=q)
    assert r.codes == [0, 0], r.out[-3000:]
    assert f"model.vocab_size=auto: {tok.get_vocab_size()}, the data tokenizer's vocabulary" in r.out
    rows = metrics(tmp / "train")
    assert [("val_loss" in row) for row in rows] == [False, True, True]
    e = train(world, capfd, [*data, "trainer.eval_batches=2", "checkpoint.resume=auto"], tmp / "eval", quiet=q,
              evaluate=True)
    assert e.codes == [0, 0], e.out[-3000:]
    found = json.loads((tmp / "eval" / "validation.json").read_text())
    assert found["step"] == 3 and found["val_loss"] == pytest.approx(rows[-1]["val_loss"], rel=1e-6)
