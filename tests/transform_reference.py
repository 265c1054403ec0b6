"""A plain-numpy DiLoCo / Streaming DiLoCo loop that the in-mesh transformation must match.

Written from the algorithm's definition alone (no gmjax code): M learners run SGD on
quadratic losses; every fragment syncs on the staggered schedule, the deltas travel
through a numpy model of the wire codec, the outer Nesterov/momentum SGD runs on an F32
master (or outer Adam, with one step count per fragment), and the merge (mixing the
learner's current fragment with the new anchor) lands ``overlap`` steps after the sync.
With error feedback ``β`` each learner sends ``wire(β·e + Δ)`` and keeps
``e ← β·e + Δ − wire(β·e + Δ)`` (zeros again if that is not finite).
With ``outer_delay = 1`` (Kale et al., arXiv 2502.12996) each learner's delta is taken
from the start of its own inner phase, and the next phase starts from the Θ before the
round (the outer step on the previous round's aggregate). With ``eager`` every learner
runs its own outer optimizer (its own F32 copy and momentum) on the paper's
``g̃_m = g_{k−1} − w_{m,k−1}·Δ_{m,k−1} + w_{m,k−1}·Δ_{m,k}`` (``w = 1/M`` before any
round) and starts its next phase there; with a lossy ``commit_precision`` that is the
committed Θ before the round plus the learner's correction (its copy minus the master),
since Θ is all a learner receives.
The loop knows nothing of shards: a sharded run must compute what it computes.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

F32 = np.float32
_QMAX = {"F8_E4M3": 448.0, "F4": 6.0, "I4": 7.0, "I2": 1.0}
_CASTS = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}


def wire(x: np.ndarray, precision, dtype=np.float32) -> np.ndarray:
  """What an F32 array reads as after travelling at ``precision`` (None: ``dtype``)."""
  x = np.asarray(x, F32)
  if precision is None:
    return x.astype(dtype).astype(F32)
  if precision in _CASTS:
    return x.astype(_CASTS[precision]).astype(F32)
  flat = x.reshape(-1)
  n = flat.size
  blocks = np.zeros(-(-n // 32) * 32, F32)
  blocks[:n] = flat
  blocks = blocks.reshape(-1, 32)
  scale = (np.max(np.abs(blocks), axis=1) / F32(_QMAX[precision])).astype(F32)
  safe = np.where(scale > 0, scale, F32(1))
  scaled = np.where(scale[:, None] > 0, blocks / safe[:, None], F32(0)).astype(F32)
  qmax = _QMAX[precision]
  if precision == "F8_E4M3":
    codes = np.clip(scaled, -qmax, qmax).astype(ml_dtypes.float8_e4m3fn).astype(F32)
  elif precision == "F4":
    codes = np.clip(scaled, -qmax, qmax).astype(ml_dtypes.float4_e2m1fn).astype(F32)
  else:  # I4, I2: integers, rounded half to even, in [-qmax, qmax]
    codes = np.clip(np.round(scaled), -qmax, qmax).astype(F32)
  return (codes * scale[:, None]).astype(F32).reshape(-1)[:n].reshape(x.shape)


def sparse_wire(x: np.ndarray, precision, dtype, topk: int, chunk: int) -> np.ndarray:
  """What an F32 array reads as after travelling top-k sparse: per chunk of ``chunk``
  values of the flattened array the ``min(topk, length)`` largest magnitudes (subnormals
  as zero, ties to the lower index), by ascending index, travel as one vector at
  ``precision``; the rest reads as zero."""
  flat = np.asarray(x, F32).reshape(-1)
  magnitude = np.abs(flat).astype(np.float64)
  magnitude[magnitude < 2.0**-126] = 0.0
  positions = []
  for start in range(0, flat.size, chunk):
    order = np.argsort(-magnitude[start:start + chunk], kind="stable")[:topk]
    positions.append(start + np.sort(order))
  positions = np.concatenate(positions)
  out = np.zeros(flat.size, F32)
  out[positions] = wire(flat[positions], precision, dtype)
  return out.reshape(np.shape(x))


def step_of(r: int, sync_every: int, fragments: int) -> int:
  cycle, position = divmod(r, fragments)
  return cycle * sync_every + (position + 1) * sync_every // fragments


@dataclasses.dataclass
class Setup:
  """Learners, losses and the algorithm's settings."""

  theta0: list            # per learner: dict name -> array (learner 0's is used)
  targets: list           # per learner: dict name -> array
  curvature: list         # per learner: float
  plan: list              # fragments: tuples of names
  sync_every: int = 4
  lr: float = 0.1
  outer_lr: float = 0.7
  outer_momentum: float = 0.9
  nesterov: bool = True
  delta_precision: object = None
  delta_topk: object = None   # None: dense deltas; k: top-k per chunk (sparse_wire)
  delta_chunk: int = 4096
  commit_precision: object = None
  mixing: float = 0.0
  overlap: int = 0
  tokens: object = None    # None, or array [steps, M]
  dtype: object = np.float32
  outer: str = "sgd"       # "sgd" (momentum/Nesterov by the fields above) or "adam"
  adam: tuple = (0.9, 0.999, 1e-8)  # b1, b2, eps of the outer Adam
  error_feedback: object = None     # None, or β in (0, 1]
  outer_delay: int = 0
  eager: bool = False
  outlier_factor: object = 10.0     # None: only non-finite deltas are rejected


