"""The planner: predict memory, communication and step time for any model, layout and cluster.

``hpctrain-plan`` (``cli``) composes the same config as ``hpctrain-train``,
enumerates the layouts that pass the training validator's layout checks
(``layouts``), estimates each (``estimate``: ``memory``, ``activations``,
``compute``, ``comm_model``, ``schedules``) on the cluster (``cluster``),
ranks those that fit (``search``) and prints them (``report``). The formulas,
their sources and the validation against published tables are in
docs/planner.md.
"""
from hpctrain.planner.arch import Arch  # noqa: F401
from hpctrain.planner.cluster import ClusterSpec, cluster_spec  # noqa: F401
from hpctrain.planner.estimate import Estimate, Workload, estimate  # noqa: F401
from hpctrain.planner.layouts import Layout, enumerate_layouts  # noqa: F401
from hpctrain.planner.memory import HPCTRAIN, ZERO_PAPER, StateBytes  # noqa: F401
from hpctrain.planner.search import Plan, search  # noqa: F401
