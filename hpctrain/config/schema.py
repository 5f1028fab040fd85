"""Typed configuration schema: one dataclass per config group.

These dataclasses are registered in Hydra's ConfigStore (``store.py``) and are
the schema; the YAML files under ``hpctrain/conf/`` are presets that fill them in. A
key that is not declared here is rejected by OmegaConf at composition time, so
a typo in an override fails before any rank starts work.

Plugins add their own typed sections through the ``hpctrain_config_sections``
hook; ``build_schema`` folds them in (see ``store.py``).

One module on purpose, though long: it is the whole schema a user reads top to
bottom (every group and field with its docstring, as ``--help`` and docs quote
them). What is not a field lives elsewhere: ranges in ``ranges.py``, checks in
``validate.py``; a group that grows logic of its own moves to its own module.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional


@dataclass
class RopeScalingConfig:
    """RoPE frequency scaling (``model.rope_scaling``), as Hugging Face's ``rope_scaling`` / ``rope_parameters``."""

    type: Optional[str] = None
    """null: plain RoPE; llama3: Llama 3.1's scaling (long wavelengths divided by factor, short ones kept, the
    band between interpolated); yarn: YaRN (DeepSeek-V3: frequencies ramped between beta_fast and beta_slow,
    cos/sin and the softmax scale multiplied by the mscale terms); each computed as transformers'
    modeling_rope_utils computes it."""
    factor: float = 8.0
    """llama3 and yarn: the factor long wavelengths are divided by."""
    low_freq_factor: float = 1.0
    """llama3: wavelengths above original_max_seq_len / low_freq_factor are scaled by 1/factor."""
    high_freq_factor: float = 4.0
    """llama3: wavelengths below original_max_seq_len / high_freq_factor are kept."""
    original_max_seq_len: int = 8192
    """llama3 and yarn: the context length of pretraining (Hugging Face's original_max_position_embeddings)."""
    beta_fast: float = 32.0
    """yarn: dims turning more than this many times over original_max_seq_len keep their frequency."""
    beta_slow: float = 1.0
    """yarn: dims turning fewer than this many times over original_max_seq_len are divided by factor (the band
    between is interpolated linearly)."""
    mscale: Optional[float] = None
    """yarn: with mscale_all_dim, cos and sin are scaled by (0.1 mscale ln(factor) + 1) / (0.1 mscale_all_dim
    ln(factor) + 1); null (or without mscale_all_dim): by 0.1 ln(factor) + 1 (transformers' rule)."""
    mscale_all_dim: Optional[float] = None
    """yarn: the softmax scale is multiplied by (0.1 mscale_all_dim ln(factor) + 1)^2 (DeepSeek-V3); null: not."""


@dataclass
class MLAConfig:
    """Multi-head latent attention (``model.attention_kind=mla``, DeepSeek-V2/V3): queries from a low-rank
    projection, keys and values expanded per head from one shared latent, plus a rotary part shared by the
    heads. The defaults are DeepSeek-V2-Lite's."""

    q_lora_rank: Optional[int] = None
    """Rank of the query's down-projection (with its RMSNorm) before the per-head up-projection (DeepSeek-V3:
    1536); null: one query projection d_model -> n_heads x (qk_nope_head_dim + qk_rope_head_dim) (V2-Lite)."""
    kv_lora_rank: int = 512
    """Width of the key/value latent (with its RMSNorm) that the per-head keys and values are expanded from."""
    qk_nope_head_dim: int = 128
    """Dims of each query/key head without rotary embedding (from the latent's up-projection)."""
    qk_rope_head_dim: int = 64
    """Dims of each query/key head with rotary embedding (even); the key's is one projection shared by all heads."""
    v_head_dim: int = 128
    """Dims of each value head (may differ from qk_nope_head_dim + qk_rope_head_dim)."""


