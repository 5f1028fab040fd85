"""Every out-of-range value a user can type is rejected by validation,
before any collective, with one message naming the key and the fix (the
reliability issue's table: at least 40 bad inputs). Each row: the
override, and what the message must contain. Values of the wrong type,
unknown keys and presets, and overrides that do not parse are refused when
the config is composed, with the same kind of line (``hpctrain-train``
prints it and exits 2); a row may set an environment variable (a plugin
blocked by ``HPCTRAIN_DISABLE_PLUGINS``) or pass ``hpctrain-train``'s
``--dry-run`` flags (checked at their ``--world``). A good config passes, and one
test shows every bad value of a config reported at once."""
from __future__ import annotations

import pytest

from hpctrain.config import compose_resolved
from hpctrain.config.validate import validate
from hpctrain.dry_run import check_launch, request_problems, split_flags
from hpctrain.errors import ConfigError
from hpctrain.plugins import create_manager

MLA = "model.attention_kind=mla model.n_kv_heads=null"  # latent attention on the tiny model (its 2 kv heads: null)
BAD = [
    ("trainer.steps=0", "trainer.steps=0: must be an integer >= 1"),
    ("trainer.steps=-5", "trainer.steps=-5: must be an integer >= 1"),
    ("trainer.seq_len=0", "trainer.seq_len=0: must be an integer >= 1"),
    ("trainer.seq_len=-8", "trainer.seq_len=-8"),
    ("trainer.global_batch_size=0", "trainer.global_batch_size=0: must be an integer >= 1"),
    ("trainer.micro_batch_size=0", "trainer.micro_batch_size=0: must be an integer >= 1"),
    ("trainer.micro_batch_size=-2", "trainer.micro_batch_size=-2"),
    ("trainer.log_every=0", "trainer.log_every=0: must be an integer >= 1"),
    ("trainer.seed=-1", "trainer.seed=-1: must be an integer >= 0"),
    ("trainer.precision=fp8", "trainer.precision='fp8' is not one of fp32, bf16, fp16"),
    ("trainer.loss_scale.growth=-2", "trainer.loss_scale.growth=-2.0: must be a finite number > 1"),
    ("trainer.loss_scale.growth=1", "trainer.loss_scale.growth=1.0: must be a finite number > 1"),
    ("trainer.loss_scale.growth_interval=-1", "trainer.loss_scale.growth_interval=-1: must be an integer >= 1"),
    ("trainer.loss_scale.backoff=1.5", "trainer.loss_scale.backoff=1.5: must be a number in (0, 1)"),
    ("trainer.loss_scale.initial=0", "trainer.loss_scale.initial=0.0: must be a number in [6.1e-05, 4.3e+09]"),
    ("trainer.loss_scale.initial=1e-40", "trainer.loss_scale.initial=1e-40: must be a number in [6.1e-05, 4.3e+09] "
     "(2^-14, fp16's smallest normal number"),
    ("trainer.loss_scale.initial=1e-5", "trainer.loss_scale.initial=1e-05: must be a number in [6.1e-05, 4.3e+09]"),
    ("trainer.loss_scale.initial=1e12", "trainer.loss_scale.initial=1000000000000.0: must be a number in "
     "[6.1e-05, 4.3e+09]"),
    ("optim.outer.every=0", "optim.outer.every=0: must be an integer >= 1"),
    ("optim.outer.lr=-0.7", "optim.outer.lr=-0.7: must be a finite number > 0"),
    ("optim.outer.momentum=1", "optim.outer.momentum=1.0: must be a number in [0, 1)"),
    ("optim.outer=adam", "optim.outer='adam' is not one of none, diloco"),
    ("optim.outer=diloco optim.outer.dtype=fp8", "optim.outer.dtype='fp8' is not one of fp32, bf16"),
    ("optim.outer=diloco optim.outer.every=500", "optim.outer.every=500 is more than trainer.steps=40"),
    ("optim=muon optim.outer=diloco", "optim=muon with optim.outer=diloco: Muon orthogonalises whole matrices"),
    ("optim.outer=diloco parallel.zero.stage=1",
     "parallel.zero.stage=1 with optim.outer=diloco: DiLoCo's dp replicas train alone"),
    ("trainer.progress=maybe", "trainer.progress='maybe' is not one of auto, on, off"),
    ("data.stage.dir=/local/scratch", "data.stage.dir=/local/scratch stages Megatron shards (data.source=indexed); "
     "data.source=embedded has none: leave data.stage.dir unset (null)"),
    ("data.stage.all=true", "data.stage.all=true needs data.stage.dir=<a node-local directory>"),
    ("report.target_tokens=-1", "report.target_tokens=-1: must be an integer >= 0 (tokens to project the usage for)"),
    ("finetune.method=qlora", "finetune.method='qlora': must be one of full, lora"),
    ("finetune=lora finetune.lora.rank=0", "finetune.lora.rank=0: must be an integer >= 1"),
    ("finetune=lora finetune.lora.rank=-4", "finetune.lora.rank=-4: must be an integer >= 1"),
    ("finetune=lora finetune.lora.alpha=0", "finetune.lora.alpha=0.0: must be a finite number > 0"),
    ("finetune=lora finetune.lora.dropout=1", "finetune.lora.dropout=1.0: must be a number in [0, 1)"),
    ("finetune=lora finetune.lora.targets=[q,query]", "finetune.lora.targets=['q', 'query']: must be a non-empty "
     "list of projections out of q, k, v, o, gate, up, down"),
    ("finetune=lora finetune.lora.targets=[]", "finetune.lora.targets=[]: must be a non-empty list of projections"),
    ("finetune=lora finetune.lora.targets=[gate,up,down] model=tiny-moe", "finetune.lora.targets=['gate', 'up', "
     "'down'] names no projection of this model (attention q,k,v,o; latent attention q_a,q_b,kv_a,kv_b,o, or q "
     "without q_lora_rank; gate,up,down of dense SwiGLU blocks)"),
    ("finetune=lora finetune.lora.targets=[k,v] " + MLA, "finetune.lora.targets=['k', 'v'] names no projection of "
     "this model"),
    ("finetune=lora finetune.lora.targets=[kv_a,q_b] finetune.lora.dropout=0.1 parallel.tp=2 "
     "parallel.sequence_parallel=false --world=2 --dry-run " + MLA, "finetune.lora.dropout=0.1 on latent "
     "attention's down-projections (kv_a) at parallel.tp=2 without sequence parallelism"),
    ("finetune=lora finetune.lora.experts=true", "finetune.lora.experts=True: must be false: adapters on MoE "
     "experts are not implemented yet"),
    ("trainer.compile_fullgraph=true", "trainer.compile_fullgraph=true needs trainer.compile=true"),
    ("trainer.compile_backend=tensorrtx",
     "trainer.compile_backend='tensorrtx' is not a torch.compile backend here; use inductor or aot_eager"),
    ("model.vocab_size=1", "model.vocab_size=1: must be an integer >= 2"),
    ("model.d_model=-64", "model.d_model=-64: must be an integer >= 2"),
    ("model.d_model=0", "model.d_model=0"),
    ("model.n_layers=0", "model.n_layers=0: must be an integer >= 1"),
    ("model.n_heads=0", "model.n_heads=0: must be an integer >= 1"),
    ("model.n_heads=3", "model.d_model=64 is not divisible by model.n_heads=3"),
    ("model.n_kv_heads=0", "model.n_kv_heads=0: must be null"),
    ("model.n_kv_heads=3", "model.n_heads=4 is not divisible by model.n_kv_heads=3"),
    ("model.ffn_hidden=0", "model.ffn_hidden=0: must be null"),
    ("model.ffn_multiple_of=0", "model.ffn_multiple_of=0: must be an integer >= 1"),
    ("model.max_seq_len=0", "model.max_seq_len=0: must be an integer >= 1"),
    ("trainer.seq_len=1024", "trainer.seq_len=1024 exceeds model.max_seq_len=256"),
    ("model.rope_theta=0", "model.rope_theta=0.0: must be a finite number > 0"),
    ("model.rope_theta=nan", "model.rope_theta=nan"),
    ("model.norm_eps=-1e-5", "model.norm_eps=-1e-05: must be a finite number > 0"),
    ("model.init_std=1e6", "model.init_std=1000000.0: must be a finite number in (0, 1)"),
    ("model.init_std=0", "model.init_std=0.0"),
    ("model.vocab_pad_to=0", "model.vocab_pad_to=0: must be null or an integer >= 1"),
    ("model.head_dim=7", "model.head_dim=7: must be null or an even integer >= 2"),
    ("model.head_dim=0", "model.head_dim=0: must be null or an even integer >= 2"),
    ("optim.lr=-1", "optim.lr=-1.0: must be a finite number > 0"),
    ("optim.lr=0", "optim.lr=0.0: must be a finite number > 0"),
    ("optim.lr=nan", "optim.lr=nan: must be a finite number > 0"),
    ("optim.lr=inf", "optim.lr=inf"),
    ("optim.min_lr_ratio=-1", "optim.min_lr_ratio=-1.0: must be a number in [0, 1]"),
    ("optim.min_lr_ratio=2", "optim.min_lr_ratio=2.0"),
    ("optim.weight_decay=-0.1", "optim.weight_decay=-0.1: must be a finite number >= 0"),
    ("optim.beta1=1.0", "optim.beta1=1.0: must be a number in [0, 1)"),
    ("optim.beta2=1.5", "optim.beta2=1.5: must be a number in [0, 1)"),
    ("optim.beta2=-0.5", "optim.beta2=-0.5"),
    ("optim.eps=0", "optim.eps=0.0: must be a finite number > 0"),
    ("optim.warmup_steps=-1", "optim.warmup_steps=-1: must be an integer >= 0"),
    ("optim.grad_clip=-1", "optim.grad_clip=-1.0: must be a finite number >= 0; 0 turns clipping off"),
    ("optim.grad_clip=nan", "optim.grad_clip=nan"),
    ("optim.name=sgd", "optim.name='sgd' is not one of adamw, lamb, lars, muon"),
    ("optim=muon optim.adamw_params=[*]", "optim=muon but no 2-D hidden matrix of model 'tiny' is left for Muon"),
    ("optim=muon optim.adamw_params=[layers.*,tok_embeddings.*,output.*]",
     "keep the hidden matrices out of optim.adamw_params"),
    ("optim=muon optim.ns_steps=0", "optim.ns_steps=0: must be an integer in [1, 99]"),
    ("optim=muon optim.ns_dtype=fp8", "optim.ns_dtype='fp8' is not one of fp32, bf16"),
    ("optim=muon optim.momentum=1.0", "optim.momentum=1.0: must be a number in [0, 1)"),
    ("optim=lars optim.trust_coefficient=0", "optim.trust_coefficient=0.0: must be a finite number > 0"),
    ("optim=lamb optim.exclude_from_adaptation=[norms]", "'norms' is not a kind of tensor; use any of norm, bias"),
    ("optim=lamb parallel.zero.stage=1 parallel.zero.offload=nvme",
     "parallel.zero.offload=nvme offloads AdamW's moments only; with optim=lamb"),
    ("comm.bucket_mb=-1", "comm.bucket_mb=-1.0: must be a finite number of MiB >= 0"),
    ("comm.timeout_s=-3", "comm.timeout_s=-3.0: must be a finite number of seconds > 0"),
    ("comm.backend=carrier-pigeon", "comm.backend='carrier-pigeon'"),
    ("checkpoint.every=-1", "checkpoint.every=-1: must be an integer >= 0"),
    ("checkpoint.keep=-2", "checkpoint.keep=-2: must be an integer >= 0"),
    ("checkpoint.hdf5.alignment=-1", "checkpoint.hdf5.alignment=-1 must be >= 0 (bytes; 0: HDF5's default)"),
    ("checkpoint.hdf5.alignment_kb=4", "checkpoint.hdf5.alignment_kb was renamed checkpoint.hdf5.alignment (bytes: "
     "1024 x the old value); use checkpoint.hdf5.alignment=<value>"),
    ("checkpoint.hdf5.meta_block_size=-1", "checkpoint.hdf5.meta_block_size=-1 must be >= 0 (bytes; 0: HDF5's "
     "default)"),
    ("checkpoint.hdf5.sieve_buf_size=-4096", "checkpoint.hdf5.sieve_buf_size=-4096 must be >= 0"),
    ("+checkpoint.hdf5.mpiio_hints.cb_nodez=4", "checkpoint.hdf5.mpiio_hints.cb_nodez=4: not an MPI-IO hint hpctrain "
     "passes; use one of cb_nodes, cb_buffer_size"),
    ("+checkpoint.hdf5.mpiio_hints.cb_buffer_size=0", "checkpoint.hdf5.mpiio_hints.cb_buffer_size=0: must be a "
     "positive integer (bytes)"),
    ("+checkpoint.hdf5.mpiio_hints.romio_cb_write=yes", "checkpoint.hdf5.mpiio_hints.romio_cb_write='yes': must be "
     "enable, disable or automatic"),
    ("checkpoint.lustre.stripe_count=-2", "checkpoint.lustre.stripe_count=-2 must be -1 (every storage target), 0"),
    ("checkpoint.lustre.stripe_size=4X", "checkpoint.lustre.stripe_size='4X' is not a stripe size"),
    ("checkpoint.local.every=-5", "checkpoint.local.every=-5: must be an integer >= 0; 0 turns the local tier off"),
    ("checkpoint.local.replicas=-1", "checkpoint.local.replicas=-1: must be an integer >= 0 and below the number"),
    ("checkpoint.local.replicas=1 checkpoint.local.every=5",
     "checkpoint.local.replicas=1 needs more nodes than copies: this job has 1 node(s)"),
    ("checkpoint.local.dir=/proc/nope checkpoint.local.every=5 checkpoint.local.replicas=0",
     "checkpoint.local.dir='/proc/nope' is not writable"),
    ("checkpoint.local.every=often", "checkpoint.local.every='often': must be an integer (int)"),
    ("trainer.elastic=true", "trainer.elastic=true without checkpoint.resume: a run that shrank would start again"),
    ("trainer.elastic=true checkpoint.resume=auto optim.outer=diloco optim.outer.every=5",
     "trainer.elastic=true with optim.outer=diloco: its dp ranks are replicas"),
    ("trainer.elastic=maybe", "trainer.elastic='maybe': must be true or false (bool)"),
    ("data.seed=-1", "data.seed=-1: must be an integer >= 0"),
    ("data.embedded_bytes=10", "data.embedded_bytes=10: must be an integer >= 1024"),
    ("parallel.tp=0", "parallel.tp=0: must be an integer >= 1"),
    ("parallel.pp=-1", "parallel.pp=-1: must be an integer >= 1"),
    ("parallel.dp=0", "parallel.dp=0: must be -1"),
    ("parallel.cp=3", "tp(1) * cp(3)"),
    ("parallel.tp=2", "world size 1 is not divisible by tp(2)"),
    ("parallel.order=tp-dp", "parallel.order"),
    ("model.attention=nosuch", "model.attention='nosuch' is unknown"),
    ("cluster.gpus=-8", "cluster.gpus=-8: must be an integer >= 0"),
    ("cluster.peak_tflops=nan", "cluster.peak_tflops=nan"),
    ("reliability.hang_timeout_s=-5", "reliability.hang_timeout_s=-5.0: must be 0 (off) or a finite number >= 1"),
    ("reliability.hang_timeout_s=0.1", "reliability.hang_timeout_s=0.1"),
    ("debug.fault=explode", "debug.fault='explode': must be one of none, die, stall"),
    ("debug.fault_at=lunch", "debug.fault_at='lunch': must be step or checkpoint"),
    ("debug.fault_step=0", "debug.fault_step=0: must be an integer >= 1"),
    ("debug.fault=save_error", "debug.fault=save_error fails a periodic persistent save: set checkpoint.every"),
    ("debug.fault=local_save_error", "debug.fault=local_save_error fails a node-local save: set "
     "checkpoint.local.every"),
    ("debug.comm_delay_axis=xy", "debug.comm_delay_axis='xy': must be one of none, tp, cp, ep, dp, pp"),
    ("debug.comm_delay_ms=-5", "debug.comm_delay_ms=-5.0: must be a finite number of milliseconds >= 0"),
    ("debug.comm_delay_axis=dp", "debug.comm_delay_axis=dp with debug.comm_delay_ms=0 delays nothing"),
    ("trainer.max_time=soon", "trainer.max_time='soon' is not a duration"),
    ("trainer.end_margin_s=-1", "trainer.end_margin_s=-1.0: must be a finite number of seconds >= 0"),
    ("trainer.max_time_margin_s=5", "trainer.max_time_margin_s was renamed trainer.end_margin_s; use "
     "trainer.end_margin_s=<value>"),
    ("trainer.end_time=soon", "trainer.end_time='soon' is not a time: give YYYY-MM-DDTHH:MM[:SS]"),
    ("debug.fault=die debug.fault_rank=1", "debug.fault_rank=1 is not a rank of this 1-rank job"),
    ("debug.fault_rank=-2", "debug.fault_rank=-2: must be a world rank >= 0, or -1 (every rank)"),
    ("reliability.straggler_stop_after=-1", "reliability.straggler_stop_after=-1: must be an integer >= 0"),
    ("reliability.straggler_min_s=-1", "reliability.straggler_min_s=-1.0: must be null (max(10 ms, 5% of the step "
                                       "time)) or a finite number of seconds >= 0"),
    ("data.split=1.0", "data.split=1.0: must be a fraction in [0, 1) of each source's documents"),
    ("data.split=-0.1", "data.split=-0.1"),
    ("trainer.eval_every=-1", "trainer.eval_every=-1: must be an integer >= 0; 0: validate only after the last step"),
    ("trainer.eval_batches=0", "trainer.eval_batches=0: must be an integer >= 1"),
    ("data.source=indexed", "data.source=indexed needs data.paths=[<shards>] or data.blend"),
    ("data.split=0.1", "data.split are for Megatron-format shards; set data.source=indexed"),
    ("data.document_mask=true", "data.document_mask=true needs data shards written by hpctrain-prepare"),
    ("data.paths=[/x] data.source=indexed data.blend=[{paths:[/y]}]",
     "set data.paths (one source) or data.blend (several), not both"),
    ("data.blend=[{paths:[/y],weight:-1}] data.source=indexed",
     "data.blend[0].weight=-1.0: must be a finite number > 0"),
    ("data.blend=[{weight:0.5}] data.source=indexed", "data.blend[0].paths is empty; give the source's shards"),
    ("data.paths=[/nonexistent/corpus.json] data.source=indexed",
     "data.paths: manifest /nonexistent/corpus.json does not exist; give the OUT.json hpctrain-prepare wrote"),
    ("data.split=0.1 data.source=indexed data.paths=[/x] data.validation.paths=[/z]",
     "data.split=0.1 and data.validation.paths both choose the validation documents; set one"),
    ("logging.backends=[nosuch]", "logging.backends: 'nosuch' is not provided by any installed plugin; choose from"),
    ("logging.backends=[jsonl,jsonl]", "logging.backends=['jsonl', 'jsonl'] names a backend twice"),
    ("logging.wandb.mode=cloud logging.backends=[wandb]",
     "logging.wandb.mode='cloud' is not one of offline, online, disabled"),
    ("logging.tensorboard.flush_secs=0 logging.backends=[tensorboard]",
     "logging.tensorboard.flush_secs=0: must be an integer >= 1"),
    ("trainer.profile.steps=[0,3]", "trainer.profile.steps=[0, 3]: [0] not steps of this run; use steps in 1..40"),
    ("trainer.profile.steps=[41]", "trainer.profile.steps=[41]: [41] not steps of this run"),
    ("trainer.profile.ranks=[1]", "trainer.profile.ranks=[1]: [1] not ranks of this 1-rank job; use ranks in 0..0"),
    ("trainer.profile.memory=maybe", "trainer.profile.memory='maybe': must be true or false (bool)"),
    ("HPCTRAIN_DISABLE_PLUGINS=logger_wandb logging.backends=[wandb]",
     "blocked by HPCTRAIN_DISABLE_PLUGINS: logger_wandb; to unblock"),
    # (bad shard files, a vocabulary past the model's, vocab_size=auto unrecorded: test_bad_shards.py)
    ("model=hf", "model=hf needs model.hf_dir=<a Hugging Face model directory>"),
    ("model.hf_dir=/nonexistent/llama", "model.hf_dir=/nonexistent/llama: no such directory"),
    ("checkpoint.init_from=/nonexistent/ck.h5", "checkpoint.init_from=/nonexistent/ck.h5: no such file or directory"),
    ("checkpoint.init_from=hf:/nonexistent/llama", "checkpoint.init_from=hf:/nonexistent/llama: no such directory"),
    # (Hugging Face directories: unsupported architectures and fields, missing shards, wrong shapes: test_bad_hf.py)
    # refused by composition (the same one line hpctrain-train prints, status 2)
    ("optim.lr=abc", "optim.lr='abc': must be a number (float), e.g. optim.lr=0.003"),
    ("trainer.steps=1.5", "trainer.steps=1.5: must be an integer (int), e.g. trainer.steps=40"),
    ("trainer.deterministic=maybe", "trainer.deterministic='maybe': must be true or false (bool)"),
    ("trainer.compile=maybe", "trainer.compile='maybe': must be true or false (bool)"),
    ("debug.fill_uninitialized=maybe", "debug.fill_uninitialized='maybe': must be true or false (bool)"),
    ("checkpoint.allow_batch_change=sometimes", "checkpoint.allow_batch_change='sometimes': must be true or false"),
    ("model.vocab_size=abc", "model.vocab_size='abc': must be an integer >= 2, or auto"),
    ("data.prefetch=maybe", "data.prefetch='maybe': must be true or false (bool)"),
    ("data.stage.all=maybe", "data.stage.all='maybe': must be true or false (bool)"),
    ("report.target_tokens=abc", "report.target_tokens='abc': must be an integer (int)"),
    ("model.n_kv_heads=abc", "model.n_kv_heads='abc': must be null or an integer (int)"),
    ("model.qkv_bias=maybe", "model.qkv_bias='maybe': must be true or false (bool)"),
    ("model.qk_norm=maybe", "model.qk_norm='maybe': must be true or false (bool)"),
    ("model.attention_kind=flash", "model.attention_kind='flash' is not one of gqa, mla"),
    ("model.attention_kind=mla", "model.n_kv_heads=2 with model.attention_kind=mla: latent attention sets its heads"),
    ("model.mla.q_lora_rank=0 " + MLA, "model.mla.q_lora_rank=0: must be null or an integer >= 1"),
    ("model.mla.kv_lora_rank=0 " + MLA, "model.mla.kv_lora_rank=0: must be an integer >= 1"),
    ("model.mla.qk_nope_head_dim=-8 " + MLA, "model.mla.qk_nope_head_dim=-8: must be an integer >= 1"),
    ("model.mla.qk_rope_head_dim=7 " + MLA, "model.mla.qk_rope_head_dim=7: must be even"),
    ("model.mla.v_head_dim=0 " + MLA, "model.mla.v_head_dim=0: must be an integer >= 1"),
    ("model.rope_scaling.beta_fast=0", "model.rope_scaling.beta_fast=0.0: must be a finite number > 0 (yarn)"),
    ("model.rope_scaling.beta_slow=-1", "model.rope_scaling.beta_slow=-1.0: must be a finite number > 0 (yarn)"),
    ("model.rope_scaling.mscale=0", "model.rope_scaling.mscale=0.0: must be null or a finite number > 0 (yarn)"),
    ("model.rope_scaling.mscale_all_dim=-1", "model.rope_scaling.mscale_all_dim=-1.0: must be null or a finite"),
    ("model.moe.ffn_hidden=0 model=tiny-moe", "model.moe.ffn_hidden=0: must be null (model.ffn_hidden) or an "
     "integer >= 1"),
    ("model.moe.norm_topk_prob=maybe model=tiny-moe", "model.moe.norm_topk_prob='maybe': must be true or false"),
    ("model.moe.expert_groups=0 model=tiny-moe", "model.moe.expert_groups=0: must be >= 1 (1: no group limit)"),
    ("model.moe.expert_groups=2 model=tiny-moe", "model.moe.expert_groups=2 with model.moe.router=softmax: "
     "group-limited routing is DeepSeek-V3's"),
    ("model.moe.expert_groups=3 model=tiny-moe model.moe.router=sigmoid", "model.moe.expert_groups=3 does not "
     "split model.moe.num_experts=4 into groups of 2 or more experts"),
    ("model.moe.topk_groups=3 model=tiny-moe model.moe.router=sigmoid model.moe.expert_groups=2",
     "model.moe.topk_groups=3: must be between 1 and model.moe.expert_groups (2)"),
    ("model.moe.topk_groups=1 model=tiny-moe model.moe.router=sigmoid model.moe.expert_groups=2 model.moe.top_k=3",
     "model.moe.topk_groups=1 groups of 2 experts hold fewer than model.moe.top_k=3"),
    ("model.moe.routed_scaling_factor=0 model=tiny-moe", "model.moe.routed_scaling_factor=0.0: must be a finite "
     "number > 0"),
    ("model.moe.first_dense_blocks=-1 model=tiny-moe", "model.moe.first_dense_blocks=-1: must be >= 0"),
    ("model.moe.first_dense_blocks=2 model=tiny-moe", "model.moe.first_dense_blocks=2 leaves none of "
     "model.n_layers=2 blocks MoE"),
    ("model.mtp_depth=-1", "model.mtp_depth=-1: must be an integer >= 0"),
    ("model.mtp_loss_weight=-0.1", "model.mtp_loss_weight=-0.1: must be a finite number >= 0"),
    ("model.mtp_loss_weight=inf", "model.mtp_loss_weight=inf: must be a finite number >= 0"),
    ("trainer.stepz=3", "trainer.stepz is not a config key (trainer has no 'stepz'); did you mean trainer.steps?"),
    ("+trainer.newkey=3", "trainer.newkey is not a config key (trainer has no 'newkey'); the keys of trainer: steps,"),
    ("parallel.zero.stag=1", "did you mean parallel.zero.stage?"),
    ("comm.per_axis.pp=mpi", "comm.per_axis is a mapping with no entry 'pp' yet; add one with +comm.per_axis.pp="),
    ("model=gpt5", "model=gpt5: there is no preset 'gpt5' in group model; choose one of: deepseek-v2-lite, "
     "deepseek-v3, gpt2-124m,"),
    ("HPCTRAIN_DISABLE_PLUGINS=zero optim=mine",
     "(hpctrain/conf/optim/*.yaml and the plugins'); blocked by HPCTRAIN_DISABLE_PLUGINS: zero; to unblock"),
    ("trainer.steps=[1", "cannot parse the override 'trainer.steps=[1'"),
    # a plugin blocked by the environment: the message names the variable and how to unblock
    ("HPCTRAIN_DISABLE_PLUGINS=h5ckpt checkpoint.every=5",
     "blocked by HPCTRAIN_DISABLE_PLUGINS: h5ckpt; to unblock, unset HPCTRAIN_DISABLE_PLUGINS"),
    ("HPCTRAIN_DISABLE_PLUGINS=comm_torch comm.backend=torch", "blocked by HPCTRAIN_DISABLE_PLUGINS: comm_torch"),
    ("HPCTRAIN_DISABLE_PLUGINS=moe model=tiny-moe",
     "in preset model/tiny-moe: model.moe is not a config key (model has no 'moe')"),
    ("HPCTRAIN_DISABLE_PLUGINS=zero parallel.zero.stage=1", "blocked by HPCTRAIN_DISABLE_PLUGINS: zero; to unblock"),
    # hpctrain-train --dry-run (hpctrain.dry_run): the job's world and ranks against the layout, and the launch
    ("--world=1000 --dry-run parallel.tp=8 parallel.pp=16", "--dry-run --world 1000: 1000 ranks are not divisible by "
     "tp(8) * cp(1) * ep(1) * pp(16) = 128; use --world a multiple of 128 (e.g. 896 or 1024)"),
    ("--world=16 --dry-run parallel.dp=3", "tp(1) * cp(1) * ep(1) * dp(3) * pp(1) = 3 != 16 ranks; use --world 3 "
     "or parallel.dp=-1"),
    ("--ranks=0,16 --world=16 --dry-run", "--ranks 0,16: 16 is outside the world of 16 ranks; choose ranks in 0..15"),
    ("--ranks=first --world=16 --dry-run", "--ranks first: 'first' is not a rank; give world ranks separated by "
     "commas"),
    ("--dry-run OMPI_COMM_WORLD_SIZE=4 --world=16", "--dry-run plays ranks of the 16-rank job in one process, but "
     "this launch started 4 ranks; run it without mpirun or srun"),
    ("--dry-run --ranks=0", "--dry-run needs the job's size: --world N"),
    ("--world=16 parallel.tp=2", "--world and --ranks describe a dry run: add --dry-run"),
    ("parallel.tp=3 --world=18 --dry-run", "parallel.tp=3 does not divide model.n_heads=4"),
]


