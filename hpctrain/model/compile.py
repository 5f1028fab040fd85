"""Regional compilation: ``trainer.compile=true``.

The regions are each transformer block's forward (``Block._forward``) and
the loss module's forward; the embedding, the head's projection, the
pipeline schedule and everything between regions stay eager. Regions, not
the whole model, because

- every block of a class runs one compiled code object: torch.compile's
  cache hangs on the code object and dynamo lifts parameters to graph
  inputs, so the blocks of a model (and of every trainer in one process)
  share one graph per shape instead of one per block;
- activation recomputation stays outside: ``Block.forward`` wraps the
  compiled ``_forward`` in torch's checkpoint (compile inside checkpoint),
  and ``recomputed`` is never traced (``hpctrain.model.recompute``), so
  selective recomputation of the attention core is an eager island inside
  the block's region. Recomputation then replays the compiled graph.

The differentiable collectives (``hpctrain.comm.differentiable``) are
custom operators while dynamo traces (``hpctrain.comm.ops``): one node of the
graph each, calling the backend at run time, so a tensor-parallel block is
one graph. What still calls MPI or torch.distributed from Python (an axis
plugin's own exchange, ``exchange_counts``) is a graph break, run eagerly in
the same order on every rank. Graphs and graph breaks are counted per region
kind (the block's class, the loss's: dynamo's own counters, read around the
region's first calls) and reported once, after the first step (regions are
compiled when first called), in one rank-0 line with each break's reason.

``trainer.compile_fullgraph=true`` compiles each region as one graph or not
at all: the first graph break stops the run with one ``hpctrain: error:``
line naming the region and the operation that broke it (dynamo's reason).

Fallback: when the backend cannot compile at all (inductor without a C++
compiler) the run stays eager with one rank-0 warning; a graph whose
compilation fails runs eagerly as captured (``_Backend`` returns the FX
graph's own forward), and the report names the cause. Either way training
goes on with the same numbers as eager.

``trainer.compile_backend`` picks the backend: inductor (the default: code
generation, C++ on CPU, Triton on GPU) or any backend dynamo lists, e.g.
aot_eager (dynamo and AOTAutograd without code generation).
"""
from __future__ import annotations

import collections
import re
from dataclasses import dataclass, field
from types import MethodType
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from hpctrain import eager
from hpctrain.errors import ConfigError
from hpctrain.log import get_logger, log_rank0
from hpctrain.model.transformer import Block, Transformer

log = get_logger(__name__)

RECOMPILE_LIMIT = 64
"""dynamo's cache entries per code object (its default is 8): one block code
object serves every layout a process builds (tests build many, each with
its own guards), and past the limit dynamo silently runs the frame eagerly."""


def backends() -> List[str]:
    """The backend names dynamo accepts for ``trainer.compile_backend``."""
    import torch._dynamo  # heavy: torch.compile's stack (~2 s), only when compiling

    return sorted(set(torch._dynamo.list_backends(exclude_tags=())) | {"inductor"})


def cannot_compile(backend: str) -> Optional[str]:
    """Why ``backend`` cannot compile on this machine, with the fix; None when it can.
    (Only inductor on CPU needs something outside torch: a C++ compiler.)"""
    if backend != "inductor":
        return None
    try:
        from torch._inductor import cpp_builder  # heavy: torch.compile's stack (~2 s), only when compiling

        cpp_builder.get_cpp_compiler()
    except (RuntimeError, ImportError, OSError) as e:  # InvalidCxxCompiler (a RuntimeError), or inductor missing
        return (f"inductor needs a C++ compiler and found none ({type(e).__name__}); install g++ (apt-get install "
                f"g++) or set CXX, or set trainer.compile_backend=aot_eager or trainer.compile=false")
    return None


@dataclass
class CompileStats:
    """What compilation did in this process (graphs compiled, compiles that failed)."""

    graphs: int = 0
    failures: List[str] = field(default_factory=list)


class _Backend:
    """A dynamo backend: ``name``'s compiler, counting graphs; a graph it fails to
    compile runs eagerly (its FX forward), the failure kept for the report."""

    def __init__(self, name: str, stats: CompileStats):
        self.name, self.stats = name, stats
        self.__name__ = f"hpctrain_{name}"  # dynamo names backends in its logs

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: List[Any]) -> Callable[..., Any]:
        from torch._dynamo import lookup_backend  # heavy: torch.compile's stack (~2 s), only when compiling

        # heavy: torch.compile's stack (~2 s), only when compiling
        from torch._dynamo.exc import RestartAnalysis, SkipFrame

        self.stats.graphs += 1
        try:
            return lookup_backend(self.name)(gm, example_inputs)
        except (RestartAnalysis, SkipFrame):  # dynamo's own control flow, not a failure
            raise
        except Exception as e:  # noqa: BLE001 - any failure of the compiler: the graph runs eagerly, reported
            text = str(e).strip()
            self.stats.failures.append(f"{type(e).__name__}: {text.splitlines()[0] if text else ''}")
            return gm.forward


