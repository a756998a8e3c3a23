"""Trains a SentencePiece tokenizer (BPE or unigram, byte fallback) on a dataset split.

  python scripts/train_tokenizer.py --config configs/base.py --output tok.model
  python scripts/train_tokenizer.py --config configs/base.py --config.data.dataset=text_files \
      --config.data.path=my_docs --config.data.tokenizer_type=unigram \
      --config.data.tokenizer_vocab_size=8000 --output my_docs.model

Prepares the dataset first (cached under `data.data_dir`), samples up to `--max_documents`
documents evenly over `--split`, and writes the model to `--output` (default: where
`data.prepare` would put it, so a later run reuses it). Use the result with
`--config.data.tokenizer=PATH`; `model.vocab_size` must be >= the printed vocabulary size.
"""

import os
import sys

if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

import data  # noqa: E402
from data import sources  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", "configs/base.py",
                                          "Config file whose `data` block names the dataset.")
_SPLIT = flags.DEFINE_string("split", None, "Split to train on; default data.train_split.")
_OUTPUT = flags.DEFINE_string("output", None, "Model path; default the prepared location.")
_MAX_DOCUMENTS = flags.DEFINE_integer("max_documents", 20_000, "Documents sampled from the split.")


def main(argv: list[str]) -> None:
  del argv
  logging.set_verbosity(logging.WARNING)  # TFDS's INFO lines are noise here.
  config = _CONFIG.value.data.to_dict()
  config["tokenizer"] = ""  # Train one, whatever the config names.
  cfg = data.DataConfig(**config)
  try:
    sources.prepare_dataset(cfg)
    output = _OUTPUT.value or data.tokenizer_path(cfg)
    split = _SPLIT.value or cfg.train_split
    print(f"training a {cfg.tokenizer_type} tokenizer ({cfg.tokenizer_vocab_size} pieces, byte "
          f"fallback) on '{cfg.dataset}' split '{split}'", flush=True)
    data.train_tokenizer(sources.iter_texts(cfg, split, _MAX_DOCUMENTS.value), output,
                         cfg.tokenizer_vocab_size, cfg.tokenizer_type)
    tokenizer = data.Tokenizer(output)
  except data.DataError as error:
    sys.exit(f"error: {error}")
  print(f"wrote {output}: vocab {tokenizer.vocab_size}, bos {tokenizer.bos_id}, "
        f"eos {tokenizer.eos_id}, pad {tokenizer.pad_id}")


if __name__ == "__main__":
  app.run(main)
