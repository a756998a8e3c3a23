"""Starting a run from a Hugging Face LLaMA checkpoint directory (`config.init.from_hf`).

Two stages, so that a bad checkpoint stops before anything is claimed or compiled:

- `apply_to_config`, before JAX touches a device: reads config.json and every safetensors
  header (not the data), sets the model's architecture, RoPE and tokenizer from them, and
  checks that every tensor the model needs is there with the shape config.json implies.
- `load_params`, inside the run: reads the tensors one at a time and writes each onto the
  mesh with its parameter's sharding. The host holds one tensor (and its float32 copy) at a
  time; a stacked layer parameter is filled on the devices one layer at a time.
"""

from __future__ import annotations

import json
import os
import re
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, which safetensors' reader needs)
import numpy as np
import sentencepiece
from flax import traverse_util
from jax.sharding import NamedSharding, PartitionSpec as P
from safetensors import safe_open

from model.config import ModelConfig
from trainer.config.models import model_config
from model.hf_format import HFFormatError, hf_shapes, model_fields, tensor_names, to_ours

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.model"


# `config.model` fields a command-line override keeps over the checkpoint's config.json: RoPE,
# to train or sample at a longer context than the checkpoint's, and local attention (which
# positions a layer sees, not a tensor's shape). The rest is its shape.
_OVERRIDABLE = ("rope_theta", "rope_scaling.", "window", "layer_pattern", "local_rope_theta")


def apply_to_config(config: ml_collections.ConfigDict,
                    overrides: dict[str, Any] | None = None) -> str:
  """Sets `config.model`'s architecture and RoPE, and `config.data.tokenizer` unless set,
  from the checkpoint in `config.init.from_hf`; returns a summary line to print (and a note
  line when the run is longer than the checkpoint's length, its RoPE unscaled).

  `overrides` are the command line's `--config.*` values (flat names, as ml_collections'
  `get_override_values` gives them): a RoPE field given there keeps its value; a shape
  field given there with another value than the checkpoint's stops (it would be dropped)."""
  directory = config.init.from_hf
  where = f"init.from_hf={directory}"
  if not os.path.isdir(directory):
    raise HFFormatError(f"{where}: not a directory")
  config_file = os.path.join(directory, "config.json")
  try:
    with open(config_file) as f:
      hf_config = json.load(f)
  except (OSError, json.JSONDecodeError) as error:
    raise HFFormatError(f"{where}: cannot read config.json ({error})") from None
  overrides = overrides or {}
  replaced = []  # The checkpoint's RoPE values that command-line overrides replace.
  for name, value in traverse_util.flatten_dict(model_fields(hf_config, config_file),
                                                sep=".").items():
    given = overrides.get(f"model.{name}", value)
    if given != value and name.startswith(_OVERRIDABLE):
      replaced.append(f"{name}={value}")
      continue
    if given != value:
      raise HFFormatError(f"--config.model.{name}={given}, but {where} has {value}: the "
                          f"checkpoint sets the model's shape (only its RoPE and local "
                          f"attention may be overridden); drop the override")
    target, _, field = f"model.{name}".rpartition(".")
    config[target][field] = value  # ConfigDict resolves the dotted path of the parent.
  if not config.data.tokenizer:
    config.data.tokenizer = _tokenizer_file(directory)
  _check_tokenizer(config.data.tokenizer, config.model.vocab_size, where)
  check_tensors(directory, model_config(config))
  m = config.model
  scaling = m.rope_scaling.type + (f" x{m.rope_scaling.factor:g}"
                                   if m.rope_scaling.type != "default" else "")
  trained = hf_config.get("max_position_embeddings") or 0
  # Stages set their own lengths and RoPE after this; a run without them trains at this one.
  past = (not config.stages and config.data.seq_len > trained > 0 and not replaced
          and m.rope_scaling.type == "default")
  note = (f"\nnote: data.seq_len={config.data.seq_len} is past the checkpoint's "
          f"max_position_embeddings ({trained}) with its RoPE unscaled; set "
          f"model.rope_scaling.* on the command line to extend its context" if past else "")
  return (f"starting from {directory}: {m.num_layers} layers, d_model {m.d_model}, heads "
          f"{m.num_heads}/{m.num_kv_heads} kv, vocab {m.vocab_size}, RoPE theta "
          f"{m.rope_theta:g} {scaling}"
          + (f", sliding window {m.window}" if m.window else "")
          + (f" (set on the command line; the checkpoint's: {', '.join(replaced)})"
             if replaced else "")
          + f"; tokenizer {config.data.tokenizer}{note}")


def _check_tokenizer(path: str, vocab_size: int, where: str) -> None:
  """The tokenizer's ids fit the checkpoint's vocabulary (a larger one indexes past the
  embedding, which JAX clamps without a word); the vocabulary is the checkpoint's to set."""
  try:
    pieces = sentencepiece.SentencePieceProcessor(model_file=path).get_piece_size()
  except (OSError, RuntimeError) as error:
    raise HFFormatError(f"data.tokenizer={path} cannot be read as a SentencePiece model "
                        f"({str(error).strip()})") from None
  if pieces > vocab_size:
    raise HFFormatError(f"data.tokenizer={path} has {pieces} pieces, more than {where}'s "
                        f"vocab_size {vocab_size}; use the checkpoint's own tokenizer (leave "
                        f"data.tokenizer empty) or one whose ids it knows")


