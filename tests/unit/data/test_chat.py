"""Chat and instruction data (``hpctrain-prepare --format chat|instruction``,
``hpctrain.data.chat``) and its training side (packing, the loss mask).

The tokenizer is built here: a byte-level BPE trained with ``tokenizers`` on
the built-in corpus, wrapped in transformers' ``PreTrainedTokenizerFast`` with
a chat template and saved to a temporary directory (nothing downloaded). Two
template families (ChatML as Qwen writes it, and Llama 3's headers with a
BOS), each with and without ``{% generation %}`` blocks: every conversation
of a test set (system, multi-turn, no system, an empty answer; no tools)
comes out of the shard token for token as transformers'
``apply_chat_template`` renders it, and its loss mask is exactly
transformers' own assistant mask (``return_assistant_tokens_mask`` of the
template with generation blocks), whichever way hpctrain-prepare found it.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hpctrain.data.embedded import generate_corpus
from hpctrain.data.indexed import IndexedDataset
from hpctrain.data.prepare import main
from hpctrain.data.streams import pack

LINES = [line for line in generate_corpus(40000, seed=5).decode().splitlines() if line.strip()]

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}{% generation %}"
          "{{ m['content'] }}<|im_end|>\n{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
          "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] | trim }}<|eot_id|>{% endgeneration %}"
          "{% else %}{{ m['content'] | trim }}<|eot_id|>{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>"]


def plain(template: str) -> str:
    """The template without its generation blocks (what most models' templates look like)."""
    return template.replace("{% generation %}", "").replace("{% endgeneration %}", "")


def _m(role, i):
    return {"role": role, "content": LINES[i]}


CONVERSATIONS = [
    [_m("system", 0), _m("user", 1), _m("assistant", 2)],
    [_m("user", 3), _m("assistant", 4), _m("user", 5), _m("assistant", 6), _m("user", 7), _m("assistant", 8)],
    [_m("system", 9), _m("user", 10), _m("assistant", 11), _m("user", 12), _m("assistant", 13)],
    [_m("user", 14), {"role": "assistant", "content": LINES[15] + "\n\n" + LINES[16] + " – ünïcode"}],
    [_m("system", 17), _m("user", 18), {"role": "assistant", "content": ""}],
]


def make_tokenizer(directory, template=CHATML):
    """A BPE with a chat template (None: none), saved by transformers into ``directory``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(LINES, trainers.BpeTrainer(vocab_size=420, special_tokens=SPECIALS, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|endoftext|>")
    if template is not None:
        fast.chat_template = template
    directory.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(directory))
    return str(directory)


def load(directory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory, local_files_only=True)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def prepare(capsys, *args):
    code = main([str(a) for a in args] + ["--quiet"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def documents(prefix):
    with IndexedDataset(str(prefix)) as ds:
        return [(ds.document(d).tolist(), ds.document_loss_mask(d).tolist()) for d in range(ds.num_documents)]


def chat_ids(tok, messages, template=None):
    """transformers' ``apply_chat_template(..., tokenize=True)``: the ids."""
    out = tok.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=True)
    return list(out["input_ids"])


def assistant_mask(tok, messages, template):
    """transformers' own assistant mask (the template with generation blocks)."""
    out = tok.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=True)
    return list(out["assistant_masks"])


# -- rendering and the mask ------------------------------------------------------------------

@pytest.mark.parametrize("blocks", [False, True], ids=["plain-template", "generation-blocks"])
@pytest.mark.parametrize("family", list(TEMPLATES))
def test_rendering_and_mask_equal_transformers(tmp_path, capsys, family, blocks):
    template = TEMPLATES[family] if blocks else plain(TEMPLATES[family])
    directory = make_tokenizer(tmp_path / "tok", template)
    data = write_jsonl(tmp_path / "c.jsonl", [{"messages": m} for m in CONVERSATIONS])
    prepare(capsys, data, "-o", tmp_path / "out" / "chat", "--tokenizer", directory, "--format", "chat",
            "--seq-len", 64)
    tok = load(directory)
    got = documents(tmp_path / "out" / "chat")
    assert len(got) == len(CONVERSATIONS)
    for messages, (ids, mask) in zip(CONVERSATIONS, got):
        assert ids == chat_ids(tok, messages)  # token for token
        want = assistant_mask(tok, messages, TEMPLATES[family])
        assert mask == want and mask[0] == 0
        # what the mask covers, read back: each answer and its end-of-turn token, nothing else
        trained = tok.decode([t for t, m in zip(ids, mask) if m])
        end = "<|im_end|>\n" if family == "chatml" else "<|eot_id|>"
        answers = [m["content"] if family == "chatml" else m["content"].strip()
                   for m in messages if m["role"] == "assistant"]
        assert trained == "".join(a + end for a in answers)
    manifest = json.loads((tmp_path / "out" / "chat.json").read_text())
    assert manifest["loss_mask"]["train_on"] == "assistant" and manifest["loss_mask"]["file"] == ".mask"
    assert manifest["loss_mask"]["trained_tokens"] == sum(sum(m) for _, m in got)


