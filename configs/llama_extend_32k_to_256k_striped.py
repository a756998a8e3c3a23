"""Extend a pretrained 32k-context LLaMA to 256k tokens in three stages, with Striped Attention.

    python -m trainer --config configs/llama_extend_32k_to_256k_striped.py:/ckpt/llama-32k \
        --workdir runs/llama_extend_256k
    python -m trainer --config configs/llama_extend_32k_to_256k_striped.py:/ckpt/llama-32k \
        --dry_run  # each stage's memory and step time
    python -m trainer.export --workdir runs/llama_extend_256k --out /ckpt/llama-256k

The argument after `:` (or --config.init.from_hf) is a Hugging Face LLaMA checkpoint
directory (config.json, *.safetensors, tokenizer.model): it sets the model's shape, its RoPE
and the tokenizer, and step 0's weights. The recipe follows YaRN's (and Code Llama's,
Large World Model's) practice: grow the context in stages, each from the previous stage's
final weights, rescaling RoPE for the new length (YaRN over the pretrained 32k; a stage may
instead raise model.rope_theta), with a small learning rate and a short warm-up each:

    stage   tokens/row  RoPE           steps  lr     AdamW moments
    64k     65,536      yarn x2        300    2e-5   fresh
    128k    131,072     yarn x4        200    2e-5   kept
    256k    262,144     yarn x8        100    1e-5   kept

Each step is one row (batch_size 1): 64k-256k tokens, so the stages see about 20M, 26M and
26M tokens. On 8 devices the sequence is striped over one ring of 8; parameters and AdamW
state are sharded over the ring too (ZeRO-3, see mesh.rules) and activations are fully
rematerialised. A 7B model at the 256k stage is configs/7b_256k_striped.py's step
(`--dry_run` gives each stage's memory). Interrupted anywhere, the same command resumes
inside the stage it stopped in.
"""

import importlib

import ml_collections

from configs.stages import stage

PRETRAINED_LEN = 32768
_YARN = {"type": "yarn", "original_max_len": PRETRAINED_LEN}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  # The paper's 256k step (striped ring of 8, pg19 books, one row, full remat); the
  # checkpoint then sets the model's fields and the tokenizer (trainer/ckpt/hf_import.py).
  config = importlib.import_module("configs.7b_256k_striped").get_config()
  config.init.from_hf = arg or "checkpoints/llama-32k"
  config.train.warmup_steps = 20
  config.train.min_lr_ratio = 0.5  # A short schedule: decay only halfway.
  config.train.weight_decay = 0.0  # Continued pretraining: do not pull weights towards 0.
  config.train.eval_every = 100
  config.checkpoint.every_steps = 50
  config.stages = (
      stage("64k", steps=300, seq_len=65536, lr=2e-5, rope_scaling={**_YARN, "factor": 2.0}),
      stage("128k", steps=200, seq_len=131072, lr=2e-5, keep_optimizer=True,
            rope_scaling={**_YARN, "factor": 4.0}),
      stage("256k", steps=100, seq_len=262144, lr=1e-5, keep_optimizer=True,
            rope_scaling={**_YARN, "factor": 8.0}),
  )
  return config
