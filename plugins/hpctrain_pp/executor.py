"""Runs a rank's pipeline program (``schedules.actions``) for one step.

Every send and receive is non-blocking (``batch_isend_irecv``): sends are
posted without waiting and completed at the end of the step; each receive
is posted one receive ahead of where the program consumes it (so it is in
flight during the compute before it) and waited for there. Activation
shapes are fixed for the run (micro-batch, the rank's tokens / tp under
sequence parallelism, d_model; fp32 residual stream), so no message
carries a shape. Tags name (micro-batch, stage boundary,
direction), so messages never match the wrong receive.

Gradients: backwards accumulate into ``.grad`` under the data handle's
``no_sync`` (a rank's backwards interleave micro-batches and chunks, so no
single one is "the last"); the core's ``finalize_grads`` then reduces the
data axes and sums tied embedding gradients between the first and last
stage. The last stage's loss of each micro-batch is scaled by 1/m as in
gradient accumulation (times its weight with a loss mask:
``hpctrain.train.step_runner``); auxiliary losses of any stage join that stage's
backward.

Zero-bubble ``B`` computes only the input gradient and ``W`` the weight
gradients from the gradients B kept (``weight_pass``: one backward's work in
all); the first stage has no input gradient, so its ``W`` is the whole
backward. W writes ``.grad`` by hand and marks each gradient ready with the data
handle (``mark_ready``).

``forward_only`` (validation) runs ``schedules.forward_actions`` instead:
the forwards and their transfers under ``torch.no_grad``, each stage's
output sent and dropped, the last stage's loss summed; no gradient, no
auxiliary loss, the data handle untouched.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Dict, List, Optional, Sequence, Tuple

import torch

from hpctrain.comm.protocol import P2POp
from hpctrain.mesh import Group
from hpctrain.model.aux import collect_aux_losses, scaled, with_aux
from hpctrain.parallel.handles import GradientControl
from hpctrain.pipeline.schedules import Action, actions, forward_actions, splits_weight_pass
from hpctrain.train.step_runner import StepResult, counted_targets, weighted_loss

from hpctrain_pp.timeline import Recorder
from hpctrain_pp.weight_pass import WeightPass, backward_input


def chunks_of(model: torch.nn.Module) -> List[torch.nn.Module]:
    """A rank's model chunks in order (one unless interleaved)."""
    chunks = getattr(model, "chunks", None)
    return list(chunks) if chunks is not None else [model]