@dataclass
class ModelConfig:
    """Decoder-only transformer shape (Llama-style: RMSNorm, RoPE, SwiGLU, GQA; Qwen2's q/k/v biases and
    Qwen3's qk-norm as options)."""

    name: str = "tiny"
    """Preset name, recorded in metrics and checkpoints."""
    vocab_size: Any = 256
    """Token vocabulary size (256 = byte-level)."""
    d_model: int = 64
    """Hidden size h."""
    n_layers: int = 2
    """Number of transformer blocks l."""
    n_heads: int = 4
    """Attention (query) heads a."""
    n_kv_heads: Optional[int] = None
    """Key/value heads for grouped-query attention; None means n_heads (MHA)."""
    head_dim: Optional[int] = None
    """Size of one attention head (even, for RoPE); None means d_model / n_heads. Set, it may differ from that
    (Qwen3 0.6B: 16 heads of 128 over a hidden size of 1024): the query projection is then d_model ->
    n_heads x head_dim and the output projection back."""
    qkv_bias: bool = False
    """Biases on the query, key and value projections (Qwen2); the output projection has none."""
    qk_norm: bool = False
    """An RMSNorm over each query and key head (weights of size head_dim, shared by the heads), applied before
    RoPE (Qwen3)."""
    attention_kind: str = "gqa"
    """gqa: grouped-query attention (Llama, Qwen; n_kv_heads, head_dim, qkv_bias, qk_norm); mla: multi-head
    latent attention with the shape in model.mla (DeepSeek-V2/V3; n_kv_heads null or n_heads, head_dim null, no
    qkv_bias or qk_norm)."""
    mla: MLAConfig = field(default_factory=MLAConfig)
    """Multi-head latent attention's shape (read with model.attention_kind=mla)."""
    ffn_hidden: Optional[int] = None
    """SwiGLU inner size; None means Llama's rule: 8h/3 rounded up to ffn_multiple_of."""
    ffn_multiple_of: int = 32
    """Rounding for the default ffn_hidden."""
    max_seq_len: int = 256
    """Longest sequence the model is built for (RoPE table size)."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    """RoPE frequency scaling (Llama 3.1's llama3 type); type null: none."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    tie_embeddings: bool = False
    """Share the input embedding with the output projection."""
    vocab_pad_to: Optional[int] = None
    """Under tensor parallelism the embedding and output rows are padded to a multiple of this (padding rows
    are zero, never in the loss or a checkpoint); None: tp x 64 for vocabularies of 4096 tokens or more, tp
    below that."""
    init_std: float = 0.02
    """Std of the normal init; output projections use init_std / sqrt(2 * n_layers)."""
    attention: str = "sdpa"
    """Core attention implementation (a name a plugin can provide, e.g. ring attention)."""
    ffn: str = "swiglu"
    """Feed-forward implementation per block ("swiglu" built in; "moe" from a plugin)."""
    mtp_depth: int = 0
    """Multi-token prediction (DeepSeek-V3, hpctrain/model/mtp.py): this many modules after the last block, module
    k predicting the token k + 1 ahead with one more block of the model's kind, sharing the embedding and output
    head (on the last pipeline stage); 0: none. DeepSeek-V3: 1."""
    mtp_loss_weight: float = 0.3
    """lambda: the objective is the language-model loss plus lambda / mtp_depth times the modules' summed losses
    (DeepSeek-V3: 0.3, later 0.1); the logged loss stays the language model's."""
    recompute: str = "none"
    """Activation recomputation: none; selective (the attention core is recomputed in backward); full (each
    block keeps only its input and runs its forward again in backward)."""
    hf_dir: Optional[str] = None
    """A Hugging Face model directory (model=hf): its config.json sets the shape (dimensions, GQA, RoPE and
    its scaling, norm epsilon, tied embeddings, Mixtral's experts) and the token ids below; fields the model
    does not implement are refused (hpctrain/hf/config.py). The weights come in with checkpoint.init_from."""
    bos_token_id: Any = None
    """The tokenizer's beginning-of-sequence id (from model.hf_dir's config.json), written into an export."""
    eos_token_id: Any = None
    """The tokenizer's end-of-sequence id, or a list of them (Llama 3.1), written into an export."""
    pad_token_id: Any = None
    """The tokenizer's padding id, written into an export (null: none)."""


@dataclass
class AxisImplConfig:
    """Which installed plugin implements each axis, by its entry-point name
    (``hpctrain-train --plugins`` lists them). Needed only when several
    plugins serve one axis; None means the only one installed."""

    tp: Optional[str] = None
    """Tensor parallelism."""
    cp: Optional[str] = None
    """Context parallelism."""
    ep: Optional[str] = None
    """Expert parallelism."""
    dp: Optional[str] = None
    """The data axes (cp x ep x dp): gradient averaging, e.g. zero for a ZeRO plugin."""
    pp: Optional[str] = None
    """Pipeline parallelism."""


@dataclass
class ParallelConfig:
    """Mesh layout. The product tp*cp*ep*dp*pp must equal the world size."""

    dp: int = -1
    """Data-parallel size; -1 means "whatever is left of the world size"."""
    tp: int = 1
    """Tensor-parallel size (keep within a node)."""
    pp: int = 1
    """Pipeline-parallel size."""
    cp: int = 1
    """Context-parallel size."""
    ep: int = 1
    """Expert-parallel size."""
    sequence_parallel: bool = True
    """With tp > 1: norms and the residual stream hold 1/tp of the sequence (all-gather before column-parallel
    layers, reduce-scatter after row-parallel ones); false: all-reduce after row-parallel layers."""
    cp_impl: str = "ring"
    """Context parallelism's attention: ring (key/value chunks passed around the cp ring, overlapped with
    compute) or allgather (keys and values all-gathered per layer)."""
    order: str = "tp-cp-ep-dp-pp"
    """Rank order, fastest-varying axis first (tp first keeps TP groups inside a node)."""
    impl: AxisImplConfig = field(default_factory=AxisImplConfig)
    """Which plugin implements an axis when several serve it (parallel.impl.dp=zero)."""


@dataclass
class CommConfig:
    """Collective backends."""

    backend: str = "torch"
    """Communicator plugin for every axis: auto (nccl on GPU, mpi on CPU when installed), torch (gloo on CPU,
    nccl on GPU), or a plugin's name."""
    per_axis: Dict[str, str] = field(default_factory=dict)
    """Backend override per mesh axis, e.g. {pp: mpi}."""
    bucket_mb: float = 25.0
    """Gradient bucket size for data-parallel reduction (MiB)."""
    timeout_s: float = 600.0
    """Collective timeout for torch.distributed process groups (seconds)."""


@dataclass
class BlendSource:
    """One weighted source of a blend (``data.blend``)."""

    weight: float = 1.0
    """Its share of the samples (the weights are normalised)."""
    paths: List[str] = field(default_factory=list)
    """Its shards: prefixes, directories, globs or hpctrain-prepare manifests."""
    name: Optional[str] = None
    """Its name in the log and metrics (validation loss per source); default source<i>."""


@dataclass
class ValidationDataConfig:
    """Validation shards of their own (else data.split holds documents out)."""

    paths: List[str] = field(default_factory=list)
    """Shards for validation (prefixes, directories, globs or manifests)."""


@dataclass
class StageConfig:
    """Staging of the shards to node-local disk before step 1 (``hpctrain.data.stage``)."""

    dir: Optional[str] = None
    """A node-local directory (e.g. /local/scratch) that must exist on each node; hpctrain copies into
    <dir>/<node>/ the shards that node's ranks read (checksummed, reused by the next launch) and training reads
    them there. A node where it is missing, unwritable or too small reads the shared paths (one line says
    so). None: no staging. data.source=indexed only."""
    all: bool = False
    """Copy every shard to every node, not only those the node's ranks read during trainer.steps."""


@dataclass
class DataConfig:
    """Training data source."""

    source: str = "embedded"
    """"embedded" (built-in generated corpus, no downloads), "tokens" (one legacy .bin token file with its .json
    sidecar) or "indexed" (Megatron-format .bin/.idx shards from hpctrain-prepare: data.paths or data.blend)."""
    path: Optional[str] = None
    """Token file for source=tokens (written by the byte-level hpctrain-prepare of old)."""
    dtype: Optional[str] = None
    """Token dtype of the .bin file (uint16/uint32); None reads it from the .json sidecar."""
    paths: List[str] = field(default_factory=list)
    """source=indexed: the shards of the one source (prefixes, directories, globs or hpctrain-prepare manifests)."""
    blend: List[BlendSource] = field(default_factory=list)
    """source=indexed: several sources sampled by weight (Megatron's blend: at every prefix of the stream each
    source's share is within one sample of its weight); replaces data.paths."""
    split: float = 0.0
    """Fraction of each source's documents held out for validation (whole documents, chosen by data.seed); 0: none."""
    validation: ValidationDataConfig = field(default_factory=ValidationDataConfig)
    document_mask: bool = False
    """Attention never crosses a document boundary and RoPE positions restart at each document (source=indexed)."""
    index_cache: bool = True
    """Cache the document index next to the shards (.hpctrain-index-<key>.npz), so a relaunch reads one file."""
    prefetch: bool = True
    """Prepare the next step's micro-batches on a thread while this step computes (metrics: data_wait_s)."""
    seed: int = 1234
    """Seed of the sample order (and of the embedded corpus and the held-out documents)."""
    embedded_bytes: int = 262144
    """Size of the embedded corpus in bytes."""
    stage: StageConfig = field(default_factory=StageConfig)
    """Copy the shards to node-local disk first (data.stage.dir); not part of the experiment (the checkpoint
    directory's name ignores it)."""


@dataclass
class OuterConfig:
    """An outer optimizer over the data-parallel replicas (``optim.outer=diloco``; hpctrain/train/outer.py): each
    dp replica takes ``every`` steps of the inner optimizer alone (tp, pp, cp, ep inside it as usual), then the
    replicas average their parameter deltas in one all-reduce and SGD with Nesterov momentum steps the shared
    weights with that average as its gradient (DiLoCo; every=1, lr=1, momentum=0 is local SGD's average)."""

    name: str = "none"
    """none (plain data parallelism) or diloco; ``optim.outer=diloco`` on the command line sets it."""
    every: int = 50
    """Inner steps between outer steps (DiLoCo's H; the paper uses 500)."""
    lr: float = 0.7
    """Outer learning rate (the DiLoCo paper's 0.7)."""
    momentum: float = 0.9
    """Outer SGD momentum; 0: none."""
    nesterov: bool = True
    """Nesterov momentum for the outer step (with momentum > 0)."""
    dtype: str = "fp32"
    """The parameter deltas' dtype on the wire: fp32, or bf16 (half the bytes; sums in fp32)."""


@dataclass
class OptimConfig:
    """The optimizer (AdamW, LAMB, LARS or Muon; ``hpctrain.optimizers``) with linear warmup and cosine decay."""

    name: str = "adamw"
    """Optimizer: adamw, lamb, lars or muon (the presets optim=...), or a plugin's (``hpctrain_make_optimizer``;
    ZeRO shards the first four only)."""
    lr: float = 3e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of lr at the end of the cosine."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices and embeddings only."""
    beta1: float = 0.9
    """Adam beta1."""
    beta2: float = 0.95
    """Adam beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    warmup_steps: int = 5
    """Linear warmup steps from 0 to lr."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping (with optim.outer=diloco: each replica's
    own norm)."""
    momentum: float = 0.9
    """LARS's heavy-ball momentum and Muon's (its preset: 0.95)."""
    nesterov: bool = True
    """Muon: Nesterov momentum (the orthogonalised update looks ahead along the momentum)."""
    trust_coefficient: float = 0.001
    """LARS: eta in the local learning rate eta * ||w|| / (||g|| + weight_decay * ||w||)."""
    exclude_from_adaptation: List[str] = field(default_factory=lambda: ["norm", "bias", "embedding"])
    """LAMB, LARS: kinds of tensor whose step is not scaled by a trust ratio (any of norm, bias, embedding)."""
    adamw_params: List[str] = field(default_factory=lambda: ["tok_embeddings.*", "output.*"])
    """Muon: glob patterns of logical parameter names kept on AdamW besides every tensor of rank < 2
    (default: the embedding and the head)."""
    ns_steps: int = 5
    """Muon: Newton-Schulz iterations per step."""
    ns_dtype: str = "fp32"
    """Muon: dtype of the Newton-Schulz iteration, fp32 or bf16 (what GPU runs of Muon usually take)."""
    outer: OuterConfig = field(default_factory=OuterConfig)
    """An outer optimizer over the dp replicas (DiLoCo / local SGD); name=none: plain data parallelism."""


@dataclass
class LossScaleConfig:
    """Dynamic loss scaling of ``trainer.precision=fp16`` (hpctrain/train/loss_scale.py): torch's GradScaler rule,
    with the overflow agreed by every rank in the gradient norm's all-reduce."""

    initial: float = 65536.0
    """The scale of the first step (2^16, GradScaler's default); in [2^-14, 2^32]: below fp16's smallest normal
    number the scaled gradients underflow."""
    growth_interval: int = 2000
    """After this many steps in a row without an overflow the scale grows by ``growth``."""
    backoff: float = 0.5
    """An overflow skips the step on every rank and multiplies the scale by this (in (0, 1))."""
    growth: float = 2.0
    """What the scale is multiplied by after growth_interval clean steps (> 1)."""


