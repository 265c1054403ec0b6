"""The sharded outer step computes what the replicated one computes, to an ulp."""

import jax
import numpy as np
import pytest

import transform_harness as harness

STEPS = 13


# Quantized deltas: both paths decode the same codes and sum them in learner order with
# the same weights, and every outer optimizer here is elementwise, so each element goes
# through the same F32 operations whichever learner owns it. Not bit for bit, measured:
# XLA compiles the outer step on (R, 32) shards into other fusions than on whole leaves,
# and the master of the 2-D leaf "b" rounds 1 ulp differently in a few elements (the
# 1-D leaves and the outer states agree bit for bit). With an I4 commit that 1 ulp of
# the update can move its block's scale, so Θ (parameters, anchor) may differ by a few
# ulps: 1 with Nesterov, 4 with Adam after 13 steps. F32 deltas are left out: the
# replicated path sums them with a psum, in XLA's order.
@pytest.mark.parametrize("outer,theta_ulps", [("nesterov", 1), ("adam", 4)])
def test_sharded_equals_replicated_to_an_ulp(outer, theta_ulps):
  setup = harness.make_setup(
      learners=3, fragments=3, mixing=0.5, overlap=1, tokens=True, steps=STEPS,
      nesterov=outer == "nesterov", outer="adam" if outer == "adam" else "sgd",
      outer_lr=0.05 if outer == "adam" else 0.7, delta_precision="F8_E4M3",
      commit_precision="I4",
  )
  sharded_params, sharded, _ = harness.run_vmap(setup, STEPS, shard_outer=True)
  replicated_params, replicated, _ = harness.run_vmap(setup, STEPS, shard_outer=False)
  for a, b in zip(jax.tree.leaves((sharded_params, sharded.anchor)),
                  jax.tree.leaves((replicated_params, replicated.anchor))):
    np.testing.assert_array_max_ulp(a, b, maxulp=theta_ulps)
  pairs = [(harness.masters(setup, sharded, True), harness.masters(setup, replicated, False))]
  for field in ("trace",) if outer == "nesterov" else ("mu", "nu"):
    pairs.append((harness.outer_field(setup, sharded, field, True),
                  harness.outer_field(setup, replicated, field, False)))
  for got, want in pairs:
    assert sorted(got) == sorted(want)
    for name in want:
      np.testing.assert_array_max_ulp(got[name], want[name], maxulp=1)
  assert int(sharded.stats.rounds[0]) == int(replicated.stats.rounds[0]) > 0
