"""Loads a script of ``benchmarks/`` as a module, for the tests that run it."""

import importlib.util
import os
import sys
import types

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "benchmarks")


def load(name: str) -> types.ModuleType:
  """``benchmarks/<name>.py`` as the module ``gmjax_<name>`` (the scripts import their
  siblings, such as ``inmesh``, as the interpreter running one would find them)."""
  if BENCHMARKS not in sys.path:
    sys.path.append(BENCHMARKS)
  spec = importlib.util.spec_from_file_location(f"gmjax_{name}",
                                                os.path.join(BENCHMARKS, f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses look their module up there
  spec.loader.exec_module(module)
  return module
