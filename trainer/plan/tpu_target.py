"""TPU slices described to XLA's TPU compiler, so a dry run compiles for them without a TPU.

`libtpu` (pinned in constraints.txt, the version JAX's `jax[tpu]` extra names) holds XLA's
TPU compiler. Given a topology name (`v5p:2x2x2`: a kind and its chips along each axis of
the slice's torus) it describes the slice's chips (`jax.experimental.topologies`, as
MaxText's `train_compile.py` does for whole pods), and the train step compiles for them
with the TPU's own buffer assignment. Not in it: what runs outside the XLA program.

A slice is named as Cloud TPU names it (`--plan_accelerator=v5p-16`: v4 and v5p count
TensorCores, two a chip; v5e and v6e count chips) or by its kind alone (`v5p`, `tpu_v5p`),
then as many chips as the config's mesh has devices. One device is one chip (v4 as
megacore). A plan is judged against the chip's HBM.

`libtpu` lives in `.plan_tpu/` (`make plan_tpu`), not in the virtual environment: JAX would
try to start a TPU backend from it in every process. The planner points JAX at it only to
describe a slice (`TPU_LIBRARY_PATH`), after JAX's own backend is the CPU.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import jax

from trainer.config import flops
from trainer.config.config_check import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLUGIN_DIR = os.environ.get("PLAN_TPU_DIR") or os.path.join(ROOT, ".plan_tpu")


@dataclasses.dataclass(frozen=True)
class Chip:
  hbm_gib: float  # per chip, from Google's spec sheets
  axes: int  # of the slice's torus: 3 for v4 and v5p, 2 for v5e and v6e
  cores_per_chip: int  # how Cloud TPU names count a slice (v5p-16: 16 cores, 8 chips)
  config: str = "default"  # libtpu's chip config: v4's two cores as one device (megacore)


CHIPS = {"v4": Chip(32, 3, 2, "megacore"), "v5e": Chip(16, 2, 1), "v5p": Chip(95, 3, 2),
         "v6e": Chip(32, 2, 1)}


def parse(accelerator: str) -> tuple[str, int | None] | None:
  """(kind, chips or None) of a TPU accelerator name (`v5p`, `tpu_v5p`, `v5p-16`), or None
  for a name that is no TPU's."""
  match = flops.TPU_NAME.match(accelerator)
  if not match:
    return None
  kind, count = match.group(1), match.group(2)
  if count is None:
    return kind, None
  cores = CHIPS[kind].cores_per_chip
  if int(count) % cores or int(count) == 0:
    raise ConfigError(f"--plan_accelerator={accelerator!r}: a {kind} slice counts "
                      f"{'TensorCores, two a chip' if cores == 2 else 'chips'}; {count} is "
                      f"not a whole number of chips")
  return kind, int(count) // cores


def topology(kind: str, chips: int) -> str:
  """The topology name of a slice of `chips` chips: a power of two spread over the torus's
  axes as Cloud TPU shapes them (v5p: 2x2x1, 2x2x2, 2x2x4, 2x4x4; v5e: 2x2, 2x4, 4x4)."""
  if chips < 1 or chips & (chips - 1):
    raise ConfigError(f"{chips} {kind} chips are no slice: a slice has a power of two")
  dims = [1] * CHIPS[kind].axes
  for _ in range(int(math.log2(chips))):
    dims[dims.index(min(dims))] *= 2
  dims.sort(key=lambda d: (d == 1, d))  # 1s last (2x2x1), the rest ascending
  return f"{kind}:{'x'.join(map(str, dims))}"


def compiler_installed() -> bool:
  return os.path.isfile(_library())


def _library() -> str:
  return os.path.join(PLUGIN_DIR, "libtpu", "libtpu.so")


@functools.lru_cache(maxsize=None)
def devices(kind: str, chips: int) -> tuple[jax.Device, ...]:
  """`chips` described (not attached) chips of a `kind` slice, made once per slice."""
  if not compiler_installed():
    raise ConfigError(
        f"compiling the plan for TPUs needs XLA's TPU compiler (libtpu, no TPU needed): run "
        f"`make plan_tpu` to install it into {PLUGIN_DIR}, or plan on the CPU with "
        f"--plan_compiler=cpu")
  os.environ.setdefault("TPU_LIBRARY_PATH", _library())
  # libtpu asks a TPU VM's metadata server for the accelerator and its workers unless told;
  # here there is none, and each question would print a warning. Read once, when it loads.
  # Nor does a compile hold a TPU: several planning processes (the tests' workers) may load
  # libtpu at once, which its lockfile would refuse.
  for name, value in (("TPU_SKIP_MDS_QUERY", "1"), ("TPU_WORKER_HOSTNAMES", "localhost"),
                      ("TPU_ACCELERATOR_TYPE", f"{kind}-{chips * CHIPS[kind].cores_per_chip}"),
                      ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")):
    os.environ.setdefault(name, value)
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  name = topology(kind, chips)
  try:
    described = topologies.get_topology_desc(name, "tpu",
                                              chip_config_name=CHIPS[kind].config).devices
  except Exception as error:  # pylint: disable=broad-except  (libtpu's refusal, one line)
    raise ConfigError(f"XLA's TPU compiler refuses the slice {name} ({chips} chips): "
                      f"{str(error).splitlines()[0][:200]}") from None
  if len(described) != chips:
    raise ConfigError(f"the slice {name} described {len(described)} devices, not {chips}")
  return tuple(described)
