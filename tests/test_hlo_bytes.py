"""``gmjax.transform.hlo``: collectives and bytes read from compiled steps on 8 CPU devices.

Every expected figure is worked out by hand from the per-device shapes: a (8, 16) array
on a (4, 2) mesh over ("a", "b") is a (2, 8) block per device, so F32 is 64 bytes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from gmjax.transform import hlo

RING_A = [(i, (i + 1) % 4) for i in range(4)]


def _mesh():
  return jax.make_mesh((4, 2), ("a", "b"))


def _step(fn, dtype=jnp.float32):
  """``jit(shard_map(fn))`` on a (8, 16) array of ``dtype``, and that array."""
  mesh = _mesh()
  x = jax.device_put(jnp.ones((8, 16), dtype), NamedSharding(mesh, P("a", "b")))
  step = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("a", "b"), out_specs=P(),
                               check_vma=False))
  return step, x


def _compiled_text(fn, dtype=jnp.float32):
  step, x = _step(fn, dtype)
  return step.lower(x).compile().as_text()


def _rows(collectives):
  return [(c.op, c.dtype, c.shape, c.group_size, c.bytes, c.bytes_sent)
          for c in collectives]


@pytest.mark.parametrize("fn, dtype, expected", [
    # psum over "a" (groups of 4): 2·3/4 of the 64-byte block.
    (lambda z: lax.psum(z, "a"), jnp.float32,
     [("all-reduce", "f32", (2, 8), 4, 64, 96.0)]),
    # all_gather over "a": a (4, 2, 8) s32 result of 256 bytes, 3/4 of it received.
    (lambda z: lax.all_gather(z, "a"), jnp.int32,
     [("all-gather", "s32", (4, 2, 8), 4, 256, 192.0)]),
    # psum_scatter over "a" along dim 1: operand 64 bytes, result (2, 2).
    (lambda z: lax.psum_scatter(z, "a", scatter_dimension=1, tiled=True), jnp.float32,
     [("reduce-scatter", "f32", (2, 2), 4, 64, 48.0)]),
    # all_to_all over "a": XLA splits the block into a tuple of 4 (2, 2) f16 pieces.
    (lambda z: lax.all_to_all(z, "a", 1, 1, tiled=True), jnp.float16,
     [("all-to-all", "f16", (2, 2), 4, 8, 6.0)] * 4),
    # ppermute around the ring of "a": every device sends its whole block once.
    (lambda z: lax.ppermute(z, "a", RING_A), jnp.float32,
     [("collective-permute", "f32", (2, 8), None, 64, 64.0)]),
    # all_gather over both axes: 8 u8 blocks of 16 bytes, 7/8 of them received.
    (lambda z: lax.all_gather(z, ("a", "b")), jnp.uint8,
     [("all-gather", "u8", (8, 2, 8), 8, 128, 112.0)]),
])
def test_single_collective_of_a_compiled_shard_map(fn, dtype, expected):
  found = hlo.collective_bytes(_compiled_text(fn, dtype))
  assert _rows(found) == expected
  assert hlo.total_bytes_sent(found) == pytest.approx(sum(e[-1] for e in expected))
  assert all(not c.is_async and c.computation for c in found)
  assert all("shard_map" in c.op_name for c in found)


def test_every_collective_of_one_step_and_the_sum_by_op():
  def fn(z):
    return (lax.psum(z, "b"), lax.all_gather(z, "a"), lax.ppermute(z, "a", RING_A),
            lax.psum_scatter(z, "a", scatter_dimension=1, tiled=True))

  found = hlo.collective_bytes(_compiled_text(fn))
  by_op = {op: hlo.total_bytes_sent(found, ops=[op]) for op in hlo._OPS}
  assert by_op == {
      "all-reduce": 2 * (1 / 2) * 64,            # psum over "b": groups of 2
      "all-gather": 3 / 4 * 256,
      "collective-permute": 64.0,
      "reduce-scatter": 3 / 4 * 64,
      "all-to-all": 0.0,
  }
  assert hlo.total_bytes_sent(found) == pytest.approx(sum(by_op.values()))


def test_tuple_collective_counts_every_element():
  # psum of a pair: XLA may combine both into one tuple all-reduce; either way each
  # 64-byte block costs 2·1/2·64 over "b".
  found = hlo.collective_bytes(_compiled_text(lambda z: lax.psum((z, 2 * z), "b")))
  assert [(c.op, c.dtype, c.shape, c.group_size) for c in found] == [
      ("all-reduce", "f32", (2, 8), 2)] * 2
  assert hlo.total_bytes_sent(found) == 128.0


def test_collectives_inside_a_cond_branch_count_once():
  def fn(z):
    return lax.cond(z[0, 0] > 0, lambda v: lax.psum(v, "a"), lambda v: v, z)

  found = hlo.collective_bytes(_compiled_text(fn))
  assert _rows(found) == [("all-reduce", "f32", (2, 8), 4, 64, 96.0)]


def test_a_collective_in_a_fori_loop_counts_once_and_its_loop_turns_are_known():
  def fn(z):
    return lax.fori_loop(0, 3, lambda _, v: lax.ppermute(v, "a", RING_A), z)

  text = _compiled_text(fn)
  found = hlo.collective_bytes(text)
  assert _rows(found) == [("collective-permute", "f32", (2, 8), None, 64, 64.0)]
  assert hlo.trip_counts(text)[found[0].computation] == 3


def test_bf16_and_float8_element_types_of_the_lowered_step():
  # On CPU the compiled step widens bf16 and float8 collectives (to f32 and f16), which
  # is why byte counts must come from the compiled text; the types themselves are read
  # here from the same step before optimization.
  def fn(z):
    return (lax.all_gather(z.astype(jnp.bfloat16), "a"),
            lax.all_gather(z.astype(jnp.float8_e4m3fn), "a"))

  step, x = _step(fn)
  found = hlo.collective_bytes(step.lower(x).as_text(dialect="hlo"))
  assert _rows(found) == [
      ("all-gather", "bf16", (4, 2, 8), 4, 128, 96.0),
      ("all-gather", "f8e4m3fn", (4, 2, 8), 4, 64, 48.0),
  ]


def test_groups_in_mesh_form_from_the_partitioner():
  # The sum over a dimension sharded 8 ways: XLA all-reduces the (16,) partial sums and
  # prints the group as mesh axes; 2·7/8 of 64 bytes.
  mesh = jax.make_mesh((8,), ("a",), axis_types=(AxisType.Auto,))
  x = jax.device_put(jnp.ones((16, 32)), NamedSharding(mesh, P(None, "a")))
  step = jax.jit(lambda v: jnp.sum(v, axis=1), out_shardings=NamedSharding(mesh, P("a")))
  text = step.lower(x).compile().as_text()
  assert "replica_groups=mesh[" in text, "XLA no longer prints mesh-axis groups here"
  found = hlo.collective_bytes(text)
  assert _rows(found) == [("all-reduce", "f32", (16,), 8, 64, 112.0)]


# Async and iota forms are what GPU and TPU compilers emit; XLA's own parser and printer
# check this module's syntax (the printer turns the `async-start` into
# `reduce-scatter-start`), and the text read is the one XLA prints.
_ASYNC_MODULE = """HloModule m, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%add16 (a: bf16[], b: bf16[]) -> bf16[] {
  %a = bf16[] parameter(0)
  %b = bf16[] parameter(1)
  ROOT %s = bf16[] add(%a, %b)
}