def test_train_on_last_assistant_and_all(tmp_path, capsys):
    directory = make_tokenizer(tmp_path / "tok", plain(CHATML))
    data = write_jsonl(tmp_path / "c.jsonl", [{"messages": m} for m in CONVERSATIONS])
    tok = load(directory)
    for train_on in ("last-assistant", "all"):
        out = tmp_path / train_on / "chat"
        prepare(capsys, data, "-o", out, "--tokenizer", directory, "--format", "chat", "--seq-len", 64,
                "--train-on", train_on)
        for messages, (ids, mask) in zip(CONVERSATIONS, documents(out)):
            if train_on == "all":
                assert mask == [0] + [1] * (len(ids) - 1)  # a conversation's first token: never a target
                continue
            last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
            # the last turn's tokens: the whole rendering's mask less the mask of the rendering before it
            before = assistant_mask(tok, messages[:last], CHATML) if last else []
            whole = assistant_mask(tok, messages, CHATML)
            assert mask == [0] * len(before) + whole[len(before):]
            assert sum(mask) > 0


def test_instruction_format_with_its_keys(tmp_path, capsys):
    directory = make_tokenizer(tmp_path / "tok", plain(LLAMA3))
    rows = [{"q": LINES[0], "a": LINES[1]}, {"q": LINES[2], "a": LINES[3], "sys": LINES[4]}, {"q": "", "a": LINES[5]}]
    data = write_jsonl(tmp_path / "i.jsonl", rows)
    prepare(capsys, data, "-o", tmp_path / "ins", "--tokenizer", directory, "--format", "instruction",
            "--seq-len", 64, "--prompt-key", "q", "--response-key", "a", "--system-key", "sys")
    tok = load(directory)
    for row, (ids, mask) in zip(rows, documents(tmp_path / "ins")):
        messages = ([{"role": "system", "content": row["sys"]}] if "sys" in row else []) + [
            {"role": "user", "content": row["q"]}, {"role": "assistant", "content": row["a"]}]
        assert ids == chat_ids(tok, messages)
        assert mask == assistant_mask(tok, messages, LLAMA3)


def test_a_template_given_by_file(tmp_path, capsys):
    directory = make_tokenizer(tmp_path / "tok", None)  # the tokenizer has none
    template = tmp_path / "chatml.jinja"
    template.write_text(plain(CHATML))
    data = write_jsonl(tmp_path / "c.jsonl", [{"messages": m} for m in CONVERSATIONS[:2]])
    prepare(capsys, data, "-o", tmp_path / "f", "--tokenizer", directory, "--format", "chat", "--seq-len", 64,
            "--chat-template", template)
    tok = load(directory)
    for messages, (ids, mask) in zip(CONVERSATIONS, documents(tmp_path / "f")):
        assert ids == chat_ids(tok, messages, plain(CHATML))
        assert mask == assistant_mask(tok, messages, CHATML)
    assert json.loads((tmp_path / "f.json").read_text())["loss_mask"]["chat_template"] == str(template)


# -- packing: conversations whole in one sample, the longer ones counted -------------------------