def outer_update(setup: Setup, g: dict, master: dict, momentum: dict, second: dict,
                 count: int) -> None:
  """One outer step in place on ``master`` (and the moments), written from the formulas.

  SGD (torch convention): ``u ← μ·u + g``; Nesterov ``master −= η·(g + μ·u)``, else
  ``master −= η·u``. Adam (Kingma & Ba, with optax's ε outside the root):
  ``m ← b1·m + (1−b1)·g``, ``v ← b2·v + (1−b2)·g²``,
  ``master −= η·(m/(1−b1^t)) / (sqrt(v/(1−b2^t)) + ε)``, ``t`` this fragment's step count.
  """
  eta = F32(setup.outer_lr)
  for n in g:
    if setup.outer == "sgd":
      mu = F32(setup.outer_momentum)
      momentum[n] = (mu * momentum[n] + g[n]).astype(F32)
      step = g[n] + mu * momentum[n] if setup.nesterov else momentum[n]
      master[n] = (master[n] - eta * step).astype(F32)
    else:
      b1, b2, eps = (F32(x) for x in setup.adam)
      momentum[n] = ((F32(1) - b1) * g[n] + b1 * momentum[n]).astype(F32)
      second[n] = ((F32(1) - b2) * g[n] * g[n] + b2 * second[n]).astype(F32)
      m_hat = momentum[n] / (F32(1) - b1 ** F32(count))
      v_hat = second[n] / (F32(1) - b2 ** F32(count))
      master[n] = (master[n] - eta * m_hat / (np.sqrt(v_hat) + eps)).astype(F32)


def gradient(setup: Setup, m: int, theta: dict) -> dict:
  """Gradient of ``0.5·c_m·Σ‖θ − target_m‖²``."""
  c = F32(setup.curvature[m])
  return {n: (c * (theta[n] - setup.targets[m][n])).astype(theta[n].dtype) for n in theta}


