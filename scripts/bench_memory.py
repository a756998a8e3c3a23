"""Per-device peak memory of the compiled train step against sequence length (compile only).

  python scripts/bench_memory.py                      # 8k..128k, appends results/bench_memory.jsonl
  python scripts/bench_memory.py --remat none,full --seq_lens 8192,16384
  python scripts/bench_memory.py --loss_chunking      # the loss in chunks against whole logits

The tiny model of configs/tiny_cpu.py with `striped` attention, on 8 fake CPU devices as
one ring (mesh sequence=8, batch 1 row: the smallest that shards), compiled ahead of time
from abstract shapes by the dry-run planner (`trainer.plan.dry_run.compile_step`, the trainer's
own jit). Peak = XLA memory analysis args + temps + outputs - aliased, per device. With
`--gpu h100` the same step is compiled for 8 described H100s by XLA's GPU compiler instead
(`trainer/plan/plan_target.py`, `make plan_gpu`): the GPU's own buffer assignment.

With ring attention nothing should grow faster than the tokens a device holds: activations
and K/V blocks are O(S / N), attention scratch is per tile, the loss's logits per chunk.
Target: 2x tokens -> at most 2.1x bytes. Default remat `full` (what the long-context configs use, and the policy whose
activations are the smallest, so a non-linear term shows most clearly). Each record names
the commit it measured, so runs before and after a change sit side by side in the file.

`--loss_chunking` checks what chunking the loss saves where the logits are the largest
activation: a 16,384-token vocabulary, 1,024 tokens, the tiny config's own mesh (fsdp 2 x
sequence 4) and batch of 8, the step compiled with `train.loss_chunk` 64 and with one chunk
of the whole local sequence. Target: the chunked step's temporaries are smaller by more than
one float32 copy of the device's logits. Unchunked, XLA (JAX 0.11) holds 1.3 copies more than
the chunked step (JAX 0.10: more than 2), so a chunked step that held a whole copy too would
save 0.3 (measured: 1.31).

To find a term that grows faster, rerun one size with XLA_FLAGS=--xla_dump_to=DIR and read
the largest buffers and their shapes in DIR/*train_step*memory-usage-report.txt.
"""

import os
import sys

if __name__ == "__main__":
  # Before JAX starts: 8 CPU devices.
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import datetime  # noqa: E402
import importlib  # noqa: E402
import time  # noqa: E402

import bench_results  # noqa: E402  (scripts/, first on the path)
import parallelism  # noqa: E402
from trainer.config.config_check import check_config  # noqa: E402
from trainer.plan import dry_run, plan_target  # noqa: E402

DEVICES = 8
MAX_RATIO = 2.1


def _compile(config, devices) -> tuple:
  """The trainer's step for `config`, checked and compiled on `devices`: (compiled, mesh)."""
  with plan_target.compiling_for(devices):
    check_config(config, DEVICES)
  mesh = parallelism.make_mesh(config.mesh, devices)
  return dry_run.compile_step(config, mesh)[0], mesh


def measure(seq_len: int, remat: str, tile: int, devices, gpu: str) -> dict:
  config = importlib.import_module("configs.tiny_cpu").get_config("striped")
  config.mesh.update(data=1, fsdp=1, sequence=DEVICES, tensor=1)
  config.data.seq_len = seq_len
  config.train.update(batch_size=1, micro_batches=1, remat=remat)
  if tile:
    config.model.attention_tile = tile
  start = time.monotonic()
  compiled, _ = _compile(config, devices)
  return {"seq_len": seq_len, "remat": remat, "attention": "striped", "commit": bench_results.commit(),
          "loss_chunk": config.train.get("loss_chunk"),
          "tile": config.model.attention_tile, "devices": DEVICES,
          "compiled_for": devices[0].device_kind if gpu else "cpu",
          "tokens_per_device": seq_len // DEVICES, **dry_run.memory_figures(compiled),
          "compile_s": round(time.monotonic() - start, 1)}


def loss_chunking(devices) -> dict:
  """The step's temporaries with the loss in 64-token chunks and whole (module docstring)."""
  vocab, seq_len, temps = 16384, 1024, {}
  for chunk in (64, 1 << 20):
    config = importlib.import_module("configs.tiny_cpu").get_config("striped")
    config.model.update(vocab_size=vocab, attention_tile=128)
    config.data.seq_len = seq_len
    config.train.update(loss_chunk=chunk, batch_size=8)
    compiled, mesh = _compile(config, devices)
    temps[chunk] = compiled.memory_analysis().temp_size_in_bytes
  local_rows = config.train.batch_size // (mesh.shape["data"] * mesh.shape["fsdp"])
  logits_bytes = local_rows * (seq_len // mesh.shape["sequence"]) * vocab * 4
  return {"part": "loss_chunking", "commit": bench_results.commit(), "vocab": vocab,
          "seq_len": seq_len, "attention": "striped", "chunked_temp_bytes": temps[64],
          "whole_temp_bytes": temps[1 << 20], "local_logits_bytes": logits_bytes,
          "logits_copies_saved": round((temps[1 << 20] - temps[64]) / logits_bytes, 2)}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq_lens", default="8192,16384,32768,65536,131072")
  parser.add_argument("--remat", default="full", help="comma-separated remat policies")
  parser.add_argument("--tile", type=int, default=0, help="attention tile; 0 keeps the config's")
  parser.add_argument("--gpu", default="", help="compile for described GPUs of this kind "
                      "(trainer.plan.plan_target.GPUS) instead of fake CPU devices")
  parser.add_argument("--loss_chunking", action="store_true",
                      help="only what chunking the loss saves at a wide vocabulary")
  parser.add_argument("--no_save", action="store_true")
  args = parser.parse_args()
  devices = (plan_target.devices(args.gpu, DEVICES) if args.gpu
             else dry_run.fake_devices(DEVICES))
  stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
  if args.loss_chunking:
    record = {**loss_chunking(devices), "time": stamp}
    saved = record["logits_copies_saved"]
    print(f"loss in chunks of 64: {record['chunked_temp_bytes']:,} temp bytes; whole: "
          f"{record['whole_temp_bytes']:,}; saves {saved} copies of the device's logits "
          f"({record['local_logits_bytes']:,} bytes): "
          + ("more than one (target)" if saved > 1 else "NOT more than one (target: > 1)"))
    if not args.no_save:
      bench_results.append("bench_memory.jsonl", [record])
    return
  records, linear = [], True
  for remat in args.remat.split(","):
    print(f"\nremat={remat}\n{'seq_len':>8} {'peak bytes':>14} {'temp bytes':>14} {'x prev':>7}")
    previous = None
    for seq_len in (int(s) for s in args.seq_lens.split(",")):
      record = measure(seq_len, remat, args.tile, devices, args.gpu)
      ratio = record["peak_bytes"] / previous if previous else None
      record.update(ratio_to_previous=ratio, time=stamp)
      linear &= ratio is None or ratio <= MAX_RATIO
      previous = record["peak_bytes"]
      records.append(record)
      print(f"{seq_len:>8} {record['peak_bytes']:>14,} {record['temp_bytes']:>14,} "
            f"{f'{ratio:.2f}' if ratio else '':>7}", flush=True)
  print(f"\nlinear: every doubling of tokens stays within {MAX_RATIO}x bytes" if linear else
        f"\nNOT linear: a doubling of tokens grows bytes by more than {MAX_RATIO}x")
  if not args.no_save:
    bench_results.append("bench_memory.jsonl", records)


if __name__ == "__main__":
  main()
