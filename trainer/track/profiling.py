"""`--profile_steps=FIRST:LAST`: a `jax.profiler` trace of those training steps.

The trace starts before step FIRST reads its batch and stops once step LAST's results are
on the host, so it holds whole steps: the host loop, the data, every compiled kernel and
collective. The first step a process trains compiles (step 1, the first after a resume,
and each stage's first), so start the window after it to see steady steps. Each process
traces its own devices into `<workdir>/profile/process_<i>/`; open a
`perfetto_trace.json.gz` there at https://ui.perfetto.dev, or run `tensorboard --logdir
<workdir>/profile` with the profile plugin. Writing the trace out is left out of the
logged step times. The closing line also says where the devices' time went (`summarise`).
"""

from __future__ import annotations

import collections
import glob
import gzip
import heapq
import json
import os
import re
from typing import Callable

import jax


def parse_steps(text: str) -> tuple[int, int] | None:
  """(FIRST, LAST) from 'FIRST:LAST' or 'STEP' ('' is None); a ValueError says what is
  wrong."""
  if not text:
    return None
  first, sep, last = text.partition(":")
  try:
    steps = int(first), int(last if sep else first)
  except ValueError:
    raise ValueError(f"--profile_steps={text} must be FIRST:LAST, two step numbers such as "
                     f"5:7") from None
  if not 1 <= steps[0] <= steps[1]:
    raise ValueError(f"--profile_steps={text} must have 1 <= FIRST <= LAST")
  return steps


class StepProfiler:
  """Starts and stops the trace around the chosen steps as the loop reaches them."""

  def __init__(self, steps: tuple[int, int] | None, workdir: str,
               log: Callable[[str], None]):
    self._steps, self._log = steps, log
    self._directory = os.path.join(workdir, "profile", f"process_{jax.process_index()}")
    self._tracing = False
    self._first = self._last = None  # Steps traced.

  def starts_at(self, step: int) -> bool:
    """Whether the trace starts before `step` (FIRST, or the first step a run resumed inside
    the window trains): the loop reads the steps before, then calls `start`."""
    return bool(self._steps) and not self._tracing and self._steps[0] <= step <= self._steps[1]

  def start(self, step: int) -> None:
    try:
      jax.profiler.start_trace(self._directory, create_perfetto_trace=True)
    except Exception as error:  # pylint: disable=broad-except  # Training goes on.
      self._log(f"warning: the profile could not start ({type(error).__name__}: {error}); "
                f"training goes on without it")
      self._steps = None
      return
    self._tracing, self._first = True, step

  def before(self, step: int) -> None:
    """Called before `step` reads its batch: counts the steps traced."""
    if self._tracing:
      self._last = step

  def ends_at(self, step: int) -> bool:
    """Whether the trace stops after `step` (LAST): the loop reads its results, then
    closes."""
    return self._tracing and step >= self._steps[1]

  def close(self) -> None:
    """Stops a trace still running (at LAST, or a run that ended or stopped inside the
    window); says so if the run trained none of the chosen steps. Never raises: a trace that
    cannot be written is a warning, not a lost run."""
    try:
      self._close()
    except Exception as error:  # pylint: disable=broad-except
      self._log(f"warning: the profile could not be written ({type(error).__name__}: "
                f"{error})")

  def _close(self) -> None:
    steps, self._steps = self._steps, None  # Said, or stopped, once.
    if steps and self._first is None:
      self._log(f"warning: --profile_steps={steps[0]}:{steps[1]}: this run trained none of "
                f"these steps; nothing was profiled")
    if not self._tracing:
      return
    self._tracing = False
    jax.profiler.stop_trace()
    traces = sorted(glob.glob(os.path.join(self._directory, "plugins", "profile", "*",
                                           "perfetto_trace.json.gz")), key=os.path.getmtime)
    where = traces[-1] if traces else self._directory
    shares = ""
    if traces:
      shares = "; " + ", ".join(f"{name} {share:.0%}"
                                for name, share in summarise(traces[-1]).items())
    self._log(f"profile of steps {self._first}-{self._last}: {where} (open at "
              f"https://ui.perfetto.dev, or tensorboard --logdir "
              f"{os.path.dirname(self._directory)}){shares}")


