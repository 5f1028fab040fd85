"""The optimizers over sharded state: AdamW (torch's), LAMB, LARS and Muon.

``build.build_optimizer`` makes the one ``optim.name`` chooses over the
tensors a rank updates (the parameters, or ZeRO's shards). Every one sees
finished gradients and each tensor's ShardSpec: per-tensor norms come from
the logical tensor (``norms``), Muon orthogonalises whole matrices
(``muon``), and state tensors are shaped like the tensors they belong to, so
the checkpoint stores them as logical tensors through the same specs.
"""
