"""The planner: predict memory, communication and step time for any model, layout and cluster.

``hpctrain-plan`` (``cli``) composes the same config as ``hpctrain-train``,
enumerates the layouts that pass the training validator's layout checks
(``layouts``), estimates each (``estimate``: ``memory``, ``activations``,
``compute``, ``comm_model``, ``schedules``) on the cluster (``cluster``),
ranks those that fit (``search``) and prints them (``report``). The formulas,
their sources and the validation against published tables are in
docs/planner.md.

The package itself imports nothing: ``hpctrain-plan --help`` then starts
without torch (``estimate`` reaches it through the mesh).
"""
