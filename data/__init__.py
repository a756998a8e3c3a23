"""The data pipeline (docs/architecture.md): TFDS builders, SentencePiece, packing, layouts,
global batches.

    cfg = data.DataConfig(**config.data.to_dict())
    data.prepare(cfg)                      # once; cached under cfg.data_dir
    data.check_vocab(cfg, model_vocab_size)
    it = data.make_iterator(cfg, split=cfg.train_split, global_batch_size=8, layout="striped",
                            num_shards=4, seed=0, process_index=0, process_count=1)
    batch = data.to_global_batch(next(it), sharding)
"""

from data.config import DataConfig, DataError
from data.global_batch import gather_state, process_rows, to_global_batch
from data.packing import FIELDS, TRAIN_FIELDS
from data.retrieval import RETRIEVAL, Evaluator
from data.pipeline import DataIterator, make_iterator
from data.prepare import check_vocab, load_tokenizer, prepare, tokenizer_path
from data.sources import corpus_id
from data.tokenizer import Tokenizer, train_tokenizer



def evaluator_of(cfg: DataConfig) -> Evaluator | None:
  """The eval metrics `cfg.dataset` provides beyond the loss (None: the loss alone)."""
  return RETRIEVAL if cfg.dataset == "synthetic_longrange" else None


def fields(batch: dict, names) -> dict:
  """The named fields of a batch: what is sent to the devices."""
  return {name: batch[name] for name in names}


__all__ = ["DataConfig", "DataError", "DataIterator", "Evaluator", "FIELDS", "TRAIN_FIELDS",
           "Tokenizer", "check_vocab", "corpus_id", "evaluator_of", "fields",
           "gather_state", "process_rows",
           "load_tokenizer", "make_iterator", "prepare", "to_global_batch", "tokenizer_path",
           "train_tokenizer"]
