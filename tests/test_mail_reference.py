"""Mail learners in threads over a temporary directory compute what a numpy reference does."""

import os

import numpy as np
import pytest

import gmjax
from gmjax import mail

import mail_support as ms


def reference(plan, config, learners, steps, tokens):
  """DiLoCo / Streaming DiLoCo in plain numpy: lockstep learners, exact merges."""
  H, P = config.sync_every, len(plan)
  tau, mixing = config.overlap_steps, config.mixing
  lr, mu = config.outer_learning_rate, config.outer_momentum
  sync = {}
  r = 0
  while True:
    step = (r // P) * H + ((r % P) + 1) * H // P
    if step > steps:
      break
    sync[step] = r
    r += 1
  theta = [ms.params0() for _ in range(learners)]
  goals = [ms.target(m) for m in range(learners)]
  anchor = ms.params0()
  master = {k: v.astype(np.float64) for k, v in ms.params0().items()}
  momentum = {k: np.zeros(v.shape) for k, v in ms.params0().items()}
  since = np.zeros((learners, P))
  pending = []

  def merge(due):
    for item in [p for p in pending if p[0] <= due]:
      pending.remove(item)
      for name, value in item[2].items():
        anchor[name] = value
        for m in range(learners):
          theta[m][name] = (mixing * theta[m][name] + (1 - mixing) * value).astype(np.float32)

  def outer_round(f, now, due):
    weights = since[:, f] / since[:, f].sum()
    published = {}
    for name in plan[f]:
      g = sum(weights[m] * (anchor[name].astype(np.float64) - theta[m][name])
              for m in range(learners))
      momentum[name] = mu * momentum[name] + g
      master[name] = master[name] - lr * (g + mu * momentum[name])
      published[name] = master[name].astype(np.float32)
    since[:, f] = 0
    pending.append((due, f, published))
    merge(now)

  for t in range(1, steps + 1):
    for m in range(learners):
      theta[m] = ms.inner(theta[m], goals[m])
      since[m] += tokens[m]
    merge(t)
    if t in sync:
      outer_round(sync[t] % P, t, t + tau)
  merge(float("inf"))
  # close(): every learner flushes the steps since each fragment's last round as a
  # final contribution to that fragment's next round, and merges its commit.
  first = len(sync)
  for r in range(first, first + P):
    if since[0, r % P] > 0:
      outer_round(r % P, float("inf"), float("inf"))
  return theta


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fragments, overlap, mixing", [(1, 0, 0.0), (2, 1, 0.5)])
def test_threads_match_numpy_reference(tmp_path, fragments, overlap, mixing):
  learners, steps = 3, 12
  config = gmjax.DiLoCo(sync_every=4, fragments=fragments, overlap_steps=overlap,
                        mixing=mixing, quorum_size=learners)
  url = os.path.join(tmp_path, "run")
  run = mail.create(url, ms.params0(), config)
  tokens = [1, 2, 5]
  out = {}
  threads = ms.Threads()
  for m in range(learners):
    threads.start(ms.train, mail.open(url), f"m{m}", m, steps, tokens=tokens[m], out=out)
  threads.join(timeout=100)

  expected = reference(run.plan, config, learners, steps, tokens)
  for m in range(learners):
    for name in expected[m]:
      np.testing.assert_allclose(out[f"m{m}"][name], expected[m][name], rtol=2e-5, atol=2e-6,
                                 err_msg=f"learner m{m}, leaf {name}")
  rounds = run.rounds()
  regular = steps // 4 * len(run.plan)
  assert [r.round for r in rounds][:regular] == list(range(regular))
  for record in rounds:
    assert sorted(p.learner for p in record.participants) == ["m0", "m1", "m2"]
    weights = {p.learner: p.weight for p in record.participants}
    assert weights["m2"] == pytest.approx(5 / 8)
    assert record.final == (() if record.round < regular else ("m0", "m1", "m2"))
    assert record.rejected == () and record.outer_step
