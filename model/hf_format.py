"""The Hugging Face LLaMA format: its config.json fields and tensor names, to and from ours.

Mistral checkpoints are LLaMA's tensors with a `sliding_window` in config.json: every layer
local, a query seeing the `sliding_window` keys up to itself (`ModelConfig.window`, the same
number). A local:global pattern has no form here, so it does not export.

Pure mappings (no files, no devices), shared by the import (trainer/ckpt/hf_import.py) and the
export (trainer/tools/hf_export.py). No q/k permutation is needed: `transformers` rotates halves
(x[i], x[i + D/2]) and so does model/rope.py; only Meta's original interleaved checkpoints
differ, and `transformers`' own conversion has already permuted those.

A Hugging Face linear layer stores its weight as (out, in); ours are einsum kernels (in..., out...)
with the layers of the scanned stack on a leading axis.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from model.config import ModelConfig
from model.rope import ROPE_TYPES, RopeScaling

MODEL_TYPES = ("llama", "mistral")


class HFFormatError(ValueError):
  """A checkpoint this trainer cannot read exactly; the message names the field or tensor."""


@dataclasses.dataclass(frozen=True)
class TensorName:
  """One of our parameters and the Hugging Face tensor(s) it is stored as."""

  path: tuple[str, ...]  # Our parameter path, e.g. ("blocks", "attention", "query", "kernel").
  hf_name: str  # "model.layers.{layer}...." for the stacked blocks.
  in_dims: int  # Leading dims of our per-layer kernel that are HF's input (columns); 0: no transpose.

  @property
  def layered(self) -> bool:
    return "{layer}" in self.hf_name

  def hf_names(self, num_layers: int) -> list[str]:
    return ([self.hf_name.format(layer=i) for i in range(num_layers)] if self.layered
            else [self.hf_name])


_BLOCK = "model.layers.{layer}."
TENSOR_NAMES = (
    TensorName(("embedding",), "model.embed_tokens.weight", 0),
    TensorName(("blocks", "attention", "query", "kernel"), _BLOCK + "self_attn.q_proj.weight", 1),
    TensorName(("blocks", "attention", "key", "kernel"), _BLOCK + "self_attn.k_proj.weight", 1),
    TensorName(("blocks", "attention", "value", "kernel"), _BLOCK + "self_attn.v_proj.weight", 1),
    TensorName(("blocks", "attention", "out", "kernel"), _BLOCK + "self_attn.o_proj.weight", 2),
    TensorName(("blocks", "attention_norm", "scale"), _BLOCK + "input_layernorm.weight", 0),
    TensorName(("blocks", "mlp", "gate", "kernel"), _BLOCK + "mlp.gate_proj.weight", 1),
    TensorName(("blocks", "mlp", "up", "kernel"), _BLOCK + "mlp.up_proj.weight", 1),
    TensorName(("blocks", "mlp", "down", "kernel"), _BLOCK + "mlp.down_proj.weight", 1),
    TensorName(("blocks", "mlp_norm", "scale"), _BLOCK + "post_attention_layernorm.weight", 0),
    TensorName(("final_norm", "scale"), "model.norm.weight", 0),
    TensorName(("lm_head", "kernel"), "lm_head.weight", 1),
)


def tensor_names(cfg: ModelConfig) -> tuple[TensorName, ...]:
  """The tensors of this model (a tied model has no lm_head)."""
  return tuple(t for t in TENSOR_NAMES if not (cfg.tie_embeddings and t.path[0] == "lm_head"))


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  """Every tensor a checkpoint of this config must hold, with the shape config.json implies."""
  e, q, kv, f, v = (cfg.d_model, cfg.num_heads * cfg.head_size, cfg.num_kv_heads * cfg.head_size,
                    cfg.d_ff, cfg.vocab_size)
  per_name = {
      "model.embed_tokens.weight": (v, e), _BLOCK + "self_attn.q_proj.weight": (q, e),
      _BLOCK + "self_attn.k_proj.weight": (kv, e), _BLOCK + "self_attn.v_proj.weight": (kv, e),
      _BLOCK + "self_attn.o_proj.weight": (e, q), _BLOCK + "input_layernorm.weight": (e,),
      _BLOCK + "mlp.gate_proj.weight": (f, e), _BLOCK + "mlp.up_proj.weight": (f, e),
      _BLOCK + "mlp.down_proj.weight": (e, f), _BLOCK + "post_attention_layernorm.weight": (e,),
      "model.norm.weight": (e,), "lm_head.weight": (v, e)}
  return {name: per_name[t.hf_name] for t in tensor_names(cfg)
          for name in t.hf_names(cfg.num_layers)}


def to_ours(hf_tensor: np.ndarray, ours_layer_shape: tuple[int, ...], in_dims: int) -> np.ndarray:
  """One layer of a parameter from its HF tensor."""
  return (hf_tensor.T if in_dims else hf_tensor).reshape(ours_layer_shape)


def to_hf(ours_layer: np.ndarray, in_dims: int) -> np.ndarray:
  """One layer's HF tensor from our parameter (the inverse of `to_ours`)."""
  if not in_dims:
    return ours_layer
  inputs = int(np.prod(ours_layer.shape[:in_dims]))
  return np.ascontiguousarray(ours_layer.reshape(inputs, -1).T)


