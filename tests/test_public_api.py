"""The public surface: every name in gmjax.__all__ (and SPEC section 5's core) imports."""

import importlib

import gmjax
from gmjax.core.aggregator import DiLoCoAggregator

CORE_NAMES = (
    "RoundSchedule", "Estimates", "FragmentState", "Contribution", "Participant",
    "RoundResult", "Algorithm", "Aggregator", "ParameterSpec", "Schema", "layout", "encode",
    "decode", "quantize", "dequantize", "cosine", "DiLoCo",
)


def test_all_names_import():
  module = importlib.import_module("gmjax")
  assert len(set(gmjax.__all__)) == len(gmjax.__all__)
  for name in gmjax.__all__:
    assert getattr(module, name) is not None, name
  namespace = {}
  exec("from gmjax import *", namespace)  # pylint: disable=exec-used
  assert set(gmjax.__all__) <= set(namespace)


def test_core_names_of_the_spec():
  for name in CORE_NAMES:
    assert name in gmjax.__all__, name
    assert hasattr(gmjax, name), name


def test_protocols():
  algorithm = gmjax.DiLoCo(sync_every=4)
  assert isinstance(algorithm, gmjax.Algorithm)
  schema = gmjax.Schema((gmjax.ParameterSpec("w", "F32", (2,)),))
  assert isinstance(DiLoCoAggregator(algorithm, schema), gmjax.Aggregator)
