"""Text from a checkpoint: a ring prefill of the prompt, then a KV cache sharded over the ring.

    python -m trainer.sample --workdir runs/tiny_cpu_striped --prompt "the code of mira is"
        [--prompt_file F] [--step N] [--max_new_tokens 32] [--temperature 0 --top_p 1 --seed 0]
        [--json] [--config.model.attention=dense ...]
    python -m trainer.sample --from_hf /models/Llama-2-7b-hf --prompt ... [--config.*]

The run's own config (its `config.json`, and the stage that wrote the step) gives the model,
the mesh and the attention (`--from_hf`: `configs/base.py` with the checkpoint's model);
`--config.*` overrides it as in training, e.g. to sample the same checkpoint with dense
attention. The prompt is prefilled with the run's attention over
the `sequence` axis, so with N > 1 ring devices a prompt longer than one device's memory
works; its keys and values stay where the prefill left them, 1/N on each device, and each
new token attends to them by `parallelism.decode_attention` (partial softmaxes merged by
log-sum-exp). The prompt fills every batch shard (data x fsdp) alike.

The cache holds `capacity` positions: prompt plus new tokens, rounded up to what the layout
and tile need. The prompt is padded at the end up to the capacity; the padding's keys are
never seen (a position sees only slots at or before itself), and decoding overwrites them.
With a run-time mask (`model.sparse`) each decoded position is masked as the dense forward
of the whole row of `capacity` masks it (QK-dropping's codes depend on the row's length:
model/dropping.py); the cache also keeps each key's code or SparseK score.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import data
import parallelism
from model import Decoder, ModelConfig
from model.hf_format import HFFormatError
from trainer.ckpt.checkpointing import CheckpointError
from trainer.ckpt.tool_reads import read_step
from trainer.ckpt.resume import tokenizer_problem
from trainer.config import stages
from trainer.config.config_check import ConfigError
from trainer.tools.run_flags import SampleError, check_settings


def _on_mesh(config: ml_collections.ConfigDict):
  """(mesh, what the config trains with on it) after the trainer's own config check, so a
  config that cannot run here (the device count, overrides) stops in one line."""
  from trainer.config.config_check import check_config  # pylint: disable=g-import-not-at-top
  from trainer.core.training import build_training  # pylint: disable=g-import-not-at-top
  check_config(config, jax.device_count())
  mesh = parallelism.make_mesh(config.mesh)
  with jax.set_mesh(mesh), nn.logical_axis_rules(config.mesh.rules):
    return mesh, build_training(config, mesh)


def from_hf(config: ml_collections.ConfigDict, log: Callable[[str], None] = print) -> Sampler:
  """A sampler of the Hugging Face checkpoint in `config.init.from_hf` (after
  `hf_import.apply_to_config`), its weights read one tensor at a time onto the mesh."""
  from trainer.ckpt.start import initial_params  # pylint: disable=g-import-not-at-top
  mesh, parts = _on_mesh(config)
  with jax.set_mesh(mesh), nn.logical_axis_rules(config.mesh.rules):
    params = initial_params(config, parts, log)
  return Sampler(config, mesh, params, data.Tokenizer(config.data.tokenizer), log)


def untrained(config: ml_collections.ConfigDict,
              log: Callable[[str], None] = print) -> Sampler:
  """A sampler of the run's model as step 0 would start it (its seed, or the Hugging Face
  checkpoint it starts from): the baseline that a trained checkpoint should beat."""
  from trainer.ckpt.start import initial_params  # pylint: disable=g-import-not-at-top
  from trainer.core.training import data_config  # pylint: disable=g-import-not-at-top
  config = stages.resolve(config)[0].config
  mesh, parts = _on_mesh(config)
  with jax.set_mesh(mesh), nn.logical_axis_rules(config.mesh.rules):
    params = initial_params(config, parts, log)
  return Sampler(config, mesh, params, data.load_tokenizer(data_config(config)), log)


def load(workdir: str, config: ml_collections.ConfigDict, step: int | None = None,
         log: Callable[[str], None] = print) -> tuple[Sampler, int]:
  """A sampler for step `step` (default the newest) of `workdir`, with `config` (the run's,
  overrides applied) resolved to the stage that wrote the step. Reads with a read-only
  checkpointer, verified against the step's fingerprints; a run training there is safe."""
  from trainer.core.training import data_config  # pylint: disable=g-import-not-at-top

  def read(checkpointer, step):
    step_config = stages.holding(stages.resolve(config), step).config
    mesh, parts = _on_mesh(step_config)
    log(f"reading {checkpointer.directory}/{step}")
    return step_config, mesh, *checkpointer.read_params(step, lambda meta: parts.abstract_state)

  (config, mesh, params, meta), step = read_step(workdir, step, read, SampleError)
  path = data.tokenizer_path(data_config(config))
  problem = tokenizer_problem(path, meta.get("tokenizer_sha256"))
  if problem:
    raise SampleError(f"{problem}; set --config.data.tokenizer=PATH")
  return Sampler(config, mesh, params, data.Tokenizer(path), log), step