@dataclass
class ProfileConfig:
    """The torch profiler on chosen steps and ranks (``hpctrain.train.profile``)."""

    steps: List[int] = field(default_factory=list)
    """Steps (1-based) to trace; consecutive steps share one trace; empty: no profiling."""
    ranks: List[int] = field(default_factory=lambda: [0])
    """World ranks that write a trace."""
    memory: bool = False
    """Record tensor allocations in the trace (profile_memory) and, on CUDA, the allocator's history, so an
    out-of-memory snapshot shows where each block was allocated."""


@dataclass
class TrainerConfig:
    """Training loop."""

    steps: int = 40
    """Optimizer steps to run."""
    global_batch_size: int = 16
    """Samples per optimizer step across all data-parallel ranks."""
    micro_batch_size: int = 4
    """Samples per forward/backward on one rank; the rest is gradient accumulation."""
    seq_len: int = 64
    """Tokens per sample."""
    seed: int = 0
    """Seed of the initial weights (per tensor name, layout independent)."""
    log_every: int = 5
    """Log a line (and flush metrics) every N steps."""
    precision: str = "fp32"
    """fp32, bf16 or fp16 (autocast; master weights and optimizer state stay fp32); fp16 adds dynamic loss
    scaling (trainer.loss_scale)."""
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    """Dynamic loss scaling, used with precision=fp16 only."""
    device: str = "auto"
    """auto (cuda:local_rank when present, else cpu), cpu or cuda."""
    progress: str = "auto"
    """Rank-0 progress bar: auto (when a terminal is attached), on, off."""
    deterministic: bool = True
    """Use deterministic torch algorithms (needed for the equivalence tests); with compile, inductor's own
    deterministic mode too (no kernel choice by timing)."""
    compile: bool = False
    """Regional torch.compile: each transformer block's forward and the loss are compiled (inside activation
    recomputation's checkpoint), under every parallel axis; the differentiable collectives are custom operators
    inside the graph (hpctrain/comm/ops.py), other communicator calls run eagerly between graphs (graph breaks;
    graphs and breaks per region in one log line after the first step). Where the backend cannot compile, the
    run goes on eagerly with one warning (hpctrain/model/compile.py)."""
    compile_fullgraph: bool = False
    """With trainer.compile: each region must compile to one graph; the first graph break stops the run with one
    'hpctrain: error:' line naming the region and the operation that broke it (for a layout whose blocks are
    meant to be break-free, e.g. tp with or without sequence parallelism). A separate key, not a group under
    trainer.compile, so that trainer.compile=true overrides keep working."""
    compile_backend: str = "inductor"
    """torch.compile backend with trainer.compile: inductor (generated code: C++ on CPU, needs a C++ compiler;
    Triton on GPU), aot_eager (dynamo and AOTAutograd without code generation: checks tracing, no speed-up),
    or another backend torch._dynamo.list_backends() names."""
    max_time: Optional[str] = None
    """Wall-clock budget of this launch: seconds or SLURM's [D-]HH:MM:SS; the run saves a checkpoint and stops
    (exit status 75; under SLURM the job is requeued) when less than the next step plus the measured save
    plus end_margin_s is left (hpctrain/train/deadline.py). Under SLURM the job's own end time
    (SLURM_JOB_END_TIME, else squeue) and trainer.end_time are limits too; the earliest wins. None: no limit."""
    end_time: Optional[str] = None
    """The wall-clock time the job ends, where the scheduler does not say (no Slurm, or a Slurm that neither
    exports SLURM_JOB_END_TIME nor answers squeue): YYYY-MM-DDTHH:MM[:SS] in local time or Unix seconds; the
    run stops before it as before trainer.max_time. None: no such limit."""
    end_margin_s: float = 60.0
    """Seconds kept free before the end (trainer.max_time, trainer.end_time or the SLURM job's end) beyond the
    next step and the save, which are measured (the save from this run's own saves, start to commit)."""
    eval_every: int = 0
    """Validation every N steps (and after the last), when the data has a validation source (data.split or
    data.validation.paths); 0: only after the last step."""
    eval_batches: int = 4
    """Global batches of each validation source per validation (the same ones every time, so the numbers compare)."""
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    """The torch profiler: Chrome traces of trainer.profile.steps on trainer.profile.ranks."""
    elastic: bool = False
    """Go on with the ranks there are after a failure (slurm/train.sbatch sets it when no spare node is left):
    parallel.dp is recomputed from the world size (an explicit parallel.dp is overridden, and the log says so),
    the other axes stay, the global batch stays (more gradient accumulation per rank), and the run resumes from
    the persistent checkpoint or the local tier, whose data-parallel replicas' states are dealt out to the new
    ranks (a change beyond dp falls back to the persistent checkpoint). Needs checkpoint.resume."""


