"""Loads an exported directory with the real `transformers` and says whether it warned.

    python scripts/check_hf_export.py /tmp/exported [--expected tests/hf_fixtures/X/expected.safetensors]

Run where `transformers` and `torch` are installed (the trainer needs neither). Prints every
warning `transformers` logged or raised while loading, the model's RoPE, and, given a fixture's
`expected.safetensors`, the largest relative difference of the logits it computes for the
recorded input. Exits 1 if anything warned or the logits differ by more than 1e-4.
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings

import safetensors.torch
import torch
import transformers


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("directory")
  parser.add_argument("--expected", help="a fixture's expected.safetensors to compare logits")
  args = parser.parse_args()

  logged: list[str] = []
  handler = logging.Handler()
  handler.emit = lambda record: logged.append(f"{record.levelname}: {record.getMessage()}")
  transformers.logging.get_logger().addHandler(handler)
  transformers.logging.disable_progress_bar()
  with warnings.catch_warnings(record=True) as raised:
    warnings.simplefilter("always")
    model = transformers.LlamaForCausalLM.from_pretrained(
        args.directory, dtype=torch.float32, attn_implementation="eager").eval()
  problems = logged + [f"{w.category.__name__}: {w.message}" for w in raised]
  print(f"loaded {args.directory}: rope {model.config.rope_parameters}, "
        f"{sum(p.numel() for p in model.parameters()):,} parameters")
  for problem in problems:
    print(f"  warned: {problem}")
  failed = bool(problems)
  if args.expected:
    expected = safetensors.torch.load_file(args.expected)
    with torch.no_grad():
      logits = model(input_ids=expected["input_ids"][None].long()).logits[0]
    relative = float((logits - expected["logits"]).abs().max() / expected["logits"].abs().max())
    print(f"  logits vs {args.expected}: max relative difference {relative:.2e}")
    failed |= relative > 1e-4
  print("FAILED" if failed else "ok: no warnings" + (", same logits" if args.expected else ""))
  return int(failed)


if __name__ == "__main__":
  sys.exit(main())
