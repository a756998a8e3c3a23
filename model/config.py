"""The model's frozen, typed configuration: ConfigDict stops at the trainer."""

from __future__ import annotations

import dataclasses

import parallelism
from model.rope import RopeScaling

ATTENTIONS = ("dense", "ring", "striped", "zigzag")


def layout_of(attention: str) -> str:
  """The sequence layout the data must arrive in: dense attention reads the original order."""
  return "ring" if attention == "dense" else attention


def named_strategy(attention: str, sequence_parallel: str) -> str | None:
  """The sequence-parallel strategy worth naming beside the layout (run names, plans): None
  for dense attention, which splits nothing, and for the default ring."""
  return None if attention == "dense" or sequence_parallel == "ring" else sequence_parallel
KERNELS = (parallelism.AUTO_KERNEL, *parallelism.KERNELS)
REMAT_POLICIES = ("none", "full", "save_dots", "save_attention", "offload")
LOCAL, GLOBAL = "L", "G"  # The letters of `ModelConfig.layer_pattern`.


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A LLaMA-style decoder. Field meanings are documented in configs/base.py."""

  num_layers: int
  d_model: int
  num_heads: int
  num_kv_heads: int
  d_ff: int
  vocab_size: int
  head_dim: int = 0
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling = RopeScaling()
  window: int = 0  # Keys a local layer's query sees, itself included; 0: no local layers.
  layer_pattern: str = ""  # L (local) and G (global) per layer, repeated; "": all alike.
  local_rope_theta: float = 0.0  # RoPE base of local layers (unscaled); 0: the global RoPE.
  attention_softcap: float = 0.0  # Logits capped at c * tanh(logit / c) (Gemma 2); 0: none.
  norm_eps: float = 1e-5
  tie_embeddings: bool = False
  init_std: float = 0.02
  attention: str = "dense"
  sequence_parallel: str = "ring"  # parallelism/strategies.py
  kernel: str = "auto"
  attention_tile: int = 512
  dtype: str = "bfloat16"
  param_dtype: str = "float32"
  remat: str = "none"
  loss_chunk: int = 2048  # Tokens per device whose logits the loss computes at once.

  def __post_init__(self):
    # `config.model.to_dict()` hands the nested block over as a dict; unknown keys fail here.
    if isinstance(self.rope_scaling, dict):
      object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))

  @property
  def head_size(self) -> int:
    return self.head_dim or self.d_model // self.num_heads

  @property
  def layout(self) -> str:
    return layout_of(self.attention)

  @property
  def layer_kinds(self) -> str:
    """LOCAL or GLOBAL for each layer: `layer_pattern` repeated over the layers, or every
    layer local when only `window` is set (Mistral), global when neither is."""
    pattern = self.layer_pattern or (LOCAL if self.window else GLOBAL)
    return "".join(pattern[i % len(pattern)] for i in range(self.num_layers))

  def window_of(self, kind: str) -> int | None:
    """The attention window of a layer of this kind (None: causal over the whole row)."""
    return self.window if kind == LOCAL else None

  def pattern_problem(self) -> str:
    """What makes the window and layer pattern unusable, naming the field; empty if fine."""
    if self.window < 0:
      return f"model.window={self.window} must be >= 0 (0: no local layers)"
    if set(self.layer_pattern) - {LOCAL, GLOBAL}:
      return (f"model.layer_pattern='{self.layer_pattern}' must be letters {LOCAL} (local) "
              f"and {GLOBAL} (global), e.g. 'LLLLLG' for five local layers per global one")
    if LOCAL in self.layer_kinds and not self.window:
      return (f"model.layer_pattern='{self.layer_pattern}' has local layers: set "
              f"model.window to the keys they see")
    if self.window and LOCAL not in self.layer_kinds:
      return (f"model.window={self.window} is set but model.layer_pattern="
              f"'{self.layer_pattern}' over {self.num_layers} layers has no local layer (L)")
    if self.local_rope_theta < 0:
      return f"model.local_rope_theta={self.local_rope_theta} must be >= 0 (0: the global RoPE)"
    if self.attention_softcap < 0:
      return f"model.attention_softcap={self.attention_softcap} must be >= 0 (0: no cap)"
    return ""

  def matmul_params(self) -> int:
    """Parameters that take part in a matmul per token (all but the embedding lookup)."""
    attention = self.d_model * self.head_size * (2 * self.num_heads + 2 * self.num_kv_heads)
    mlp = 3 * self.d_model * self.d_ff
    return self.num_layers * (attention + mlp) + self.d_model * self.vocab_size
