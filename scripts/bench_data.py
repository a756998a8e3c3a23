"""Tokens/sec of the data pipeline alone (no model): read, tokenize, pack, permute, prefetch.

  python scripts/bench_data.py                  # every case, appends results/bench_data.jsonl
  python scripts/bench_data.py --case tiny --batches 200
  python scripts/bench_data.py --case 8k --path DIR   # a directory of .txt files (text_files)

Cases, on the prepared default corpus (configs/base.py: synthetic_longrange, prepared under
`data.data_dir` on first use):
- `tiny`: the base config's batches, 8 rows x 256 tokens, ring layout.
- `8k`: 8 rows x 8,192 tokens, striped over 8 sequence shards.
- `256k`: one row of 262,144 tokens, striped over 8 sequence shards.
Each case builds its iterator, discards `--warmup` batches (thread start, first reads,
caches), then times `--batches` batches and reports tokens/sec and milliseconds per batch.
It also records the longest wait for one batch, first included (a stall, e.g. on reaching a
long document), and the process's peak resident memory so far: run one case per process
(`--case`) for a clean peak.
"""

import os
import sys

if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import resource  # noqa: E402
import time  # noqa: E402

import bench_results  # noqa: E402
import data  # noqa: E402
from configs import base  # noqa: E402

CASES = {  # name: (seq_len, global batch rows, layout, sequence shards, timed batches)
    "tiny": (256, 8, "ring", 1, 300),
    "8k": (8192, 8, "striped", 8, 40),
    "256k": (262_144, 1, "striped", 8, 8),
}


def bench(cfg: data.DataConfig, case: str, warmup: int, batches: int | None) -> dict:
  seq_len, rows, layout, shards, default_batches = CASES[case]
  batches = batches or default_batches
  cfg = dataclasses.replace(cfg, seq_len=seq_len)
  iterator = data.make_iterator(cfg, split=cfg.train_split, global_batch_size=rows,
                                layout=layout, num_shards=shards, seed=0)
  longest = 0.0
  for index in range(warmup + batches):
    if index == warmup:
      start = time.perf_counter()
    before = time.perf_counter()
    next(iterator)
    longest = max(longest, time.perf_counter() - before)
  elapsed = time.perf_counter() - start
  iterator.close()
  tokens = batches * rows * seq_len
  return {"case": case, "seq_len": seq_len, "rows": rows, "layout": layout,
          "sequence_shards": shards, "batches": batches, "tokens_per_sec": tokens / elapsed,
          "ms_per_batch": 1000 * elapsed / batches, "max_ms_per_batch": 1000 * longest,
          "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
          "dataset": cfg.dataset, "path": cfg.path, "prefetch": cfg.prefetch}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--case", choices=[*CASES, "all"], default="all")
  parser.add_argument("--warmup", type=int, default=3, help="Batches discarded first.")
  parser.add_argument("--batches", type=int, default=None, help="Timed batches per case.")
  parser.add_argument("--data_dir", default=None, help="Prepared-data cache; default config's.")
  parser.add_argument("--path", default=None,
                      help="A directory of .txt/.jsonl files to read (text_files) instead.")
  args = parser.parse_args()
  config = base.get_config().data.to_dict()
  if args.data_dir:
    config["data_dir"] = args.data_dir
  if args.path:
    config.update(dataset="text_files", path=args.path)
  cfg = data.DataConfig(**config)
  data.prepare(cfg)
  load = os.getloadavg()[0]
  for case in CASES if args.case == "all" else [args.case]:
    record = bench(cfg, case, args.warmup, args.batches)
    record.update(commit=bench_results.commit(), cpu_count=os.cpu_count(),
                  load_average_1m=round(load, 2),
                  time=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    print(f"{case:>5}: {record['tokens_per_sec']:,.0f} tokens/s ({record['ms_per_batch']:.1f} "
          f"ms per {record['rows']}x{record['seq_len']} {record['layout']} batch, longest wait "
          f"{record['max_ms_per_batch']:.0f} ms, peak RSS {record['peak_rss_mib']:,.0f} MiB; "
          f"1-min load {load:.2f} on {os.cpu_count()} cores)", flush=True)
    bench_results.append("bench_data.jsonl", [record])


if __name__ == "__main__":
  main()