def test_the_table_is_big_enough():
    assert len(BAD) >= 40 and len({o for o, _ in BAD}) == len(BAD)


def _problems(override, pm, monkeypatch):
    """What the user sees for ``override``: validation's problems, or the
    composition error's line (a wrong type, an unknown key or preset). An
    upper-case ``NAME=value`` is an environment variable for the row."""
    overrides, flags = [], []
    for token in override.split():
        name, _, value = token.partition("=")
        if name.isupper():
            monkeypatch.setenv(name, value)
            pm = create_manager()  # what the variable changes is which plugins load
        else:
            (flags if token.startswith("--") else overrides).append(token)
    try:
        if flags:  # hpctrain-train's --dry-run flags: checked as hpctrain.cli does, then against the config
            _, dry = split_flags(flags)
            check_launch(dry)
            cfg = compose_resolved(overrides, pm)
            assert dry is not None  # (a row's --world goes with --dry-run, or split_flags refused it)
            return request_problems(cfg, dry) or validate(cfg, dry.world, pm)
        return validate(compose_resolved(overrides, pm), 1, pm)
    except ConfigError as e:
        return str(e).splitlines()


@pytest.mark.parametrize("override,message", BAD, ids=[o for o, _ in BAD])
def test_bad_input_is_rejected_with_its_key(pm, monkeypatch, override, message):
    problems = _problems(override, pm, monkeypatch)
    assert any(message in p for p in problems), problems
    key = override.split()[0].split("=", 1)[0].lstrip("+")
    assert any(key in p or "world size" in p for p in problems)  # the message names what to change