def model_fields(hf_config: dict[str, Any], source: str) -> dict[str, Any]:
  """`config.model` fields (architecture and RoPE) that reproduce a HF LLaMA config.json.

  Raises HFFormatError naming the field when the checkpoint is not one this model computes
  exactly (another architecture, biases, another activation, a RoPE type we lack).
  """

  def require(condition: bool, message: str) -> None:
    if not condition:
      raise HFFormatError(f"{source}: {message}")

  model_type = hf_config.get("model_type")
  require(model_type in MODEL_TYPES,
          f"model_type={model_type!r} is not a LLaMA-family checkpoint (supported: "
          f"{', '.join(MODEL_TYPES)})")
  require(hf_config.get("hidden_act", "silu") == "silu",
          f"hidden_act={hf_config.get('hidden_act')!r}; the model's MLP is SwiGLU (silu)")
  for bias in ("attention_bias", "mlp_bias"):
    require(not hf_config.get(bias, False), f"{bias}=true; the model has no biases")
  require(hf_config.get("partial_rotary_factor", 1.0) == 1.0,
          f"partial_rotary_factor={hf_config.get('partial_rotary_factor')}; the model rotates "
          f"every dimension")
  for field in ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size",
                "vocab_size"):
    require(isinstance(hf_config.get(field), int) and hf_config[field] > 0,
            f"{field}={hf_config.get(field)!r} must be a positive integer")
  window = hf_config.get("sliding_window") if model_type == "mistral" else None
  require(window is None or (isinstance(window, int) and window > 0),
          f"sliding_window={window!r} must be a positive integer or null")
  heads = hf_config["num_attention_heads"]
  kv_heads = hf_config.get("num_key_value_heads") or heads
  head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // heads
  theta, scaling = _rope(hf_config, require)
  return {
      "num_layers": hf_config["num_hidden_layers"],
      "d_model": hf_config["hidden_size"],
      "num_heads": heads,
      "num_kv_heads": kv_heads,
      "head_dim": head_dim,
      "d_ff": hf_config["intermediate_size"],
      "vocab_size": hf_config["vocab_size"],
      "rope_theta": float(theta),
      "rope_scaling": dataclasses.asdict(scaling),
      "norm_eps": float(hf_config.get("rms_norm_eps", 1e-6)),
      "tie_embeddings": bool(hf_config.get("tie_word_embeddings", False)),
      "window": window or 0,
      "layer_pattern": "",
      "local_rope_theta": 0.0,
  }


