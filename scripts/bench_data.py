"""Tokens/sec of the data pipeline alone (no model): read, tokenize, pack, permute, prefetch.

  python scripts/bench_data.py                  # both cases, appends results/bench_data.jsonl
  python scripts/bench_data.py --case tiny --batches 200

Cases, on the prepared default corpus (configs/base.py: synthetic_longrange, prepared under
`data.data_dir` on first use):
- `tiny`: the base config's batches, 8 rows x 256 tokens, ring layout.
- `256k`: one row of 262,144 tokens, striped over 8 sequence shards.
Each case builds its iterator, discards `--warmup` batches (thread start, first reads,
caches), then times `--batches` batches and reports tokens/sec and milliseconds per batch.
"""

import os
import sys

if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import data  # noqa: E402
from configs import base  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "results", "bench_data.jsonl")
CASES = {  # name: (seq_len, global batch rows, layout, sequence shards, timed batches)
    "tiny": (256, 8, "ring", 1, 300),
    "256k": (262_144, 1, "striped", 8, 8),
}


def bench(cfg: data.DataConfig, case: str, warmup: int, batches: int | None) -> dict:
  seq_len, rows, layout, shards, default_batches = CASES[case]
  batches = batches or default_batches
  cfg = dataclasses.replace(cfg, seq_len=seq_len)
  iterator = data.make_iterator(cfg, split=cfg.train_split, global_batch_size=rows,
                                layout=layout, num_shards=shards, seed=0)
  for _ in range(warmup):
    next(iterator)
  start = time.perf_counter()
  for _ in range(batches):
    next(iterator)
  elapsed = time.perf_counter() - start
  iterator.close()
  tokens = batches * rows * seq_len
  return {"case": case, "seq_len": seq_len, "rows": rows, "layout": layout,
          "sequence_shards": shards, "batches": batches, "tokens_per_sec": tokens / elapsed,
          "ms_per_batch": 1000 * elapsed / batches, "prefetch": cfg.prefetch}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--case", choices=[*CASES, "all"], default="all")
  parser.add_argument("--warmup", type=int, default=3, help="Batches discarded first.")
  parser.add_argument("--batches", type=int, default=None, help="Timed batches per case.")
  parser.add_argument("--data_dir", default=None, help="Prepared-data cache; default config's.")
  args = parser.parse_args()
  config = base.get_config().data.to_dict()
  if args.data_dir:
    config["data_dir"] = args.data_dir
  cfg = data.DataConfig(**config)
  data.prepare(cfg)
  load = os.getloadavg()[0]
  os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
  for case in CASES if args.case == "all" else [args.case]:
    record = bench(cfg, case, args.warmup, args.batches)
    record.update(cpu_count=os.cpu_count(), load_average_1m=round(load, 2),
                  time=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    print(f"{case:>5}: {record['tokens_per_sec']:,.0f} tokens/s ({record['ms_per_batch']:.1f} "
          f"ms per {record['rows']}x{record['seq_len']} {record['layout']} batch; 1-min load "
          f"{load:.2f} on {os.cpu_count()} cores)", flush=True)
    with open(RESULTS, "a", encoding="utf-8") as f:
      f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
  main()