def run(setup: Setup, steps: int) -> dict:
  """Trains ``steps`` steps; returns each learner's θ, the anchor, master, momentum, log."""
  learners = len(setup.theta0)
  dtype = setup.dtype
  start = {n: np.asarray(v, dtype) for n, v in setup.theta0[0].items()}
  theta = [{n: v.copy() for n, v in start.items()} for _ in range(learners)]
  anchor = {n: v.copy() for n, v in start.items()}
  master = {n: v.astype(F32) for n, v in start.items()}
  momentum = {n: np.zeros(v.shape, F32) for n, v in start.items()}
  second = {n: np.zeros(v.shape, F32) for n, v in start.items()}
  outer_steps = [0] * len(setup.plan)
  counted = np.zeros((learners, len(setup.plan)), np.float64)
  fragments = len(setup.plan)
  syncs = {step_of(r, setup.sync_every, fragments): r % fragments
           for r in range(steps * fragments // setup.sync_every + fragments + 1)}
  merges: dict[int, list] = {}
  log = []
  own = [{n: np.asarray(v, dtype) for n, v in t0.items()} for t0 in setup.theta0]
  residual = [{n: np.zeros(v.shape, F32) for n, v in start.items()} for _ in range(learners)]
  # Delayed / eager: each learner's phase start, its own outer copy and momentum, the
  # previous aggregate of each fragment, its previous decoded delta and weight.
  begin = [{n: v.astype(F32) for n, v in start.items()} for _ in range(learners)]
  own_master = [{n: v.astype(F32) for n, v in start.items()} for _ in range(learners)]
  own_momentum = [{n: np.zeros(v.shape, F32) for n, v in start.items()}
                  for _ in range(learners)]
  previous_g = {n: np.zeros(v.shape, F32) for n, v in start.items()}
  previous_delta = [{n: np.zeros(v.shape, F32) for n, v in start.items()}
                    for _ in range(learners)]
  previous_weight = np.full((learners, len(setup.plan)), 1.0 / learners)
  for t in range(1, steps + 1):
    for m in range(learners):
      # The first gradients were taken at each learner's own start; the update then
      # applies them to learner 0's parameters, which every learner adopts.
      g = gradient(setup, m, own[m] if t == 1 else theta[m])
      theta[m] = {n: (theta[m][n] - F32(setup.lr) * g[n]).astype(dtype) for n in theta[m]}
      counted[m] += 1.0 if setup.tokens is None else setup.tokens[t - 1][m]
    if t in syncs:
      f = syncs[t]
      names = setup.plan[f]
      if setup.delta_topk is None:
        travel = lambda x: wire(x, setup.delta_precision, dtype)
      else:
        travel = lambda x: sparse_wire(x, setup.delta_precision, dtype, setup.delta_topk,
                                       setup.delta_chunk)
      deltas = []
      for m in range(learners):
        reference = begin[m] if setup.outer_delay else anchor
        sent = {n: (reference[n].astype(F32) - theta[m][n].astype(F32)).astype(F32)
                for n in names}
        if setup.error_feedback is not None:
          beta = F32(setup.error_feedback)
          sent = {n: (beta * residual[m][n] + sent[n]).astype(F32) for n in names}
        deltas.append({n: travel(sent[n]) for n in names})
        if setup.error_feedback is not None:
          left = {n: (sent[n] - deltas[m][n]).astype(F32) for n in names}
          if not all(np.all(np.isfinite(v)) for v in left.values()):
            left = {n: np.zeros_like(v) for n, v in left.items()}
          residual[m].update(left)
      kept, used, clamped = screen(deltas, counted[:, f], names, setup.outlier_factor)
      total = used.sum()
      weights = used / total if total > 0 else np.full(learners, 1.0 / learners)
      g = {n: np.zeros(anchor[n].shape, F32) for n in names}
      for m in kept:
        for n in names:
          g[n] = (g[n] + F32(weights[m]) * deltas[m][n]).astype(F32)
      finite = bool(kept) and all(np.all(np.isfinite(g[n])) for n in names)
      before = {n: anchor[n].astype(F32) for n in names}
      if setup.eager:
        for m in range(learners):
          ok = all(np.all(np.isfinite(deltas[m][n])) for n in names)
          w = F32(previous_weight[m, f])
          mine = {n: deltas[m][n] if ok else np.zeros_like(deltas[m][n]) for n in names}
          mixture = {n: (previous_g[n] - w * previous_delta[m][n] + w * mine[n]).astype(F32)
                     for n in names}
          outer_update(setup, mixture, own_master[m], own_momentum[m], None, 0)
          for n in names:
            begin[m][n] = (own_master[m][n].copy() if setup.commit_precision is None else
                           (before[n] + (own_master[m][n] - master[n])).astype(F32))
            previous_delta[m][n] = mine[n]
          previous_weight[m, f] = weights[m] if finite and m in kept else 0.0
        for n in names:
          previous_g[n] = g[n] if finite else np.zeros_like(g[n])
      elif setup.outer_delay:
        for m in range(learners):
          for n in names:
            begin[m][n] = before[n].copy()
      if finite:
        outer_steps[f] += 1
        outer_update(setup, g, master, momentum, second, outer_steps[f])
        for n in names:
          if setup.commit_precision is None:
            anchor[n] = master[n].astype(dtype)
          else:
            change = wire(master[n] - anchor[n].astype(F32), setup.commit_precision)
            anchor[n] = (anchor[n].astype(F32) + change).astype(dtype)
      counted[:, f] = 0
      merges.setdefault(t + setup.overlap, []).append((f, finite))
      log.append(dict(step=t, fragment=f, finite=finite,
                      delta_norm=float(np.sqrt(sum(np.sum(g[n].astype(np.float64) ** 2)
                                                   for n in names))),
                      cosine=_cosine([deltas[m] for m in kept], names),
                      rejected=learners - len(kept), clamped=clamped))
    for f, finite in merges.pop(t, []):
      for m in range(learners):
        for n in setup.plan[f]:
          if setup.outer_delay:
            theta[m][n] = begin[m][n].astype(dtype)
          elif finite:
            mixed = (F32(setup.mixing) * theta[m][n].astype(F32)
                     + F32(1 - setup.mixing) * anchor[n].astype(F32))
            theta[m][n] = mixed.astype(dtype)
          else:
            theta[m][n] = anchor[n].copy()
  return dict(theta=theta, anchor=anchor, master=master, momentum=momentum, second=second,
              residual=residual, begin=begin, log=log)


OUTLIER_FACTOR = 10.0


def _lower_median_beside(values, i):
  """The ⌊(k−1)/2⌋-th smallest of the k finite, positive values, value ``i``'s own
  included; None if no value but ``i``'s is one."""
  usable = [j for j, v in enumerate(values) if v is not None and np.isfinite(v) and v > 0]
  if not [j for j in usable if j != i]:
    return None
  return sorted(values[j] for j in usable)[(len(usable) - 1) // 2]


def screen(deltas, tokens, names, factor=OUTLIER_FACTOR):
  """The learners whose deltas are aggregated, their token counts, and how many clamped.

  A delta with a NaN/Inf value is rejected; so is one whose norm exceeds ``factor``
  times the lower median of the finite deltas' norms (judged only beside another finite
  delta). A kept learner's tokens above the factor times the kept learners' lower median
  are clamped to ``floor`` of that bound. Rejected learners count zero tokens. ``factor=None``: neither.
  """
  learners = len(deltas)
  finite = [all(np.all(np.isfinite(d[n])) for n in names) for d in deltas]
  norms = [float(np.sqrt(sum(np.sum(d[n].astype(np.float64) ** 2) for n in names)))
           if ok else None for d, ok in zip(deltas, finite)]
  kept = []
  for m in range(learners):
    reference = _lower_median_beside(norms, m)
    if finite[m] and (reference is None or factor is None or norms[m] <= factor * reference):
      kept.append(m)
  used = np.zeros(learners, np.float64)
  kept_tokens = [float(tokens[m]) if m in kept else None for m in range(learners)]
  clamped = 0
  for m in kept:
    reference = _lower_median_beside(kept_tokens, m)
    used[m] = tokens[m]
    if factor is not None and reference is not None and tokens[m] > np.floor(factor * reference):
      used[m] = np.floor(factor * reference)
      clamped += 1
  return kept, used, clamped


def _cosine(deltas, names):
  vectors = [np.concatenate([d[n].reshape(-1) for n in names]).astype(np.float64)
             for d in deltas]
  values = []
  for i in range(len(vectors)):
    for j in range(i + 1, len(vectors)):
      ni, nj = np.linalg.norm(vectors[i]), np.linalg.norm(vectors[j])
      if ni > 0 and nj > 0:
        values.append(vectors[i] @ vectors[j] / (ni * nj))
  return float(np.mean(values)) if values else float("nan")
