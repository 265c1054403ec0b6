"""The round schedule and the timing estimates (SPEC section 2)."""

import re

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

import gmjax


@st.composite
def schedules(draw):
  h = draw(st.integers(1, 64))
  p = draw(st.integers(1, h))
  return gmjax.RoundSchedule(sync_every=h, fragments=p, in_flight=1)


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(schedules(), st.integers(0, 5))
def test_every_fragment_once_per_cycle(schedule, cycle):
  h, p = schedule.sync_every, schedule.fragments
  rounds = range(cycle * p, (cycle + 1) * p)
  assert sorted(schedule.fragment_of(r) for r in rounds) == list(range(p))
  assert sum(schedule.gap(r) for r in rounds) == h
  steps = [schedule.step_of(r) for r in rounds]
  assert steps[-1] == (cycle + 1) * h and cycle * h < steps[0]
  assert all(schedule.version_after(r) == cycle + 1 for r in rounds)


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(schedules())
def test_step_of_formula_and_monotone(schedule):
  h, p = schedule.sync_every, schedule.fragments
  assert schedule.step_of(-1) == 0
  previous = 0
  for r in range(3 * p + 2):
    assert schedule.step_of(r) == (r // p) * h + ((r % p) + 1) * h // p
    assert schedule.step_of(r) > previous
    assert schedule.gap(r) == schedule.step_of(r) - previous >= 1
    previous = schedule.step_of(r)


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(schedules())
def test_round_at_and_first_round_after(schedule):
  sync_steps = {schedule.step_of(r): r for r in range(4 * schedule.fragments)}
  for step in range(0, 3 * schedule.sync_every + 1):
    assert schedule.round_at(step) == sync_steps.get(step)
    r = schedule.first_round_after(step)
    assert schedule.step_of(r) > step
    assert r == 0 or schedule.step_of(r - 1) <= step


def test_seed_examples():
  s = gmjax.RoundSchedule(sync_every=10, fragments=3, in_flight=2)
  assert [s.step_of(r) for r in range(6)] == [3, 6, 10, 13, 16, 20]
  assert [s.fragment_of(r) for r in range(4)] == [0, 1, 2, 0]
  assert [s.version_after(r) for r in range(4)] == [1, 1, 1, 2]
  assert [s.gap(r) for r in range(4)] == [3, 3, 4, 3]


def test_rounds_and_steps_must_be_ints():
  # Accepted before, each answering something no round or step is: step_of(2.5) 7.0,
  # fragment_of(2.5) 0.5, round_at(2.0) 0.0, step_of(True) 4, step_of(-5) -8,
  # version_after(-5) -2; first_round_after(inf) never returned.
  s = gmjax.RoundSchedule(sync_every=4, fragments=2)
  assert (s.step_of(np.int64(2)), s.round_at(np.int32(6)), s.step_of(-1)) == (6, 2, 0)
  calls = [(s.step_of, 2.5, "step_of(round=2.5) needs an int >= -1"),
           (s.step_of, -5, "step_of(round=-5) needs an int >= -1"),
           (s.step_of, True, "step_of(round=True)"),
           (s.fragment_of, 2.5, "fragment_of(round=2.5) needs an int >= 0"),
           (s.fragment_of, -1, "fragment_of(round=-1)"),
           (s.version_after, -5, "version_after(round=-5) needs an int >= 0"),
           (s.gap, -1, "gap(round=-1)"),
           (s.round_at, 2.0, "round_at(step=2.0) needs an int"),
           (s.round_at, np.array([2, 4]), "round_at(step=array"),
           (s.first_round_after, float("inf"), "first_round_after(step=inf) needs an int"),
           # round_at(-5) was None and first_round_after(-5) 0, as if steps began before 0.
           (s.round_at, -5, "round_at(step=-5) needs an int >= 0"),
           (s.first_round_after, -5, "first_round_after(step=-5) needs an int >= 0")]
  for method, value, said in calls:
    with pytest.raises(ValueError, match=re.escape(f"RoundSchedule.{said}")):
      method(value)


@pytest.mark.parametrize(
    "kwargs",
    [dict(sync_every=0, fragments=1), dict(sync_every=2, fragments=3),
     dict(sync_every=2, fragments=0), dict(sync_every=2, fragments=1, in_flight=0),
     dict(sync_every=2, fragments=1, overlap_steps=-1), dict(sync_every=True, fragments=1),
     # Accepted before: due() was then True on every count.
     dict(sync_every=4, fragments=2, overlap_steps=True),
     dict(sync_every=4, fragments=2, overlap_steps=4)],
)
def test_invalid_schedules(kwargs):
  with pytest.raises(ValueError):
    gmjax.RoundSchedule(**kwargs)


def test_numpy_integers_make_the_same_schedule():
  # RoundSchedule(np.int64(8), 4) was refused ("must be a positive int, got np.int64(8)"),
  # where DiLoCo and every RoundSchedule method take numpy integers.
  made = gmjax.RoundSchedule(np.int64(8), np.int32(4), np.int64(2), np.int64(1))
  assert made == gmjax.RoundSchedule(8, 4, 2, 1)
  assert all(type(getattr(made, f)) is int
             for f in ("sync_every", "fragments", "in_flight", "overlap_steps"))
  with pytest.raises(ValueError, match=r"fragments must be a positive int, got np.float64"):
    gmjax.RoundSchedule(8, np.float64(4.0))
  with pytest.raises(ValueError, match=r"overlap_steps must be None or an int .* got np.True_"):
    gmjax.RoundSchedule(8, 4, overlap_steps=np.bool_(True))


positive = st.one_of(st.none(), st.floats(0, 1e4, allow_nan=False))


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(st.lists(st.tuples(positive, positive, positive), max_size=6),
                  st.floats(0.001, 10))
def test_estimates_ema_and_timeout(observations, poll):
  estimates = gmjax.Estimates()
  expected = {"step": None, "quorum": None, "sync": None}
  for step, quorum, sync in observations:
    estimates = estimates.updated(step=step, quorum=quorum, sync=sync)
    for key, new in (("step", step), ("quorum", quorum), ("sync", sync)):
      old = expected[key]
      if new is not None:
        new = new if old is None else min(new, 2 * old + 0.1)
        expected[key] = new if old is None else old + 0.1 * (new - old)
  for key, value in expected.items():
    got = getattr(estimates, key)
    assert (got is None) == (value is None)
    if value is not None:
      assert got == pytest.approx(value, rel=1e-12, abs=1e-12)
  known = sum(v for v in expected.values() if v is not None)
  assert estimates.timeout(poll) == pytest.approx(max(30 * poll, 3 * known))
  assert gmjax.Estimates.from_json(estimates.to_json()) == estimates


def test_estimates_first_observation_taken_as_is():
  e = gmjax.Estimates().updated(step=2.0)
  assert e.step == 2.0 and e.quorum is None and e.sync is None
  assert e.updated(step=4.0).step == pytest.approx(2.2)
  assert e.updated(step=1e4).step == pytest.approx(2.21)  # at most 2·2 + 0.1 counts
  assert gmjax.Estimates().timeout(0.5) == 15.0
  assert e.timeout(0.01) == pytest.approx(6.0)


def test_schedule_of_something_else_names_it_in_a_line():
  # Parameters passed for their Schema: the message held their whole repr (14,362
  # characters for 50 leaves of 64x64).
  config = gmjax.DiLoCo(sync_every=8, fragments=2)
  params = {f"w{i}": np.zeros((64, 64), np.float32) for i in range(50)}
  with pytest.raises(ValueError, match=r"Schema.from_tree\(params\)") as caught:
    config.schedule(params)
  assert len(str(caught.value)) < 600  # whatever the size of the parameters
  for bad in (0, 3, True, 2.0, "2"):
    with pytest.raises(ValueError, match=r"an int in \[1, 2\]"):
      config.schedule(bad)
  assert config.schedule(np.int64(1)).fragments == 1
  assert config.schedule(gmjax.Schema.from_tree(params)).fragments == 2
