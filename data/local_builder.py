"""The base of this project's own TFDS builders (generated or local data, nothing downloaded)."""

from __future__ import annotations

import inspect

from etils import epath
import tensorflow_datasets as tfds


class LocalBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """A GeneratorBasedBuilder that works without TensorFlow's optional extras installed."""

  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls) -> epath.Path:
    # TFDS 4.9.10 otherwise imports `importlib_resources` (a Python < 3.9 backport) here.
    return epath.Path(inspect.getfile(cls))
