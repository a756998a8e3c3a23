"""The model's frozen, typed configuration: ConfigDict stops at the trainer."""

from __future__ import annotations

import dataclasses

import parallelism
from model import spans as span_plans
from model.rope import RopeScaling

ATTENTIONS = ("dense", "ring", "striped", "zigzag")
# Run-time sparse attention (issue #38): hash (model/hashing.py), qk_drop (model/dropping.py),
# sparsek (model/sparsek.py).
SPARSE = parallelism.masks.SPARSE


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
  head_spans: str = ""  # A plan of per-(layer, head) spans (model/spans.py); "": none.
  sink_tokens: int = 0  # Local layers also see the first k positions of each document.
  sparse: str = "none"  # "hash": a query sees only keys of its bucket; "qk_drop": kept ones.
  hash_buckets: int = 0  # Buckets of hash attention (even, 2 to 2 x head size); 0 without it.
  qk_drop_rate: float = 0.0  # Share of queries and keys QK-dropping drops; 0 without it.
  sparsek_k: int = 0  # Keys SparseK's soft top-k mask keeps per query; 0 without it.
  sparsek_window: int = 0  # Keys up to itself a SparseK query always sees; 0: none.
  span_length: int = 0  # The row length the plan resolves at (data.seq_len; the trainer's).
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
    # The span plan is read once, here (a ValueError says what is wrong with it, when asked).
    object.__setattr__(self, "_spans", ())
    if self.head_spans and self.span_length >= 1:
      try:
        plan = span_plans.resolve(self.head_spans, self.num_layers, self.num_heads,
                                  self.span_length)
      except ValueError as error:
        plan = error
      object.__setattr__(self, "_spans", plan)

  @property
  def head_size(self) -> int:
    return self.head_dim or self.d_model // self.num_heads

  @property
  def layout(self) -> str:
    return layout_of(self.attention)

  @property
  def layer_kinds(self) -> str:
    """LOCAL or GLOBAL for each layer: `layer_pattern` repeated over the layers, or every
    layer local when only `window` is set (Mistral), global when neither is. With a span
    plan, a layer is local when one of its heads sees fewer keys than the row."""
    if self.head_spans:
      return "".join(LOCAL if min(row) < self.span_length else GLOBAL for row in self.spans)
    pattern = self.layer_pattern or (LOCAL if self.window else GLOBAL)
    return "".join(pattern[i % len(pattern)] for i in range(self.num_layers))

  @property
  def spans(self) -> tuple[tuple[int, ...], ...]:
    """Per-(layer, query head) spans of the plan at `span_length` (model/spans.py); ()."""
    if not self.head_spans:
      return ()
    if self.span_length < 1:
      raise ValueError(f"model.head_spans='{self.head_spans}' needs the row length it "
                       f"resolves at (data.seq_len)")
    if isinstance(self._spans, ValueError):
      raise self._spans
    return self._spans

  def _local_spans(self) -> list[int]:
    return [s for row in self.spans if min(row) < self.span_length for s in row]

  def window_of(self, kind: str) -> int | None:
    """The attention window of a layer of this kind (None: causal over the whole row); with
    per-head spans the widest of any local layer's head (what the schedule skips by)."""
    if kind != LOCAL:
      return None
    return max(self._local_spans()) if self.head_spans else self.window

  @property
  def narrowest_span(self) -> int | None:
    """With per-head spans that differ, the narrowest of any local layer's head (what the
    schedule computes without a mask by); else None (one window per local layer)."""
    local = self._local_spans()
    return min(local) if local and min(local) < max(local) else None

  def pattern_problem(self) -> str:
    """What makes the window and layer pattern unusable, naming the field; empty if fine."""
    if self.head_spans:
      if self.window or self.layer_pattern:
        return (f"model.head_spans='{self.head_spans}' gives every layer's spans: leave "
                f"model.window at 0 and model.layer_pattern empty")
      try:
        self.spans  # pylint: disable=pointless-statement
      except ValueError as error:
        return str(error)
    if self.window < 0:
      return f"model.window={self.window} must be >= 0 (0: no local layers)"
    if set(self.layer_pattern) - {LOCAL, GLOBAL}:
      return (f"model.layer_pattern='{self.layer_pattern}' must be letters {LOCAL} (local) "
              f"and {GLOBAL} (global), e.g. 'LLLLLG' for five local layers per global one")
    if LOCAL in self.layer_kinds and not self.window and not self.head_spans:
      return (f"model.layer_pattern='{self.layer_pattern}' has local layers: set "
              f"model.window to the keys they see")
    if self.window and LOCAL not in self.layer_kinds:
      return (f"model.window={self.window} is set but model.layer_pattern="
              f"'{self.layer_pattern}' over {self.num_layers} layers has no local layer (L)")
    if self.local_rope_theta < 0:
      return f"model.local_rope_theta={self.local_rope_theta} must be >= 0 (0: the global RoPE)"
    if self.sink_tokens < 0:
      return f"model.sink_tokens={self.sink_tokens} must be >= 0 (0: none)"
    if self.sink_tokens and LOCAL not in self.layer_kinds:
      return (f"model.sink_tokens={self.sink_tokens} needs local layers (model.window or "
              f"model.head_spans): a global layer already sees every earlier key")
    # Reformer's and SCFA's R is a random rotation: b/2 directions of a head's space at most.
    # So the fixed projections and the projected q and k are never larger than q and k.
    if self.sparse == "hash" and self.hash_buckets > 2 * self.head_size:
      return (f"model.hash_buckets={self.hash_buckets} must be at most twice the head size, "
              f"{2 * self.head_size} (argmax over [xR, -xR] of b/2 directions in head size "
              f"dimensions)")
    for kind in dict.fromkeys(self.layer_kinds):  # every rule of masks: one function
      problem = parallelism.masks.problem(self.mask_spec(kind), self._mask_names)
      if problem:
        return problem
    return ""

  @property
  def _mask_names(self) -> dict[str, str]:
    """The config fields a mask spec's fields come from (`parallelism.masks.problem`)."""
    names = {name: f"model.{name}" for name in parallelism.masks.FIELDS}
    names.update(softcap="model.attention_softcap", narrowest="model.head_spans")
    if self.head_spans:
      names["window"] = "model.head_spans"
    return names

  def mask_spec(self, kind: str) -> parallelism.MaskSpec:
    """What a layer of this kind may see (`parallelism.masks`): its window or per-head
    spans' bounds and sinks when local, the soft cap and the run-time mask."""
    local = kind == LOCAL
    return parallelism.MaskSpec(
        window=self.window_of(kind), narrowest=self.narrowest_span if local else None,
        sink_tokens=self.sink_tokens if local else 0, softcap=self.attention_softcap,
        sparse=self.sparse, hash_buckets=self.hash_buckets, qk_drop_rate=self.qk_drop_rate,
        sparsek_k=self.sparsek_k, sparsek_window=self.sparsek_window)

  @property
  def hashed(self) -> bool:
    """Whether attention is hash attention (bucket codes mask every layer)."""
    return self.sparse == "hash"

  @property
  def dropped(self) -> bool:
    """Whether attention is QK-dropping (kept/dropped codes mask every layer)."""
    return self.sparse == "qk_drop"

  @property
  def selects(self) -> bool:
    """Whether attention is SparseK (a learned soft top-k mask scores every layer's keys)."""
    return self.sparse == "sparsek"

  @property
  def coded(self) -> bool:
    """Whether run-time codes (hash buckets or kept flags) mask every layer's attention."""
    return self.sparse != "none"

  def matmul_params(self) -> int:
    """Parameters that take part in a matmul per token (all but the embedding lookup)."""
    attention = self.d_model * self.head_size * (2 * self.num_heads + 2 * self.num_kv_heads)
    attention += self.d_model * self.num_kv_heads if self.selects else 0  # SparseK's scorer
    mlp = 3 * self.d_model * self.d_ff
    return self.num_layers * (attention + mlp) + self.d_model * self.vocab_size
