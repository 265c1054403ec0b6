"""One process of a two-process JAX job that is a single mail learner (jax.distributed).

Usage: mail_jax_job.py URL PORT PROCESS_ID STEPS OUT [STATE_DIR] (process 1 joins
``JOIN_DELAY`` seconds late, from the environment, 0 by default; with ``OWN_STATE_DIR`` set,
each process passes ``STATE_DIR-<process>``). Each process has 2 CPU
devices; the parameters are global arrays sharded over all 4. Writes what it saw as JSON
to OUT. With STATE_DIR the learner keeps its state there (``{"m": the parameters after
each inner step}``, the step as position) and first restores what it finds.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # pylint: disable=g-import-not-at-top

jax.config.update("jax_cpu_collectives_implementation", "gloo")


def main():
  url, port, process_id, steps, out = sys.argv[1:6]
  state_dir = sys.argv[6] if len(sys.argv) > 6 else None
  if state_dir is not None and os.environ.get("OWN_STATE_DIR"):
    state_dir = f"{state_dir}-{process_id}"  # each process its own: refused at join
  process_id, steps = int(process_id), int(steps)
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                             process_id=process_id)
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=g-import-not-at-top

  import mail_support  # pylint: disable=g-import-not-at-top
  from gmjax import mail  # pylint: disable=g-import-not-at-top

  mesh = jax.make_mesh((4,), ("x",))
  host = mail_support.params0()
  shardings = {"a": NamedSharding(mesh, PartitionSpec("x")),  # (4, 3): one row each
               "b": NamedSharding(mesh, PartitionSpec()),
               "c": NamedSharding(mesh, PartitionSpec(None, None))}
  like = {k: jax.make_array_from_callback(v.shape, shardings[k], lambda i, v=v: v[i])
          for k, v in host.items()}
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

  def gather(tree):
    return {k: np.asarray(multihost_utils.process_allgather(v, tiled=True)).tolist()
            for k, v in tree.items()}

  if process_id == 1:  # JOIN_DELAY: process 1 joins that many seconds after process 0
    import time  # pylint: disable=g-import-not-at-top
    time.sleep(float(os.environ.get("JOIN_DELAY", "0")))
  learner = mail.open(url).join("job", poll_interval=0.02, wait_timeout=120,
                                state_dir=state_dir)
  params = learner.pull(like)
  def same(tree):
    return all(tree[k].sharding.is_equivalent_to(shardings[k], tree[k].ndim) for k in host)

  seen = {"primary": learner.primary, "pull_sharding": same(params),
          "pulled": learner.versions, "pulled_params": gather(params)}
  if state_dir is not None:
    restored = learner.restore({"m": like})
    if restored is not None:
      seen["restored"] = {"position": restored.position, "exact": restored.exact,
                          "step_count": learner.step_count, "m": gather(restored.state["m"]),
                          "sharding": same(restored.state["m"])}
  goal = mail_support.target(0)
  step = jax.jit(lambda p, g: jax.tree.map(lambda x, y: x - 0.1 * (x - y), p, g))
  goal = {k: jax.make_array_from_callback(v.shape, shardings[k], lambda i, v=v: v[i])
          for k, v in goal.items()}
  for i in range(steps):
    params = step(params, goal)
    if state_dir is None:
      params = learner.step(params)
    else:
      seen["handed"] = gather(params)
      params = learner.step(params, state={"m": params}, position=i + 1)
  seen["step_sharding"] = same(params)
  params = learner.close(params)
  seen["final"] = gather(params)
  with open(out, "w") as f:
    json.dump(seen, f)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main()
