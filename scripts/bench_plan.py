"""The dry-run planner's per-device memory for one config at several sequence lengths, or for
every config under configs/ at its own.

  python scripts/bench_plan.py --config configs/7b_256k_striped.py \
      --seq_lens 262144,524288,1048576 [--remat full] [--sequence 16] [--memory_gib 80]
  python scripts/bench_plan.py --all --plan_compiler=gpu       # make bench_plan

Calls `trainer.plan.dry_run.plan` (what `python -m trainer --dry_run` prints) once per length,
compiled for described GPUs of `--accelerator`'s kind (XLA's GPU compiler, `make plan_gpu`)
or on fake CPU devices (`--plan_compiler`, as the trainer's flag), and appends one JSON line
per plan to results/bench_plan.jsonl with the commit measured and the JAX and GPU-compiler
versions that compiled it (`compiled_for` tells the compiles apart), so plans before and
after a change sit side by side: a figure moves with the compiler as well as with the code
(the 7B at 1M went from 51.6 to 57.8 GiB per device with JAX 0.10.2 -> 0.11.2, the code
unchanged). Without `--seq_lens` a config plans at its own `data.seq_len`, a staged one
(`config.stages`) once per stage. `--all` plans every config file under configs/ (one row
each, or each stage's); one the planner cannot plan prints its reason and is skipped. A
config whose model comes from a Hugging Face checkpoint (`init.from_hf`) that is not on this
machine plans with the config's own model fields, the row saying so. Compile-only: no
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
import glob  # noqa: E402
import importlib.metadata  # noqa: E402
import importlib.util  # noqa: E402

import jax  # noqa: E402

import bench_results  # noqa: E402  (scripts/, first on the path)
import parallelism  # noqa: E402
from model.hf_format import HFFormatError  # noqa: E402
from trainer.ckpt import hf_import  # noqa: E402
from trainer.config import stages  # noqa: E402
from trainer.config.config_check import ConfigError, check_config  # noqa: E402
from trainer.plan import dry_run, plan_target  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 2.0 ** 30


def _load_config(path: str):
  spec = importlib.util.spec_from_file_location("plan_config", os.path.join(ROOT, path))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def config_files() -> list[str]:
  """Every config file under configs/ (those with a `get_config`; stages.py and the package
  file are helpers), relative to the repository."""
  def defines_config(path):
    with open(path, encoding="utf-8") as f:
      return "def get_config(" in f.read()
  paths = sorted(glob.glob(os.path.join(ROOT, "configs", "*.py")))
  return [os.path.relpath(p, ROOT) for p in paths if defines_config(p)]


def _model_source(config) -> dict:
  """Applies the config's Hugging Face checkpoint to its model fields, as the trainer does
  before it plans; without the checkpoint here, clears it so that the config's own fields
  are planned, and says so in the row."""
  directory = config.init.from_hf
  if not directory:
    return {}
  if not os.path.isdir(directory):
    config.init.from_hf = ""
    return {"from_hf": directory, "model_from": "the config's own fields (no checkpoint here)"}
  hf_import.apply_to_config(config)
  return {"from_hf": directory, "model_from": "checkpoint"}


def planned(path: str, args) -> list[tuple[str, dict, object]]:
  """(stage name, row fields, config) for each plan of `path`: at each of `--seq_lens`, or
  at the config's own length (a staged config: each stage's config)."""
  if not args.seq_lens:
    config = _load_config(path)
    extra = _model_source(config)
    return [(stage.name, extra, _overridden(stage.config, args))
            for stage in stages.resolve(config)]
  out = []
  for seq_len in (int(s) for s in args.seq_lens.split(",")):
    config = _load_config(path)
    config.data.seq_len = seq_len
    out.append(("", {}, _overridden(config, args)))
  return out


def _overridden(config, args):
  if args.remat:
    config.train.remat = args.remat
  if args.sequence:
    config.mesh.sequence = args.sequence
  return config


def toolchain() -> dict:
  """The versions that compiled the plan: JAX, jaxlib and the CUDA plugin holding XLA's GPU
  compiler (found once a GPU plan has loaded it from .plan_gpu/), None where absent."""
  def version(name):
    try:
      return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      return None
  return {"jax": jax.__version__, "jaxlib": version("jaxlib"),
          "plan_plugin": version("jax-cuda13-plugin")}


def on_device(config, memory_gib: float) -> dict:
  """The step compiled for this machine's devices: XLA's memory analysis, and the verdict
  for `memory_gib` on its figure (no CPU promotion here, so the floor is the figure)."""
  check_config(config, jax.device_count())
  mesh = parallelism.make_mesh(config.mesh)
  compiled, _ = dry_run.compile_step(config, mesh)
  out = {"devices": jax.device_count(), "mesh": dict(mesh.shape),
         **dry_run.memory_figures(compiled)}
  return dry_run.with_verdict(dry_run.accelerator_figures(out), memory_gib)


def measure(path: str, stage: str, extra: dict, config, args, stamp: dict) -> dict:
  """One plan (or on-device compile) of `config` as a results row; `stamp`: the commit
  measured and the time."""
  out = (on_device(config, args.memory_gib or 80.0) if args.on_device
         else dry_run.plan(config, device_memory_gib=args.memory_gib,
                           accelerator=args.accelerator, compiler=args.plan_compiler))
  return {"config": path, **({"stage": stage} if stage else {}), **extra,
          "seq_len": config.data.seq_len, "remat": config.train.remat,
          "backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
          "attention": config.model.attention, **stamp,
          **toolchain(), **{key: value for key, value in out.items() if key != "mesh"},
          "mesh": out["mesh"]}


def print_table(rows: list[dict], on_device_: bool) -> None:
  """The rows as one line each, in GiB per device."""
  compiled_for = rows[-1].get("compiled_for", jax.devices()[0].device_kind)
  print(f"\ncompiled for {compiled_for} ({'on the device' if on_device_ else 'the plan'}, "
        f"JAX {rows[-1]['jax']})")
  print(f"{'config':<48} {'seq_len':>10} {'remat':>8} {'total GiB':>10} {'floor GiB':>10} "
        f"{'temps GiB':>10} {'host GiB':>9}  verdict")
  for r in rows:
    floor = r.get("floor_total_bytes")
    verdict = ("fits" if r["fits"] else "may fit" if r.get("may_fit") else "does not fit")
    name = r["config"].removeprefix("configs/") + (f" [{r['stage']}]" if "stage" in r else "")
    print(f"{name:<48} {r['seq_len']:>10,} {r['remat']:>8} {r['total_bytes'] / GIB:>10.1f} "
          f"{floor / GIB if floor is not None else float('nan'):>10.1f} "
          f"{r['temp_bytes'] / GIB:>10.1f} {r.get('host_temp_bytes', 0) / GIB:>9.1f}  {verdict}")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", help="a config file (or --all)")
  parser.add_argument("--all", action="store_true", help="every config under configs/")
  parser.add_argument("--seq_lens", default="",
                      help="comma-separated token counts (default: the config's own)")
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
  if bool(args.all) == bool(args.config):
    parser.error("pass one of --config and --all")
  stamp = {"commit": bench_results.commit(), "time": datetime.datetime.now(
      datetime.timezone.utc).isoformat(timespec="seconds")}
  rows = []
  for path in config_files() if args.all else [args.config]:
    try:
      for stage, extra, config in planned(path, args):
        rows.append(measure(path, stage, extra, config, args, stamp))
        if not args.no_save:
          bench_results.append("bench_plan.jsonl", [rows[-1]])
    except (ConfigError, HFFormatError) as error:
      if not args.all:
        sys.exit(f"error: {error}")
      print(f"{path}: not planned: {error}", flush=True)
  if rows:
    print_table(rows, args.on_device)


if __name__ == "__main__":
  main()