%wrapped (x: f32[16]) -> f32[4] {
  %x = f32[16]{0} parameter(0)
  ROOT %rs = f32[4]{0} reduce-scatter(%x), channel_id=4, replica_groups=[2,4]<=[8], dimensions={0}, to_apply=%add, use_global_device_ids=true
}

ENTRY %main (p0: f32[4,8], p1: bf16[16], p2: f32[16], p3: u8[6]) -> (f32[16,8], bf16[16], f32[4,8], f32[4], u8[6], f32[16]) {
  %p0 = f32[4,8]{1,0} parameter(0)
  %p1 = bf16[16]{0} parameter(1)
  %p2 = f32[16]{0} parameter(2)
  %p3 = u8[6]{0} parameter(3)
  %ags = (f32[4,8]{1,0}, f32[16,8]{1,0}) all-gather-start(%p0), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}, use_global_device_ids=true
  %agd = f32[16,8]{1,0} all-gather-done(%ags)
  %ars = bf16[16]{0} all-reduce-start(%p1), channel_id=2, replica_groups=[4,2]<=[2,4]T(1,0), use_global_device_ids=true, to_apply=%add16
  %ard = bf16[16]{0} all-reduce-done(%ars)
  %cps = (f32[4,8]{1,0}, f32[4,8]{1,0}, u32[], u32[]) collective-permute-start(%p0), channel_id=3, source_target_pairs={{0,1},{1,0}}
  %cpd = f32[4,8]{1,0} collective-permute-done(%cps)
  %st = ((f32[16]{0}), f32[4]{0}) async-start(%p2), calls=%wrapped
  %rsd = f32[4]{0} async-done(%st)
  %a2a = u8[6]{0} all-to-all(%p3), channel_id=5, replica_groups={{0,1,2},{3,4,5}}, dimensions={0}
  %all = f32[16]{0} all-reduce(%p2), channel_id=6, replica_groups={}, use_global_device_ids=true, to_apply=%add
  ROOT %t = (f32[16,8]{1,0}, bf16[16]{0}, f32[4,8]{1,0}, f32[4]{0}, u8[6]{0}, f32[16]{0}) tuple(%agd, %ard, %cpd, %rsd, %a2a, %all)
}
"""


def test_async_iota_and_empty_groups_as_xla_prints_them():
  from jaxlib import _hlo  # XLA's HLO parser and printer

  text = _hlo.hlo_module_from_text(_ASYNC_MODULE).to_string()
  assert "reduce-scatter-start" in text and "<=[" in text
  found = hlo.collective_bytes(text)
  assert [(c.op, c.is_async) for c in found] == [
      ("all-gather", True), ("all-reduce", True), ("collective-permute", True),
      ("reduce-scatter", True), ("all-to-all", False), ("all-reduce", False)]
  assert _rows(found) == [
      ("all-gather", "f32", (16, 8), 4, 512, 384.0),     # [2,4]<=[8]: groups of 4
      ("all-reduce", "bf16", (16,), 2, 32, 32.0),        # [4,2]<=[2,4]T(1,0): of 2
      ("collective-permute", "f32", (4, 8), None, 128, 128.0),
      ("reduce-scatter", "f32", (4,), 4, 64, 48.0),      # operand: 4 × the result
      ("all-to-all", "u8", (6,), 3, 6, 4.0),
      ("all-reduce", "f32", (16,), 8, 64, 112.0),        # {}: all 8 partitions
  ]


def test_replica_groups_as_device_ids():
  found = {(c.op, c.group_size): c.groups for c in hlo.collective_bytes(_ASYNC_MODULE)}
  assert found["all-gather", 4] == ((0, 1, 2, 3), (4, 5, 6, 7))     # [2,4]<=[8]
  assert found["all-reduce", 2] == ((0, 4), (1, 5), (2, 6), (3, 7))  # [4,2]<=[2,4]T(1,0)
  assert found["collective-permute", None] == ()
  assert found["all-to-all", 3] == ((0, 1, 2), (3, 4, 5))
  assert found["all-reduce", 8] == (tuple(range(8)),)               # {}
  # Mesh axes: the devices of a (2, 4) mesh laid out by device_ids, grouped over 'b'.
  line = ("HloModule m, num_partitions=8\nENTRY %e () -> f32[2] {\n  %x = f32[2]{0} "
          "all-reduce(%p), replica_groups=mesh['a'=2,'b'=4], device_ids=([4,2]T(1,0))"
          " {'b'}, to_apply=%add\n}\n")
  ids = np.arange(8).reshape(4, 2).T  # device_ids, as the mesh's (2, 4) array
  assert hlo.collective_bytes(line)[0].groups == tuple(tuple(int(d) for d in r) for r in ids)
  # Read from a compiled step: the sum over a dimension split over 'a' of an (a, b) mesh
  # reduces over the devices that differ in 'a' only.
  mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Explicit,) * 2)
  x = jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh, P("b", "a")))
  text = jax.jit(lambda v: jnp.sum(v, axis=1)).lower(x).compile().as_text()
  ids = np.vectorize(lambda d: d.id)(mesh.devices)
  (reduce,) = [c for c in hlo.collective_bytes(text) if c.op == "all-reduce"]
  assert sorted(reduce.groups) == sorted(tuple(int(d) for d in ids[:, b]) for b in range(4))
  assert all(hlo.spanned_axes(mesh, g) == {"a"} for g in reduce.groups)


def test_mesh_sub_axis_groups():
  # A reshard of (P("b", "a")) to (P("a", "b")) on a (2, 4) mesh: XLA exchanges over a
  # sub-axis of size 2 of the second mesh axis, printed `{'axis_1':(2)2}`.
  mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Auto,) * 2)
  x = jax.device_put(jnp.ones((16, 32)), NamedSharding(mesh, P("b", "a")))
  target = NamedSharding(mesh, P("a", "b"))
  step = jax.jit(lambda v: lax.with_sharding_constraint(2 * v, target))
  text = step.lower(x).compile().as_text()
  found = [c for c in hlo.collective_bytes(text) if c.op == "all-to-all"]
  assert "':(2)2}" in text, "XLA no longer prints sub-axis groups here"
  assert {c.group_size for c in found} == {2}


def test_unknown_group_form_is_refused():
  line = ("HloModule m\nENTRY %e () -> f32[2] {\n  %x = f32[2]{0} all-reduce(%p), "
          "replica_groups=weird, to_apply=%add\n}\n")
  with pytest.raises(ValueError, match="replica_groups='weird'"):
    hlo.collective_bytes(line)
