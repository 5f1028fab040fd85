"""One long document is encoded in pieces (``hpctrain.data.tokenize``, "Long documents"): the
tokenizer never sees more than ``LONG_DOCUMENT`` characters at once (it held about 130 bytes per
character: a 50 MB document peaked at several GB), and the ids are exactly the tokenizer's own
encoding of the whole document, for BPEs built here with GPT-2's byte-level pre-tokenizer, Llama 3's
split regex, and SentencePiece; a tokenizer that joins text across spaces (a normalizer prepending
``▁``, no pre-tokenizer: converted SentencePiece models such as Llama 2's) is encoded whole, with one
warning. ``LONG_DOCUMENT`` is lowered to 4096 characters so that small documents take many cuts."""
from __future__ import annotations

import io
import random

import numpy as np
import pytest

from hpctrain.data import tokenize
from hpctrain.data.tokenize import Encoder, resolve_tokenizer

LIMIT = 4096
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")


def _text(n: int, seed: int = 0) -> str:
    """Words, numbers, punctuation, runs of spaces and newlines, accents and an emoji: every kind of cut."""
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyzé") for _ in range(rng.randint(1, 9))) for _ in range(300)]
    out, size = [], 0
    while size < n:
        line = " ".join(rng.choice(words) for _ in range(rng.randint(1, 12)))
        line += rng.choice([".", ",", "!", " 12345", "  ", "", " it's", " 😀"]) + rng.choice(["\n", " ", "\n\n", "   ",
                                                                                             "\t", " \n"])
        out.append(line)
        size += len(line)
    return "".join(out)[:n]


def _bpe(path, pre, normalizer=None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>" if pre is None else None))
    if pre is not None:
        tok.pre_tokenizer = pre
        tok.decoder = decoders.ByteLevel()
    if normalizer is not None:
        tok.normalizer = normalizer
    alphabet = pre_tokenizers.ByteLevel.alphabet() if pre is not None else []
    tok.train_from_iterator(_text(100_000, seed=1).splitlines(), trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<unk>", "</s>"], initial_alphabet=alphabet))
    tok.save(str(path))
    return Tokenizer.from_file(str(path))


def _byte_level(path):
    from tokenizers import pre_tokenizers

    return _bpe(path, pre_tokenizers.ByteLevel(add_prefix_space=False))


def _llama3(path):
    from tokenizers import Regex, pre_tokenizers

    return _bpe(path, pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]))


def _llama2_style(path):
    from tokenizers import normalizers

    return _bpe(path, None, normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]))


def _encoder_seeing(path, monkeypatch):
    """The Encoder of ``path`` with the longest text its tokenizer was given, recorded."""
    monkeypatch.setattr(tokenize, "LONG_DOCUMENT", LIMIT)
    enc = Encoder(resolve_tokenizer(str(path), eos="</s>"))
    seen = [0]
    batch = enc._batch

    def recording(docs):
        seen[0] = max([seen[0]] + [len(d) for d in docs])
        return batch(docs)
    enc._batch = recording
    return enc, seen


@pytest.mark.parametrize("make", [_byte_level, _llama3], ids=["gpt2-byte-level", "llama3-split"])
def test_a_long_document_is_encoded_in_pieces_to_the_same_ids(tmp_path, monkeypatch, capsys, make):
    tok = make(tmp_path / "tokenizer.json")
    enc, seen = _encoder_seeing(tmp_path / "tokenizer.json", monkeypatch)
    doc, short = _text(60_000, seed=2), _text(500, seed=3)
    flat, lengths = enc.encode([short, doc, short])
    eos = tok.token_to_id("</s>")
    want = [tok.encode(t, add_special_tokens=False).ids + [eos] for t in (short, doc, short)]
    assert lengths.tolist() == [len(w) for w in want]
    assert flat.tolist() == sum(want, [])
    assert seen[0] <= LIMIT + 2 * tokenize._WINDOW, seen[0]  # pieces, and the windows that check the cuts
    assert len(tokenize.split_long(doc, enc._one, LIMIT)) >= 60_000 // LIMIT
    assert capsys.readouterr().err == ""


def test_a_stretch_without_spaces_stays_in_one_piece(tmp_path, monkeypatch):
    tok = _byte_level(tmp_path / "tokenizer.json")
    enc, _ = _encoder_seeing(tmp_path / "tokenizer.json", monkeypatch)
    doc = _text(10_000, seed=4) + "x" * 3 * LIMIT + _text(10_000, seed=5)
    flat, _ = enc.encode([doc])
    assert flat.tolist() == tok.encode(doc, add_special_tokens=False).ids + [tok.token_to_id("</s>")]
    pieces = tokenize.split_long(doc, enc._one, LIMIT)
    assert max(b - a for a, b in pieces) > 3 * LIMIT and pieces[0][0] == 0 and pieces[-1][1] == len(doc)


def test_a_tokenizer_that_joins_across_spaces_is_encoded_whole_with_one_warning(tmp_path, monkeypatch, capsys):
    tok = _llama2_style(tmp_path / "tokenizer.json")
    enc, seen = _encoder_seeing(tmp_path / "tokenizer.json", monkeypatch)
    docs = [_text(6_000, seed=6), _text(6_000, seed=7)]
    flat, _ = enc.encode(docs)
    eos = tok.token_to_id("</s>")
    assert flat.tolist() == sum([tok.encode(d, add_special_tokens=False).ids + [eos] for d in docs], [])
    assert seen[0] == 6_000 and enc._splittable is False
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("hpctrain: warning: a document of 6,000 characters is encoded whole")


def test_sentencepiece_long_documents_match_too(tmp_path, monkeypatch):
    spm = pytest.importorskip("sentencepiece")
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(_text(100_000, seed=8).splitlines()), model_writer=model,
                                   vocab_size=300, model_type="bpe", eos_id=2, bos_id=1, unk_id=0, pad_id=-1)
    (tmp_path / "sp.model").write_bytes(model.getvalue())
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    monkeypatch.setattr(tokenize, "LONG_DOCUMENT", LIMIT)
    enc = Encoder(resolve_tokenizer(str(tmp_path / "sp.model"), bos="none"))
    doc = _text(40_000, seed=9)
    flat, _ = enc.encode([doc])
    assert enc._splittable is True
    np.testing.assert_array_equal(flat, sp.encode(doc, out_type=int) + [2])
