"""hpctrain-prepare's tokenizers (``hpctrain.data.tokenize``) with real
libraries: a BPE trained here with ``tokenizers`` on the built-in corpus and
a SentencePiece model trained here (nothing downloaded). Each rule for BOS
and EOS has a case, and the encoder's output equals the library's own
encoding of each document plus that rule."""
from __future__ import annotations

import json

import numpy as np
import pytest
import sentencepiece as spm  # the test extra installs both: a missing one is a failure, not a skip

from hpctrain.data.embedded import generate_corpus
from hpctrain.data.tokenize import Encoder, TokenizerError, resolve_tokenizer

LINES = generate_corpus(60000, seed=11).decode().splitlines()
DOCS = ["\n".join(LINES[i:i + 3]) for i in range(0, 60, 3)] + ["ünïcode – text"]


def bpe(path, specials=("<s>", "</s>"), bos_post_processor=False, config=None, truncation=None):
    """A byte-level BPE trained on the built-in corpus, saved as ``path`` (and a tokenizer_config.json beside it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=list(specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(LINES, trainer)
    if bos_post_processor:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                           special_tokens=[("<s>", tok.token_to_id("<s>"))])
    if truncation:
        tok.enable_truncation(truncation)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    if config is not None:
        (path.parent / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer.from_file(str(path))


def sentencepiece(tmp_path, **options):
    spm.SentencePieceTrainer.train(sentence_iterator=iter(LINES), model_prefix=str(tmp_path / "sp"), vocab_size=150,
                                   model_type="bpe", minloglevel=2, **options)
    return str(tmp_path / "sp.model"), spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))


def _docs_of(flat, lengths):
    ends = np.cumsum(lengths)
    return [flat[e - n:e].tolist() for e, n in zip(ends, lengths)]


def test_bytes_are_todays_ids_with_eos_zero():
    spec = resolve_tokenizer("bytes")
    assert (spec.kind, spec.vocab_size, spec.bos_id, spec.eos_id, spec.dtype) == ("bytes", 256, None, 0, "uint16")
    flat, lengths = Encoder(spec).encode(["ab", b"c\xff", "é"])
    assert _docs_of(flat, lengths) == [[97, 98, 0], [99, 255, 0], [0xC3, 0xA9, 0]]
    flat, lengths = Encoder(spec).encode([b"ab", b"cd", b"e"], open_ended=[True, False, False])
    assert _docs_of(flat, lengths) == [[97, 98], [99, 100, 0], [101, 0]]  # a piece, its end, a document


def test_bpe_with_a_bos_post_processor(tmp_path):
    tok = bpe(tmp_path / "tokenizer.json", bos_post_processor=True)
    spec = resolve_tokenizer(str(tmp_path / "tokenizer.json"))
    assert spec.kind == "huggingface" and spec.vocab_size == tok.get_vocab_size()
    assert spec.bos_id == tok.token_to_id("<s>") and spec.eos_id == tok.token_to_id("</s>")  # </s>: by its name
    flat, lengths = Encoder(spec).encode(DOCS)
    assert flat.dtype == np.uint16
    # the library's own encoding puts BOS in front (its post-processor); EOS after every document
    assert _docs_of(flat, lengths) == [tok.encode(d).ids + [spec.eos_id] for d in DOCS]
    assert all(ids[0] == spec.bos_id for ids in _docs_of(flat, lengths))
    # a directory holding the tokenizer.json names it too
    assert resolve_tokenizer(str(tmp_path)).path == spec.path


def test_eos_and_bos_from_tokenizer_config(tmp_path):
    tok = bpe(tmp_path / "m" / "tokenizer.json", specials=("<bos>", "<eot>", "</s>"),
              config={"eos_token": {"content": "<eot>"}, "bos_token": "<bos>", "add_bos_token": True})
    spec = resolve_tokenizer(str(tmp_path / "m"))
    assert spec.name == "m" and spec.eos_id == tok.token_to_id("<eot>") and spec.bos_id == tok.token_to_id("<bos>")
    flat, lengths = Encoder(spec).encode(DOCS[:3])
    assert _docs_of(flat, lengths) == [[spec.bos_id] + tok.encode(d).ids + [spec.eos_id] for d in DOCS[:3]]


def test_no_bos_without_a_rule(tmp_path):
    bpe(tmp_path / "tokenizer.json", specials=("<|endoftext|>",))  # GPT-2 style
    spec = resolve_tokenizer(str(tmp_path / "tokenizer.json"))
    assert spec.bos_id is None and spec.eos_id == 0


def test_overrides(tmp_path):
    tok = bpe(tmp_path / "tokenizer.json", bos_post_processor=True)
    path = str(tmp_path / "tokenizer.json")
    spec = resolve_tokenizer(path, bos="none", eos="7")
    assert spec.bos_id is None and spec.eos_id == 7
    assert resolve_tokenizer(path, eos="<s>").eos_id == tok.token_to_id("<s>")
    with pytest.raises(TokenizerError, match="--eos <nope>: the tokenizer .* has no such token"):
        resolve_tokenizer(path, eos="<nope>")
    with pytest.raises(TokenizerError, match="id 5000 is outside the vocabulary"):
        resolve_tokenizer(path, bos="5000")
    assert resolve_tokenizer("bytes", eos="10").eos_id == 10
    assert resolve_tokenizer("bytes", dtype="int32").dtype == "int32"


def test_a_tokenizer_without_eos_asks_for_one(tmp_path):
    bpe(tmp_path / "tokenizer.json", specials=("<pad>",))
    with pytest.raises(TokenizerError, match="defines no EOS token .* pass --eos TOKEN"):
        resolve_tokenizer(str(tmp_path / "tokenizer.json"))


def test_the_tokenizers_own_truncation_is_switched_off(tmp_path):
    tok = bpe(tmp_path / "tokenizer.json", truncation=8)
    long_doc = " ".join(LINES[:20])
    assert len(tok.encode(long_doc).ids) == 8  # what the file asks for
    spec = resolve_tokenizer(str(tmp_path / "tokenizer.json"))
    flat, lengths = Encoder(spec).encode([long_doc])
    tok.no_truncation()
    assert flat.tolist() == tok.encode(long_doc).ids + [spec.eos_id] and lengths[0] > 9


def test_sentencepiece_bos_and_eos_are_the_models(tmp_path):
    path, sp = sentencepiece(tmp_path)
    spec = resolve_tokenizer(path)
    assert (spec.kind, spec.bos_id, spec.eos_id, spec.vocab_size) == ("sentencepiece", 1, 2, 150)
    flat, lengths = Encoder(spec).encode(DOCS)
    assert _docs_of(flat, lengths) == [sp.encode(d, add_bos=True, add_eos=True) for d in DOCS]
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "tokenizer.model").write_bytes((tmp_path / "sp.model").read_bytes())
    assert resolve_tokenizer(str(tmp_path / "llama")).kind == "sentencepiece"


def test_sentencepiece_without_eos_asks_for_one(tmp_path):
    path, sp = sentencepiece(tmp_path, eos_id=-1, bos_id=-1)
    with pytest.raises(TokenizerError, match="defines no EOS token"):
        resolve_tokenizer(path)
    spec = resolve_tokenizer(path, eos="<unk>")
    assert spec.bos_id is None and spec.eos_id == sp.unk_id()


@pytest.mark.parametrize("make,fragment", [
    (lambda p: str(p / "missing.json"), "does not exist; give bytes, a tokenizer.json"),
    (lambda p: (p / "empty").mkdir() or str(p / "empty"), "holds no tokenizer.json (Hugging Face) or tokenizer.model"),
    (lambda p: (p / "t.json").write_text("{}") and str(p / "t.json"), "cannot be loaded by the tokenizers library"),
    (lambda p: (p / "t.model").write_bytes(b"junk") and str(p / "t.model"), "cannot be loaded by sentencepiece"),
], ids=["missing", "empty-directory", "not-a-tokenizer-json", "not-a-model"])
def test_a_bad_tokenizer_is_one_line(tmp_path, make, fragment):
    with pytest.raises(TokenizerError) as e:
        resolve_tokenizer(make(tmp_path))
    assert fragment in str(e.value) and "\n" not in str(e.value)
