"""`--dry_run` for described TPU slices: the train step compiled by XLA's TPU compiler on this
CPU machine (`trainer/plan/tpu_target.py`; `make test` installs libtpu with `make plan_tpu`;
without it the compile test skips and says why)."""

import pytest

from trainer.config.config_check import ConfigError
from trainer.plan import dry_run, plan_target, tpu_target

needs_libtpu = pytest.mark.skipif(
    not tpu_target.compiler_installed(),
    reason=f"XLA's TPU compiler (libtpu) is not in {tpu_target.PLUGIN_DIR}: `make plan_tpu`")


@pytest.mark.slow(15)
@needs_libtpu
def test_the_tiny_config_plans_for_a_described_tpu_slice(tiny_config):
  """8 chips of a v5e slice (2x4): the TPU's own buffer assignment, judged against its 16 GiB
  of HBM. At 128-token ring blocks `auto` runs splash, and Mosaic compiles its forward, dq
  and dK/dV kernels (not interpreted); the ring's transfers are compiled for the slice."""
  config = tiny_config("striped", **{"data.seq_len": 512, "model.attention_tile": 128})
  plan, compiled = dry_run.memory_plan(config, 16.0, target="v5e")
  assert plan["compiled_for"] == "TPU v5 lite" and plan["devices"] == 8
  assert plan["fits"] and plan["floor_total_bytes"] == plan["total_bytes"] > 0
  assert plan["kernel"] == "splash" and "ring_overlap" not in plan
  text = compiled.as_text()
  assert "collective-permute" in text
  for phase in ("fwd", "dq", "dkv"):
    assert f"splash_mha_{phase}_segmented" in text, phase


def test_slices_are_named_as_cloud_tpu_names_them():
  assert tpu_target.parse("v5p-16") == ("v5p", 8)  # TensorCores, two a chip
  assert tpu_target.parse("v5e-8") == ("v5e", 8)  # chips
  assert tpu_target.parse("tpu_v4") == ("v4", None) and tpu_target.parse("h100") is None
  assert [tpu_target.topology("v5p", n) for n in (4, 8, 16, 32)] == [
      "v5p:2x2x1", "v5p:2x2x2", "v5p:2x2x4", "v5p:2x4x4"]
  assert [tpu_target.topology("v6e", n) for n in (4, 8, 16, 256)] == [
      "v6e:2x2", "v6e:2x4", "v6e:4x4", "v6e:16x16"]
  assert plan_target.peak_key("v5p-16") == "tpu_v5p" and plan_target.memory_gib("v4") == 32


@pytest.mark.parametrize("call, message", [
    (lambda: tpu_target.parse("v5p-3"), "a v5p slice counts TensorCores, two a chip; 3 is"),
    (lambda: tpu_target.topology("v5e", 12), "12 v5e chips are no slice"),
    (lambda: plan_target.peak_key("v7"), "--plan_accelerator='v7' is not one of h100"),
    (lambda: plan_target.described_target("tpu", "h100"),
     "--plan_compiler=tpu compiles for v4, v5e, v5p, v6e; --plan_accelerator='h100'"),
    (lambda: plan_target.described_devices("v5p-32", 8),
     "--plan_accelerator=v5p-32 is 16 chips; this config's mesh has 8 devices"),
])
def test_a_slice_that_cannot_be_is_one_line(call, message):
  with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
    call()
