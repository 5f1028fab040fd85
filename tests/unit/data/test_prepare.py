import json

import numpy as np
import pytest

from hpctrain.data.prepare import main, prepare
from hpctrain.data.sources import check_data_config, token_file_source
from hpctrain.data.tokenfile import TokenFile


def test_prepare_round_trip(tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("hello, cluster\n" * 50)
    out = tmp_path / "data" / "tokens.bin"
    n = prepare(str(src), str(out), "uint32")
    assert n == 15 * 50
    meta = json.loads((tmp_path / "data" / "tokens.json").read_text())
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 256 and meta["num_tokens"] == n
    source = token_file_source(str(out))
    assert isinstance(source.tokens, TokenFile) and len(source) == n  # read window by window, not mapped
    assert bytes(source.tokens[:14].astype(np.uint8)) == b"hello, cluster"


def test_prepare_cli_reports_missing_input(tmp_path, capsys):
    assert main([str(tmp_path / "nope.txt"), str(tmp_path / "x.bin")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_data_checks_name_the_fix(make_config, tmp_path):
    cfg = make_config("data=tokens", f"data.path={tmp_path}/missing.bin")
    problems = check_data_config(cfg.data, 64, 256)
    assert problems and "hpctrain-prepare" in problems[0] and "does not exist" in problems[0]
    cfg = make_config("data=tokens")
    assert "needs data.path" in check_data_config(cfg.data, 64, 256)[0]


def test_training_on_a_prepared_file(make_config, tmp_path):
    from hpctrain.run import reference_run

    src = tmp_path / "in.txt"
    src.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    prepare(str(src), str(tmp_path / "t.bin"))
    cfg = make_config("data=tokens", f"data.path={tmp_path}/t.bin", "trainer.steps=8", "trainer.log_every=100")
    hist = reference_run(cfg)
    assert len(hist) == 8 and hist[-1]["loss"] < hist[0]["loss"]


# -- hpctrain-prepare: documents into Megatron-format shards (one process; tests/launch runs it under mpiexec) --

import gzip  # noqa: E402

from hpctrain.data.indexed import IndexedDataset  # noqa: E402
from hpctrain.data.prepare import balance  # noqa: E402


def _run(argv, capsys):
    code = main([str(a) for a in argv] + ["--quiet"])
    out, err = capsys.readouterr()
    return code, out, err


def _docs(prefix):
    ds = IndexedDataset(str(prefix))
    return [bytes(ds.document(i).astype(np.uint8)) for i in range(ds.num_documents)]


@pytest.mark.parametrize("mode,expected", [
    ("file", [b"a b\n\n\nc\r\nd\n\n\0"]),
    ("blank-line", [b"a b\0", b"c\r\nd\0"]),
    ("line", [b"a b\0", b"c\0", b"d\0"]),
])
def test_plain_text_documents(tmp_path, capsys, mode, expected):
    (tmp_path / "t.txt").write_bytes(b"a b\n\n\nc\r\nd\n\n")
    code, out, err = _run([tmp_path / "t.txt", "-o", tmp_path / "o", "--text-documents", mode], capsys)
    assert code == 0, err
    assert _docs(tmp_path / "o") == expected  # bytes: EOS is 0 after every document
    meta = json.loads((tmp_path / "o.json").read_text())
    assert meta["num_documents"] == len(expected) and meta["eos_id"] == 0 and meta["bos_id"] is None
    assert meta["shards"] == [{"prefix": "o", "num_tokens": sum(map(len, expected)), "num_documents": len(expected),
                               "inputs": [str(tmp_path / "t.txt")]}]
    assert out.startswith(f"hpctrain-prepare: wrote {len(expected)} document")


def test_a_large_text_file_is_one_document_read_in_pieces(tmp_path, capsys, monkeypatch):
    from hpctrain.data import inputs

    monkeypatch.setattr(inputs, "PIECE_BYTES", 1000)
    data = bytes(range(1, 256)) * 20  # 5100 bytes: six pieces
    (tmp_path / "big.txt").write_bytes(data)
    assert _run([tmp_path / "big.txt", "-o", tmp_path / "o"], capsys)[0] == 0
    assert _docs(tmp_path / "o") == [data + b"\0"]


def test_compressed_files_directories_globs_and_the_old_form(tmp_path, capsys):
    import zstandard

    d = tmp_path / "in"
    (d / "sub").mkdir(parents=True)
    (d / "a.jsonl").write_text('{"text": "one"}\n\n{"text": ""}\n{"text": null}\n{"text": "two"}\n')
    (d / "sub" / "b.jsonl.gz").write_bytes(gzip.compress(b'{"text": "three"}\n'))
    zst = zstandard.ZstdCompressor()
    (d / "sub" / "c.txt.zst").write_bytes(zst.compress(b"fo") + zst.compress(b"ur"))  # two frames, one text
    (d / "README").write_text("not an input: no known extension")
    (d / ".hidden.txt").write_text("hidden")
    assert _run([d, "-o", tmp_path / "dir"], capsys)[0] == 0
    assert _docs(tmp_path / "dir") == [b"one\0", b"two\0", b"three\0", b"four\0"]  # empty and null skipped
    assert _run([f"{d}/**/*.*", "-o", tmp_path / "glob"], capsys)[0] == 0
    assert _docs(tmp_path / "glob") == [b"one\0", b"two\0", b"three\0", b"four\0"]
    assert _run([d / "a.jsonl", d / "README", tmp_path / "old.bin"], capsys)[0] == 0  # INPUT... OUT.bin
    assert _docs(tmp_path / "old") == [b"one\0", b"two\0", b"not an input: no known extension\0"]


def test_parquet_column(tmp_path, capsys):
    import pyarrow as pa  # the test extra installs it
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": [1, 2, 3], "body": ["x y", None, "z"]}), tmp_path / "p.parquet")
    assert _run([tmp_path / "p.parquet", "-o", tmp_path / "o", "--text-key", "body"], capsys)[0] == 0
    assert _docs(tmp_path / "o") == [b"x y\0", b"z\0"]


def test_files_are_balanced_over_ranks_by_size():
    assert balance([10, 1, 1, 9, 5, 5], 2) == [[0, 2, 5], [1, 3, 4]]  # 16 and 15 bytes, each list in input order
    assert balance([7, 7, 7], 4) == [[0], [1], [2], []]  # a file is never split: a rank may get none


# -- every bad input: one "hpctrain: error:" line naming the file (and line) and the fix, exit 2 --

def _bpe(tmp_path, specials=("</s>",)):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["the quick fox", "the lazy dog"], trainers.BpeTrainer(
        vocab_size=300, special_tokens=list(specials), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.save(str(tmp_path / "tok.json"))
    return str(tmp_path / "tok.json")


def _write(tmp_path, name, data):
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.write_bytes if isinstance(data, bytes) else path.write_text)(data)
    return str(path)


def _parquet(tmp_path, name, **columns):
    import pyarrow as pa  # the test extra installs it
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), tmp_path / name)
    return str(tmp_path / name)


def _good(tmp_path):
    return _write(tmp_path, "good.txt", "fine")


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _chat_tokenizer(tmp_path, template=CHATML):
    """A model directory as transformers saves it: the BPE above with a chat template (None: none)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast  # the test extra installs it (the hf extra does for users)

    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(_bpe(tmp_path, ("</s>", "<|im_start|>",
                                                                                        "<|im_end|>"))),
                                   eos_token="</s>")
    if template is not None:
        fast.chat_template = template
    fast.save_pretrained(str(tmp_path / "model"))
    return str(tmp_path / "model")


def _chat(tmp_path, name, *lines):
    return _write(tmp_path, name, "".join(json.dumps(line) + "\n" for line in lines))


def _turns(*roles):
    return {"messages": [{"role": r, "content": f"the {r} says"} for r in roles]}


# each row: (arguments before -o, fragments the one line must hold)
BAD_INPUTS = {
    "missing-input": lambda t: ([f"{t}/nope.txt"], [f"input {t}/nope.txt does not exist", "a directory or a glob"]),
    "empty-directory": lambda t: (
        [(t / "d").mkdir() or f"{t}/d"],
        [f"input directory {t}/d holds no file with a known extension", "name the files"]),
    "glob-matches-nothing": lambda t: (
        [f"{t}/*.jsonl"],
        [f"input pattern {t}/*.jsonl matches no file", "quote the pattern"]),
    "missing-tokenizer": lambda t: (
        [_good(t), "--tokenizer", f"{t}/tok.json"],
        [f"--tokenizer {t}/tok.json does not exist", "local files only"]),
    "broken-tokenizer-json": lambda t: (
        [_good(t), "--tokenizer", _write(t, "tok.json", '{"model": 1}')],
        ["cannot be loaded by the tokenizers library", "give a tokenizer.json"]),
    "broken-sentencepiece": lambda t: (
        [_good(t), "--tokenizer", _write(t, "sp.model", b"\0junk")],
        ["cannot be loaded by sentencepiece", "give a SentencePiece .model"]),
    "tokenizer-without-eos": lambda t: (
        [_good(t), "--tokenizer", _bpe(t, ("<pad>",))],
        ["defines no EOS token", "pass --eos TOKEN"]),
    "unknown-eos": lambda t: (
        [_good(t), "--tokenizer", _bpe(t), "--eos", "<eot>"],
        ["--eos <eot>: the tokenizer", "has no such token"]),
    "jsonl-line-without-key": lambda t: (
        [_write(t, "a.jsonl", '{"text": "x"}\n{"body": "y", "id": 3}\n')],
        [f"input {t}/a.jsonl line 2 has no key 'text' (its keys: body, id)", "pass --text-key KEY"]),
    "jsonl-not-json": lambda t: (
        [_write(t, "a.jsonl", '{"text": "x"}\n\n{"text": oops}\n')],
        [f"input {t}/a.jsonl line 3 is not JSON", "one JSON object per line"]),
    "jsonl-not-an-object": lambda t: (
        [_write(t, "a.json", '["x"]\n')],
        [f"input {t}/a.json line 1 is a JSON list, not an object"]),
    "jsonl-text-not-a-string": lambda t: (
        [_write(t, "a.jsonl", '{"text": 5}\n')],
        [f"input {t}/a.jsonl line 1: 'text' holds a JSON int, not a string"]),
    "parquet-unreadable": lambda t: (
        [_write(t, "p.parquet", b"PAR1 not really")],
        [f"input {t}/p.parquet is not a readable Parquet file", "check that it is whole"]),
    "parquet-without-column": lambda t: (
        [_parquet(t, "p.parquet", body=["x"])],
        [f"input {t}/p.parquet has no column 'text' (its columns: body)", "--text-key COLUMN"]),
    "parquet-column-not-text": lambda t: (
        [_parquet(t, "p.parquet", text=[1, 2])],
        [f"input {t}/p.parquet: column 'text' holds int64, not strings"]),
    "gzip-that-is-not": lambda t: (
        [_write(t, "a.jsonl.gz", b"plain")],
        [f"input {t}/a.jsonl.gz cannot be read", "Not a gzipped file", "gzip-compressed: check"]),
    "gzip-cut-short": lambda t: (
        [_write(t, "a.txt.gz", gzip.compress(b"x" * 999)[:-9])],
        [f"input {t}/a.txt.gz cannot be read", "EOFError", "check that it is, and whole"]),
    "zstd-cut-short": lambda t: (
        [_write(t, "a.txt.zst", __import__("zstandard").ZstdCompressor().compress(b"x" * 999)[:-6])],
        [f"input {t}/a.txt.zst cannot be read", "zstd-compressed: check"]),
    "not-utf8": lambda t: (
        [_write(t, "l.txt", b"ok\n\nbad \xff\n"), "--tokenizer", _bpe(t), "--text-documents", "blank-line"],
        [f"input {t}/l.txt line 3 is not UTF-8 text (byte 4: b'\\xff')", "iconv -t UTF-8"]),
    "no-documents": lambda t: (
        [_write(t, "e.jsonl", '{"text": ""}\n')],
        ["the inputs hold no document with text", "--text-key"]),
    "output-over-input": lambda t: (
        [_write(t, "o.bin", b"x"), "--input-format", "text"],
        ["would overwrite the input", "choose another output"]),
    "workers-zero": lambda t: ([_good(t), "--workers", "0"], ["--workers 0: give 1 or more"]),
    "uint32": lambda t: (
        [_good(t), "--dtype", "uint32"],
        ["argument --dtype: invalid choice: 'uint32'", "see hpctrain-prepare --help"]),
    "unknown-option": lambda t: ([_good(t), "--text-field", "x"], ["unrecognized arguments: --text-field x"]),
    # chat and instruction data (hpctrain.data.chat)
    "chat-without-assistant-turns": lambda t: (
        [_chat(t, "c.jsonl", _turns("user", "assistant"), _turns("system", "user"), _turns("user")),
         "--tokenizer", _chat_tokenizer(t), "--format", "chat", "--seq-len", "64"],
        [f"2 conversations have no assistant turn (the first: input {t}/c.jsonl line 2)",
         "--train-on assistant would train on nothing", "drop such lines", "or pass --train-on all"]),
    "chat-tokenizer-without-template": lambda t: (
        [_chat(t, "c.jsonl", _turns("user", "assistant")), "--tokenizer", _chat_tokenizer(t, None),
         "--format", "chat", "--seq-len", "64"],
        [f"--tokenizer {t}/model has no chat template", "pass --chat-template FILE"]),
    "chat-template-file-missing": lambda t: (
        [_chat(t, "c.jsonl", _turns("user", "assistant")), "--tokenizer", _chat_tokenizer(t, None),
         "--format", "chat", "--seq-len", "64", "--chat-template", f"{t}/none.jinja"],
        [f"--chat-template {t}/none.jinja cannot be read", "give a Jinja chat template file"]),
    "chat-template-cannot-render": lambda t: (
        [_chat(t, "c.jsonl", _turns("user", "assistant"), _turns("assistant", "user", "assistant")),
         "--tokenizer", _chat_tokenizer(t, "{% if messages[0]['role'] != 'user' %}{{ raise_exception('the "
                                           "first message must be the user\\'s') }}{% endif %}" + CHATML),
         "--format", "chat", "--seq-len", "64"],
        [f"input {t}/c.jsonl line 2: the chat template cannot render this conversation", "the first message must "
         "be the user's", "fix the conversation or give --chat-template FILE"]),
    "chat-with-bytes-tokenizer": lambda t: (
        [_chat(t, "c.jsonl", _turns("user", "assistant")), "--format", "chat", "--seq-len", "64"],
        ["--format chat renders conversations with a Hugging Face chat template", "(not bytes)"]),
    "chat-without-seq-len": lambda t: (
        [_chat(t, "c.jsonl", _turns("user", "assistant")), "--format", "chat"],
        ["--format chat needs --seq-len N, the trainer.seq_len you will train with"]),
    "unknown-train-on": lambda t: (
        [_chat(t, "c.jsonl", _turns("user", "assistant")), "--format", "chat", "--seq-len", "64",
         "--train-on", "answers"],
        ["argument --train-on: invalid choice: 'answers'", "all", "assistant", "last-assistant",
         "see hpctrain-prepare --help"]),
    "train-on-without-chat-format": lambda t: (
        [_good(t), "--train-on", "all"],
        ["--train-on is for chat and instruction data: add --format chat or --format instruction"]),
    "chat-line-without-messages": lambda t: (
        [_chat(t, "c.jsonl", _turns("user", "assistant"), {"conversation": []}),
         "--tokenizer", _chat_tokenizer(t), "--format", "chat", "--seq-len", "64"],
        [f"input {t}/c.jsonl line 2 has no key 'messages' (its keys: conversation)", "pass --messages-key KEY"]),
    "chat-message-without-role": lambda t: (
        [_chat(t, "c.jsonl", {"messages": [{"content": "hi"}]}),
         "--tokenizer", _chat_tokenizer(t), "--format", "chat", "--seq-len", "64"],
        [f"input {t}/c.jsonl line 1: message 1", "not an object with a string role and a string content"]),
    "instruction-without-response": lambda t: (
        [_chat(t, "i.jsonl", {"prompt": "a", "response": "b"}, {"prompt": "a", "answer": "b"}),
         "--tokenizer", _chat_tokenizer(t), "--format", "instruction", "--seq-len", "64"],
        [f"input {t}/i.jsonl line 2 has no key 'response' (its keys: prompt, answer)", "pass --response-key KEY"]),
    "instruction-without-prompt-key-named": lambda t: (
        [_chat(t, "i.jsonl", {"question": "a", "response": "b"}),
         "--tokenizer", _chat_tokenizer(t), "--format", "instruction", "--seq-len", "64", "--prompt-key", "q"],
        [f"input {t}/i.jsonl line 1 has no key 'q' (its keys: question, response)", "pass --prompt-key KEY"]),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_every_bad_input_is_one_line(tmp_path, capsys, name):
    args, fragments = BAD_INPUTS[name](tmp_path)
    before = set(tmp_path.rglob("*"))
    code, out, err = _run(args + ["-o", tmp_path / "o"], capsys)
    assert code == 2 and out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("hpctrain: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert set(tmp_path.rglob("*")) == before  # no shard, no manifest, no temporary file left


def test_no_output_named(tmp_path, capsys):
    code, out, err = _run([_good(tmp_path)], capsys)
    assert code == 2 and err == "hpctrain: error: name the output: -o OUT (writes OUT.bin, OUT.idx and " \
                                "OUT.json) (see hpctrain-prepare --help)\n"
