"""Builds the tiny Hugging Face LLaMA fixtures under tests/hf_fixtures/ with the real `transformers`.

Run once, where `transformers`, `torch`, `safetensors` and `sentencepiece` are installed (the
trainer's own environment needs none of them but `safetensors`):

    python -m venv /tmp/hfvenv && /tmp/hfvenv/bin/pip install torch transformers safetensors \
        sentencepiece && /tmp/hfvenv/bin/python scripts/make_hf_fixture.py

Each fixture is a directory as `save_pretrained` writes it (config.json, safetensors, sharded
or not) plus a SentencePiece `tokenizer.model`, and `expected.safetensors`: a fixed input and
the float32 logits `transformers` computes for it with eager attention. Together they cover
GQA, tied and untied embeddings, bf16 and float32 storage, each RoPE scaling type the trainer
reads, the older `rope_theta` + `rope_scaling` form of config.json, and a Mistral checkpoint
(LLaMA's tensors with a sliding window). `--only NAME` remakes one fixture. `versions.json`
records what made them. Tests compare the trainer's import with these logits.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil

import safetensors.torch
import sentencepiece
import torch
import transformers

SEQ_LEN = 128  # Past every fixture's original_max_position_embeddings, so scaling matters.
VOCAB = 384  # Model rows; the tokenizer has fewer pieces, as real checkpoints often do.
TOKENIZER_PIECES = 320
# Large enough that attention scores are O(10), so that positions (RoPE and its scaling)
# change the logits by far more than float32 rounding; with the usual 0.02 attention is
# nearly uniform and a wrong rotation would go unseen.
INIT_STD = 0.2

FIXTURES = {
    # GQA 2, untied, plain theta, float32 in 3 safetensors shards with an index.
    "llama_gqa_sharded": dict(
        config=dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        dtype=torch.float32, max_shard_size="150KB"),
    # MHA, tied embeddings, linear position interpolation, bf16.
    "llama_tied_linear": dict(
        config=dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True,
                    rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                                     "factor": 4.0}),
        dtype=torch.bfloat16, max_shard_size=None),
    # Llama 3.1's frequency bands, GQA 4 (one K/V head), head_dim wider than d_model/heads.
    "llama3_rope": dict(
        config=dict(num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                    tie_word_embeddings=False,
                    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                     "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 32}),
        dtype=torch.bfloat16, max_shard_size=None),
    # YaRN with its attention temperature, written in the pre-`rope_parameters` form.
    "llama_yarn_old_format": dict(
        config=dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                     "original_max_position_embeddings": 32}),
        dtype=torch.bfloat16, max_shard_size=None, old_format=True),
    # Mistral: every layer sees the 16 keys up to itself (128 tokens, so the window matters).
    "mistral_window": dict(
        config=dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                    sliding_window=16,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        dtype=torch.float32, max_shard_size=None, family="mistral"),
}
FAMILIES = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
            "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}


def tokenizer_corpus(seed: int) -> list[str]:
  rng = random.Random(seed)
  words = ["the", "needle", "context", "ring", "striped", "token", "device", "long", "key",
           "value", "attention", "model", "rope", "scale", "train", "a", "of", "is", "in"]
  return [" ".join(rng.choice(words) for _ in range(40)) for _ in range(500)]


def write_tokenizer(directory: str) -> None:
  prefix = os.path.join(directory, "tokenizer")
  sentencepiece.SentencePieceTrainer.train(
      sentence_iterator=iter(tokenizer_corpus(0)), model_prefix=prefix, model_type="bpe",
      vocab_size=TOKENIZER_PIECES, byte_fallback=True, bos_id=1, eos_id=2, unk_id=0,
      pad_id=-1, normalization_rule_name="identity", minloglevel=2)
  os.remove(prefix + ".vocab")


def to_old_format(directory: str) -> None:
  """Rewrites config.json as `transformers` < 4.5x wrote it: rope_theta + rope_scaling."""
  path = os.path.join(directory, "config.json")
  with open(path) as f:
    config = json.load(f)
  rope = config.pop("rope_parameters")
  config["rope_theta"] = rope.pop("rope_theta")
  rope["type"] = rope.pop("rope_type")
  config["rope_scaling"] = rope
  with open(path, "w") as f:
    json.dump(config, f, indent=2)


def make(name: str, spec: dict, out_dir: str) -> None:
  directory = os.path.join(out_dir, name)
  shutil.rmtree(directory, ignore_errors=True)
  os.makedirs(directory)
  torch.manual_seed(sum(map(ord, name)))
  config_class, model_class = FAMILIES[spec.get("family", "llama")]
  config = config_class(
      vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
      max_position_embeddings=SEQ_LEN, rms_norm_eps=1e-5, initializer_range=INIT_STD,
      bos_token_id=1, eos_token_id=2, **spec["config"])
  model = model_class(config).eval()
  # Random norms, not ones, so that a norm read into the wrong place shows in the logits.
  with torch.no_grad():
    for module_name, parameter in model.named_parameters():
      if module_name.endswith("norm.weight"):
        parameter.uniform_(0.5, 1.5)
  save_kwargs = {"max_shard_size": spec["max_shard_size"]} if spec["max_shard_size"] else {}
  model.to(spec["dtype"]).save_pretrained(directory, **save_kwargs)
  if spec.get("old_format"):
    to_old_format(directory)
  # The reference logits come from `transformers` reading the saved files back in float32 (a
  # model cast to bf16 in memory would also round its RoPE frequencies; a load does not).
  reference = model_class.from_pretrained(
      directory, dtype=torch.float32, attn_implementation="eager").eval()
  token_rng = random.Random(1)
  input_ids = torch.tensor([token_rng.randrange(TOKENIZER_PIECES) for _ in range(SEQ_LEN)])[None]
  with torch.no_grad():
    logits = reference(input_ids=input_ids).logits[0]
  write_tokenizer(directory)
  safetensors.torch.save_file(
      {"input_ids": input_ids[0].to(torch.int32), "logits": logits.contiguous()},
      os.path.join(directory, "expected.safetensors"))
  print(f"{name}: {sorted(os.listdir(directory))}")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--only", default=None, choices=sorted(FIXTURES),
                      help="remake this fixture alone")
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests",
                                                    "hf_fixtures"))
  args = parser.parse_args()
  os.makedirs(args.out, exist_ok=True)
  for name, spec in FIXTURES.items():
    if args.only in (None, name):
      make(name, spec, args.out)
  versions = {"transformers": transformers.__version__, "torch": torch.__version__,
              "safetensors": safetensors.__version__,
              "sentencepiece": sentencepiece.__version__, "seq_len": SEQ_LEN}
  with open(os.path.join(args.out, "versions.json"), "w") as f:
    json.dump(versions, f, indent=2)
    f.write("\n")


if __name__ == "__main__":
  main()
