"""A load reads each contiguous box straight into the trainer's tensors and
verifies it block by block as it reads: no copy, and still every corrupt
byte is found, in any block. A file that fails verification after some of
its blocks went into the trainer is then loaded over by resume=auto's older
checkpoint, which leaves exactly the state a direct resume from that one gives."""
from __future__ import annotations

import os
import shutil

import h5py
import pytest
import torch

import hpctrain_h5ckpt.reader as reader_module
import hpctrain_h5ckpt.restore as restore_module
from hpctrain_h5ckpt.errors import CheckpointError

BIG = "/model/tok_embeddings.weight"  # 256 x 64 fp32: 64 KiB, 64 blocks of 1 KiB here


@pytest.fixture(scope="module")
def pm():
    from hpctrain.plugins import create_manager

    return create_manager()


def _trainer(pm, d: str, *extra: str):
    from hpctrain.config import compose_resolved
    from hpctrain.run import reference_trainer

    base = ["trainer.steps=4", "checkpoint.every=1", "checkpoint.keep=0", f"checkpoint.dir={d}",
            "trainer.global_batch_size=4", "trainer.micro_batch_size=2", "trainer.seq_len=32", "trainer.progress=off"]
    return reference_trainer(compose_resolved(base + list(extra), pm), pm)


@pytest.fixture(scope="module")
def ckpt_dir(pm, tmp_path_factory):
    """Checkpoints at steps 1 and 2 of the tiny model, trained in this process."""
    d = str(tmp_path_factory.mktemp("inplace") / "ck")
    trainer = _trainer(pm, d)
    for _ in range(2):
        trainer.train_step()
        trainer.save_checkpoint()
    return d


def _state(trainer) -> dict:
    out = {f"param {n}": p.detach().clone() for n, p in trainer.model.named_parameters()}
    for i, group in enumerate(trainer.optimizer.state.values()):
        for key, value in group.items():
            out[f"state {i} {key}"] = value.clone() if isinstance(value, torch.Tensor) else value
    return out


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])), k


def test_contiguous_boxes_are_read_in_place_without_a_copy(pm, ckpt_dir, monkeypatch):
    copies = []
    real = restore_module._copy_in
    monkeypatch.setattr(restore_module, "_copy_in", lambda dst, src: (copies.append(dst.shape), real(dst, src)))
    first = _trainer(pm, ckpt_dir, f"checkpoint.resume={ckpt_dir}/step_00000002.h5")
    pointers = {n: p.data_ptr() for n, p in first.model.named_parameters()}
    assert first.step == 2 and copies == []  # one process: every box is a whole tensor, read where it lives
    with h5py.File(f"{ckpt_dir}/step_00000002.h5", "r") as f:
        for name, p in first.model.named_parameters():
            assert torch.equal(p.detach(), torch.from_numpy(f[f"/model/{name}"][()])), name
    assert pointers == {n: p.data_ptr() for n, p in first.model.named_parameters()}


@pytest.mark.parametrize("where", [0.02, 0.5, 0.98])
def test_a_flipped_byte_in_any_block_is_found_and_auto_falls_back_to_the_exact_older_state(
        pm, ckpt_dir, tmp_path, monkeypatch, where):
    monkeypatch.setattr(reader_module, "_HOT_BLOCK_BYTES", 1024)
    d = str(tmp_path / "ck")
    os.makedirs(d)
    for name in ("step_00000001.h5", "step_00000002.h5"):
        shutil.copy(f"{ckpt_dir}/{name}", d)
    bad = f"{d}/step_00000002.h5"
    with h5py.File(bad, "r") as f:
        offset = f[BIG].id.get_offset() + int(f[BIG].id.get_storage_size() * where)
    with open(bad, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x10]))

    with pytest.raises(CheckpointError, match="checksum mismatch") as err:
        _trainer(pm, d, f"checkpoint.resume={bad}")
    assert BIG in str(err.value) and bad in str(err.value)

    fallen_back = _trainer(pm, d, "checkpoint.resume=auto")  # the bad file's blocks went in first
    direct = _trainer(pm, d, f"checkpoint.resume={d}/step_00000001.h5")
    assert fallen_back.step == direct.step == 1
    _assert_same(_state(fallen_back), _state(direct))
