"""Bytes per device of each strategy, counted in compiled HLO, equal the formula exactly.

One attention call with packed documents and GQA on 8 fake CPU devices, forward alone and
forward with backward (where XLA computes the collectives the backward repeats once:
`traffic.formula`'s `reused`). Float32 operands: the CPU compiler moves bf16 all-to-alls
as float32, which would double those terms on this backend only.
"""

import pytest

from parallelism import traffic


@pytest.mark.parametrize("strategy,ring,ulysses", [
    ("ring", 8, 1), ("allgather", 8, 1), ("ulysses", 1, 8), ("hybrid", 2, 4)])
def test_compiled_collectives_send_what_the_formula_says(strategy, ring, ulysses):
  shapes = traffic.Shapes(rows=2, seq_len=128, heads=8, kv_heads=2, head_dim=16, itemsize=4,
                          packed=True)
  counted = traffic.compiled_bytes(strategy, shapes, ring, ulysses, tile_size=16)
  expected = traffic.formula(strategy, shapes, ring, ulysses)
  assert counted["forward"]["unknown_trips"] == counted["gradient"]["unknown_trips"] == 0
  assert traffic.sent_total(counted["forward"]) == pytest.approx(expected["forward"])
  assert traffic.sent_total(counted["gradient"]) == pytest.approx(
      expected["forward"] + expected["backward"] - expected["reused"])


def test_collective_lines_are_read_with_their_group_and_loop():
  hlo = """HloModule m

%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %cp = f32[4]{0} collective-permute(f32[4]{0} %x), source_target_pairs={{0,1},{1,0}}
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %ag = f32[8,2]{1,0} all-gather(f32[2,2]{1,0} %a), replica_groups=[2,4]<=[8], dimensions={0}
  %w = (s32[], f32[4]) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
}
"""
  counted = traffic.hlo_bytes(hlo)
  assert counted["collective-permute"] == 3 * 16  # 16 bytes, 3 trips
  assert counted["all-gather"] == 64 * 3 / 4  # groups of 4: 3/4 of the 64-byte result
  assert counted["unknown_trips"] == 0


def test_groups_named_by_mesh_axes_count_their_devices():
  """JAX 0.11 prints a group as the mesh axes it runs along; read as one device, an
  all-gather sent nothing (scripts/bench_strategies.py reported zero bytes)."""
  hlo = """HloModule m

ENTRY %main (a: u8[1,16]) -> u8[8,16] {
  %ag = u8[8,16]{1,0} all-gather(%a), channel_id=1, replica_groups=mesh['sequence'=8,'ulysses'=1] {'sequence'}, dimensions={0}, use_global_device_ids=true
  %a2a = (f32[1,64,4,16]{3,2,1,0}, f32[1,64,4,16]{3,2,1,0}) all-to-all(%x, %y), channel_id=2, replica_groups=mesh['sequence'=4,'ulysses'=2] {'ulysses'}
  %ar = f32[4]{0} all-reduce(%z), channel_id=3, replica_groups=mesh['sequence'=4,'ulysses'=2] {'sequence','ulysses'}, to_apply=%add
}
"""
  counted = traffic.hlo_bytes(hlo)
  assert counted["all-gather"] == 128 * 7 / 8
  assert counted["all-to-all"] == 2 * (64 * 4 * 16 * 4) / 2  # two f32 arrays, groups of 2
  assert counted["all-reduce"] == 2 * 16 * 7 / 8


def test_an_unknown_group_form_is_an_error_not_zero_traffic():
  with pytest.raises(ValueError, match="unknown replica_groups form"):
    traffic.hlo_bytes("ENTRY %main () -> f32[8] {\n"
                      "  %ag = f32[8]{0} all-gather(%a), replica_groups=devices(0..7)\n}\n")
