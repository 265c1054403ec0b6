"""Mail runs with other outer optimizers against numpy: plain momentum, a learning-rate
schedule, Adam; their state as committed; the manifest's outer description."""

import json
import os

import numpy as np
import pytest

import gmjax
from gmjax import mail
from gmjax.mail import states
from gmjax.mail.manifest import Manifest

import mail_support as ms


class NumpyOuter:
  """The outer optimizers of these tests, in float64 numpy, one state per fragment.

  ``kind`` is ``"sgd"`` (torch-convention momentum, Nesterov or plain, with the learning
  rate ``lr(t)`` at the fragment's ``t``-th outer step) or ``"adam"`` (Kingma & Ba, bias
  corrected, as a gradient step).
  """

  def __init__(self, kind, params, fragments, *, lr, mu=0.9, nesterov=True, b1=0.9,
               b2=0.999, eps=1e-8):
    self.kind, self.lr, self.mu, self.nesterov = kind, lr, mu, nesterov
    self.b1, self.b2, self.eps = b1, b2, eps
    self.master = {k: v.astype(np.float64) for k, v in params.items()}
    self.first = {k: np.zeros(v.shape) for k, v in params.items()}  # momentum, or Adam's m
    self.second = {k: np.zeros(v.shape) for k, v in params.items()}  # Adam's v
    self.count = [0] * fragments

  def step(self, fragment, gradient):
    """Applies the outer gradient of one fragment; returns the new Θ of its leaves."""
    t, lr = self.count[fragment], self.lr(self.count[fragment])
    for name, g in gradient.items():
      if self.kind == "sgd":
        u = self.first[name] = self.mu * self.first[name] + g
        self.master[name] = self.master[name] - lr * (g + self.mu * u if self.nesterov else u)
      else:
        m = self.first[name] = self.b1 * self.first[name] + (1 - self.b1) * g
        v = self.second[name] = self.b2 * self.second[name] + (1 - self.b2) * g * g
        m_hat, v_hat = m / (1 - self.b1 ** (t + 1)), v / (1 - self.b2 ** (t + 1))
        self.master[name] = self.master[name] - lr * m_hat / (np.sqrt(v_hat) + self.eps)
    self.count[fragment] += 1
    return {name: self.master[name].astype(np.float32) for name in gradient}


