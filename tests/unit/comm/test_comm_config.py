"""Configuration of the mpi and hier backends: names, sections, validation."""
from hpctrain.config.validate import validate


def _problems(make_config, pm, *overrides, world=4):
    return validate(make_config(*overrides), world, pm)


def test_backends_are_installed_plugins(make_config, pm):
    from hpctrain.plugins import capabilities

    served = capabilities(pm)["comm.backend"]
    assert "mpi" in served and "hier" in served
    assert _problems(make_config, pm, "comm.backend=mpi") == []
    assert _problems(make_config, pm, "comm.backend=hier") == []
    assert _problems(make_config, pm, "+comm.per_axis.pp=mpi") == []


def test_unknown_backend_lists_mpi_and_hier(make_config, pm):
    (p,) = _problems(make_config, pm, "comm.backend=carrier-pigeon")
    assert "comm.backend='carrier-pigeon' is not provided by any installed plugin" in p
    assert "mpi" in p and "hier" in p


def test_presets_and_sections(make_config):
    cfg = make_config("comm=mpi")
    assert cfg.comm.backend == "mpi" and cfg.comm.mpi.check_shapes is False and cfg.comm.mpi.cuda_aware == "auto"
    cfg = make_config("comm=hier", "comm.hier.intra=gloo")
    assert cfg.comm.backend == "hier" and (cfg.comm.hier.intra, cfg.comm.hier.inter) == ("gloo", "mpi")
    assert cfg.comm.hier.uneven == "flat"


def test_hier_rejects_itself_unknown_names_and_bad_choices(make_config, pm):
    problems = _problems(make_config, pm, "comm.backend=hier", "comm.hier.intra=hier", "comm.hier.inter=smoke",
                         "comm.hier.uneven=maybe")
    assert len(problems) == 3
    assert "comm.hier.intra=hier would nest the hierarchical backend in itself" in problems[0]
    assert "comm.hier.inter='smoke' is not provided by any installed plugin" in problems[1]
    assert "mpi" in problems[1]
    assert "comm.hier.uneven='maybe' must be one of flat, error" in problems[2]


def test_hier_options_only_checked_when_used(make_config, pm):
    assert _problems(make_config, pm, "comm.backend=mpi", "comm.hier.intra=smoke") == []


def test_mpi_cuda_aware_choices(make_config, pm):
    (p,) = _problems(make_config, pm, "comm.backend=mpi", "comm.mpi.cuda_aware=perhaps")
    assert p == "comm.mpi.cuda_aware='perhaps' must be one of auto, on, off"
