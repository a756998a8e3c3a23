"""Per-device peak memory of the compiled train step against sequence length (compile only).

  python scripts/bench_memory.py                      # 8k..128k, appends results/bench_memory.jsonl
  python scripts/bench_memory.py --remat none,full --seq_lens 8192,16384

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


def measure(seq_len: int, remat: str, tile: int, devices, gpu: str) -> dict:
  config = importlib.import_module("configs.tiny_cpu").get_config("striped")
  config.mesh.update(data=1, fsdp=1, sequence=DEVICES, tensor=1)
  config.data.seq_len = seq_len
  config.train.update(batch_size=1, micro_batches=1, remat=remat)
  if tile:
    config.model.attention_tile = tile
  with plan_target.compiling_for(devices):
    check_config(config, DEVICES)
  mesh = parallelism.make_mesh(config.mesh, devices)
  start = time.monotonic()
  compiled, _ = dry_run.compile_step(config, mesh)
  return {"seq_len": seq_len, "remat": remat, "attention": "striped", "commit": bench_results.commit(),
          "loss_chunk": config.train.get("loss_chunk"),
          "tile": config.model.attention_tile, "devices": DEVICES,
          "compiled_for": devices[0].device_kind if gpu else "cpu",
          "tokens_per_device": seq_len // DEVICES, **dry_run.memory_figures(compiled),
          "compile_s": round(time.monotonic() - start, 1)}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq_lens", default="8192,16384,32768,65536,131072")
  parser.add_argument("--remat", default="full", help="comma-separated remat policies")
  parser.add_argument("--tile", type=int, default=0, help="attention tile; 0 keeps the config's")
  parser.add_argument("--gpu", default="", help="compile for described GPUs of this kind "
                      "(trainer.plan.plan_target.GPUS) instead of fake CPU devices")
  parser.add_argument("--no_save", action="store_true")
  args = parser.parse_args()
  devices = (plan_target.devices(args.gpu, DEVICES) if args.gpu
             else dry_run.fake_devices(DEVICES))
  stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
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
