"""The needle grid's lengths and depths as flags and configs write them: parsed apart from
trainer/tools/needle.py, which samples, so that the config check can read them without importing
the sampler."""

from __future__ import annotations


class NeedleError(RuntimeError):
  """A grid that cannot be built (e.g. too little filler); the message says what to change."""


def parse_lengths(text: str) -> list[int]:
  """'1k,4k,16000' -> [1024, 4096, 16000]."""
  lengths = []
  for part in filter(None, (p.strip().lower() for p in text.split(","))):
    scale = 1024 if part.endswith("k") else 1
    try:
      lengths.append(int(float(part.rstrip("k")) * scale))
    except ValueError:
      raise NeedleError(f"cannot read the length '{part}' (write e.g. 512,1k,4k)") from None
  if not lengths or min(lengths) < 16:
    raise NeedleError(f"lengths '{text}' must be a list of at least 16 tokens each")
  return _once_each(lengths, "lengths", text)


def parse_depths(text: str) -> list[float]:
  try:
    depths = [float(part) for part in text.split(",") if part.strip()]
  except ValueError:
    raise NeedleError(f"cannot read the depths '{text}' (write e.g. 0,0.25,0.5,0.75,1)") from None
  if not depths or any(not 0 <= d <= 1 for d in depths):
    raise NeedleError(f"depths '{text}' must be fractions between 0 and 1")
  return _once_each(depths, "depths", text)


def _once_each(values: list, what: str, text: str) -> list:
  """`values`, unless one repeats: a repeated cell counted its needles twice."""
  repeated = sorted({v for v in values if values.count(v) > 1})
  if repeated:
    raise NeedleError(f"{what} '{text}' name {', '.join(f'{v:g}' for v in repeated)} more than "
                      f"once")
  return values
