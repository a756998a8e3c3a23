"""Work that could run the host out of memory, which the OS answers with a silent kill,
is refused first with one line: a CPU run whose state cannot fit, and a
`--find_max_seq_len` probe whose compile would not."""

import mmap
import os

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from trainer.config.config_check import ConfigError
from trainer.plan import dry_run
from trainer.run import host_memory
from trainer.run.loop import train


def test_state_bytes_count_every_copy_on_this_host():
  mesh = jax.make_mesh((8,), ("x",))
  leaf = lambda spec: jax.ShapeDtypeStruct((64, 16), np.float32,
                                           sharding=NamedSharding(mesh, PartitionSpec(*spec)))
  assert host_memory.bytes_on_this_host({"sharded": leaf(("x",))}) == 64 * 16 * 4
  assert host_memory.bytes_on_this_host({"replicated": leaf(())}) == 8 * 64 * 16 * 4


def test_a_cpu_run_whose_state_cannot_fit_stops_before_anything_is_written(
    tiny_config, tmp_path, monkeypatch):
  monkeypatch.setattr(host_memory, "available_bytes", lambda: 100_000)
  with pytest.raises(ConfigError, match="optimizer state alone take .* GB of host memory .* "
                     "cannot train on this machine") as error:
    train(tiny_config(), str(tmp_path / "run"))
  assert "\n" not in str(error.value)
  assert os.listdir(tmp_path / "run") == [".lock"]  # No config.json, checkpoint or metrics.


def test_the_peak_meter_sees_an_allocation_freed_before_it_ends():
  with host_memory.PeakMeter() as meter:
    # Measured inside: an allocator may return memory to the OS between any two lines.
    before = host_memory.resident_bytes()
    # 200 MB of fresh pages, touched: mapped here, not from an allocator (mimalloc, which the
    # suite preloads, may hand back pages a test before freed but kept resident).
    block = mmap.mmap(-1, 200_000_000)
    pages = np.frombuffer(block, np.uint8)
    pages[:] = 1
    del pages
    block.close()
  if meter.peak is None or before is None:
    pytest.skip("no /proc/self/clear_refs here")
  assert meter.peak >= before + 190e6


def test_the_length_search_stops_before_a_compile_the_host_cannot_hold():
  """The tiny config's measured compiles (32-token tiles, 8 described H100s): 1.8 GB at 1M
  tokens, 7.0 GB at 2M; the 4M probe was killed by the OS at 22 GB on a 23 GB host."""
  peaks = {1 << 19: 600_000_000, 1 << 20: 1_800_000_000, 1 << 21: 7_000_000_000}
  reason = dry_run._beyond_host_memory(peaks, 1 << 22, room=23_000_000_000)
  assert reason and "about 27 GB more host memory" in reason and "23 GB are free" in reason
  assert dry_run._beyond_host_memory(peaks, 1 << 22, room=100_000_000_000) is None
  assert dry_run._beyond_host_memory({1 << 21: 7e9}, 1 << 22, room=1) is None  # One probe.
  # A first probe that grew nothing (memory reused): at most 4x per doubling is assumed.
  reason = dry_run._beyond_host_memory({1 << 20: 0, 1 << 21: 5e9}, 1 << 22, room=30e9)
  assert reason is None
