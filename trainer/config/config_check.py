"""Start-up checks of a resolved config: fail early, in one line that names the field.

Runs before any device memory is touched (only the device count is read), so a bad
override costs seconds, not a compile.
"""

from __future__ import annotations

import math

import ml_collections
import jax
import jax.numpy as jnp

import data
import parallelism
from data.config import RESERVED_PIECES
from trainer.config import fields, flops, needle_grid, stages
from trainer.config.models import model_config
from model import ATTENTIONS, KERNELS, REMAT_POLICIES
from model.config import layout_of
from model.rope import RopeScaling

WANDB_MODES = ("auto", "online", "offline", "disabled")


class ConfigError(ValueError):
  """A config value that cannot work; the message names the field and what to change."""


def check_config(config: ml_collections.ConfigDict, num_devices: int) -> None:
  """Checks the config, and each of its stages as the config it resolves to."""
  stage_problem = stages.problem(config)
  _require(not stage_problem, stage_problem)
  if not config.stages:
    _check_one(config, num_devices)
    return
  for stage in stages.resolve(config):
    try:
      _check_one(stage.config, num_devices)
    except ConfigError as error:
      raise ConfigError(f"{stage.label}: {error}") from None


def _check_one(config: ml_collections.ConfigDict, num_devices: int) -> None:
  m, t, d = config.model, config.train, config.data
  # First: NaN fails every comparison, so `x < 0` lets it through to the first step's loss.
  for field, value in fields.flatten(config.to_dict()).items():
    _require(not isinstance(value, float) or math.isfinite(value),
             f"{field}={value} must be a finite number")
  for field in ("num_layers", "d_model", "num_heads", "num_kv_heads", "d_ff", "vocab_size",
                "attention_tile"):
    _require(m[field] > 0, f"model.{field}={m[field]} must be positive")
  for field in ("rope_theta", "norm_eps", "init_std"):
    _require(m[field] > 0, f"model.{field}={m[field]} must be positive")
  _require(m.head_dim >= 0, f"model.head_dim={m.head_dim} must be >= 0 (0: d_model / num_heads)")
  for field in ("steps", "batch_size", "log_every", "loss_chunk"):
    _require(t[field] > 0, f"train.{field}={t[field]} must be positive")
  _require(config.cpu_devices >= 0,
           f"cpu_devices={config.cpu_devices} must be >= 0 (0: JAX's default)")
  _check_data(config.data)
  _require(m.attention in ATTENTIONS, f"model.attention='{m.attention}' must be one of {ATTENTIONS}")
  _require(m.kernel in KERNELS, f"model.kernel='{m.kernel}' must be one of {KERNELS}")
  if m.kernel == "cudnn":  # Also in a dry run: cuDNN's calls do not compile for the CPU.
    unusable = parallelism.kernel_cudnn.unusable()
    _require(unusable is None, f"model.kernel='cudnn' {unusable}; model.kernel='auto' "
                               f"chooses a kernel that runs here")
  _require(t.remat in REMAT_POLICIES, f"train.remat='{t.remat}' must be one of {REMAT_POLICIES}")
  for field in ("dtype", "param_dtype"):
    _require(_is_float_dtype(m[field]), f"model.{field}='{m[field]}' is not a float dtype")
  _require(m.num_heads % m.num_kv_heads == 0,
           f"model.num_heads={m.num_heads} must be divisible by model.num_kv_heads={m.num_kv_heads}")
  head_size = m.head_dim or m.d_model // m.num_heads
  _require(m.head_dim or m.d_model % m.num_heads == 0,
           f"model.d_model={m.d_model} must be divisible by model.num_heads={m.num_heads} "
           f"(or set model.head_dim)")
  rope_problem = RopeScaling(**m.rope_scaling.to_dict()).problem()
  _require(not rope_problem, rope_problem)
  model_cfg = model_config(config)
  pattern_problem = model_cfg.pattern_problem()
  _require(not pattern_problem, pattern_problem)
  _require(head_size % 2 == 0, f"head size {head_size} must be even for rotary embeddings "
                               f"(model.head_dim or model.d_model / model.num_heads)")
  _require(t.on_nonfinite in ("stop", "skip"),
           f"train.on_nonfinite='{t.on_nonfinite}' must be 'stop' or 'skip'")
  _require(t.lr > 0, f"train.lr={t.lr} must be positive")
  schedule = t.schedule_steps or t.steps
  _require(t.schedule_steps >= 0, f"train.schedule_steps={t.schedule_steps} must be >= 0")
  _require(0 <= t.warmup_steps <= schedule,
           f"train.warmup_steps={t.warmup_steps} must be between 0 and the schedule length "
           f"{schedule} (train.schedule_steps, or train.steps when that is 0)")
  _require(t.grad_clip >= 0, f"train.grad_clip={t.grad_clip} must be >= 0 (0 disables)")
  _require(0 <= t.min_lr_ratio <= 1, f"train.min_lr_ratio={t.min_lr_ratio} must be in [0, 1]")
  _check_optimizer(t)
  _require(t.eval_every >= 0, f"train.eval_every={t.eval_every} must be >= 0 (0: no evals)")
  # Only counted when evals run: an eval of no batches has no loss to report.
  _require(not t.eval_every or t.eval_steps >= 1,
           f"train.eval_steps={t.eval_steps} must be >= 1 when train.eval_every="
           f"{t.eval_every} runs evals (or set train.eval_every=0)")
  if t.eval_needle_lengths:
    try:
      needle_grid.parse_lengths(t.eval_needle_lengths)
      needle_grid.parse_depths(t.eval_needle_depths)
    except needle_grid.NeedleError as error:
      raise ConfigError(f"train.eval_needle_*: {error}") from None
    _require(t.eval_needle_trials >= 1,
             f"train.eval_needle_trials={t.eval_needle_trials} must be at least 1")
  _require(config.checkpoint.every_steps >= 0,
           f"checkpoint.every_steps={config.checkpoint.every_steps} must be positive, or 0 "
           f"for no checkpoints")
  _require(config.checkpoint.keep >= 1, f"checkpoint.keep={config.checkpoint.keep} must be >= 1")
  _require(config.wandb.mode in WANDB_MODES,
           f"wandb.mode='{config.wandb.mode}' must be one of {WANDB_MODES}")
  _require(d.dataset != "text_files" or d.path,
           "data.path must name a directory of .txt/.jsonl files when data.dataset='text_files'")
  _require(not config.accelerator or config.accelerator in flops.PEAK_FLOPS,
           f"accelerator='{config.accelerator}' must be empty (guess from the device) or one of "
           f"{', '.join(flops.PEAK_FLOPS)}")
  _require(config.peak_flops_per_device >= 0,
           f"peak_flops_per_device={config.peak_flops_per_device} must be >= 0 (0 uses the table)")
  _check_mesh(config, num_devices)