_COMPILED: Dict[Tuple[Callable[..., Any], str, bool], Callable[..., Any]] = {}
"""One torch.compile wrapper per (function, backend, fullgraph) in the process."""
_STATS: Dict[str, CompileStats] = collections.defaultdict(CompileStats)
"""Per backend: graphs compiled and failures, in this process."""


def _compiled(fn: Callable[..., Any], backend: str, fullgraph: bool = False) -> Callable[..., Any]:
    key = (fn, backend, fullgraph)
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(fn, backend=_Backend(backend, _STATS[backend]), fullgraph=fullgraph)
    return _COMPILED[key]


def graph_break_reasons() -> Dict[str, int]:
    """dynamo's graph breaks in this process so far, by reason."""
    from torch._dynamo.utils import counters  # heavy: torch.compile's stack (~2 s), only when compiling

    return dict(counters["graph_break"])


@dataclass
class RegionCount:
    """What dynamo did while one kind of region (a block class, a loss class) ran its first calls."""

    graphs: int = 0
    breaks: Dict[str, int] = field(default_factory=dict)
    """Graph breaks by dynamo's reason."""

    @property
    def total_breaks(self) -> int:
        return sum(self.breaks.values())


PROBED_CALLS = 8
"""Calls of each region kind during which its graphs and breaks are counted (its compilation happens at
its first calls; a recompilation later, for a new shape, is in the process-wide totals only). dynamo counts
a break when it compiles the frame: a region whose code dynamo reuses from an earlier model of this process
(the same guards) would show 0 graphs and 0 breaks; a new model's groups and modules fail the old guards,
so in practice each trainer compiles its own (tests/mpi/test_compile_breaks.py asserts graphs >= 1)."""


@dataclass
class CompiledRegions:
    """The compiled regions of one model, and what to report after its first step."""

    backend: str
    main: bool
    """Whether this rank reports (the world's rank 0)."""
    blocks: int
    losses: int
    stats: CompileStats
    graphs_before: int
    failures_before: int
    breaks_before: Dict[str, int]
    fullgraph: bool = False
    """``trainer.compile_fullgraph``: a graph break is an error (``hpctrain: error:``)."""
    reported: bool = False
    calls: int = 0
    """Calls of the compiled regions so far (forward and recomputation)."""
    per_region: Dict[str, RegionCount] = field(default_factory=dict)
    """By region kind (the class name of the block or the loss): graphs and graph breaks of its first calls."""
    _probed: Dict[str, int] = field(default_factory=dict)

    def region(self, fn: Callable[..., Any], kind: str = "region") -> Callable[..., Any]:
        """``fn``, counted in ``calls``; its first calls counted in ``per_region[kind]``, and with
        ``fullgraph`` a graph break raised as one ``ConfigError`` naming ``kind`` and the breaking op."""
        count = self.per_region.setdefault(kind, RegionCount())

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            if self._probed.get(kind, 0) >= PROBED_CALLS:
                return fn(*args, **kwargs)
            self._probed[kind] = self._probed.get(kind, 0) + 1
            graphs, breaks = self.stats.graphs, graph_break_reasons()
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                if self.fullgraph and _is_graph_break(e):
                    raise ConfigError(f"trainer.compile_fullgraph=true: {kind} does not compile to one graph: "
                                      f"{_break_message(e)}; set trainer.compile_fullgraph=false to compile it "
                                      f"in pieces (the start-up line then counts the breaks)") from e
                raise
            finally:
                count.graphs += self.stats.graphs - graphs
                for k, v in graph_break_reasons().items():
                    if v > breaks.get(k, 0):
                        count.breaks[k] = count.breaks.get(k, 0) + v - breaks.get(k, 0)
        return call

    def breaks_in(self, kind: str) -> int:
        """Graph breaks counted in region kind ``kind`` (0 when it never ran)."""
        count = self.per_region.get(kind)
        return count.total_breaks if count is not None else 0

    def report(self) -> str:
        """The start-up line: regions, graphs compiled, graph breaks, and per region kind its graphs and
        breaks with their reasons (differences since set-up)."""
        self.reported = True
        breaks = {k: v - self.breaks_before.get(k, 0) for k, v in graph_break_reasons().items()}
        breaks = {k: v for k, v in breaks.items() if v > 0}
        graphs = self.stats.graphs - self.graphs_before
        failed = self.stats.failures[self.failures_before:]
        line = (f"compile ({self.backend}{', fullgraph' if self.fullgraph else ''}): {self.blocks + self.losses} "
                f"regions ({self.blocks} blocks, {self.losses} loss), {graphs} graphs compiled, "
                f"{sum(breaks.values())} graph breaks")
        kinds = []
        for kind, count in self.per_region.items():
            where = "; ".join(f"{n}x {_short(k)}" for k, n in sorted(count.breaks.items(), key=lambda kv: -kv[1]))
            kinds.append(f"{kind}: {count.graphs} graph(s), {count.total_breaks} breaks" + (f" ({where})" if where
                                                                                            else ""))
        if kinds:
            line += " | " + " | ".join(kinds)
        if failed:
            line += (f"; {len(failed)} graph(s) failed to compile and run eagerly ({failed[0]}); fix the cause or "
                     f"set trainer.compile_backend=aot_eager or trainer.compile=false")
        return line


