"""The local tier's pure parts: the file format (round trip, damage found),
the partner ring, the agreement over what the surviving nodes hold, the
node directory's manifests and pruning, and one trainer's state put back
exactly (the next steps' losses and every gradient equal an uninterrupted
run's)."""
import pytest
import torch

from hpctrain.localckpt import partners, store
from hpctrain.localckpt.state import LocalStateError, RankState, capture, decode, encode, restore
from hpctrain.localckpt.tier import decide


def test_encode_decode_round_trip_keeps_dtypes_shapes_and_meta():
    s = RankState({"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.tensor(3.0),
                   "c": torch.ones(4, dtype=torch.bfloat16), "e": torch.empty(0, 5), "r": torch.get_rng_state()},
                  {"step": 7, "cursor": {"consumed_samples": 112}})
    back = decode(encode(s))
    assert back.meta == s.meta
    for k, t in s.tensors.items():
        assert back.tensors[k].dtype == t.dtype and back.tensors[k].shape == t.shape
        assert torch.equal(back.tensors[k], t)


def test_a_damaged_or_truncated_file_is_refused():
    data = bytearray(encode(RankState({"a": torch.ones(8)}, {"step": 1})))
    data[-10] ^= 1
    with pytest.raises(LocalStateError, match="checksum"):
        decode(bytes(data))
    with pytest.raises(LocalStateError):
        decode(bytes(data[:20]))


def test_partners_are_the_same_place_on_the_next_nodes():
    nodes = (0, 0, 1, 1, 2, 2, 3, 3)
    assert partners(nodes, 6, 1) == [0]
    assert partners(nodes, 7, 2) == [1, 3]
    assert partners(nodes, 0, 3) == [2, 4, 6]


def test_decide_takes_the_newest_step_every_rank_is_held_for():
    sig = "s"
    # 4 ranks, 2 nodes; node 1 (ranks 2, 3) lost step 20's own files and everything of step 25 is partial
    node0 = {20: {sig: [0, 1, 2, 3]}, 15: {sig: [0, 1, 2, 3]}, 25: {sig: [0, 1]}}
    node1 = {15: {sig: [0, 1, 2, 3]}}
    found = decide([node0, node0, node1, node1], sig, 4)
    assert found.step == 20 and found.holders == {2: 0, 3: 0} and found.lost == 2
    # all own copies present: nobody fetches anything
    assert decide([node0, node0, node0, node0], sig, 4).holders == {}
    # another layout's files are not used, and said so
    other = decide([{30: {"x": [0, 1, 2, 3]}}] * 4, sig, 4)
    assert other.step is None and other.other_layout == 30
    assert decide([{}] * 4, sig, 4).step is None


def test_manifests_count_only_files_present_and_prune_keeps_the_newest(tmp_path):
    root = str(tmp_path)
    for step in (5, 10, 15):
        for r in (0, 1):
            store.write_atomic(store.rank_file(root, step, r), b"x")
        store.write_manifest(root, step, 0, [0, 1], "s")
    store.write_atomic(store.rank_file(root, 20, 0), b"x")  # written, manifest not yet: not held
    import os
    os.remove(store.rank_file(root, 15, 1))
    held = store.held(root)
    assert held[15] == {"s": {0}} and held[10] == {"s": {0, 1}} and 20 not in held
    store.prune(root, 2)
    assert store.steps(root) == [20, 15]
    store.prune(root, 2, newer_than=15)
    assert store.steps(root) == [15]


def test_a_trainers_state_comes_back_exactly(make_config, pm):
    """Two steps, capture, two more; a fresh trainer restored from the capture
    makes the same two steps: equal losses and equal gradients, bit for bit."""
    from hpctrain.run import reference_trainer

    cfg = make_config("trainer.steps=4", "trainer.log_every=1", "trainer.progress=off")
    a = reference_trainer(cfg, pm)
    a.train_step()
    a.train_step()
    saved = decode(encode(capture(a.state)))
    want, grads = [], []
    for _ in range(2):
        want.append(a.train_step()["loss"])
        grads.append([p.grad.clone() for p in a.params])
    torch.manual_seed(1234)  # the RNG state must come from the capture, not from here
    b = reference_trainer(cfg, pm)
    assert b.step == 0
    b.step = restore(b.state, saved)  # the state's tensors, cursor and RNG in place; the step returned
    assert b.step == 2 and b.cursor.consumed_samples == a.cursor.consumed_samples - 2 * 16
    for i in range(2):
        assert b.train_step()["loss"] == want[i]
        for g, p in zip(grads[i], b.params):
            assert torch.equal(g, p.grad)
    for p, q in zip(a.params, b.params):
        assert torch.equal(p, q)


def test_state_of_another_layout_is_refused(make_config, pm):
    from hpctrain.run import reference_trainer

    a = reference_trainer(make_config("trainer.steps=2"), pm)
    saved = capture(a.state)
    saved.meta["signature"] = "someone else"
    with pytest.raises(LocalStateError, match="another layout"):
        restore(reference_trainer(make_config("trainer.steps=2"), pm).state, saved)


def test_shards_split_over_dp_are_assembled_for_another_dp_size():
    """ZeRO's flat shards of a 10-element tensor over dp 4 (chunks of 3, the last of 1) cut into dp 2's (5 each)
    from the pieces each old rank recorded; a missing old rank's piece is refused."""
    from types import SimpleNamespace

    from hpctrain.localckpt.state import _dp_pieces, assemble
    from hpctrain.shard import ShardSpec

    spec = ShardSpec("w", (2, 5)).flat_split("dp")
    logical = torch.arange(10, dtype=torch.float32)

    def mesh(dp, rank):
        sizes = {"tp": 1, "cp": 1, "ep": 1, "dp": dp, "pp": 1}
        return SimpleNamespace(sizes=sizes, coords={**{a: 0 for a in sizes}, "dp": rank}, size=lambda a: sizes[a])

    old = []
    for r in range(4):
        a, b = spec._flat_range(mesh(4, r).coords, mesh(4, r).sizes)
        t = logical[a:b].clone()
        old.append(RankState({"o0/exp_avg": t}, {"pieces": {"o0/exp_avg": _dp_pieces(spec, t, mesh(4, r))}}))
    assert [tuple(s.tensors["o0/exp_avg"].shape) for s in old] == [(3,), (3,), (3,), (1,)]
    for r in range(2):
        assert torch.equal(assemble("o0/exp_avg", spec, mesh(2, r), old), logical[5 * r:5 * r + 5])
    with pytest.raises(LocalStateError, match="do not cover"):
        assemble("o0/exp_avg", spec, mesh(2, 1), old[:2])
