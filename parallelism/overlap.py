"""Whether the ring's transfers overlap compute, read from the compiled program's own schedule.

The ring issues each step's transfer (a K/V block, a dK/dV accumulator) before the kernels
it could hide behind (`parallelism.ring`), but whether they run at once is the GPU
compiler's decision: its latency-hiding scheduler splits every `collective-permute` into a
`-start` and a `-done` and orders them among the kernels. A compiled program's text
(`compiled.as_text()`, `is_scheduled=true`) lists each computation's instructions in that
order, a while loop's body once for all the steps it runs. A transfer overlaps when at least
one kernel (a custom call: Pallas's Triton or Mosaic kernels, cuDNN, cuBLAS; or a fusion
that runs a matmul) is scheduled between its start and its done; one with none, or
a synchronous `collective-permute`, waits with the device idle on the link.

One transfer may wait by design: the last hop that takes each dK/dV accumulator home after
the ring's last step (`ring.HOME_HOP`, found by its named scope), when nothing is left to
compute but what needs it.
"""

from __future__ import annotations

import dataclasses
import re

from parallelism.ring import HOME_HOP
from parallelism import traffic

_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%?([\w.-]+) = (.*?) ([\w-]+)\((.*)$")
_CALLED = re.compile(r"(?:calls|body|to_apply|branch_computations|condition|true_computation"
                     r"|false_computation)=\{?([^,}]*(?:, %[\w.-]+)*)\}?")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
# Custom calls that move or describe data rather than compute (none is a kernel).
_NOT_KERNELS = ("AllocateBuffer", "SliceToDynamic", "PadToStatic", "MoveToHost",
                "MoveToDevice", "Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape")


@dataclasses.dataclass(frozen=True)
class Transfer:
  """One ring transfer in the schedule: where it is issued (`computation`: a while loop's
  body stands for every step it runs), how many bytes each device receives, the kernels
  scheduled while it is in flight (empty: it is waited on with nothing to hide it), and
  whether it is the dK/dV's last hop home."""
  name: str
  computation: str
  nbytes: int
  overlapped: tuple[str, ...]
  home: bool = False


@dataclasses.dataclass
class _Instruction:
  name: str
  type: str
  op: str
  rest: str


def _computations(hlo_text: str) -> dict[str, list[_Instruction]]:
  """Each computation's instructions in schedule order (`traffic.computations` splits them)."""
  found = {}
  for name, lines in traffic.computations(hlo_text)[0].items():
    matches = (_INSTRUCTION.match(line) for line in lines)
    found[name] = [_Instruction(*match.groups()) for match in matches if match]
  return found


def _called(instruction: _Instruction) -> list[str]:
  names = []
  for group in _CALLED.findall(instruction.rest):
    names += [name.strip().lstrip("%") for name in group.split(",") if name.strip()]
  return names


def _kernel(instruction: _Instruction, computations, seen=None) -> str | None:
  """The instruction's name if it runs a kernel (itself, or a computation it calls), else
  None. Matmuls count (cuBLAS calls, or the fusions XLA emits for them); elementwise
  fusions, copies and slices do not: they are too short to hide a transfer behind."""
  if instruction.op == "custom-call":
    target = _TARGET.search(instruction.rest)
    if target and target.group(1) not in _NOT_KERNELS:
      return instruction.name
    return None
  if instruction.op in ("dot", "convolution"):
    return instruction.name
  if instruction.op == "fusion" and "kind=kCustom" in instruction.rest:
    return instruction.name
  seen = set() if seen is None else seen
  for name in _called(instruction):
    if name in seen or name not in computations:
      continue
    seen.add(name)
    if any(_kernel(inner, computations, seen) for inner in computations[name]):
      return instruction.name
  return None


def transfers(hlo_text: str) -> list[Transfer]:
  """Every `collective-permute` of a scheduled program, in program order, with the kernels
  scheduled between its start and its done."""
  computations = _computations(hlo_text)
  found = []
  for computation, instructions in computations.items():
    started = {}
    for instruction in instructions:
      home = HOME_HOP in instruction.rest
      received = traffic.array_bytes(instruction.type)  # a done's, or a synchronous one's
      if instruction.op == "collective-permute":
        found.append(Transfer(instruction.name, computation, received, (), home))
      elif instruction.op == "collective-permute-start":
        started[instruction.name] = ([], home)
      elif instruction.op == "collective-permute-done":
        start = instruction.rest.split(")")[0].strip().lstrip("%")
        kernels, home = started.pop(start, ([], False))
        found.append(Transfer(start, computation, received, tuple(kernels), home))
      else:
        kernel = _kernel(instruction, computations)
        if kernel:
          for kernels, _ in started.values():
            kernels.append(kernel)
  return found


def exposed(found: list[Transfer]) -> list[Transfer]:
  """The ring steps' transfers with no kernel to hide behind (the home hop aside)."""
  return [t for t in found if not t.overlapped and not t.home]


def summary(found: list[Transfer]) -> str:
  """One line: whether every ring step's transfer overlaps a kernel in the schedule."""
  if not found:
    return "ring transfers: none in this program"
  steps = [t for t in found if not t.home]
  home = [t for t in found if t.home]
  home_waits = [t for t in home if not t.overlapped]
  tail = (f"; dK/dV's last hop home waits ({home_waits[0].nbytes / 2**20:.2f} MiB a layer: "
          f"nothing is left to compute)" if home_waits else
          "; dK/dV's last hop home overlaps too" if home else "")
  bare = exposed(found)
  if not bare:
    return (f"ring transfers: every ring step's ({len(steps)} in the schedule) overlaps a "
            f"kernel in the GPU compiler's schedule{tail}")
  names = ", ".join(f"{t.name} ({t.nbytes / 2**20:.2f} MiB, in {t.computation})"
                    for t in bare[:3])
  more = f" and {len(bare) - 3} more" if len(bare) > 3 else ""
  return (f"ring transfers: {len(bare)} of {len(steps)} wait with nothing to overlap: "
          f"{names}{more}{tail}")