def _check_optimizer(t: ml_collections.ConfigDict) -> None:
  """AdamW's moments average over 1 / (1 - beta) steps: a beta of 1 or more never forgets
  (or grows), a negative one flips signs; neither fails, both train wrongly."""
  for field in ("b1", "b2"):
    _require(0 <= t[field] < 1, f"train.{field}={t[field]} must be in [0, 1)")
  _require(t.weight_decay >= 0,
           f"train.weight_decay={t.weight_decay} must be >= 0 (0: no decay)")


def _check_data(d: ml_collections.ConfigDict) -> None:
  """The data pipeline's own checks of its fields, before any preparation or workdir; and
  the size of the tokenizer that preparation trains when none is named."""
  try:
    data.DataConfig(**d.to_dict())
  except data.DataError as error:
    raise ConfigError(str(error)) from None
  _require(d.tokenizer or d.tokenizer_vocab_size > RESERVED_PIECES,
           f"data.tokenizer_vocab_size={d.tokenizer_vocab_size} must exceed {RESERVED_PIECES} "
           f"(byte fallback's 256 pieces and 4 special ids) for the tokenizer trained when "
           f"data.tokenizer is empty")


def _check_mesh(config: ml_collections.ConfigDict, num_devices: int) -> None:
  m = config.model
  try:
    shape = dict(zip(parallelism.MESH_AXES,
                     parallelism.resolve_mesh_shape(config.mesh, num_devices)))
    parallelism.check_rules(config.mesh.rules)
  except ValueError as error:
    # On CPUs the devices are simulated: their number is a config field too.
    sizes = [config.mesh.get(axis, 1) for axis in parallelism.MESH_AXES]
    wanted = math.prod(sizes)
    cpus = (f"; or config.cpu_devices={wanted} simulates that many CPU devices"
            if jax.default_backend() == "cpu" and min(sizes) > 0 and wanted != num_devices
            else "")
    raise ConfigError(f"{error}{cpus}") from None
  batch_shards = shape["data"] * shape["fsdp"]
  _require(config.train.batch_size % batch_shards == 0,
           f"train.batch_size={config.train.batch_size} must be divisible by mesh.data x mesh.fsdp"
           f" = {batch_shards}")
  micro = config.train.micro_batches
  _require(micro >= 1 and config.train.batch_size % (micro * batch_shards) == 0,
           f"train.micro_batches={micro} must be >= 1 and split train.batch_size="
           f"{config.train.batch_size} into slices divisible by mesh.data x mesh.fsdp = "
           f"{batch_shards}")
  tensor = shape["tensor"]
  for field in ("num_heads", "num_kv_heads", "d_ff"):
    _require(m[field] % tensor == 0,
             f"model.{field}={m[field]} must be divisible by mesh.tensor={tensor}")
  sequence, ulysses = shape["sequence"], shape["ulysses"]
  seq_len = config.data.seq_len
  strategy = m.sequence_parallel
  _require(strategy in parallelism.STRATEGIES,
           f"model.sequence_parallel='{strategy}' must be one of {parallelism.STRATEGIES}")
  if m.attention == "dense":  # No ring: the sequence axes only shard its activations.
    _require(ulysses == 1, f"mesh.ulysses={ulysses} splits the sequence for Ulysses attention, "
                           f"which model.attention='dense' does not run: set mesh.ulysses=1")
    _require(seq_len % sequence == 0,
             f"data.seq_len={seq_len} must be divisible by mesh.sequence={sequence}")
    return
  # The data pipeline permutes each batch for mesh.sequence shards: the ring runs there.
  seq_axes = parallelism.mesh.as_axes(dict(config.mesh.rules).get("activation_seq"))
  _require(seq_axes in (("sequence",), ("sequence", "ulysses")),
           f"mesh.rules maps activation_seq to {seq_axes or 'nothing'}; model.attention="
           f"'{m.attention}' needs it on ('sequence',), optionally then 'ulysses': the ring "
           f"the data is laid out for, then the Ulysses axis")
  split = attention_split(config, num_devices)
  if split.kv_repeat > 1:
    _say_once(f"note: the key/value heads (model.num_kv_heads={m.num_kv_heads}) do not split "
              f"over mesh.ulysses={ulysses}; Ulysses repeats each {split.kv_repeat} times "
              f"(GQA: exact, with {split.kv_repeat}x the key/value all-to-all bytes)")