def reference(plan, config, learners, steps, tokens, optimizer):
  """Lockstep learners (``overlap_steps = 0``, ``mixing = 0``) with ``optimizer``."""
  H, P = config.sync_every, len(plan)
  sync = {}
  r = 0
  while (step := (r // P) * H + ((r % P) + 1) * H // P) <= steps:
    sync[step] = r
    r += 1
  theta = [ms.params0() for _ in range(learners)]
  goals = [ms.target(m) for m in range(learners)]
  anchor = ms.params0()
  since = np.zeros((learners, P))

  def outer_round(f):
    weights = since[:, f] / since[:, f].sum()
    gradient = {name: sum(weights[m] * (anchor[name].astype(np.float64) - theta[m][name])
                          for m in range(learners)) for name in plan[f]}
    for name, value in optimizer.step(f, gradient).items():
      anchor[name] = value
      for m in range(learners):
        theta[m][name] = value.copy()
    since[:, f] = 0

  for t in range(1, steps + 1):
    for m in range(learners):
      theta[m] = ms.inner(theta[m], goals[m])
      since[m] += tokens[m]
    if t in sync:
      outer_round(sync[t] % P)
  for r in range(len(sync), len(sync) + P):  # close(): final contributions
    if since[0, r % P] > 0:
      outer_round(r % P)
  return theta, optimizer


BIG = 2**24
CASES = {
    "plain momentum": (dict(outer_options={"nesterov": False}),
                       dict(kind="sgd", lr=lambda t: 0.7, nesterov=False), [1, 2, 5]),
    "schedule": (dict(outer_options={"learning_rate": {
                     "schedule": "exponential_decay", "init_value": 0.7,
                     "transition_steps": 1, "decay_rate": 0.8}}),
                 dict(kind="sgd", lr=lambda t: 0.7 * 0.8**t), [1, 2, 5]),
    # Token counts past 2**24 (F32 would round 2**24 + 1 to 2**24).
    "adam": (dict(outer="adam", outer_options={"learning_rate": 0.05, "b1": 0.8}),
             dict(kind="adam", lr=lambda t: 0.05, b1=0.8), [BIG + 1, BIG, BIG]),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(CASES))
def test_threads_match_numpy_outer(tmp_path, case):
  config_options, numpy_options, tokens = CASES[case]
  numpy_options = dict(numpy_options)
  learners, steps = 3, 12
  config = gmjax.DiLoCo(sync_every=4, fragments=2, quorum_size=learners, **config_options)
  url = os.path.join(tmp_path, "run")
  run = mail.create(url, ms.params0(), config)
  assert mail.open(url).config == config  # the manifest's outer description
  out = {}
  threads = ms.Threads()
  for m in range(learners):
    threads.start(ms.train, mail.open(url), f"m{m}", m, steps, tokens=tokens[m], out=out)
  threads.join(timeout=100)

  optimizer = NumpyOuter(numpy_options.pop("kind"), ms.params0(), len(run.plan),
                         **numpy_options)
  expected, optimizer = reference(run.plan, config, learners, steps, tokens, optimizer)
  for m in range(learners):
    for name in expected[m]:
      np.testing.assert_allclose(out[f"m{m}"][name], expected[m][name], rtol=2e-5,
                                 atol=1e-5, err_msg=f"learner m{m}, leaf {name}")
  rounds = run.rounds()
  for record in rounds:
    assert record.rejected == () and record.outer_step
    total = sum(p.tokens for p in record.participants)
    for p in record.participants:
      assert p.tokens == p.steps * tokens[int(p.learner[1:])]
      assert p.weight == p.tokens / total
  # The committed outer state of each fragment is the optimizer's, under its record names.
  for fragment, names in enumerate(run.plan):
    version = max(states.committed_versions(run.store, fragment))
    state = states.load_state(run.store, states.read_commit(run.store, fragment, version,
                                                             None), 1 << 30)
    assert version == optimizer.count[fragment]
    if config.outer == "adam":
      assert int(state.outer["outer.0.count"]) == version
      for name in names:
        np.testing.assert_allclose(state.outer[f"outer.0.mu.{name}"],
                                   optimizer.first[name], rtol=1e-4, atol=1e-7)
        np.testing.assert_allclose(state.outer[f"outer.0.nu.{name}"],
                                   optimizer.second[name], rtol=1e-4, atol=1e-9)
      assert not any(k.startswith("momentum.") for k in state.outer)
    else:
      for name in names:
        np.testing.assert_allclose(state.outer[f"momentum.{name}"], optimizer.first[name],
                                   rtol=1e-4, atol=1e-6)
      if case == "schedule":
        assert int(state.outer["outer.1.count"]) == version


def test_manifest_keeps_the_outer_description(tmp_path):
  config = gmjax.DiLoCo(sync_every=4, outer="adam", outer_options={
      "b2": 0.95, "learning_rate": {"schedule": "cosine_decay_schedule", "init_value": 0.1,
                                    "decay_steps": 50}})
  url = os.path.join(tmp_path, "run")
  mail.create(url, ms.params0(), config)
  stored = json.loads(open(os.path.join(url, "manifest.json"), "rb").read())
  assert stored["algorithm"]["outer"] == "adam"
  assert stored["algorithm"]["outer_options"]["learning_rate"]["decay_steps"] == 50
  assert mail.open(url).config == config
  mail.create(url, ms.params0(), config)  # the same run again: accepted
  with pytest.raises(mail.RunExists, match="algorithm"):
    mail.create(url, ms.params0(), gmjax.DiLoCo(sync_every=4, outer="adam"))


def test_manifest_without_outer_fields_is_the_default_sgd(tmp_path):
  config = gmjax.DiLoCo(sync_every=4, fragments=2)
  record = Manifest.new(gmjax.Schema.from_tree(ms.params0()), config, None).to_json()
  for field in ("outer", "outer_options"):
    del record["algorithm"][field]  # a manifest written before these fields existed
  loaded = Manifest.loads(json.dumps(record).encode())
  assert loaded.config == config and loaded.config.outer_transform() is not None
  assert loaded.config.to_json()["outer"] == "sgd"
