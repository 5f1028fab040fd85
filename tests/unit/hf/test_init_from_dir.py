"""The default checkpoint directory tells fine-tunings from different weights apart
(a relaunch with checkpoint.resume=auto must not continue another run's
fine-tuning), and keeps the name of a run that starts from no weights."""
from __future__ import annotations

from hpctrain.checkpoint import default_checkpoint_dir


def test_init_from_is_part_of_the_experiment(make_config, tmp_path):
    plain = make_config()
    a, b = make_config("checkpoint.init_from=/w/a.h5"), make_config("checkpoint.init_from=/w/b.h5")
    dirs = [default_checkpoint_dir(c, str(tmp_path)) for c in (plain, a, b)]
    assert len(set(dirs)) == 3
    assert default_checkpoint_dir(make_config("checkpoint.init_from=/w/a.h5"), str(tmp_path)) == dirs[1]
    # unset, it is left out of the hash (tests/unit/test_checkpoint_dir_names.py pins the names of runs
    # without it)