def test_pack_never_splits_a_document_that_fits():
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 20, size=400)
    lengths[[7, 100, 101, 399]] = [33, 34, 80, 200]  # exactly a sample, then longer ones (two in a row, the last)
    sample = 33
    packing = pack(lengths, sample)
    ends = np.cumsum(lengths)
    begins = ends - lengths
    assert packing.split == int((lengths > sample).sum()) == 3
    assert np.all(packing.stop - packing.start <= sample) and np.all(packing.stop > packing.start)
    for d, (a, b) in enumerate(zip(begins, ends)):
        inside = np.flatnonzero((packing.start <= a) & (packing.stop > a))
        if lengths[d] <= sample:  # whole, in exactly one sample
            assert len(inside) == 1 and packing.stop[inside[0]] >= b
        else:  # its own samples, each target once: pieces overlap by the one token a target shares with an input
            pieces = np.flatnonzero((packing.start >= a) & (packing.stop <= b))
            assert packing.start[pieces[0]] == a and packing.stop[pieces[-1]] == b
            assert np.array_equal(packing.start[pieces[1:]], packing.stop[pieces[:-1]] - 1)
    # samples follow the stream, every token in one (a piece's shared edge in two), and next fit is greedy:
    # a sample ends where the next document would not fit
    assert packing.start[0] == 0 and packing.stop[-1] == ends[-1]
    after = packing.start[1:]
    assert np.all((after == packing.stop[:-1]) | (after == packing.stop[:-1] - 1))
    for a, b in zip(packing.start, packing.stop):
        nxt = np.flatnonzero(begins == b)
        if len(nxt) and b - a < sample and lengths[nxt[0]] <= sample and np.any(begins == a):
            assert b - a + lengths[nxt[0]] > sample


def _chat_shard(tmp_path, capsys, conversations, seq_len, *extra):
    directory = make_tokenizer(tmp_path / "tok", plain(CHATML))
    data = write_jsonl(tmp_path / "c.jsonl", [{"messages": m} for m in conversations])
    out = prepare(capsys, data, "-o", tmp_path / "d" / "chat", "--tokenizer", directory, "--format", "chat",
                  "--seq-len", seq_len, *extra)
    return out, str(tmp_path / "d" / "chat.json")


def test_packed_samples_hold_whole_conversations_and_say_which_targets_count(tmp_path, capsys, make_config):
    """Through the index and the cursor: one epoch's samples hold every conversation that fits
    whole, in one sample; the longer ones are counted by the prepare summary and cut; the targets
    the loss must not count are MASKED, exactly the mask's 0s (and the padding)."""
    from hpctrain.data.cursor import MASKED, DataCursor
    from hpctrain.data.orders import sample_orders

    rng = np.random.default_rng(0)
    conversations = [CONVERSATIONS[int(rng.integers(len(CONVERSATIONS)))][: int(rng.integers(2, 7))] for _ in range(40)]
    conversations = [c for c in conversations if any(m["role"] == "assistant" for m in c)]
    seq_len = 96
    out, manifest = _chat_shard(tmp_path, capsys, conversations, seq_len)
    docs = documents(tmp_path / "d" / "chat")
    long = sum(len(ids) > seq_len + 1 for ids, _ in docs)
    assert 0 < long < len(docs)  # the test set has both kinds
    assert f"{long:,} of the {len(docs):,} conversations are longer than a sample (--seq-len {seq_len}" in out
    assert json.loads(open(manifest).read())["loss_mask"]["longer_than_sample"] == long

    cfg = make_config("data=indexed", f"data.paths=[{manifest}]", "data.index_cache=false", "model.vocab_size=512")
    order = sample_orders(cfg.data, seq_len, 512).train[0]
    assert order.packed and order.masked and order.packing.split == long
    cursor = DataCursor([order], order.num_windows, 1, 0, 1)
    assert cursor.document_mask and cursor.loss_mask  # packed conversations: document masking is on
    mbs = cursor.next_step()  # the whole first epoch, one sample per micro-batch
    seen = {}
    for mb, k in zip(mbs, order._perm(0)):
        start, stop = int(order.packing.start[k]), int(order.packing.stop[k])
        flat = np.concatenate([np.asarray(ids) for ids, _ in docs])
        mask = np.concatenate([np.asarray(m) for _, m in docs])
        n = stop - start
        assert np.array_equal(mb.inputs[0].numpy()[:n], flat[start:stop][:seq_len])
        assert np.all(mb.inputs[0].numpy()[n:] == order.pad_id)
        counts = mask[start + 1:stop].astype(bool)  # padding: nothing counts
        want = np.full(seq_len, MASKED)
        want[:n - 1] = np.where(counts, flat[start + 1:stop], MASKED)
        assert np.array_equal(mb.targets[0].numpy(), want) and mb.counted == int(counts.sum())
        # a segment per conversation (and one for the padding's inputs): attention never crosses them
        ends = np.cumsum([len(ids) for ids, _ in docs])
        inner = ends[(ends > start) & (ends < stop)] - start
        assert int(mb.segments[0].max()) == len(inner) + (1 if n < seq_len else 0)
        for d, (ids, _) in enumerate(docs):
            a = int(ends[d]) - len(ids)
            if len(ids) <= seq_len + 1 and start <= a < stop:
                assert int(ends[d]) <= stop  # whole
                seen[d] = seen.get(d, 0) + 1
    assert seen == {d: 1 for d, (ids, _) in enumerate(docs) if len(ids) <= seq_len + 1}


