"""Tiles SparseK's kernel computes on a trained model's own scores (issue #38).

  python scripts/sparsek_tiles.py --workdir runs/sparsek --step 100 --tile 32

Loads the step's parameters, runs the model's dense path on one batch of the eval split and
keeps each layer's scores (a `jax.debug.callback` around `model.attention._sparsek_operands`),
then per layer counts the (query head, query tile, key tile) pairs the kernel computes
(`parallelism.kernel_sparsek.computed_tiles`, the whole row as one block) against the same
with every mask 1 (causal within documents). Prints one line per layer.
"""

import os
import sys

if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

import data  # noqa: E402
import model.attention as attention_module  # noqa: E402
from model import Decoder  # noqa: E402
from model.sparsek import prefix_thresholds  # noqa: E402
from parallelism import kernel_sparsek  # noqa: E402
from parallelism.masks import Mask  # noqa: E402
from trainer.core.training import data_config, model_config  # noqa: E402


def params_of(workdir: str, step: int) -> dict:
  """The step's parameters on one device (Orbax, by the checkpoint's own metadata)."""
  checkpointer, path = ocp.PyTreeCheckpointer(), f"{workdir}/checkpoints/{step}/state"
  meta = checkpointer.metadata(path)
  meta = getattr(getattr(meta, "item_metadata", meta), "tree", meta)
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  args = jax.tree.map(lambda _: ocp.ArrayRestoreArgs(sharding=one), meta)
  return {"params": checkpointer.restore(path, restore_args=args)["params"]}


def layer_scores(cfg, params, tokens, positions, seg) -> list[np.ndarray]:
  """Each layer's SparseK scores [B, S, Hkv] as the model computes them."""
  kept, original = [], attention_module._sparsek_operands  # pylint: disable=protected-access

  def keep(cfg_, u_BSK, seg_BS):
    jax.debug.callback(lambda u: kept.append(np.asarray(u)), u_BSK)
    return original(cfg_, u_BSK, seg_BS)

  attention_module._sparsek_operands = keep  # pylint: disable=protected-access
  try:
    jax.block_until_ready(Decoder(cfg).apply(params, tokens, positions, seg))
    jax.effects_barrier()
  finally:
    attention_module._sparsek_operands = original  # pylint: disable=protected-access
  return kept


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--step", type=int, default=100)
  parser.add_argument("--tile", type=int, default=32)
  args = parser.parse_args()
  config = ml_collections.ConfigDict(json.load(open(f"{args.workdir}/config.json")))
  cfg = dataclasses.replace(model_config(config), attention="dense")
  batch = next(iter(data.make_iterator(data_config(config), config.data.eval_split,
                                       config.train.batch_size)))
  tokens, positions, seg = (jnp.asarray(batch[k]) for k in ("tokens", "positions",
                                                           "segment_ids"))
  index = np.arange(tokens.shape[1], dtype=np.int32)
  for layer, u in enumerate(layer_scores(cfg, params_of(args.workdir, args.step), tokens,
                                         positions, seg)):
    tau = prefix_thresholds(jnp.asarray(u), seg, cfg.sparsek_k, cfg.sparsek_window)
    tau = jnp.repeat(tau, cfg.num_heads // cfg.num_kv_heads, axis=2)
    count = lambda tau, u=u: int(kernel_sparsek.computed_tiles(
        Mask.of(cfg.mask_spec("G"), seg, scores=(tau, u)), index, index, args.tile))
    computed, every = count(tau), count(jnp.full_like(tau, -jnp.inf))
    print(f"layer {layer}: {computed} of {every} tiles ({computed / every:.3f}) of causal "
          f"attention within documents; scores' std {float(np.std(u)):.2f}")


if __name__ == "__main__":
  main()
