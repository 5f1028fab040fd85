"""One place where a step's gradients are finished.

Between the step's last backward and the gradient norm, clipping and the
optimizer, every gradient goes through these steps, in this order, each
done by the part of the run that owns it:

1. **Data axes** (``data.reduce_gradients``, the data axes' handle): each
   gradient averaged over the data axes it is not split on (dense weights
   over ``cp x ep x dp``, experts over ``cp x dp``), by whoever holds it (the
   parameter, or a ZeRO rank's shard). Gradients that a forward collective
   already summed over a data axis (experts over ``ep``: the dispatch
   all-to-all carries each rank's contribution to the weight's owner) were
   divided by that axis's size as backward produced them
   (``grad_sync.presummed``), so they arrive here as partial averages like
   the others.
2. **Tied embeddings** (the core, over ``mesh.pp_ends()``): the first
   pipeline stage's table and the last stage's output projection are one
   logical tensor held twice; each end adds the other's (already averaged)
   gradient, in the tensors the data handle names (``gradients_of``), so
   both copies stay bitwise equal.
3. **Replicas inside a model-parallel group** need nothing here: their
   gradients are summed in backward by the collectives that made them
   replicas (``copy_to_region`` on a sequence-parallel norm's weight, a key/
   value head shared by several tensor-parallel ranks, an expert layer left
   whole under tp).
4. **Loss normalisation** is already in the gradients: each micro-batch's
   backward is of its mean token loss over the number of micro-batches, and
   every data rank holds the same number of tokens (the cursor), so the
   average of step 1 is the gradient of the global mean loss. With a loss
   mask (chat data) each micro-batch's loss is weighted by its share of the
   global batch's counted targets before its backward
   (``hpctrain.train.step_runner.weigh_masked``), to the same end.

Optimizers then see finished gradients; the global norm and clipping are
the trainer's (``hpctrain.train.grad_norm``).
"""
from __future__ import annotations

from torch import nn

from hpctrain.comm.protocol import ReduceOp
from hpctrain.mesh import Mesh
from hpctrain.parallel.handles import DataHandle, tied_parameters


def finalize_grads(model: nn.Module, data: DataHandle, mesh: Mesh) -> None:
    """Finish this rank's gradients for the optimizer (module docstring; collective)."""
    data.reduce_gradients()
    tied = tied_parameters(model, mesh)
    if tied:
        ends = mesh.pp_ends().communicator()
        for grad in data.gradients_of(tied):
            ends.all_reduce(grad, ReduceOp.SUM)
