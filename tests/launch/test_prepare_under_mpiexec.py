"""``mpiexec -n 2 hpctrain-prepare`` with real tokenizers (a BPE trained
here with ``tokenizers`` on the built-in corpus, a SentencePiece model
trained here; nothing downloaded) on JSON Lines, Parquet and text inputs:
each rank writes a Megatron-format shard, rank 0 the manifest, and every
document in the shards is the tokenizer's own encoding of the input
document, with BOS where the tokenizer defines one and EOS after it. A bad
line on one rank ends the job on every rank with one error line and no
output."""
import gzip
import json
import os
import shutil
import subprocess
import sys

import pytest

from hpctrain.data.embedded import generate_corpus
from hpctrain.data.indexed import IndexedDataset

from test_launchers import MPIEXEC, TIMEOUT, _env

pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec")
tokenizers = pytest.importorskip("tokenizers")
spm = pytest.importorskip("sentencepiece")
pa = pytest.importorskip("pyarrow")
zstandard = pytest.importorskip("zstandard")

LINES = generate_corpus(120000, seed=21).decode().splitlines()


def _prepare_cmd():
    exe = shutil.which("hpctrain-prepare", path=os.path.dirname(sys.executable))
    return [exe] if exe else [sys.executable, "-m", "hpctrain.data.prepare"]


def _mpiexec(args, n=2):
    return subprocess.run([MPIEXEC, "-n", str(n), *_prepare_cmd(), *map(str, args)], env=_env(),
                          capture_output=True, text=True, timeout=TIMEOUT)


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


def test_bpe_on_jsonl_and_parquet_two_ranks(tmp_path):
    import pyarrow.parquet as pq

    tok = _bpe(tmp_path / "tokenizer.json")
    eos = tok.token_to_id("</s>")
    inputs = {}  # path -> its documents, in order

    def jsonl(name, docs, opener=open):
        with opener(tmp_path / name, "wt") as f:
            for d in docs:
                f.write(json.dumps({"id": len(d), "content": d}) + "\n")
        inputs[str(tmp_path / name)] = docs

    jsonl("a.jsonl", _documents(120, 0))
    jsonl("b.jsonl.gz", _documents(60, 500), gzip.open)
    with zstandard.open(tmp_path / "c.jsonl.zst", "wt") as f:
        for d in _documents(40, 800):
            f.write(json.dumps({"content": d}) + "\n")
    inputs[str(tmp_path / "c.jsonl.zst")] = _documents(40, 800)
    for name, start in (("d.parquet", 1000), ("e.parquet", 1400)):
        docs = _documents(90, start, per=3)
        pq.write_table(pa.table({"content": docs}), tmp_path / name, row_group_size=25)
        inputs[str(tmp_path / name)] = docs

    r = _mpiexec([*inputs, "-o", tmp_path / "out" / "corpus", "--tokenizer", tmp_path / "tokenizer.json",
                  "--text-key", "content", "--workers", "2"])
    assert r.returncode == 0, r.stderr
    manifest, shards = _shards(tmp_path / "out" / "corpus.json")
    assert [s[0] for s in shards] == ["corpus_00000", "corpus_00001"]  # one shard per rank
    assert sorted(p for s in shards for p in s[1]) == sorted(inputs)  # every file, on one rank each
    expected_total = 0
    for prefix, files, got in shards:
        want = [tok.encode(d).ids + [eos] for f in files for d in inputs[f]]  # document for document, in input order
        assert got == want, prefix
        assert all(ids[0] == tok.token_to_id("<s>") for ids in got)
        expected_total += sum(map(len, want))
        own = json.loads((tmp_path / "out" / f"{prefix}.json").read_text())
        assert own["num_documents"] == len(want) and own["manifest"] == "corpus.json"
    assert manifest["num_tokens"] == expected_total and manifest["num_documents"] == sum(map(len, inputs.values()))
    assert (manifest["vocab_size"], manifest["bos_id"], manifest["eos_id"], manifest["dtype"]) == \
        (tok.get_vocab_size(), tok.token_to_id("<s>"), eos, "uint16")
    assert manifest["tokenizer"] == {"kind": "huggingface", "name": "tokenizer.json",
                                     "path": str(tmp_path / "tokenizer.json")}
    # rank 0 alone reports: one summary, no line from another rank
    assert r.stdout.count("hpctrain-prepare: wrote") == 1 and "error" not in r.stderr
    assert not list((tmp_path / "out").glob("*.tmp"))


def test_sentencepiece_on_text_two_ranks(tmp_path):
    spm.SentencePieceTrainer.train(sentence_iterator=iter(LINES), model_prefix=str(tmp_path / "sp"), vocab_size=180,
                                   model_type="bpe", minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    inputs = {}
    for k in range(3):
        docs = _documents(30 + 10 * k, 300 * k)
        (tmp_path / "txt").mkdir(exist_ok=True)
        (tmp_path / "txt" / f"part{k}.txt").write_text("\n\n".join(docs) + "\n")
        inputs[str(tmp_path / "txt" / f"part{k}.txt")] = docs
    r = _mpiexec([tmp_path / "txt", "-o", tmp_path / "sp_out", "--tokenizer", tmp_path / "sp.model",
                  "--text-documents", "blank-line"])
    assert r.returncode == 0, r.stderr
    manifest, shards = _shards(tmp_path / "sp_out.json")
    assert len(shards) == 2 and (manifest["bos_id"], manifest["eos_id"]) == (sp.bos_id(), sp.eos_id())
    for prefix, files, got in shards:
        assert got == [sp.encode(d, add_bos=True, add_eos=True) for f in files for d in inputs[f]], prefix


def test_a_bad_line_on_one_rank_ends_every_rank_with_one_line(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"text": d}) + "\n" for d in _documents(400, 0)))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"txt": "no key"}) + "\n")
    r = _mpiexec([good, bad, "-o", tmp_path / "out" / "c"])
    assert r.returncode == 2
    errors = [line for line in r.stderr.splitlines() if "error" in line.lower() and "hpctrain" in line]
    assert errors == [f"hpctrain: error: input {bad} line 2 has no key 'text' (its keys: txt); pass "
                      f"--text-key KEY, or fix the line"], r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())  # no shard, no manifest