def capacity_for(length: int, config: ml_collections.ConfigDict, num_shards: int,
                 ulysses: int = 1) -> int:
  """The smallest cache length >= `length` that the config's attention can prefill on a
  ring of `num_shards` devices times `ulysses`."""
  if config.model.attention == "dense":  # no tiles: every shard of the cache alike
    unit = parallelism.length_unit("ring", num_shards, 0, ulysses, seq_len=0)
    return -(-length // unit) * unit
  return parallelism.shortest_ring_length(length, config.model.attention, num_shards,
                                          config.model.attention_tile, ulysses)


@dataclasses.dataclass
class Sampler:
  """Generates from `params` with `config`'s model, attention and mesh."""

  config: ml_collections.ConfigDict
  mesh: jax.sharding.Mesh
  params: dict
  tokenizer: data.Tokenizer
  log: Callable[[str], None] = print

  def __post_init__(self):
    from trainer.core.training import (  # pylint: disable=g-import-not-at-top
        data_config, model_config)
    # No gradient here: nothing to rematerialise.
    self.model_cfg: ModelConfig = dataclasses.replace(model_config(self.config), remat="none")
    self.data_cfg: data.DataConfig = data_config(self.config)
    self._steps = {}  # (capacity, temperature, top_p) -> the compiled prefill and decode.
    self.rules = tuple(self.config.mesh.rules)
    self.rows = parallelism.batch_shards(self.mesh)  # The same prompt in every batch shard.
    self.num_shards = self.mesh.shape["sequence"]  # The ring the layout permutes for.
    self.ulysses = self.mesh.shape.get("ulysses", 1)
    self._warned_length = False

  def cache_sharding(self, rank: int = 5) -> NamedSharding:
    """[layers, batch, capacity, kv heads, head dim] (keys, values; `rank` 4 without the head
    dim: a run-time mask's codes or scores), capacity over the sequence axes."""
    spec = parallelism.logical_to_spec(parallelism.CACHE_NAMES,
                                       parallelism.decode_rules(self.rules))
    return NamedSharding(self.mesh, P(None, *spec[:rank - 1]))

  def generate(self, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0,
               top_p: float = 1.0, seed: int = 0,
               on_token: Callable[[int], None] | None = None,
               capacity: int | None = None, ignore_eos: bool = False,
               on_logits: Callable[[jax.Array], None] | None = None) -> tuple[list[int], dict]:
    """New token ids after `prompt_ids` (stopping at EOS, which is not returned) and timings:
    prefill and decode seconds and tokens/sec, compile time apart. `capacity` (default: just
    enough, see `capacity_for`) may be given larger so that prompts of several lengths share
    one compile. `ignore_eos` generates all `max_new_tokens` (for benchmarks). `on_logits`
    gets the float32 logits [V] (row 0's, on the device) each new token is chosen from."""
    if not prompt_ids:
      raise SampleError("the prompt is empty")
    check_settings(max_new_tokens, temperature, top_p)
    length = len(prompt_ids)
    trained = self.config.data.seq_len
    if length + max_new_tokens > trained and not self._warned_length:
      self._warned_length = True
      self.log(f"note: prompt plus new tokens ({length + max_new_tokens}) exceed the run's "
               f"trained sequence length ({trained}); positions beyond it use RoPE outside "
               f"the trained range")
    needed = capacity_for(length + max_new_tokens, self.config, self.num_shards, self.ulysses)
    if capacity is not None and (capacity < needed or capacity_for(
        capacity, self.config, self.num_shards, self.ulysses) != capacity):
      raise SampleError(f"capacity {capacity} cannot hold {length} + {max_new_tokens} tokens "
                        f"in this layout (try {needed})")
    capacity = capacity or needed
    layout = self.model_cfg.layout
    inverse = parallelism.layouts.inverse_permutation(layout, capacity, self.num_shards)
    tokens_C = np.full(capacity, self.tokenizer.pad_id, np.int32)
    tokens_C[:length] = prompt_ids
    positions_C = np.arange(capacity, dtype=np.int32)
    row = lambda x_C: np.broadcast_to(
        parallelism.permute(x_C[None], layout, self.num_shards), (self.rows, capacity))
    batch_sharding = parallelism.batch_sharding(self.mesh)
    prefill_args = [jax.device_put(row(x), batch_sharding)
                    for x in (tokens_C, positions_C, np.ones(capacity, np.int32))]
    rows_sharding = NamedSharding(self.mesh, P(batch_sharding.spec[0]))
    last_slot_B = jax.device_put(np.full(self.rows, inverse[length - 1], np.int32),
                                 rows_sharding)
    key = jax.random.key(seed)
    choice = functools.partial(_choose, temperature=temperature, top_p=top_p,
                               vocab=self.tokenizer.vocab_size)

    started = time.monotonic()
    signature = (capacity, temperature, top_p)
    if signature not in self._steps:
      self._steps[signature] = self._compiled(choice, prefill_args, last_slot_B, key)
    prefill, decode = self._steps[signature]
    compile_s = time.monotonic() - started

    started = time.monotonic()
    token_B, logits_BV, cache = prefill(self.params, *prefill_args, last_slot_B, key)
    token = int(token_B[0])
    prefill_s = time.monotonic() - started
    new_ids, decode_steps = [], 0
    started = time.monotonic()
    for i in range(max_new_tokens):
      if token == self.tokenizer.eos_id and not ignore_eos:
        break
      new_ids.append(token)
      if on_token:
        on_token(token)
      if on_logits:
        on_logits(logits_BV[0])
      if i + 1 == max_new_tokens:
        break
      position_B = jax.device_put(np.full(self.rows, length + i, np.int32), rows_sharding)
      token_B, logits_BV, cache = decode(self.params, cache, token_B, position_B,
                                         jax.random.fold_in(key, i + 1))
      token = int(token_B[0])
      decode_steps += 1
    decode_s = time.monotonic() - started  # With `on_token`'s time: what a user waits.
    key_cache = next(x for path, x in jax.tree_util.tree_leaves_with_path(cache)
                     if path[-1].key == "key")
    return new_ids, {
        "prompt_tokens": length, "new_tokens": len(new_ids), "capacity": capacity,
        # [layers, rows, capacity, kv heads, head dim]: the whole, and one device's part.
        "cache_shape": tuple(key_cache.shape),
        "cache_shard_shape": tuple(key_cache.addressable_shards[0].data.shape),
        "compile_s": compile_s, "prefill_s": prefill_s,
        "prefill_tokens_per_s": length / prefill_s,
        "decode_s": decode_s, "decode_tokens_per_s": decode_steps / decode_s if decode_steps else None}

  def _compiled(self, choice, prefill_args, last_slot_B, key):
    """The prefill and decode steps for these shapes, compiled ahead of the timing: each
    returns (tokens, their logits [B, V], cache). Tokens come out sharded as rows go in
    (`last_slot_B`'s sharding): one decode step's output is the next one's input."""
    prefill_model, decode_model = Decoder(self.model_cfg), Decoder(self.model_cfg, decode=True)
    rules, decode_rules = self.rules, parallelism.decode_rules(self.rules)
    # Each cache entry by its rank: keys and values, and a run-time mask's codes or scores.
    pinned = lambda cache: jax.tree.map(
        lambda x: jax.lax.with_sharding_constraint(x, self.cache_sharding(x.ndim)), cache)

    def prefill(params, tokens_BC, positions_BC, segment_ids_BC, last_slot_B, key):
      with nn.logical_axis_rules(rules):
        logits_B1V, variables = prefill_model.apply(
            {"params": params}, tokens_BC, positions_BC, segment_ids_BC,
            logits_at_B=last_slot_B, mutable=["cache"])
      return choice(logits_B1V[:, 0], key), logits_B1V[:, 0], pinned(variables["cache"])

    def decode(params, cache, token_B, position_B, key):
      with nn.logical_axis_rules(decode_rules):
        logits_B1V, variables = decode_model.apply(
            {"params": params, "cache": cache}, token_B[:, None], position_B[:, None],
            jnp.ones_like(token_B[:, None]), mutable=["cache"])
      return choice(logits_B1V[:, 0], key), logits_B1V[:, 0], pinned(variables["cache"])

    with jax.set_mesh(self.mesh):
      logits_sharding = NamedSharding(self.mesh, P(last_slot_B.sharding.spec[0], None))
      out_shardings = (last_slot_B.sharding, logits_sharding, None)  # the cache: `pinned`
      prefill_jit = jax.jit(prefill, out_shardings=out_shardings)
      compiled_prefill = prefill_jit.lower(self.params, *prefill_args, last_slot_B,
                                           key).compile()
      cache_shapes = jax.tree.map(
          lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype,
                                         sharding=self.cache_sharding(len(s.shape))),
          compiled_prefill.out_info[2])
      decode_jit = jax.jit(decode, out_shardings=out_shardings, donate_argnums=1)
      compiled_decode = decode_jit.lower(self.params, cache_shapes, last_slot_B, last_slot_B,
                                         key).compile()
    return compiled_prefill, compiled_decode


