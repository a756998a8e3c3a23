"""The dry-run planner's per-device memory for one config at several sequence lengths.

  python scripts/bench_plan.py --config configs/7b_256k_striped.py \
      --seq_lens 262144,524288,1048576 [--remat full] [--sequence 16] [--memory_gib 80]

Calls `trainer.plan.dry_run.plan` (what `python -m trainer --dry_run` prints) once per length,
compiled for described GPUs of `--accelerator`'s kind (XLA's GPU compiler, `make plan_gpu`)
or on fake CPU devices (`--plan_compiler`, as the trainer's flag), and appends one JSON line
per plan to results/bench_plan.jsonl with the commit measured (`compiled_for` tells the
compiles apart), so plans before and after a change sit side by side. Compile-only: no
accelerator is needed and nothing is allocated.

`--on_device` compiles the same step on this machine's own devices instead (their count
must be the mesh's: on one GPU, `--sequence 1` for the 8-device configs) and records XLA's
memory analysis of it under the same keys, `backend` telling the rows apart. The planner's
CPU figure against the real compile, on one GPU:

  python scripts/bench_plan.py --config configs/1b_32k_striped.py --seq_lens 32768 \
      --sequence 1                       # the plan, on one fake CPU device
  python scripts/bench_plan.py --config configs/1b_32k_striped.py --seq_lens 32768 \
      --sequence 1 --on_device           # the step compiled for the GPU
"""

import os
import sys

if __name__ == "__main__":
  if "--on_device" not in sys.argv:  # The planner's fake devices are CPU ones.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import datetime  # noqa: E402
import importlib.util  # noqa: E402

import jax  # noqa: E402

import bench_results  # noqa: E402  (scripts/, first on the path)
import parallelism  # noqa: E402
from trainer.config.config_check import ConfigError, check_config  # noqa: E402
from trainer.plan import dry_run, plan_target  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 2.0 ** 30


def _load_config(path: str):
  spec = importlib.util.spec_from_file_location("plan_config", os.path.join(ROOT, path))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def on_device(config, memory_gib: float) -> dict:
  """The step compiled for this machine's devices: XLA's memory analysis, and the verdict
  for `memory_gib` on its figure (no CPU promotion here, so the floor is the figure)."""
  check_config(config, jax.device_count())
  mesh = parallelism.make_mesh(config.mesh)
  compiled, _ = dry_run.compile_step(config, mesh)
  out = {"devices": jax.device_count(), "mesh": dict(mesh.shape),
         **dry_run.memory_figures(compiled)}
  return dry_run.with_verdict(dry_run.accelerator_figures(out), memory_gib)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", required=True)
  parser.add_argument("--seq_lens", required=True, help="comma-separated token counts")
  parser.add_argument("--remat", default="", help="override train.remat")
  parser.add_argument("--sequence", type=int, default=0, help="override mesh.sequence")
  parser.add_argument("--memory_gib", type=float, default=None,
                      help="default: the described GPU's memory, else 80")
  parser.add_argument("--accelerator", default="h100",
                      help="a key of trainer.config.flops.PEAK_FLOPS")
  parser.add_argument("--plan_compiler", choices=plan_target.COMPILERS, default="auto")
  parser.add_argument("--no_save", action="store_true")
  parser.add_argument("--on_device", action="store_true",
                      help="compile on this machine's devices, not fake CPU ones (no plan)")
  args = parser.parse_args()
  commit = bench_results.commit()
  stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
  rows = []
  for seq_len in (int(s) for s in args.seq_lens.split(",")):
    config = _load_config(args.config)
    config.data.seq_len = seq_len
    if args.remat:
      config.train.remat = args.remat
    if args.sequence:
      config.mesh.sequence = args.sequence
    try:
      out = (on_device(config, args.memory_gib or 80.0) if args.on_device
             else dry_run.plan(config, device_memory_gib=args.memory_gib,
                               accelerator=args.accelerator, compiler=args.plan_compiler))
    except ConfigError as error:
      sys.exit(f"error: {error}")
    record = {"config": args.config, "seq_len": seq_len, "remat": config.train.remat,
              "backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
              "attention": config.model.attention, "commit": commit, "time": stamp,
              **{key: value for key, value in out.items() if key != "mesh"},
              "mesh": out["mesh"]}
    rows.append(record)
    if not args.no_save:
      bench_results.append("bench_plan.jsonl", [record])
  compiled_for = rows[-1].get("compiled_for", jax.devices()[0].device_kind)
  print(f"\ncompiled for {compiled_for} ({'on the device' if args.on_device else 'the plan'})")
  print(f"{'seq_len':>10} {'remat':>8} {'total GiB':>10} {'floor GiB':>10} "
        f"{'temps GiB':>10} {'host GiB':>9}  verdict")
  for r in rows:
    floor = r.get("floor_total_bytes")
    verdict = ("fits" if r["fits"] else "may fit" if r.get("may_fit") else "does not fit")
    print(f"{r['seq_len']:>10,} {r['remat']:>8} {r['total_bytes'] / GIB:>10.1f} "
          f"{floor / GIB if floor is not None else float('nan'):>10.1f} "
          f"{r['temp_bytes'] / GIB:>10.1f} {r.get('host_temp_bytes', 0) / GIB:>9.1f}  {verdict}")


if __name__ == "__main__":
  main()