def test_a_good_config_passes(make_config, pm):
    assert validate(make_config(), 1, pm) == []


def test_every_bad_value_is_reported_at_once(make_config, pm):
    problems = validate(make_config("optim.lr=-1", "optim.beta2=1.5", "trainer.steps=0"), 1, pm)
    assert len(problems) == 3


def test_an_unwritable_checkpoint_dir_fails_before_the_first_step(make_config, pm, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    problems = validate(make_config("checkpoint.every=5", f"checkpoint.dir={blocker}/ckpt"), 1, pm)
    assert any(f"checkpoint.dir='{blocker}/ckpt' is not writable" in p for p in problems), problems
    assert validate(make_config("checkpoint.every=5", f"checkpoint.dir={tmp_path}/ok"), 1, pm) == []


def test_a_fresh_run_is_refused_a_directory_holding_another_runs_checkpoints(make_config, pm, tmp_path):
    """Only a run that starts afresh and may save (every, or save_on_stop alone) is refused."""
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "step_00000080.h5").write_bytes(b"")
    where = f"checkpoint.dir={tmp_path}/ck"
    for saves in (["checkpoint.every=5"], []):  # save_on_stop is on by default
        problems = validate(make_config(where, *saves), 1, pm)
        assert [p for p in problems if "already holds checkpoints of another run (newest step_00000080.h5)" in p
                and "checkpoint.resume=auto" in p], problems
    assert validate(make_config(where, "checkpoint.every=5", "checkpoint.resume=auto"), 1, pm) == []
    assert validate(make_config(where, "checkpoint.save_on_stop=false"), 1, pm) == []
    assert validate(make_config(f"checkpoint.dir={tmp_path}/new", "checkpoint.every=5"), 1, pm) == []


def test_an_unwritable_logging_dir_fails_before_the_first_step(make_config, pm, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    problems = validate(make_config(f"logging.dir={blocker}/logs"), 1, pm)
    assert any(f"logging.dir='{blocker}/logs' is not writable" in p for p in problems), problems
    assert validate(make_config(f"logging.dir={tmp_path}/ok"), 1, pm) == []


@pytest.mark.parametrize("backend,package,extra", [("tensorboard", "tensorboard", "tensorboard"),
                                                   ("wandb", "wandb", "wandb"), ("mlflow", "mlflow", "mlflow")])
def test_a_backend_whose_library_is_missing_names_the_extra(make_config, pm, monkeypatch, backend, package, extra):
    import sys

    monkeypatch.setitem(sys.modules, package, None)  # Python's own way to make an import fail
    problems = validate(make_config(f"logging.backends=[jsonl,{backend}]"), 1, pm)
    assert problems == [f"logging.backends includes {backend} but the {package} package is not installed; "
                        f"pip install 'hpctrain[{extra}]' (or {package}), or remove {backend} from logging.backends"]
