"""The demo learner's data and schedule positions when it starts or rejoins a run, and its
held-out set."""

from pathlib import Path

import numpy as np
import pytest

from gmjax.app import config as config_lib
from gmjax.app import data, worker
from gmjax.mail import Restored


def _saved(step, schedule_offset, exact):
  return Restored(state=None, position={"step": step, "schedule_offset": schedule_offset},
                  exact=exact)


@pytest.mark.parametrize("adaptive", [False, True])
def test_without_a_saved_state_data_and_schedule_go_on_from_the_runs_step(adaptive):
  assert worker.resume_position(40, None, adaptive) == worker.Position(40, 40)
  assert worker.resume_position(0, None, adaptive) == worker.Position(0, 0)


@pytest.mark.parametrize("adaptive", [False, True])
def test_an_exact_restore_goes_on_from_the_save(adaptive):
  # With adaptive steps a slower learner's own steps (12 trained since it started) are
  # behind the run's step, which jumped to 40 at the rounds it published early; with
  # fixed steps (overlap_steps = None, several fragments) the run's step may also stop
  # one short of the worker's. Neither moves its data or schedule.
  for start in (12, 11, 40):
    assert worker.resume_position(start, _saved(12, 0, True), adaptive) == (12, 0)
  # A save made after an earlier rejoin without a state keeps that rejoin's offset.
  assert worker.resume_position(40, _saved(30, 20, True), adaptive) == (30, 20)


def test_moved_on_with_fixed_steps_brings_data_and_schedule_to_the_runs_step():
  # Saved at step 13 with the count at 8 (offset 5); the run went on to step 24: the
  # count goes on from 8 and the schedule is at 8 + 16 = 24.
  assert worker.resume_position(24, _saved(13, 5, False), adaptive=False) == (24, 16)


def test_moved_on_with_adaptive_steps_goes_on_from_its_own_steps():
  # It trained none of its own while it was stopped: the run's step says nothing of them.
  assert worker.resume_position(60, _saved(12, 0, False), adaptive=True) == (12, 0)



def test_every_evaluation_reads_the_same_held_out_windows():
  # Each evaluation drew new windows: the learners' final loss and the baseline's were
  # taken on different windows (a "1.26x the baseline" of a model that scored 0.94x on
  # the baseline's), and two evaluations of the same parameters differed.
  cfg = config_lib.load(Path(__file__).parent.parent / "configs" / "quickstart.toml")
  _, tokens = data.load_corpus(cfg.corpus_bytes)
  seen = []
  def loss(params, batch):
    seen.append(batch)
    return float(np.mean(batch)) + params
  first = worker.evaluate(loss, 0.0, worker.held_out(cfg, tokens))
  again = worker.evaluate(loss, 0.0, worker.held_out(cfg, tokens))  # as the baseline's
  assert first == again and len(seen) == 2 * cfg.eval_batches
  for a, b in zip(seen[:cfg.eval_batches], seen[cfg.eval_batches:]):
    np.testing.assert_array_equal(a, b)
  assert seen[0].shape == (cfg.batch_size, cfg.model.seq_len + 1)
  assert not np.array_equal(seen[0], seen[1])  # random windows, not one repeated