def _is_graph_break(e: BaseException) -> bool:
    """Whether ``e`` is dynamo refusing to trace something (what fullgraph turns a graph break into)."""
    import torch._dynamo.exc as exc  # heavy: torch.compile's stack (~2 s), only when compiling

    return isinstance(e, (exc.Unsupported, exc.UserError))


def _break_message(e: BaseException) -> str:
    """dynamo's reason for a graph break under fullgraph, in one line: what it could not trace and the
    innermost user frame that called it (``in collecting (model/aux.py:80)``)."""
    text = str(e)
    line = _short(text) if text.strip() else type(e).__name__
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\w+)', text)
    if frames:
        path, number, name = frames[-1]
        line += f" in {name} ({'/'.join(path.split('/')[-2:])}:{number})"
    return line


def _short(reason: str) -> str:
    """dynamo's graph-break reason in one line: its first line and the "Developer debug context" (what was
    called); our eager islands (``hpctrain.eager``) by their function's name."""
    lines = [line.strip() for line in reason.strip().splitlines() if line.strip()]
    first = lines[0] if lines else reason
    context = [line.split(":", 1)[1].strip() for line in lines if line.startswith("Developer debug context:")]
    island = re.fullmatch(r"<function ([\w.]+) at 0x[0-9a-f]+>", context[0]) if context else None
    if "disable()" in first and island:
        return f"eager {island.group(1)}"
    if context and context[0]:
        first += f" [{context[0]}]"
    first = " ".join(re.sub(r" at 0x[0-9a-f]+", "", first).split())  # (addresses differ by rank and run)
    return first if len(first) <= 200 else first[:197] + "..."


def compile_regions(model: nn.Module, backend: str, deterministic: bool, main: bool,
                    fullgraph: bool = False) -> Optional[CompiledRegions]:
    """Compile every block ``model`` runs and its loss (``model`` may be a pipeline
    stage or an interleaved rank's chunks). Returns None, after one warning from
    the main rank (``main``), when ``backend`` cannot compile here: the model stays eager."""
    why = cannot_compile(backend)
    if why is not None:
        if main:
            log.warning("trainer.compile=true: %s; training eagerly", why)
        return None
    import torch._dynamo  # heavy: torch.compile's stack (~2 s), only when compiling

    eager.prepare()  # collectives and recomputation: graph breaks, never traced
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    if backend == "inductor":
        import torch._inductor.config as inductor_config  # heavy: torch.compile's stack (~2 s), only when compiling

        # trainer.deterministic: inductor picks kernels without timing them (timings differ run to run)
        inductor_config.deterministic = bool(deterministic)
    stats = _STATS[backend]
    regions = CompiledRegions(backend, main, 0, 0, stats, stats.graphs, len(stats.failures), graph_break_reasons(),
                              fullgraph=fullgraph)
    for module in model.modules():
        if isinstance(module, Block):
            module.compiled_forward = MethodType(regions.region(_compiled(type(module)._forward, backend, fullgraph),
                                                                type(module).__name__), module)
            regions.blocks += 1
        elif isinstance(module, Transformer) and module.loss_fn is not None:
            loss = module.loss_fn
            if "forward" not in vars(loss):  # (a loss shared by two parts is compiled once)
                # an instance attribute shadows the class's forward (nn.Module.__call__ looks it up on the instance)
                object.__setattr__(loss, "forward", MethodType(
                    regions.region(_compiled(type(loss).forward, backend, fullgraph), type(loss).__name__), loss))
                regions.losses += 1
    return regions


def report_once(regions: Optional[CompiledRegions]) -> None:
    """Log ``regions``' start-up line from the main rank (after the first step), once:
    a warning when a graph failed to compile."""
    if regions is None or regions.reported:
        return
    line = regions.report()
    if regions.main:
        if regions.stats.failures[regions.failures_before:]:
            log.warning("%s", line)
        else:
            log_rank0("%s", line)
