"""`python -m trainer.sample --workdir RUN --prompt TEXT`: text from a run's checkpoint or a
Hugging Face one (the command; trainer/tools/sampling.py does the work).

Its flags, prompt and sampling settings are checked before JAX and the model's code are
imported, so a mistyped flag or an empty prompt is said in a fraction of a second, not after
seconds of imports (as `python -m trainer` does)."""

from __future__ import annotations

import json
import sys

from trainer.tools.run_flags import (SampleError, check_settings, parse_run_flags,
                                     use_cpu_devices)
from trainer.track import console


def _define_flags() -> None:
  from absl import flags  # pylint: disable=g-import-not-at-top

  flags.DEFINE_string("prompt", None, "Prompt text.")
  flags.DEFINE_string("prompt_file", None, "File whose text is the prompt.")
  flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate at most (EOS stops early).")
  flags.DEFINE_float("temperature", 0.0, "0: greedy; else softmax temperature.")
  flags.DEFINE_float("top_p", 1.0, "Nucleus sampling: keep the most likely tokens up to "
                     "this probability mass.")
  flags.DEFINE_integer("seed", 0, "Sampling seed.")
  flags.DEFINE_bool("json", False, "Print one JSON object (ids, text, timings) at the end "
                    "instead of streaming text.")
  flags.DEFINE_bool("ignore_eos", False, "Generate all --max_new_tokens, past EOS.")


def _prompt_text(f) -> str:
  """The prompt from --prompt or --prompt_file; exits with one line when there is none."""
  if (f.prompt is None) == (f.prompt_file is None):
    sys.exit("error: pass exactly one of --prompt=TEXT and --prompt_file=FILE")
  if f.prompt_file is not None:
    try:
      with open(f.prompt_file, encoding="utf-8") as file:
        text = file.read().rstrip("\n")
    except OSError as error:
      sys.exit(f"error: cannot read --prompt_file: {error}")
  else:
    text = f.prompt
  if not text.strip():
    sys.exit("error: the prompt is empty (--prompt / --prompt_file)")
  return text


def main(argv: list[str]) -> None:
  """The command line (module docstring)."""
  console.exit_at_ctrl_c()
  f = parse_run_flags(argv, _define_flags, allow_hf=True)
  text = _prompt_text(f)
  try:
    check_settings(f.max_new_tokens, f.temperature, f.top_p)  # Before minutes of loading.
  except SampleError as error:
    console.exit_with_error(str(error))
  use_cpu_devices(f.config)
  # pylint: disable=g-import-not-at-top  # The flags are fine: now the seconds of imports.
  from ml_collections import config_flags
  from trainer.ckpt import hf_import
  from trainer.tools import sampling
  # pylint: enable=g-import-not-at-top
  config = f.config
  info = lambda line: print(line, file=sys.stderr, flush=True)
  try:
    if f.from_hf:
      info(hf_import.apply_to_config(config, config_flags.get_override_values(f["config"])))
      sampler, step = sampling.from_hf(config, info), None
    else:
      sampler, step = sampling.load(f.workdir, config, f.step, info)
    ids = sampling.prompt_ids(sampler.tokenizer, text)
    info(f"{'step ' + str(step) if step is not None else 'from ' + f.from_hf}, "
         f"{sampler.model_cfg.attention} attention over "
         f"{sampler.num_shards} sequence shard(s), prompt {len(ids)} tokens")
    shown = []

    def stream(token: int) -> None:
      before = sampler.tokenizer.decode(shown)
      shown.append(token)
      print(sampler.tokenizer.decode(shown)[len(before):], end="", flush=True)

    new_ids, timing = sampler.generate(ids, f.max_new_tokens, f.temperature, f.top_p, f.seed,
                                       on_token=None if f.json else stream,
                                       ignore_eos=f.ignore_eos)
  except sampling.RUN_ERRORS as error:
    console.exit_with_error(str(error))
  if f.json:
    print(json.dumps({"workdir": f.workdir, "from_hf": f.from_hf, "step": step,
                      "prompt": text, "prompt_ids": ids,
                      "generated_ids": new_ids,
                      "text": sampler.tokenizer.decode(new_ids), **timing}))
    return
  print(flush=True)
  decode_speed = timing["decode_tokens_per_s"]
  info(f"prefill {timing['prompt_tokens']} tokens in {timing['prefill_s']:.2f} s "
       f"({timing['prefill_tokens_per_s']:,.0f} tok/s); decode "
       + (f"{decode_speed:,.1f} tok/s" if decode_speed else "-")
       + f"; compile {timing['compile_s']:.1f} s")


if __name__ == "__main__":
  main(sys.argv)
