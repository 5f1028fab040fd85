"""The planner's error band against published runs, stored for ``hpctrain-plan`` to print beside its MFU.

``hpctrain-plan --validate --write-band`` measures it (``validate.band``: the range of predicted /
published MFU - 1 over the published runs it predicts, and the share of all runs within 15%) and
writes ``validation_band.yaml`` next to this module (YAML: the wheel ships ``planner/*.yaml``);
every plan then prints its MFU with that band (``band_text``), and ``tests/unit/planner`` check
the stored file is what the current planner measures, so it is regenerated whenever the model
changes. Reading it needs nothing heavy: the plan's report imports this module, not the validation.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional

import yaml  # type: ignore[import-untyped]  # (pyyaml is a dependency; its stubs are not installed)

BAND_FILE = Path(__file__).with_name("validation_band.yaml")
HEADER = ("# The planner's error band against the published runs (hpctrain/planner/published_runs.yaml), as\n"
          "# hpctrain-plan prints it beside its MFU. Generated: hpctrain-plan --validate --write-band\n")


def write_band(data: Dict[str, Any], path: Path = BAND_FILE) -> None:
    path.write_text(HEADER + yaml.safe_dump(data, sort_keys=False))


def load_band(path: Path = BAND_FILE) -> Optional[Dict[str, Any]]:
    """The stored band, or None when there is none."""
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None
    return data if isinstance(data, dict) and "all" in data else None


def band_text(mfu: float, stored: Optional[Dict[str, Any]]) -> str:
    """``MFU 41.2%`` and, with a stored band, how far the planner was from published runs, e.g.
    ``(against 43 published runs the planner was -12%..+9% off the measured MFU, 80% within 15%: ...)``."""
    text = f"MFU {100 * mfu:.1f}%"
    if not stored or stored["all"].get("min_error") is None:
        return text
    a = stored["all"]
    return (f"{text} (against {a['runs']} published runs the planner was {100 * a['min_error']:+.0f}%.."
            f"{100 * a['max_error']:+.0f}% off the measured MFU, {100 * a['within_fraction_of_runs']:.0f}% "
            f"within {100 * stored['tolerance']:.0f}%: hpctrain-plan --validate)")
