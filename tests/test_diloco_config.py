"""gmjax.DiLoCo: eager validation, JSON round trip, the fragment plan."""

import hypothesis
import hypothesis.strategies as st
import pytest

import gmjax


@pytest.mark.parametrize(
    "field, value",
    [("sync_every", 0), ("sync_every", 2.5), ("fragments", 0), ("fragments", 9),
     ("outer_learning_rate", 0.0), ("outer_learning_rate", -1.0),
     ("outer_learning_rate", float("nan")), ("outer_learning_rate", float("inf")),
     ("outer_momentum", 1.0), ("outer_momentum", -0.1), ("nesterov", 1),
     ("delta_precision", "F8"), ("commit_precision", "int4"), ("mixing", 1.0),
     ("mixing", -0.5), ("overlap_steps", 8), ("overlap_steps", -1), ("in_flight", 0),
     ("quorum_size", 0), ("global_batch_size", -4), ("flush_on_close", "yes")],
)
def test_bad_field_named(field, value):
  with pytest.raises(ValueError, match=field):
    gmjax.DiLoCo(sync_every=8, **{field: value}) if field != "sync_every" else gmjax.DiLoCo(
        sync_every=value)


def test_json_round_trip():
  config = gmjax.DiLoCo(sync_every=10, fragments=3, outer_learning_rate=0.5,
                        nesterov=False, delta_precision="F4", commit_precision="BF16",
                        mixing=0.25, overlap_steps=None, in_flight=2, quorum_size=2,
                        flush_on_close=False, global_batch_size=64)
  record = config.to_json()
  assert record["name"] == "DiLoCo"
  assert gmjax.DiLoCo.from_json(record) == config
  assert gmjax.DiLoCo.from_json(gmjax.DiLoCo(sync_every=3).to_json()) == gmjax.DiLoCo(3)
  with pytest.raises(ValueError):
    gmjax.DiLoCo.from_json({**record, "surprise": 1})
  with pytest.raises(ValueError):
    gmjax.DiLoCo.from_json({**record, "name": "SGD"})


def test_protocol_values():
  config = gmjax.DiLoCo(sync_every=6, fragments=2, quorum_size=3, global_batch_size=32)
  assert config.quorum() == 3 and config.global_batch() == 32
  assert gmjax.DiLoCo(sync_every=6).quorum() == 1
  schedule = config.schedule(2)
  assert (schedule.sync_every, schedule.fragments) == (6, 2)


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(
    st.lists(st.tuples(st.integers(1, 500), st.sampled_from(["F32", "BF16"])),
             min_size=1, max_size=12),
    st.integers(1, 16),
)
def test_plan(leaves, fragments):
  schema = gmjax.Schema(tuple(gmjax.ParameterSpec(f"p{i:02d}", dtype, (size,))
                              for i, (size, dtype) in enumerate(leaves)))
  config = gmjax.DiLoCo(sync_every=16, fragments=fragments)
  plan = config.plan(schema)
  assert plan == config.plan(schema)  # deterministic
  assert len(plan) == min(fragments, len(leaves))
  names = [n for part in plan for n in part]
  assert sorted(names) == sorted(schema.names)  # every leaf exactly once
  assert all(part for part in plan)
  loads = [sum(schema[n].nbytes for n in part) for part in plan]
  # Greedy balance: no fragment exceeds the lightest by more than the largest leaf.
  assert max(loads) - min(loads) <= max(spec.nbytes for spec in schema)
