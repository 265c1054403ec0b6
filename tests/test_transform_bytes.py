"""Bytes each learner sends per sync, read from the compiled step, within the bound.

The sharded exchange sends at most ``(M−1)/M · (b_delta + b_publish) · n + O(M²)`` bytes
per learner per sync of ``n`` parameters, for every ``M``; the figures come from the
compiled HLO (``gmjax.transform.hlo``), where XLA's own choices (widening float8 or bf16
collectives, say) would show.
"""

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gmjax
from gmjax.transform import hlo

N = 2048  # one leaf, a multiple of 32·8: no padding
# (delta_precision, commit_precision, b_delta, b_publish) for F32 parameters.
PRECISIONS = [
    (None, None, 4.0, 4.0),
    ("BF16", None, 2.0, 4.0),
    ("F8_E4M3", None, 1.125, 4.0),
    ("I4", "F8_E4M3", 0.625, 1.125),
    ("I2", None, 0.375, 4.0),
    ("I2", "I2", 0.375, 0.375),
]


def sync_collectives(learners, delta_precision, commit_precision):
  config = gmjax.DiLoCo(sync_every=2, delta_precision=delta_precision,
                        commit_precision=commit_precision)
  optimizer = gmjax.diloco(optax.sgd(0.1), config, axis_name="learner")
  mesh = jax.make_mesh((learners,), ("learner",), devices=jax.devices()[:learners])

  def body(params, state):
    params, state = jax.tree.map(lambda x: x[0], (params, state))
    updates, state = optimizer.update(params, state, params)
    return jax.tree.map(lambda x: x[None], (updates, state))

  params = {"w": jnp.ones((learners, N), jnp.float32)}
  init = jax.shard_map(lambda p: jax.tree.map(lambda x: x[None], optimizer.init(jax.tree.map(lambda x: x[0], p))),
                       mesh=mesh, in_specs=P("learner"), out_specs=P("learner"))
  params = jax.device_put(params, NamedSharding(mesh, P("learner")))
  state = jax.jit(init)(params)
  step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("learner"),
                               out_specs=P("learner")))
  text = step.lower(params, state).compile().as_text()
  found = hlo.collective_bytes(text)
  # The first update's broadcast of learner 0's parameters (an all-reduce of the leaf)
  # runs once per training run, not per sync.
  return [c for c in found if not (c.op == "all-reduce" and c.bytes == 4 * N)]


@pytest.mark.parametrize("learners", [2, 4, 8])
@pytest.mark.parametrize("delta_precision,commit_precision,b_delta,b_publish", PRECISIONS)
def test_sync_bytes_within_the_bound(learners, delta_precision, commit_precision, b_delta,
                                     b_publish):
  found = sync_collectives(learners, delta_precision, commit_precision)
  sent = hlo.total_bytes_sent(found)
  bound = (learners - 1) / learners * (b_delta + b_publish) * N
  statistics = 2 * 4 * (learners**2 + 2) + 8 * learners  # Gram psum, token pairs
  print(f"M={learners} {delta_precision}/{commit_precision}: {sent:.0f} bytes,"
        f" {sent / N:.3f} per parameter (bound {bound / N:.3f} + {statistics} bytes)")
  assert sent <= bound + statistics
  # The payload itself is not smaller than the bound's main term allows: it is there.
  assert sent >= bound
  assert not [c for c in found if c.dtype.startswith("f8") or c.dtype in ("bf16", "f16")]
