"""A few ``gmjax.diloco`` steps on a (learner=4, data=2) mesh, in one or many processes.

``python tests/multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT OUT`` joins a JAX
multi-controller runtime on ``127.0.0.1:PORT`` (gloo CPU collectives), runs every case of
``CASES`` on the global mesh of all processes' devices, and saves this process's
addressable shards to ``OUT`` (``np.savez``). ``test_transform_multiprocess.py`` starts two
of these with 4 CPU devices each, so the learner axis spans both processes, and compares
with ``run_cases`` on 8 devices of one process.

The model: per learner, a linear map ``w`` (16×4), a bias ``b`` (4) and a vector ``v``
(40, not a multiple of the codec's block of 32), trained with Adam on a least-squares
loss of its own data, the batch split over ``data`` (gradients ``pmean``-ed there).
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gmjax

LEARNERS, DATA, STEPS = 4, 2, 7
SETTINGS = {
    "f32": dict(sync_every=2, fragments=2, overlap_steps=1, mixing=0.5),
    "i4": dict(sync_every=3, fragments=1, delta_precision="I4", commit_precision="BF16"),
}
# The default layout with an axis (the outer step sharded over the learners) and the
# replicated one.
LAYOUTS = {"sharded": None, "replicated": False}
# Every setting sharded, and one replicated too (each case costs a compile per process).
CASES = [("f32", "sharded"), ("f32", "replicated"), ("i4", "sharded")]


def cases():
  """``(label, config, shard_outer)`` of every case."""
  return [(f"{setting}-{layout}", gmjax.DiLoCo(**SETTINGS[setting]), LAYOUTS[layout])
          for setting, layout in CASES]


def _data():
  """Global inputs as numpy: initial params, batches and token counts per learner."""
  rng = np.random.default_rng(0)
  params = {"w": rng.standard_normal((LEARNERS, 16, 4)),
            "b": np.zeros((LEARNERS, 4)),
            "v": rng.standard_normal((LEARNERS, 40))}
  x = rng.standard_normal((LEARNERS, DATA, 8, 16))
  y = rng.standard_normal((LEARNERS, DATA, 8, 4))
  t = rng.standard_normal((LEARNERS, DATA, 40))
  tokens = rng.integers(1, 9, size=(STEPS, LEARNERS))
  cast = lambda a: a.astype(np.float32)
  return jax.tree.map(cast, params), cast(x), cast(y), cast(t), cast(tokens)


def _loss(params, x, y, t):
  fit = jnp.mean(jnp.square(x @ params["w"] + params["b"] - y))
  return fit + 0.5 * jnp.mean(jnp.square(params["v"] - t))


def _global(mesh, host, spec):
  """A global array of ``host`` laid out by ``spec``; each process fills its own shards."""
  sharding = NamedSharding(mesh, spec)
  return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _first(tree):
  return jax.tree.map(lambda a: a[0], tree)


def _stack(tree):
  return jax.tree.map(lambda a: a[None], tree)


def run_case(mesh, config, shard_outer):
  """Trains ``STEPS`` steps of one case; returns the global ``(params, state)`` arrays."""
  extra = {} if shard_outer is None else {"shard_outer": shard_outer}
  optimizer = gmjax.diloco(optax.adam(3e-2), config, axis_name="learner", **extra)
  params0, x, y, t, tokens = _data()
  learner = P("learner")

  def init(params):
    return _stack(optimizer.init(_first(params)))

  def step(params, state, x, y, t, tokens):
    params, state = _first(params), _first(state)
    grads = jax.grad(_loss)(params, x[0, 0], y[0, 0], t[0, 0])
    grads = jax.lax.pmean(grads, "data")
    updates, state = optimizer.update(grads, state, params, tokens=tokens[0])
    return _stack((optax.apply_updates(params, updates), state))

  batch = P("learner", "data")
  shard = lambda f, specs: jax.jit(jax.shard_map(
      f, mesh=mesh, in_specs=specs, out_specs=learner))
  params = jax.tree.map(lambda a: _global(mesh, a, learner), params0)
  state = shard(init, (learner,))(params)
  x, y, t = (_global(mesh, a, batch) for a in (x, y, t))
  train = shard(step, (learner, learner, batch, batch, batch, learner))
  for i in range(STEPS):
    params, state = train(params, state, x, y, t, _global(mesh, tokens[i], learner))
  return params, state


def run_cases(mesh):
  """``{label: (params, state)}`` of every case, as global arrays."""
  return {label: run_case(mesh, config, shard_outer)
          for label, config, shard_outer in cases()}


def addressable(results) -> dict[str, np.ndarray]:
  """This process's shards of ``results``, keyed ``label/path@start:stop,...`` (one
  replica of each)."""
  saved = {}
  for label, tree in results.items():
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
      for shard in leaf.addressable_shards:
        if shard.replica_id == 0:
          bounds = (s.indices(n)[:2] for s, n in zip(shard.index, leaf.shape))
          index = ",".join(f"{start}:{stop}" for start, stop in bounds)
          saved[f"{label}/{jax.tree_util.keystr(path)}@{index}"] = np.asarray(shard.data)
  return saved


def mesh_processes(mesh) -> np.ndarray:
  """The process of every device of ``mesh``, laid out like the mesh."""
  return np.vectorize(lambda d: d.process_index)(mesh.devices)


def main(process_id: int, num_processes: int, port: int, out: str) -> None:
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
      coordinator_address=f"127.0.0.1:{port}", num_processes=num_processes,
      process_id=process_id, initialization_timeout=60, heartbeat_timeout_seconds=30)
  mesh = jax.make_mesh((LEARNERS, DATA), ("learner", "data"))
  results = run_cases(mesh)
  np.savez(out, mesh_processes=mesh_processes(mesh), **addressable(results))
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