def trainable(module: torch.nn.Module) -> List[torch.nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


class PipelineRunner:
    """The ``StepRunner`` (``hpctrain.train.step_runner``) of a pipeline: it
    executes the programme ``schedule`` names over the pp group."""

    def __init__(self, schedule: str, group: Group, vpp: int, hidden: Callable[[torch.Tensor], Tuple[int, ...]],
                 recorder: Optional[Recorder] = None):
        self.schedule, self.group, self.v = schedule, group, vpp
        self.p, self.rank = group.size, group.rank
        self.last = self.p * vpp - 1
        self.hidden = hidden
        """Shape of a stage's output for a micro-batch's token tensor."""
        self.recorder = recorder or Recorder(False)
        self._programs: Dict[Tuple[int, bool], List[Action]] = {}

    def program(self, m: int, forward_only: bool = False) -> List[Action]:
        if (m, forward_only) not in self._programs:
            programs = forward_actions(self.p, self.v, m) if forward_only else actions(self.schedule, self.p, self.v, m)
            self._programs[(m, forward_only)] = programs[self.rank]
        return self._programs[(m, forward_only)]

    def _tag(self, microbatch: int, boundary: int, backward: bool) -> int:
        """Messages cross stage boundary ``boundary`` (between stages boundary and boundary + 1)."""
        return ((microbatch * self.last + boundary) << 1) | int(backward)

    def run(self, model: torch.nn.Module, microbatches: Sequence[Any], grads: GradientControl,
            autocast: Callable[[], ContextManager] = contextlib.nullcontext, forward_only: bool = False
            ) -> StepResult:
        if forward_only:
            with torch.no_grad():
                return self._forward_only(model, microbatches, autocast)
        chunks = chunks_of(model)
        comm = self.group.communicator()
        m = len(microbatches)
        device = next(model.parameters()).device
        split = splits_weight_pass(self.schedule)
        inputs: Dict[Tuple[int, int], torch.Tensor] = {}
        outputs: Dict[Tuple[int, int], List[torch.Tensor]] = {}   # tensors to differentiate
        out_grads: Dict[Tuple[int, int], List[Optional[torch.Tensor]]] = {}
        weight_passes: Dict[Tuple[int, int], Optional[WeightPass]] = {}
        sends: List[Any] = []
        loss_sum = torch.zeros((), dtype=torch.float32, device=device)
        tokens = 0
        program = self.program(m)
        post_next, received = self._receiver(program, microbatches, comm, device)
        self.recorder.begin_step()
        post_next()
        with grads.no_sync():
            for i, a in enumerate(program):
                key = (a.microbatch, a.chunk)
                stage = a.chunk * self.p + self.rank
                mb = microbatches[a.microbatch]
                started = self.recorder.now()
                if a.kind == "RECV_F":
                    inputs[key] = received(i).requires_grad_()
                elif a.kind == "F":
                    out, aux = self._forward(chunks[a.chunk], stage, mb, inputs.get(key), autocast)
                    if stage == self.last:  # (a loss mask's weight: hpctrain.train.step_runner)
                        count = counted_targets(mb)
                        loss_sum = loss_sum + out.detach().float() * count
                        tokens += count
                        objective = with_aux(weighted_loss(out, mb), aux, mb.loss_weight)
                        outputs[key], out_grads[key] = [objective / m], [None]
                    else:
                        outputs[key], out_grads[key] = [out], [None]
                        extra = aux.total()
                        if extra is not None:  # this stage's auxiliary losses join its backward
                            outputs[key].append(scaled(extra) / m)
                            out_grads[key].append(None)
                elif a.kind == "SEND_F":
                    sends.append(self._send(comm, outputs[key][0].detach(), a, stage, False))
                elif a.kind == "RECV_B":
                    out_grads[key][0] = received(i)
                elif a.kind == "B":
                    if not split:
                        torch.autograd.backward(outputs.pop(key), out_grads.pop(key))
                    elif stage > 0:  # the first stage has no input gradient: its W is the whole backward
                        weight_passes[key] = backward_input(outputs[key], out_grads[key], inputs[key],
                                                            trainable(chunks[a.chunk]))
                        if weight_passes[key] is not None:
                            del outputs[key], out_grads[key]
                elif a.kind == "W":
                    deferred = weight_passes.pop(key, None)
                    if deferred is not None:
                        deferred.run(grads.mark_ready)
                    else:  # the whole backward, towards the weights only
                        torch.autograd.backward(outputs.pop(key), out_grads.pop(key),
                                                inputs=trainable(chunks[a.chunk]))
                elif a.kind == "SEND_B":
                    grad = inputs.pop(key).grad
                    assert grad is not None  # this micro-batch's backward wrote it
                    sends.append(self._send(comm, grad, a, stage - 1, True))
                self.recorder.record(started)
            _wait_all(sends)
        return StepResult(loss_sum, tokens)

    def _forward_only(self, model: torch.nn.Module, microbatches: Sequence[Any],
                      autocast: Callable[[], ContextManager]) -> StepResult:
        chunks = chunks_of(model)
        comm = self.group.communicator()
        device = next(model.parameters()).device
        program = self.program(len(microbatches), forward_only=True)
        post_next, received = self._receiver(program, microbatches, comm, device)
        inputs: Dict[Tuple[int, int], torch.Tensor] = {}
        outputs: Dict[Tuple[int, int], torch.Tensor] = {}
        sends: List[Any] = []
        loss_sum = torch.zeros((), dtype=torch.float32, device=device)
        tokens = 0
        post_next()
        for i, a in enumerate(program):
            key = (a.microbatch, a.chunk)
            stage = a.chunk * self.p + self.rank
            mb = microbatches[a.microbatch]
            if a.kind == "RECV_F":
                inputs[key] = received(i)
            elif a.kind == "F":
                out, _ = self._forward(chunks[a.chunk], stage, mb, inputs.pop(key, None), autocast)
                if stage == self.last:
                    loss_sum = loss_sum + out.float() * counted_targets(mb)
                    tokens += counted_targets(mb)
                else:
                    outputs[key] = out
            elif a.kind == "SEND_F":
                sends.append(self._send(comm, outputs.pop(key), a, stage, False))
        _wait_all(sends)
        return StepResult(loss_sum, tokens)

    def _forward(self, chunk: torch.nn.Module, stage: int, mb: Any, received: Optional[torch.Tensor],
                 autocast: Callable[[], ContextManager]) -> Tuple[torch.Tensor, Any]:
        """One chunk's forward of ``mb``: its output (the loss on the last stage) and its auxiliary losses."""
        x = mb.inputs if stage == 0 else received
        assert x is not None  # a later stage's RECV_F comes before its F
        # a later stage's input may be a sequence shard (tp): name the tokens' positions
        positions = mb.positions if mb.positions is not None else torch.arange(mb.inputs.shape[1], device=x.device)
        with autocast(), collect_aux_losses() as aux:  # every stage's attention masks documents
            # the last stage's multi-token prediction embeds the token ids (hpctrain.model.mtp)
            out = chunk(x, mb.targets if stage == self.last else None, positions, segments=mb.segments,
                        tokens=mb.inputs if stage == self.last else None)
        return out, aux

    def _send(self, comm: Any, tensor: torch.Tensor, a: Action, boundary: int, backward: bool) -> Tuple[Any, Any]:
        """Post ``tensor``'s send across stage boundary ``boundary``; (tensor, works), kept alive until waited."""
        return tensor, comm.batch_isend_irecv([P2POp("send", tensor, a.peer, self._tag(a.microbatch, boundary,
                                                                                       backward))])

    def _receiver(self, program: List[Action], microbatches: Sequence[Any], comm: Any, device: torch.device):
        """(post_next, received): receives posted one ahead of where the program consumes them."""
        receives = iter([i for i, a in enumerate(program) if a.kind.startswith("RECV")])
        posted: Dict[int, Tuple[torch.Tensor, List[Any]]] = {}

        def post_next() -> None:  # the program's next receive, posted now, waited for where it stands
            i = next(receives, None)
            if i is not None:
                a = program[i]
                s = a.chunk * self.p + self.rank
                buf = torch.empty(self.hidden(microbatches[a.microbatch].inputs), dtype=torch.float32, device=device)
                tag = self._tag(a.microbatch, s - 1, False) if a.kind == "RECV_F" else self._tag(a.microbatch, s, True)
                posted[i] = (buf, comm.batch_isend_irecv([P2POp("recv", buf, a.peer, tag)]))

        def received(i: int) -> torch.Tensor:
            post_next()  # keep one receive ahead in flight while this one is consumed and computed on
            buf, works = posted.pop(i)
            for w in works:
                w.wait()
            return buf

        return post_next, received


def _wait_all(sends: List[Tuple[Any, Any]]) -> None:
    for _, works in sends:
        for w in works:
            w.wait()