def _rope(hf_config: dict[str, Any], require) -> tuple[float, RopeScaling]:
  """RoPE from either form: `rope_parameters` (transformers >= 4.56) or the older top-level
  `rope_theta` + `rope_scaling` (None for plain RoPE)."""
  params = dict(hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {})
  theta = params.get("rope_theta", hf_config.get("rope_theta", 10000.0))
  rope_type = params.get("rope_type", params.get("type", "default"))
  require(rope_type in ROPE_TYPES,
          f"rope type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
  for unsupported in ("mscale", "mscale_all_dim"):
    require(not params.get(unsupported), f"rope {unsupported}={params.get(unsupported)} is not "
                                         f"supported")
  original = params.get("original_max_position_embeddings",
                        hf_config.get("max_position_embeddings", 0))
  defaults = RopeScaling()
  scaling = RopeScaling(
      type=rope_type,
      factor=float(params.get("factor", 1.0) or 1.0),
      original_max_len=int(original) if rope_type in ("llama3", "yarn") else 0,
      low_freq_factor=float(params.get("low_freq_factor", defaults.low_freq_factor)),
      high_freq_factor=float(params.get("high_freq_factor", defaults.high_freq_factor)),
      beta_fast=float(params.get("beta_fast") or defaults.beta_fast),
      beta_slow=float(params.get("beta_slow") or defaults.beta_slow),
      attention_factor=float(params.get("attention_factor") or 0.0),
      truncate=bool(params.get("truncate", True)))
  require(not scaling.problem(), scaling.problem())
  return theta, scaling


def export_problem(cfg: ModelConfig) -> str:
  """Why `cfg` has no LLaMA or Mistral config.json; empty when it has one."""
  # (field = value as the config has it, what it is): the options no config.json can hold.
  unexportable = [
      (cfg.head_spans and f"model.head_spans='{cfg.head_spans}'", "per-head spans have"),
      (cfg.attention_softcap and f"model.attention_softcap={cfg.attention_softcap:g}",
       "capped attention logits have"),
      (cfg.sink_tokens and f"model.sink_tokens={cfg.sink_tokens}", "sink tokens have"),
      (cfg.coded and f"model.sparse='{cfg.sparse}'", "run-time sparse attention has")]
  for setting, what in unexportable:
    if setting:
      return f"{setting}: {what} no LLaMA or Mistral config.json"
  if set(cfg.layer_kinds) == {"L", "G"} or (cfg.window and cfg.local_rope_theta):
    return (f"model.layer_pattern='{cfg.layer_pattern}' and model.local_rope_theta="
            f"{cfg.local_rope_theta:g}: a model with local and global layers (or local layers "
            f"with their own RoPE) has no LLaMA or Mistral config.json; only every layer local "
            f"(Mistral's sliding_window) or every layer global (LLaMA) exports")
  return ""


def hf_config_of(cfg: ModelConfig, max_position_embeddings: int, bos_id: int, eos_id: int,
                 dtype: str) -> dict[str, Any]:
  """The config.json `transformers` reads back into the same model (current form): Mistral's
  when every layer is local, else LLaMA's. `export_problem` says when there is none."""
  if export_problem(cfg):
    raise HFFormatError(export_problem(cfg))
  s = cfg.rope_scaling
  rope: dict[str, Any] = {"rope_type": s.type, "rope_theta": cfg.rope_theta}
  if s.type != "default":
    rope["factor"] = s.factor
  if s.type == "llama3":
    rope.update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor,
                original_max_position_embeddings=s.original_max_len)
  if s.type == "yarn":
    rope.update(beta_fast=s.beta_fast, beta_slow=s.beta_slow, truncate=s.truncate,
                original_max_position_embeddings=s.original_max_len)
    if s.attention_factor:
      rope["attention_factor"] = s.attention_factor
  family = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
  if cfg.window:
    family = {"architectures": ["MistralForCausalLM"], "model_type": "mistral",
              "sliding_window": cfg.window}
  return {
      **family,
      "hidden_act": "silu",
      "attention_bias": False,
      "mlp_bias": False,
      "num_hidden_layers": cfg.num_layers,
      "hidden_size": cfg.d_model,
      "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads,
      "head_dim": cfg.head_size,
      "intermediate_size": cfg.d_ff,
      "vocab_size": cfg.vocab_size,
      "rms_norm_eps": cfg.norm_eps,
      "tie_word_embeddings": cfg.tie_embeddings,
      # YaRN defines its context as original x factor (`transformers` warns at any other).
      "max_position_embeddings": (round(s.original_max_len * s.factor) if s.type == "yarn"
                                  else max_position_embeddings),
      "rope_parameters": rope,
      "bos_token_id": bos_id,
      "eos_token_id": eos_id,
      "dtype": dtype,
  }