@dataclass
class LocalCheckpointConfig:
    """The local resilience tier (hpctrain/localckpt): every rank's exact state on node-local storage, with
    copies on partner nodes, resumed with checkpoint.resume=auto when newer than the persistent checkpoint."""

    every: int = 0
    """Save every rank's own state locally every N steps (in the background after a host copy); 0 turns the
    tier off. Independent of checkpoint.every, which keeps saving the persistent HDF5 checkpoint."""
    dir: Optional[str] = None
    """Node-local directory (/dev/shm or a local disk); None: /dev/shm/hpctrain-<user>-<SLURM job id, or a hash
    of checkpoint.dir outside SLURM>, the same for every restart of one allocation or experiment."""
    replicas: int = 1
    """Copies of each rank's state sent to the same place on the next nodes (MPI point-to-point); must be below
    the number of nodes. 0 keeps no copy (a lost node then loses the tier)."""


@dataclass
class LustreConfig:
    """Striping of the checkpoint directory on Lustre (hpctrain/lustre.py; docs/checkpointing.md)."""

    stripe_count: int = 0
    """lfs setstripe -c on checkpoint.dir before the first save, so every checkpoint spreads over this many
    storage targets (OSTs); -1: all of them; 0: leave the directory's layout. Without lfs, one line says so."""
    stripe_size: str = ""
    """lfs setstripe -S with stripe_count: bytes or a number with K, M or G (4M), a multiple of 64K; empty: the
    file system's default (1M)."""