# What a device op is, by its kernel or HLO name (first match wins): our Pallas kernels
# (`parallelism.kernel_pallas`), cuDNN's and XLA's attention kernels; cuBLAS/cuBLASLt,
# CUTLASS and XLA's own matmuls (on the CPU, dots and XNNPACK/YNNPACK fusions); NCCL and
# XLA's collectives (on the CPU, their rendezvous).
CATEGORIES = (
    ("attention", re.compile(r"block_fwd|block_bwd|fmha|flash|cudnn|sdpa|attention", re.I)),
    ("matmuls", re.compile(r"gemm|cublas|nvjet|xmma|cutlass|matmul|\bdot|[xy]nn_fusion"
                           r"|convolution", re.I)),
    ("collectives", re.compile(r"nccl|all-gather|all-reduce|all-to-all|reduce-scatter"
                               r"|collective|permute|rendezvous", re.I)),
)


def summarise(trace_path: str) -> dict[str, float]:
  """Where the devices' time went in a `perfetto_trace.json.gz`: the share of each device's
  time (from its first op to its last, summed over devices) in attention, matmuls,
  collectives, other ops, and idle. A device op is an event with an `hlo_op` argument, on
  the GPU's streams when the trace has a GPU; a device is a GPU (all its streams: XLA runs
  cuDNN's and other ops on side streams), or on the CPU a `device_ordinal`. An op counts
  its own time, less the ops nested in it (a loop's body) on its stream; ops of one stream
  that overlap count their shared time once. Overlapping streams of one GPU can make the busy
  shares exceed 1; a CPU device's shares never do."""
  with gzip.open(trace_path, "rt") as f:
    events = json.load(f)["traceEvents"]
  process = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
  gpus = {pid for pid, name in process.items() if name.startswith("/device:GPU")}
  streams = collections.defaultdict(list)
  for e in events:
    args = e.get("args") or {}
    if e.get("ph") == "X" and "hlo_op" in args and (not gpus or e["pid"] in gpus):
      device = e["pid"] if gpus else args.get("device_ordinal", "0")
      stream = e["tid"] if gpus else 0  # the CPU's threads of one device: one stream
      streams[device, stream].append((e["ts"], e["dur"], f"{e['name']} {args['hlo_op']}"))
  busy = collections.defaultdict(float)
  spans: dict = {}  # device -> [first op's start, last op's end] over all its streams
  for (device, _), stream_ops in streams.items():
    first, last = min(ts for ts, _, _ in stream_ops), max(ts + dur for ts, dur, _ in stream_ops)
    span = spans.setdefault(device, [first, last])
    span[0], span[1] = min(span[0], first), max(span[1], last)
    for kind, own in _own_times(stream_ops):
      busy[kind] += own
  total = sum(last - first for first, last in spans.values())
  if not total:
    return {}
  shares = {name: busy[name] / total for name, _ in (*CATEGORIES, ("other", None))}
  shares["idle"] = max(0.0, 1.0 - sum(shares.values()))
  return shares


def _own_times(stream_ops):
  """(category, time) of each stretch of one stream, given its ops as (start, duration,
  text): each instant goes to the op that started last among those running then, so a
  loop's body is not its loop's time, and ops that overlap without nesting (a CPU device's
  ops on two threads) count their shared time once, never more than the stream's span."""
  ops = sorted(stream_ops, key=lambda op: (op[0], -op[1]))  # a parent before what it holds
  edges = sorted({t for ts, dur, _ in ops for t in (ts, ts + dur)})
  running: list = []  # heap of (-start, -order, end, category): the latest start on top
  following = iter(enumerate(ops))
  upcoming = next(following, None)
  for begin, end in zip(edges[:-1], edges[1:]):
    while upcoming and upcoming[1][0] <= begin:
      order, (ts, dur, text) = upcoming
      kind = next((name for name, pattern in CATEGORIES if pattern.search(text)), "other")
      heapq.heappush(running, (-ts, -order, ts + dur, kind))
      upcoming = next(following, None)
    while running and running[0][2] <= begin:  # ended ops on top go; others when on top
      heapq.heappop(running)
    if running:
      yield running[0][3], end - begin
