"""Token files read with positioned reads: the same tokens a memory map
gives, a clear error instead of SIGBUS when the file shrinks under the
reader, and the trainer's cursor deferring that error so the ranks can agree
on it (``hpctrain.data.tokenfile``)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from hpctrain.data import DataCursor, SampleOrder
from hpctrain.data.prepare import prepare
from hpctrain.data.sources import token_file_source
from hpctrain.data.tokenfile import ShortRead, TokenFile, TokenFileChanged


def _file(tmp_path, text_bytes=4000, dtype="uint16"):
    src = tmp_path / "in.txt"
    src.write_bytes(bytes((i * 7 + i // 13) % 256 for i in range(text_bytes)))
    out = tmp_path / "t.bin"
    prepare(str(src), str(out), dtype)
    return out


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_windows_read_as_the_array_holds_them(tmp_path, dtype):
    out = _file(tmp_path, dtype=dtype)
    whole = np.fromfile(out, dtype=dtype)
    tokens = token_file_source(str(out)).tokens
    assert isinstance(tokens, TokenFile) and len(tokens) == len(whole) == 4000
    for a, b in [(0, 65), (1234, 1299), (3935, 4000), (17, 17)]:
        got = tokens[a:b]
        assert got.dtype == np.dtype(dtype) and np.array_equal(got, whole[a:b])
    assert tokens[-1] == int(whole[-1]) and tokens[3] == int(whole[3])


def test_a_file_truncated_under_a_reader_reads_short_instead_of_sigbus(tmp_path):
    """In a child process: were the file memory-mapped, the read past the new
    end would kill it with SIGBUS (status -7), and this pytest with it."""
    out = _file(tmp_path)
    script = textwrap.dedent(f"""
        import os
        import numpy as np
        from hpctrain.data.sources import token_file_source
        from hpctrain.data.tokenfile import ShortRead
        source = token_file_source({str(out)!r})
        read = lambda a, b: np.asarray(source.tokens[a:b], dtype=np.int64)  # as the sample order reads
        read(3000, 3065)  # once, as a running job has
        os.truncate({str(out)!r}, 4000)  # half of its 8000 bytes
        assert len(read(100, 165)) == 65  # before the new end: still fine
        try:
            read(3000, 3065)  # two pages past the new end
        except ShortRead as e:
            print("ShortRead:", e)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr)
    assert r.stdout.startswith("ShortRead: "), r.stdout
    assert f"data.path={out} shrank under the running job" in r.stdout
    assert "tokens [3000, 3065) need bytes up to 6130, it now holds 4000 bytes (it held 8000" in r.stdout


def _windows(order, cursor):
    return [order.window_start(i) for i in cursor.local_indices()]


def test_the_cursor_defers_a_short_read_and_every_rank_raises_the_agreed_error(tmp_path):
    """Two sample ranks of one step: the file is cut just past rank 0's last
    window, so only rank 1 reads short. Each gets its whole step (rank 1's
    lost windows as zeros, counted); given the agreed count, both raise the
    same error; without deferral rank 1 raises at the read."""
    out = _file(tmp_path)
    order = SampleOrder(token_file_source(str(out)), seq_len=16, seed=2)
    cursors = [DataCursor(order, 8, 2, r, 2, defer_short_reads=True) for r in range(2)]
    ends = [max(_windows(order, c)) + 17 for c in cursors]
    assert ends[0] < ends[1], "the seed must put rank 1's last window past rank 0's"
    os.truncate(out, 2 * ends[0])
    steps = [c.next_step() for c in cursors]
    assert [c.short_reads for c in cursors] == [0, 1]
    assert all(len(s) == 2 and s[0].inputs.shape == (2, 16) for s in steps)
    rank1 = torch.cat([mb.inputs for mb in steps[1]])
    assert (rank1 == 0).all(dim=1).any()  # the window past the end came back as zeros
    for c in cursors:
        c.raise_if_short(0, 1)  # nobody short: nothing happens
    messages = []
    for c in cursors:
        with pytest.raises(TokenFileChanged) as e:
            c.raise_if_short(1, 1)
        messages.append(str(e.value))
    assert messages[0] == messages[1]
    assert f"data.path={out} changed under the running job: step 1 reads past its end on 1 rank;" in messages[0]
    assert f"it held 8000 bytes (4000 uint16 tokens) when the job started and holds {2 * ends[0]} now" in messages[0]
    strict = DataCursor(order, 8, 2, 1, 2)
    with pytest.raises(ShortRead):
        strict.next_step()


@pytest.mark.parametrize("prefetch", [False, True])
def test_a_file_that_shrinks_between_steps_stops_the_run_before_the_update(make_config, tmp_path, prefetch):
    """One process through the trainer: the first step that reads after the
    cut raises the agreed error; its update is not applied and the step is not
    counted. With ``data.prefetch`` step 3's tokens were read during step 2,
    before the cut, so step 3 trains on them and step 4 is the one that fails."""
    from hpctrain.run import reference_trainer

    out = _file(tmp_path, text_bytes=20000)
    cfg = make_config("data=tokens", f"data.path={out}", "trainer.steps=5", "trainer.log_every=100",
                      f"data.prefetch={str(prefetch).lower()}")
    trainer = reference_trainer(cfg)
    trainer.train_step()
    trainer.train_step()
    os.truncate(out, 0)
    if prefetch:
        trainer.train_step()
    failing = trainer.step + 1
    before = [p.detach().clone() for p in trainer.params]
    said = rf"step {failing} reads past its end on 1 rank; it held 40000 bytes .* holds 0 now"
    with pytest.raises(TokenFileChanged, match=said):
        trainer.train_step()
    assert trainer.step == failing - 1
    assert all(torch.equal(a, p) for a, p in zip(before, trainer.params))