@dataclass
class CheckpointConfig:
    """Checkpointing (the format is a plugin; see hpctrain_make_checkpointer)."""

    format: str = "hdf5"
    """Checkpoint format plugin."""
    dir: Optional[str] = None
    """Directory for checkpoints; None (from the command line): checkpoints/<model name>-<hash of the model,
    data, optimizer, batch, sequence, seed and precision settings> under the launch directory, so a
    relaunch of the same experiment finds its checkpoints (hpctrain.checkpoint.default_checkpoint_dir)."""
    every: int = 0
    """Save every N steps; 0 disables periodic saves."""
    save_on_stop: bool = True
    """Commit a checkpoint when a signal (SIGUSR1, SIGTERM, SIGINT) or the time limit stops the run, whatever
    ``every`` is, to ``dir`` (the command line's default directory when unset), so a preempted job that
    never set ``every`` still resumes. false: a stop saves nothing (its message says so)."""
    resume: Optional[str] = None
    """None (fresh start), auto (newest good checkpoint in dir), or a path."""
    init_from: Optional[str] = None
    """Weights only, for fine-tuning or continued pretraining (fresh optimizer, step 0, data cursor at 0):
    hf:DIR, a Hugging Face directory of safetensors (each rank reads only its slices), or one of our
    checkpoints (a file or a checkpoint directory's newest). Ignored when checkpoint.resume finds a checkpoint
    (a restarted fine-tuning run continues from its own checkpoint)."""
    keep: int = 3
    """How many checkpoints to keep (0 keeps all)."""
    async_save: bool = False
    """Write checkpoints in the background: a save blocks the step only while tensors are copied to host
    memory. (The key is not ``async`` because that is a Python keyword.)"""
    local: LocalCheckpointConfig = field(default_factory=LocalCheckpointConfig)
    """The node-local tier with partner copies (checkpoint.local.every, dir, replicas)."""
    lustre: LustreConfig = field(default_factory=LustreConfig)
    """Lustre striping of checkpoint.dir (checkpoint.lustre.stripe_count, stripe_size)."""
    allow_batch_change: bool = False
    """Resume from a checkpoint saved with another trainer.global_batch_size. Refused by default, because the
    run then differs from the one that saved it while looking like its continuation; when allowed, the
    global sample cursor continues at the checkpoint's consumed samples (the same stream of samples, cut
    into batches of the new size) and the learning-rate schedule follows the step
    (hpctrain/data/cursor.py)."""