def _tokenizer_file(directory: str) -> str:
  path = os.path.join(directory, TOKENIZER_FILE)
  if os.path.isfile(path):
    return path
  has_json = os.path.isfile(os.path.join(directory, "tokenizer.json"))
  raise HFFormatError(
      f"init.from_hf={directory} has no {TOKENIZER_FILE}"
      + (" (only tokenizer.json, a Hugging Face tokenizers file)" if has_json else "")
      + ": the data pipeline tokenizes with SentencePiece; set data.tokenizer to a SentencePiece"
        " model whose ids are the checkpoint's (LLaMA 1/2 ship one; LLaMA 3's tiktoken "
        "vocabulary has none)")


def tensor_files(directory: str) -> dict[str, str]:
  """Tensor name -> the safetensors file holding it (sharded checkpoints list them in an index)."""
  index_path = os.path.join(directory, INDEX_FILE)
  if os.path.isfile(index_path):
    try:
      with open(index_path) as f:
        weight_map = json.load(f)["weight_map"]
    except (OSError, json.JSONDecodeError, KeyError) as error:
      raise HFFormatError(f"{index_path}: cannot read its weight_map ({error})") from None
    return {name: os.path.join(directory, file) for name, file in weight_map.items()}
  single = os.path.join(directory, SINGLE_FILE)
  if os.path.isfile(single):
    try:
      with safe_open(single, framework="numpy") as f:
        return {name: single for name in f.keys()}
    except Exception as error:  # OSError, or safetensors' own SafetensorError for a bad header.
      raise HFFormatError(f"{single}: cannot read ({error})") from None
  raise HFFormatError(
      f"init.from_hf={directory} holds neither {SINGLE_FILE} nor {INDEX_FILE} (a "
      f"pytorch_model.bin checkpoint must be converted to safetensors first)")


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def check_tensors(directory: str, cfg: ModelConfig) -> None:
  """Every tensor `cfg` needs is in the checkpoint with the shape its config.json implies.

  Reads only the safetensors headers."""
  files = tensor_files(directory)
  expected = hf_shapes(cfg)
  for name in expected:
    if name not in files:
      raise HFFormatError(f"init.from_hf={directory}: tensor {name} is missing")
  # Layers past config.json's count would be dropped without a word (other extras, such as
  # the rotary inv_freq buffers of older exports, are not weights).
  layers = {int(match.group(1)) for match in map(_LAYER.match, files) if match}
  if layers and max(layers) >= cfg.num_layers:
    raise HFFormatError(f"init.from_hf={directory}: config.json has num_hidden_layers="
                        f"{cfg.num_layers}, but the checkpoint holds tensors of layer "
                        f"{max(layers)} (0-based); fix config.json")
  by_file: dict[str, list[str]] = {}
  for name in expected:
    by_file.setdefault(files[name], []).append(name)
  for path, names in by_file.items():
    try:
      with safe_open(path, framework="numpy") as f:
        present = set(f.keys())
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in names if name in present}
    except Exception as error:  # OSError, or safetensors' own SafetensorError for a bad header.
      raise HFFormatError(f"{path}: cannot read ({error})") from None
    for name in names:
      if name not in shapes:
        raise HFFormatError(f"{path}: tensor {name} is missing (the index names this file)")
      if shapes[name] != expected[name]:
        raise HFFormatError(f"{path}: tensor {name} has shape {shapes[name]}, but config.json "
                            f"implies {expected[name]}")


def load_params(directory: str, cfg: ModelConfig, abstract_params: Any,
                log: Callable[[str], None] = print) -> Any:
  """The checkpoint's weights as the model's parameters, each with its abstract leaf's dtype
  and sharding."""
  files = tensor_files(directory)

  def read(name: str) -> np.ndarray:
    # Opened per tensor: safetensors maps the file, and pages of a mapping held open count
    # as this process's memory until it is closed (a whole checkpoint, read to the end).
    with safe_open(files[name], framework="numpy") as f:
      return f.get_tensor(name)

  return _load_all(cfg, abstract_params, read, log)


def _load_all(cfg: ModelConfig, abstract_params: Any, read: Callable[[str], np.ndarray],
              log: Callable[[str], None]) -> Any:
  start = time.perf_counter()
  abstract = traverse_util.flatten_dict(abstract_params)
  params = {}
  names = tensor_names(cfg)
  for number, tensor in enumerate(names, 1):
    leaf = abstract[tensor.path]
    if tensor.layered:
      value = _load_layered(tensor.hf_names(cfg.num_layers), tensor.in_dims, leaf, read)
    else:
      value = jax.device_put(to_ours(read(tensor.hf_name), leaf.shape, tensor.in_dims)
                             .astype(leaf.dtype), leaf.sharding)
    params[tensor.path] = value
    log(f"  loaded {number}/{len(names)} {'/'.join(tensor.path)} {tuple(leaf.shape)} "
        f"({time.perf_counter() - start:.1f} s)")
  return traverse_util.unflatten_dict(params)


def _load_layered(hf_names: list[str], in_dims: int, leaf, read) -> jax.Array:
  sharding = leaf.sharding
  layer_sharding = NamedSharding(sharding.mesh, P(*sharding.spec[1:]))
  stack = jax.jit(lambda: jnp.zeros(leaf.shape, leaf.dtype), out_shardings=sharding)()
  set_layer = jax.jit(lambda stack, layer, i: stack.at[i].set(layer), donate_argnums=0,
                      out_shardings=sharding)
  for i, name in enumerate(hf_names):
    layer = jax.device_put(to_ours(read(name), leaf.shape[1:], in_dims).astype(leaf.dtype),
                           layer_sharding)
    stack = set_layer(stack, layer, i)
  return stack
