"""Import time and peak host memory of a Hugging Face checkpoint, through the trainer's import.

    python scripts/bench_hf_import.py [--dir /tmp/hf_tinyllama_1b] [--out results/hf_import.jsonl]

Makes (once) a checkpoint of TinyLlama-1.1B's shape (22 layers, d_model 2048, 32 heads, 4 K/V
heads, d_ff 5632, vocabulary 32000) with random bf16 weights in 23 safetensors shards. Then, in
a fresh process with 8 simulated CPU devices (fsdp 8), it runs what `--config.init.from_hf`
runs: `hf_import.apply_to_config` (config.json and every header) and `hf_import.load_params`.

On a CPU the devices' buffers live in host memory, so the bound checked is: the growth of the
process's peak resident memory during the load <= the bytes the devices hold afterwards + the
largest tensor as read (bf16) and converted (float32) + a stated margin. Prints a table and
appends a JSON line to the results file.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = dict(num_hidden_layers=22, hidden_size=2048, num_attention_heads=32,
             num_key_value_heads=4, intermediate_size=5632, vocab_size=32000)
MARGIN_BYTES = 256 << 20  # Allocator slack, XLA's executables, Python objects.


def make_checkpoint(directory: str) -> None:
  import ml_dtypes
  import numpy as np
  import sentencepiece
  from safetensors.numpy import save_file

  sys.path.insert(0, ROOT)
  from model.config import ModelConfig
  from model.hf_format import hf_shapes

  if os.path.isfile(os.path.join(directory, "model.safetensors.index.json")):
    return
  os.makedirs(directory, exist_ok=True)
  hf_config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
               "hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": 2048,
               "rope_theta": 10000.0, "tie_word_embeddings": False, **SHAPE}
  cfg = ModelConfig(num_layers=SHAPE["num_hidden_layers"], d_model=SHAPE["hidden_size"],
                    num_heads=SHAPE["num_attention_heads"],
                    num_kv_heads=SHAPE["num_key_value_heads"], d_ff=SHAPE["intermediate_size"],
                    vocab_size=SHAPE["vocab_size"])
  rng = np.random.default_rng(0)
  groups: dict[str, dict[str, tuple[int, ...]]] = {}
  for name, shape in hf_shapes(cfg).items():
    group = name.split(".")[2] if name.startswith("model.layers.") else "other"
    groups.setdefault(group, {})[name] = shape
  weight_map = {}
  for i, (group, shapes) in enumerate(groups.items()):
    file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
    tensors = {name: (rng.standard_normal(shape, np.float32) * 0.02).astype(ml_dtypes.bfloat16)
               for name, shape in shapes.items()}
    save_file(tensors, os.path.join(directory, file), metadata={"format": "pt"})
    weight_map.update({name: file for name in tensors})
    print(f"  wrote {file}", flush=True)
  with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {}, "weight_map": weight_map}, f)
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(hf_config, f, indent=2)
  text = [" ".join(f"w{(i * 7 + j) % 997}" for j in range(50)) for i in range(2000)]
  sentencepiece.SentencePieceTrainer.train(
      sentence_iterator=iter(text), model_prefix=os.path.join(directory, "tokenizer"),
      vocab_size=1000, model_type="bpe", minloglevel=2)


def measure(directory: str) -> dict:
  """Runs in its own process: the import path of `--config.init.from_hf`, timed."""
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
  os.environ["JAX_PLATFORMS"] = "cpu"
  sys.path.insert(0, ROOT)
  import flax.linen as nn
  import jax
  import numpy as np
  from safetensors import safe_open

  import parallelism
  from configs import base
  from model import Decoder
  from trainer.ckpt import hf_import
  from trainer.run import host_memory
  from trainer.core.training import model_config
  from trainer.core.optimizer import make_optimizer
  from trainer.core.state import abstract_state

  config = base.get_config()
  config.init.from_hf = directory
  config.mesh.fsdp, config.mesh.sequence = 8, 1
  start = time.perf_counter()
  hf_import.apply_to_config(config)
  check_s = time.perf_counter() - start
  mesh = parallelism.make_mesh(config.mesh)
  cfg = model_config(config)
  with jax.set_mesh(mesh), nn.logical_axis_rules(config.mesh.rules):
    state = abstract_state(Decoder(cfg), make_optimizer(config.train), mesh, config.mesh.rules)
    files = hf_import.tensor_files(directory)
    largest_read = 0
    for name, path in files.items():
      with safe_open(path, framework="numpy") as f:
        largest_read = max(largest_read, int(np.prod(f.get_slice(name).get_shape())))
    before = host_memory.resident_bytes()
    start = time.perf_counter()
    with host_memory.PeakMeter() as meter:
      params = hf_import.load_params(directory, cfg, state.params, log=lambda line: None)
      jax.block_until_ready(params)
    load_s = time.perf_counter() - start
    if meter.peak is None or before is None:
      raise RuntimeError("this bench reads /proc/self (Linux)")
    peak = meter.peak
  device_bytes = sum(shard.data.nbytes for leaf in jax.tree.leaves(params)
                     for shard in leaf.addressable_shards)
  one_tensor = largest_read * (2 + 4)  # bf16 as read, then its float32 copy.
  growth = peak - before
  return {"checkpoint": directory, "parameters": sum(x.size for x in jax.tree.leaves(params)),
          "devices": 8, "mesh": "fsdp=8", "check_s": round(check_s, 2),
          "load_s": round(load_s, 2), "peak_growth_bytes": growth,
          "device_bytes": device_bytes, "largest_tensor_bytes": one_tensor,
          "margin_bytes": MARGIN_BYTES,
          "within_bound": growth <= device_bytes + one_tensor + MARGIN_BYTES,
          "excess_over_devices_bytes": growth - device_bytes}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--dir", default="/tmp/hf_tinyllama_1b")
  parser.add_argument("--out", default=os.path.join(ROOT, "results", "hf_import.jsonl"))
  parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.measure:
    print(json.dumps(measure(args.dir)))
    return
  make_checkpoint(args.dir)
  result = subprocess.run([sys.executable, __file__, "--measure", "--dir", args.dir],
                          capture_output=True, text=True, check=True)
  row = json.loads(result.stdout.strip().splitlines()[-1])
  row["date"] = time.strftime("%Y-%m-%d")
  row["command"] = "python scripts/bench_hf_import.py"
  gib = lambda b: f"{b / 2**30:.2f} GiB"
  print(f"{'parameters':28s} {row['parameters']:,}")
  print(f"{'header check (s)':28s} {row['check_s']}")
  print(f"{'load onto 8 devices (s)':28s} {row['load_s']}")
  print(f"{'devices hold':28s} {gib(row['device_bytes'])}")
  print(f"{'peak host growth':28s} {gib(row['peak_growth_bytes'])}")
  print(f"{'  of which beyond devices':28s} {gib(row['excess_over_devices_bytes'])}")
  print(f"{'largest tensor (bf16+f32)':28s} {gib(row['largest_tensor_bytes'])}")
  print(f"{'bound (+ margin)':28s} {gib(row['device_bytes'] + row['largest_tensor_bytes'] + MARGIN_BYTES)}"
        f"  {'holds' if row['within_bound'] else 'EXCEEDED'}")
  with open(args.out, "a") as f:
    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
  main()