# -- the loss: masked targets add neither loss nor count ---------------------------------------------

def test_a_masked_out_sample_adds_nothing_and_only_counted_targets_normalise(make_config):
    """One process, three micro-batches: partly masked, unmasked, wholly masked. The step's
    gradient is that of (sum of the counted targets' losses) / (their number) over the whole
    batch (not the mean of the micro-batches' means), the wholly masked micro-batch changes
    neither loss nor gradient whatever its tokens, and the runner counts only counted targets."""
    import torch.nn.functional as F

    from hpctrain.comm.protocol import LocalCommunicator
    from hpctrain.data.cursor import MASKED, MicroBatch
    from hpctrain.mesh import AXES, Mesh
    from hpctrain.model.build import build_model, materialize
    from hpctrain.parallel.handles import LocalData
    from hpctrain.train.step_runner import GradAccumulation, weigh_masked

    cfg = make_config()
    model = materialize(build_model(cfg), torch.device("cpu"), 0, cfg.model.init_std, cfg.model.n_layers)
    mesh = Mesh({a: 1 for a in AXES}, 0, 1)
    mesh.attach_backends(lambda group: LocalCommunicator())
    g = torch.Generator().manual_seed(4)
    tokens = [torch.randint(0, 256, (1, 17), generator=g) for _ in range(3)]

    def batch(masked_tokens):
        out = []
        for i, t in enumerate(tokens[:2] + [masked_tokens]):
            targets = t[:, 1:].clone()
            if i == 0:
                targets[:, :11] = MASKED  # 5 of 16 count
            if i == 2:
                targets[:] = MASKED  # none counts
            out.append(MicroBatch(t[:, :-1], targets, counted=int((targets >= 0).sum())))
        return weigh_masked(out, mesh, torch.device("cpu"))

    def step(mbs):
        model.zero_grad()
        result = GradAccumulation().run(model, mbs, LocalData(model))
        return result, {n: p.grad.clone() for n, p in model.named_parameters()}

    mbs = batch(tokens[2])
    assert [mb.counted for mb in mbs] == [5, 16, 0] and mbs[2].loss_weight == 0.0
    result, grads = step(mbs)
    assert result.tokens == 21
    # by hand: the sum of the 21 counted targets' losses over 21
    model.zero_grad()
    total = sum(F.cross_entropy(model(mb.inputs).flatten(0, 1).float(), mb.targets.flatten(), reduction="sum",
                                ignore_index=MASKED) for mb in mbs[:2])
    (total / 21).backward()
    assert float(result.loss_sum) / result.tokens == pytest.approx(float(total.detach()) / 21, rel=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-7, msg=name)
    # the mean of the micro-batches' means would differ: the normalisation really is per counted target
    with torch.no_grad():
        means = sum(float(model(mb.inputs, mb.targets)) for mb in mbs[:2]) / 2
    assert abs(means - float(total.detach()) / 21) > 1e-3
    # the wholly masked micro-batch: any tokens, the same step
    other, other_grads = step(batch(torch.randint(0, 256, (1, 17), generator=g)))
    assert float(other.loss_sum) == float(result.loss_sum) and other.tokens == result.tokens
    for name in grads:
        assert torch.equal(grads[name], other_grads[name]), name
    # a micro-batch with nothing to count has loss 0, not 0/0
    with torch.no_grad():
        assert float(model(mbs[2].inputs, mbs[2].targets)) == 0.0
