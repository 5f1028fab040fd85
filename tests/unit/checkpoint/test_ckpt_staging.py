"""Staging (the host copy of an async save) and the background saver's
staged/finished handshake, in one process; the same through real MPI ranks
and the trainer is in tests/mpi/checkpoint/test_ckpt_safety.py."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from hpctrain.config.validate import validate

from hpctrain_h5ckpt.asyncsave import BackgroundSaver
from hpctrain_h5ckpt.errors import CheckpointError
from hpctrain_h5ckpt.layout import full_box
from hpctrain_h5ckpt.snapshot import StateView, _decl
from hpctrain_h5ckpt.staging import HostBuffers, Stager


def _view(**tensors: torch.Tensor) -> StateView:
    view = StateView()
    for name, t in tensors.items():
        view.add(_decl(f"/model/{name}", tuple(t.shape), t.dtype), full_box(tuple(t.shape)), t)
    return view


def _owned(view: StateView):
    return {path: list(boxes) for path, boxes in view.boxes.items()}


def test_copy_holds_the_values_at_save_time_in_reused_buffers():
    w, b = torch.randn(8, 4), torch.arange(6, dtype=torch.bfloat16)
    view, buffers = _view(w=w, b=b), HostBuffers()
    first = Stager(view, _owned(view), buffers).copy()
    np.testing.assert_array_equal(first["/model/w"][0][1], w.numpy())
    assert first["/model/b"][0][1].dtype == np.dtype("<u2")  # bfloat16 travels as its bit pattern
    assert not np.shares_memory(first["/model/w"][0][1], w.numpy())
    with torch.no_grad():
        w.mul_(2)
    second = Stager(view, _owned(view), buffers).copy()
    assert np.shares_memory(first["/model/w"][0][1], second["/model/w"][0][1])  # same buffer, copied again
    np.testing.assert_array_equal(second["/model/w"][0][1], w.numpy())


def test_without_buffers_a_cpu_tensor_is_written_from_its_own_memory():
    w = torch.randn(8, 4)
    view = _view(w=w)
    stager = Stager(view, _owned(view), None)
    out = stager.copy()
    assert np.shares_memory(out["/model/w"][0][1], w.numpy())
    assert stager.items == []  # the Stager lets go of the training's tensors once copied


def test_a_tensor_changed_before_its_copy_fails_the_save_and_names_it():
    p = torch.nn.Parameter(torch.ones(4, 4))
    view = _view(w=p)
    stager = Stager(view, _owned(view), HostBuffers())
    opt = torch.optim.SGD([p], lr=0.1)
    p.grad = torch.ones_like(p)
    opt.step()  # what a loop that skips before_update() does
    with pytest.raises(CheckpointError, match=r"changed while an async save.*/model/w.*before_update"):
        stager.copy()


def test_swapping_the_parameter_storage_does_not_change_what_is_saved():
    p = torch.nn.Parameter(torch.full((3,), 7.0))
    view = _view(w=p)
    stager = Stager(view, _owned(view), HostBuffers())
    p.data = torch.zeros(3)  # e.g. a plugin gathering a full parameter for the forward
    np.testing.assert_array_equal(stager.copy()["/model/w"][0][1], np.full(3, 7.0, dtype=np.float32))


def test_nbytes_counts_the_owned_boxes():
    view = _view(w=torch.zeros(8, 4), b=torch.zeros(6, dtype=torch.bfloat16))
    assert Stager(view, _owned(view), None).nbytes == 8 * 4 * 4 + 6 * 2


def test_wait_staged_returns_while_the_write_still_runs():
    saver, release, order = BackgroundSaver(0), threading.Event(), []

    def write(x):
        assert release.wait(30)
        order.append(("wrote", x))

    saver.submit(lambda: order.append("staged") or 42, write, "t")
    waited = saver.wait_staged()
    assert waited >= 0 and order == ["staged"] and saver.busy and not saver.staging
    release.set()
    saver.wait()
    assert order == ["staged", ("wrote", 42)] and not saver.busy


def test_a_staging_failure_is_raised_by_wait_staged_and_the_write_never_runs():
    saver, wrote = BackgroundSaver(0), []

    def stage():
        raise CheckpointError("staging broke")

    saver.submit(stage, wrote.append, "t")
    with pytest.raises(CheckpointError, match="staging broke"):
        saver.wait_staged()
    assert wrote == [] and not saver.busy
    saver.wait()  # the error was delivered once


def test_a_write_failure_is_left_for_wait():
    saver = BackgroundSaver(0)

    def write(_):
        raise OSError("disk full")

    saver.submit(lambda: None, write, "t")
    saver.wait_staged()
    with pytest.raises(OSError, match="disk full"):
        saver.wait()


def test_staging_mode_is_validated(make_config, pm):
    ok = ("checkpoint.every=1", "checkpoint.dir=/tmp/x")
    assert make_config(*ok).checkpoint.hdf5.staging == "overlap"
    problems = validate(make_config(*ok, "checkpoint.hdf5.staging=later"), 2, pm)
    assert any("checkpoint.hdf5.staging='later' is not one of overlap, blocking" in p for p in problems)
    assert validate(make_config(*ok, "checkpoint.hdf5.staging=blocking"), 2, pm) == []