@dataclass
class ReliabilityConfig:
    """What a run does when training goes wrong (see hpctrain/train/guard.py)."""

    nonfinite: str = "stop"
    """A non-finite loss or gradient norm (every rank sees the same global values before the update): stop
    (end the run with an error, exit status 3, before the update, so no checkpoint holds non-finite
    weights) or skip (drop that step's update and count it)."""
    max_skips: int = 3
    """With nonfinite=skip: this many non-finite steps in a row stop the run."""
    spike_window: int = 20
    """Loss-spike detector: the finite losses of the last this-many steps form the baseline."""
    spike_zscore: float = 6.0
    """A loss this many standard deviations above the baseline's mean is logged as a spike (metrics: loss_spike=1)."""
    weight_check_every: int = 100
    """Every this many steps, data-parallel replicas compare exact checksums of the weights they share; a
    mismatch names the diverging ranks and stops the run (exit status 4). 0 turns it off."""
    straggler_every: int = 10
    """Every this many steps, each rank's step and compute time are gathered: metrics.jsonl gets the slowest
    rank against the median. 0 turns it off."""
    straggler_factor: float = 1.5
    """A rank whose compute time exceeds this x the other ranks' median in two checks in a row is named in the
    log (if it is also straggler_min_s slower)."""
    straggler_stop_after: int = 0
    """When the log has named the same rank(s) as stragglers in this many reports in a row, the run saves a
    checkpoint and stops (exit status 76) with their ranks and nodes in last_failure.json, which
    slurm/train.sbatch reads to restart without those nodes on a spare. 0: only name them."""
    straggler_min_s: Optional[float] = None
    """The least time (seconds) a straggler's compute time must exceed the other ranks' median by, besides the
    factor: on small steps a rank descheduled for a few milliseconds is 1.5x slower and costs nothing.
    None: max(0.010, 0.05 x the median step time) at each check, so 10 ms at least and 5% of the step on
    long steps; 0: the factor alone."""
    hang_timeout_s: float = 600.0
    """Hang watchdog (hpctrain/train/watchdog.py): a rank silent, or waited for in a collective, this long (or
    a rank that died, at once) is named by rank 0 with its op and sequence number and the job is aborted
    (exit status 5) within twice this; 0 turns it off. Keep it above the slowest checkpoint save."""


