"""Model FLOPs per token, the accelerator's peak, and MFU.

FLOPs per trained token = 6 * N_matmul + 6 * L * H_q * D_head * S, where N_matmul counts the
parameters used in a matmul per token (all but the embedding lookup, the output projection
included) and the second term is attention: QK^T and PV cost 2 * 2 * S * H_q * D_head
forward per token and layer, x3 for forward plus backward = 12 * L * H_q * D_head * S for
full attention, halved because a causal mask skips half of it; a local layer of window w < S
counts the keys its queries see, w (w + 1) / 2 + (S - w) w over S, plus the sink tokens
beyond its window (`model.sink_tokens`, up to k per query). Remat recomputation is not
counted (it is hardware FLOPs, not model FLOPs), so MFU does not rise when remat is on.

MFU = FLOPs per token * tokens per second / (devices * peak FLOP/s of one device).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # Only for annotations: the GPU benchmark imports this without
  # ml_collections, and the train command's flags (trainer/plan/command.py) before JAX.
  import ml_collections

  from model import ModelConfig

# Dense bf16 peak FLOP/s of one device (chip), from the vendors' spec sheets (no sparsity).
PEAK_FLOPS = {
    "h100": 989e12,  # H100 SXM.
    "h100_pcie": 756e12,
    "h200": 989e12,  # Same tensor cores as H100 SXM; more and faster memory.
    "a100": 312e12,
    "tpu_v4": 275e12,
    "tpu_v5e": 197e12,
    "tpu_v5p": 459e12,
    "tpu_v6e": 918e12,
}
# The links a GPU ring runs over, bytes/s per direction from each GPU: a node's NVLink (an
# H100's or H200's, through its NVSwitch) and a 400 Gb/s link between nodes (one InfiniBand
# NIC per GPU); and the GPUs of a node (HGX). What the planner's link lines, the strategy
# table's defaults and the GPU check's ring emulation assume.
LINK_BYTES_PER_S = {"nvlink": 450e9, "ib_400g": 50e9}
GPUS_PER_NODE = 8

# A TPU by kind (`v5p`, `tpu_v5p`) or slice, as Cloud TPU names one (`v5p-16`).
TPU_NAME = re.compile(r"^(?:tpu_)?(v4|v5e|v5p|v6e)(?:-(\d+))?$")


def accelerator_key(name: str) -> str | None:
  """The PEAK_FLOPS key of an accelerator's name (a GPU's key, a TPU kind or slice), or
  None for a name it knows no peak of."""
  tpu = TPU_NAME.match(name)
  if tpu:
    return f"tpu_{tpu.group(1)}"
  return name if name in PEAK_FLOPS else None


def accelerator_problem(name: str) -> str | None:
  """The one line for an accelerator name `accelerator_key` does not know, or None."""
  if accelerator_key(name):
    return None
  gpus = ", ".join(key for key in PEAK_FLOPS if not key.startswith("tpu_"))
  return (f"--plan_accelerator={name!r} is not one of {gpus}, or a TPU kind (v4, v5e, v5p, "
          f"v6e) or slice (v5p-16)")


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
  sinks = cfg.sink_tokens
  if cfg.head_spans:  # Per-head spans: each head counts the keys it sees.
    keys = sum(sum(_keys_per_query(span, seq_len, sinks) for span in row) / len(row)
               for row in cfg.spans)
  else:
    keys = sum(_keys_per_query(cfg.window_of(kind), seq_len, sinks) for kind in cfg.layer_kinds)
  return 6 * cfg.matmul_params() + 12 * cfg.num_heads * cfg.head_size * keys


def _keys_per_query(window: int | None, seq_len: int, sinks: int = 0) -> float:
  """Keys a query sees on average in a row of one document, as the FLOPs count them (causal:
  half the row); with a window, also the first `sinks` keys beyond it (the query m tokens
  past its window's first sees min(sinks, m) of them)."""
  if window is None or window >= seq_len:
    return seq_len / 2
  beyond = seq_len - window  # Queries with keys beyond their window: m = 1 .. beyond.
  few = min(sinks, beyond)
  sink_keys = few * (few + 1) / 2 + (beyond - few) * sinks
  return (window * (window + 1) / 2 + beyond * window + sink_keys) / seq_len


def accelerator_name(device_kind: str) -> str | None:
  """Best guess of the PEAK_FLOPS key from a JAX device kind ('NVIDIA H100 80GB HBM3').

  JAX names a v5e chip 'TPU v5 lite', a v5p chip 'TPU v5' (or 'TPU v5p'), a v6e 'TPU v6 lite'.
  """
  kind = device_kind.lower().replace(" ", "")
  for name, needle in (("h200", "h200"), ("h100_pcie", "h100pcie"), ("h100", "h100"),
                       ("a100", "a100"), ("tpu_v6e", "v6lite"), ("tpu_v6e", "v6e"),
                       ("tpu_v5p", "v5p"), ("tpu_v5e", "v5lite"),
                       ("tpu_v5e", "v5e"), ("tpu_v5p", "tpuv5"), ("tpu_v4", "v4")):
    if needle in kind:
      return name
  return None


def peak_flops(config: ml_collections.ConfigDict, device_kind: str) -> float | None:
  """Peak FLOP/s of one device: the config's number, else its named table entry, else a guess.

  Returns None (so MFU is not reported) when nothing names a known accelerator, e.g. on CPU.
  A misspelt `config.accelerator` is an error rather than a silently missing MFU.
  """
  number = float(config.get("peak_flops_per_device", 0.0) or 0.0)
  if number < 0:
    raise ValueError(f"config.peak_flops_per_device={number} must be >= 0 (0 uses the table)")
  if number:
    return number
  name = (config.get("accelerator", "") or "").lower()
  if name:
    if name not in PEAK_FLOPS:
      raise ValueError(f"config.accelerator={name!r} is not one of {', '.join(PEAK_FLOPS)}; "
                       f"name one or set config.peak_flops_per_device")
    return PEAK_FLOPS[name]
  guess = accelerator_name(device_kind)
  return PEAK_FLOPS[guess] if guess else None


def mfu(flops_token: float, tokens_per_sec: float, num_devices: int,
        peak_flops: float | None) -> float | None:
  if not peak_flops:
    return None
  return flops_token * tokens_per_sec / (num_devices * peak_flops)
