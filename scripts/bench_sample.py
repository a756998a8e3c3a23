"""Prefill and decode speed of `trainer.sample` on CPU: tokens/sec by attention layout.

  python scripts/bench_sample.py        # tiny model, 2,048-token prompt, 64 new tokens
  python scripts/bench_sample.py --workdir runs/tiny_cpu --attentions striped,dense

Times `Sampler.generate`, what `python -m trainer.sample` runs: a ring prefill of the prompt,
then one decode step per new token over the KV cache sharded along the ring. The model is
configs/tiny_cpu.py as step 0 starts it (speed does not depend on the weights), or a run's
newest checkpoint with --workdir; 8 simulated CPU devices (fsdp 2 x sequence 4). Compile
time is apart; each cell is the median of --repeats. Appends to results/bench_sample.jsonl.
"""

import os
import sys

if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import datetime  # noqa: E402
import importlib  # noqa: E402
import statistics  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

import bench_results  # noqa: E402  (scripts/, first on the path)
import data  # noqa: E402
from trainer.core.training import data_config  # noqa: E402
from trainer.tools import run_flags, sampling  # noqa: E402



def _sampler(attention: str, workdir: str | None):
  if workdir:
    config = run_flags.run_config(workdir)
    config.model.attention = attention
    return sampling.load(workdir, config, log=lambda line: None)[0]
  config = importlib.import_module("configs.tiny_cpu").get_config(attention)
  data.prepare(data_config(config))
  return sampling.untrained(config, log=lambda line: None)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workdir", default=None, help="a run; default the untrained tiny model")
  parser.add_argument("--attentions", default="striped,ring,dense")
  parser.add_argument("--prompt_tokens", type=int, default=2048)
  parser.add_argument("--new_tokens", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--no_save", action="store_true")
  args = parser.parse_args()
  jax.config.update("jax_num_cpu_devices", 8)  # Before the first device use.
  commit = bench_results.commit()
  stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
  print(f"{'attention':>10} {'prompt':>7} {'capacity':>8} {'prefill tok/s':>14} "
        f"{'decode tok/s':>13} {'compile s':>10}")
  records = []
  for attention in args.attentions.split(","):
    sampler = _sampler(attention, args.workdir)
    prompt = list(np.random.default_rng(0).integers(4, sampler.model_cfg.vocab_size,
                                                    args.prompt_tokens))
    runs = [sampler.generate(prompt, args.new_tokens, ignore_eos=True)[1]
            for _ in range(args.repeats + 1)]
    timed = runs[1:]  # The first run's timing includes first-call work beyond compilation.
    record = {
        "attention": attention, "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens, "capacity": runs[0]["capacity"],
        "prefill_tokens_per_s": statistics.median(r["prefill_tokens_per_s"] for r in timed),
        "decode_tokens_per_s": statistics.median(r["decode_tokens_per_s"] for r in timed),
        "compile_s": runs[0]["compile_s"], "mesh": dict(sampler.mesh.shape),
        "workdir": args.workdir, "devices": jax.device_count(),
        "backend": jax.default_backend(), "commit": commit, "time": stamp}
    records.append(record)
    print(f"{attention:>10} {args.prompt_tokens:>7,} {record['capacity']:>8,} "
          f"{record['prefill_tokens_per_s']:>14,.0f} {record['decode_tokens_per_s']:>13,.1f} "
          f"{record['compile_s']:>10.1f}", flush=True)
  if not args.no_save:
    bench_results.append("bench_sample.jsonl", records)


if __name__ == "__main__":
  main()