FAULTS = ("none", "die", "stall", "freeze", "nan", "slow", "corrupt", "overflow", "oom", "save_error",
          "local_save_error")


@dataclass
class DebugConfig:
    """Fault injection, to test how a job fails (hpctrain/train/faults.py), and checks that cost speed."""

    fault: str = "none"
    """What happens to rank fault_rank: die (killed by SIGKILL), stall (its training thread stops; the process
    stays alive), freeze (the whole process stops: SIGSTOP), nan (its loss becomes NaN), slow (sleeps
    slow_s in every step's compute from then on), corrupt (one of its weights changes), overflow (one of its
    gradients becomes inf after that step's reduction, as an fp16 overflow on one rank), oom (its step raises
    CUDA's out-of-memory error, on any device: the error line and the memory snapshot), save_error (its part of
    the persistent save after that step fails with an I/O error, in the background with checkpoint.async_save),
    local_save_error (its node-local save after that step fails with an I/O error); none."""
    fault_rank: int = 0
    """The world rank the fault happens on; -1: every rank at once (hpctrain-tune's test of a layout that runs
    out of memory everywhere)."""
    fault_step: int = 1
    """The step (1-based) it happens in."""
    fault_at: str = "step"
    """Where in that step: step (before its forward) or checkpoint (before the checkpoint save that follows
    it; the step must save)."""
    slow_s: float = 0.05
    """Seconds a slow rank sleeps per micro-batch forward."""
    comm_delay_axis: str = "none"
    """A slow link: every collective, send and receive of each group spanning this axis (tp, cp, ep, dp, pp),
    on every rank, first sleeps comm_delay_ms (hpctrain/comm/delay.py); none. The model trains the same;
    hpctrain-tune's tests use it to show a measured slow axis changes the ranking."""
    comm_delay_ms: float = 0.0
    """Milliseconds each operation on comm_delay_axis's groups waits; 0 with an axis named is refused."""
    fill_uninitialized: bool = False
    """With trainer.deterministic, fill every new tensor with NaN (torch's fill_uninitialized_memory), so that
    code reading memory it never wrote shows NaN instead of whatever was there. Off by default: it writes
    every activation and buffer once more (on a CPU, the MoE token path took twice as long with it)."""


