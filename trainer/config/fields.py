"""Config fields by dotted name: the form resume's allow-list and a stage's settings use."""

from __future__ import annotations

from typing import Any


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
  """Dotted names of a nested dict's leaves; a list of groups (the stages) by index:
  `stages[1].train.lr`."""
  flat = {}
  for key, value in tree.items():
    name = f"{prefix}{key}"
    if isinstance(value, dict):
      flat.update(flatten(value, name + "."))
    elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
      for index, item in enumerate(value):
        flat.update(flatten(item, f"{name}[{index}]."))
    elif value != [] or key != "stages":  # No stages is the same as the older configs' none.
      flat[name] = value
  return flat


def matches(name: str, fields: tuple[str, ...]) -> bool:
  """Whether `name` is one of `fields`, or inside one of its groups (ending in '.')."""
  return any(name == field or (field.endswith(".") and name.startswith(field))
             for field in fields)