# How the trainer's users know what `parallelism.split_attention` names: config fields.
CONFIG_NAMES = parallelism.Names(seq_len="data.seq_len", tile="model.attention_tile",
                                 kernel="model.kernel",
                                 strategy="model.sequence_parallel", heads="model.num_heads",
                                 rules="mesh.rules", axis="mesh.{}")


def attention_split(config: ml_collections.ConfigDict, num_devices: int,
                    kind: str | None = None):
  """Each device's side of the config's (non-dense) attention on its mesh:
  `parallelism.split_attention`, its errors a ConfigError naming config fields. The split of
  layers of `kind` (default: the first layer's): kinds differ in their window, and so may
  their kernel (`block_kernels`)."""
  m = config.model
  cfg = model_config(config)
  kind = kind or cfg.layer_kinds[0]
  shape = dict(zip(parallelism.MESH_AXES,
                   parallelism.resolve_mesh_shape(config.mesh, num_devices)))
  mesh = jax.sharding.AbstractMesh(tuple(shape.values()), tuple(shape))
  try:
    row = lambda heads: jax.ShapeDtypeStruct((1, config.data.seq_len, heads, cfg.head_size),
                                             jnp.dtype(m.dtype))
    return parallelism.split_attention(
        m.sequence_parallel, layout_of(m.attention), m.attention_tile, m.kernel, mesh,
        config.mesh.rules, row(m.num_heads), row(m.num_kv_heads), CONFIG_NAMES,
        spec=cfg.mask_spec(kind))
  except ValueError as error:
    raise ConfigError(str(error)) from None


def block_kernels(config: ml_collections.ConfigDict, num_devices: int) -> tuple[str, str]:
  """The block kernel the config's (non-dense) attention runs, per layer kind where the
  kinds differ ('pallas for L layers; cudnn for G layers'): (the kernels alone, the kernels
  each with why it is not the one model.kernel names)."""
  kinds = model_config(config).layer_kinds
  splits = [(kind, attention_split(config, num_devices, kind)) for kind in dict.fromkeys(kinds)]
  why = lambda s: f" ({s.kernel_fallback})" if s.kernel_fallback else ""
  return (_per_kind({kind: s.kernel for kind, s in splits}),
          _per_kind({kind: s.kernel + why(s) for kind, s in splits}))


def _per_kind(values: dict[str, str]) -> str:
  if len(set(values.values())) == 1:
    return next(iter(values.values()))
  return "; ".join(f"{value} for {kind} layers" for kind, value in values.items())


_SAID: set[str] = set()  # Notes already printed by this process.


def _say_once(note: str) -> None:
  if note not in _SAID:
    _SAID.add(note)
    print(note, flush=True)


def _is_float_dtype(name: str) -> bool:
  try:
    return jnp.issubdtype(jnp.dtype(name), jnp.floating)
  except TypeError:
    return False


def _require(condition: bool, message: str) -> None:
  if not condition:
    raise ConfigError(message)