@dataclass
class LoggingConfig:
    """Where rank 0 sends each step's metrics: logger backends, each a plugin (``hpctrain.train.loggers``)."""

    backends: List[str] = field(default_factory=lambda: ["jsonl"])
    """Backends that get every step's metrics: jsonl (metrics.jsonl in the run directory, built in), tensorboard,
    wandb, mlflow, or a logger plugin's name (hpctrain-train --plugins lists them). metrics.jsonl is written
    whatever the list holds (hpctrain-report, hpctrain-plan --compare and a sweep's summary read it), so
    [wandb] means jsonl and W&B; naming jsonl is allowed and changes nothing."""
    dir: Optional[str] = None
    """Directory the backends write under (TensorBoard events, the W&B offline runs, the MLflow file store); None:
    the run directory, or in a Hydra sweep the sweep directory, so the points are runs side by side."""
    group: Optional[str] = None
    """The run's group in backends that have one (W&B group, MLflow experiment); None: the Hydra sweep directory
    in a multirun, else the model's name."""
    name: Optional[str] = None
    """The run's name in the backends; None: the sweep point's number and overrides in a multirun, else the run
    directory's name."""


@dataclass
class ReportConfig:
    """What the run's usage figures are projected for (metrics usage.*, hpctrain-report)."""

    target_tokens: int = 0
    """A token budget: the rank-hours (GPU-hours) and energy to train that many tokens at the measured rate
    (usage.target_*); 0: none."""


@dataclass
class ClusterConfig:
    """The machine the run targets (used by the planner and the launch templates)."""

    name: str = "local"
    """Cluster preset name."""
    gpus: int = 0
    """Total accelerators (0 = CPU run)."""
    gpus_per_node: int = 0
    """Accelerators per node."""
    gpu_mem_gb: float = 0.0
    """Memory per accelerator in GB."""
    peak_tflops: float = 0.0
    """Dense peak TFLOP/s per accelerator at the training precision."""
    intra_bw_gbs: float = 0.0
    """Intra-node bus bandwidth per GPU (GB/s)."""
    inter_bw_gbs: float = 0.0
    """Inter-node bus bandwidth per GPU (GB/s)."""


LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down", "q_a", "q_b", "kv_a", "kv_b")
"""Projections LoRA can adapt, by the names of their role (Llama's q_proj ... down_proj; latent attention's
q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj)."""


@dataclass
class LoraConfig:
    """Low-rank adapters (LoRA, Hu et al. 2021) on the chosen projections; the base weights are frozen
    (``hpctrain.finetune.lora``)."""

    rank: int = 8
    """r: the adapters' inner size (A: r x in, B: out x r)."""
    alpha: float = 16.0
    """The update is scaled by alpha / rank (PEFT's lora_alpha)."""
    dropout: float = 0.0
    """Dropout on the adapter's input (PEFT's lora_dropout); 0 for exact parity between layouts."""
    targets: List[str] = field(default_factory=lambda: ["q", "k", "v", "o"])
    """Projections to adapt, any of q, k, v, o (attention), gate, up, down (the SwiGLU feed-forward); with latent
    attention (model.attention_kind=mla) q_a, kv_a (its down-projections), q_b, kv_b (its up-projections), o, and
    q where it has no q_lora_rank."""
    experts: bool = False
    """Adapt the feed-forward projections of MoE experts too (not implemented yet: must stay false); false:
    gate/up/down adapt only dense SwiGLU blocks."""


FINETUNE_METHODS = ("full", "lora")


@dataclass
class FinetuneConfig:
    """Fine-tuning: which weights train. Where the weights come from is checkpoint.init_from."""

    method: str = "full"
    """full: every weight trains; lora (the preset finetune=lora): only LoRA adapters train (finetune.lora),
    every other weight is frozen (no gradient, no optimizer state)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """The adapters of method=lora."""


@dataclass
class TrainConfig:
    """The whole run. Plugin sections are added by ``store.build_schema``."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    reliability: ReliabilityConfig = field(default_factory=ReliabilityConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    run_dir: Optional[str] = None
    """Not read or written by hpctrain: the run directory is passed to the hooks that need it (``run_dir``
    arguments). Kept so configs saved by older runs (checkpoints' ``/meta/config``) still load."""