def _choose(logits_BV: jax.Array, key: jax.Array, *, temperature: float, top_p: float,
            vocab: int | None = None) -> jax.Array:
  """Greedy at temperature 0; else a draw from the tempered softmax cut to its top-p mass
  (the smallest set of most likely tokens whose probability reaches `top_p`). Only ids below
  `vocab` (the tokenizer's size) are chosen: a model's vocabulary may be padded past the
  tokenizer's, and an id it cannot decode is no text."""
  if vocab is not None and vocab < logits_BV.shape[-1]:
    logits_BV = jnp.where(jnp.arange(logits_BV.shape[-1]) < vocab, logits_BV, -jnp.inf)
  if temperature <= 0:
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  logits_BV = logits_BV / temperature
  if top_p < 1.0:
    sorted_BV = jnp.sort(logits_BV, axis=-1)[:, ::-1]
    mass_BV = jnp.cumsum(jax.nn.softmax(sorted_BV, axis=-1), axis=-1)
    # The cut-off logit: the last one needed to reach top_p (the first always stays).
    cut_B = jnp.sum(mass_BV - jax.nn.softmax(sorted_BV, axis=-1) < top_p, axis=-1)
    cut_B = jnp.maximum(cut_B, 1)
    threshold_B = jnp.take_along_axis(sorted_BV, cut_B[:, None] - 1, axis=-1)
    logits_BV = jnp.where(logits_BV >= threshold_B, logits_BV, -jnp.inf)
  # One key for every row: the rows hold the same prompt and give the same draw.
  return jax.vmap(lambda logits_V: jax.random.categorical(key, logits_V))(
      logits_BV).astype(jnp.int32)


# What loading and sampling a run raise for a problem of the run or the flags, each with a
# one-line message (the command lines print it and exit 1).
RUN_ERRORS = (SampleError, CheckpointError, ConfigError, data.DataError, HFFormatError)


def prompt_ids(tokenizer: data.Tokenizer, text: str) -> list[int]:
  """The prompt as training saw a document's start: BOS (when the tokenizer has one), text."""
  return ([tokenizer.bos_id] if tokenizer.bos_id >= 0 else []) + tokenizer.encode(text)
