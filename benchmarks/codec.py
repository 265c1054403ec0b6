"""Codec throughput: gmjax.encode / gmjax.decode of a 64 MiB F32 pytree, per precision.

Reported as ratios, measured in one run: to a numpy copy of the same arrays (np.copy of
64 MiB), and to a numpy + ml_dtypes implementation of the same codec (written below).
Every variant and the copy run once per round, in an order shuffled each round, after a
warm-up call each (compilation, first touch); each time is the median over the rounds, with
``block_until_ready`` on the results.

Page faults on fresh output buffers move these numbers from one process to the next (see
BENCHMARKS.md), so ``--processes N`` measures in N fresh processes and reports each cell's
median and range. Under ``GLIBC_TUNABLES`` that keep freed memory for reuse, outputs need
no fresh pages at all, for numpy as for XLA.

Run: .venv/bin/python benchmarks/codec.py [--repeats N] [--processes N]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import gmjax

PRECISIONS = ("F32", "F16", "BF16", "F8_E4M3", "F4", "I4")
QMAX = {"F8_E4M3": 448.0, "F4": 6.0, "I4": 7.0}
CASTS = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}


def numpy_encode(tree, precision):
  """The codec in numpy + ml_dtypes: entries by name, NaN/Inf refused."""
  entries = {}
  for name, x in tree.items():
    if precision in CASTS:
      out = x.astype(CASTS[precision])
      if not np.isfinite(out).all():
        raise ValueError(name)
      entries[name] = out
      continue
    blocks = x.reshape(-1, 32)  # the benchmark's sizes are multiples of 32
    scales = np.abs(blocks).max(axis=1) / np.float32(QMAX[precision])
    if not np.isfinite(scales).all():
      raise ValueError(name)
    safe = np.where(scales > 0, scales, np.float32(1))[:, None]
    scaled = np.clip(blocks / safe, -QMAX[precision], QMAX[precision])
    if precision == "F8_E4M3":
      entries[name] = scaled.astype(ml_dtypes.float8_e4m3fn).reshape(x.shape)
    else:
      if precision == "F4":
        nibbles = scaled.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0x0F
      else:
        nibbles = np.rint(scaled).astype(np.int8).view(np.uint8) & 0x0F
      nibbles = nibbles.reshape(-1)
      entries[name] = nibbles[0::2] | (nibbles[1::2] << 4)
    entries[name + ".scale"] = scales
  return entries


def numpy_decode(entries, shapes, precision):
  out = {}
  for name, shape in shapes.items():
    data = entries[name]
    if precision in CASTS:
      out[name] = data.astype(np.float32)
      continue
    if precision == "F8_E4M3":
      values = data.astype(np.float32).reshape(-1, 32)
    else:
      nibbles = np.empty(data.size * 2, np.uint8)
      nibbles[0::2] = data & 0x0F
      nibbles[1::2] = data >> 4
      if precision == "F4":
        values = nibbles.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
      else:
        values = ((nibbles.view(np.int8) << 4) >> 4).astype(np.float32)
      values = values.reshape(-1, 32)
    out[name] = (values * entries[name + ".scale"][:, None]).reshape(shape)
  return out


def seconds(fn):
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


def interleaved_medians(fns, rounds, seed=0):
  """Median seconds of each of ``fns`` (by name), each run once per round.

  Every function is called once first (compilation, first touch). Running the variants
  and the copy they are compared with in the same rounds exposes them to the same machine
  state, so slow phases (other load, frequency changes) affect all of them alike. The
  order is shuffled every round (seeded): a function's time depends on what ran just
  before it (memory the previous one freed, caches), and a fixed order would favour or
  penalize the same functions every round.
  """
  for fn in fns.values():
    fn()
  order = list(fns)
  rng = random.Random(seed)
  times = {name: [] for name in fns}
  for _ in range(rounds):
    rng.shuffle(order)
    for name in order:
      times[name].append(seconds(fns[name]))
  return {name: statistics.median(t) for name, t in times.items()}


def measure(repeats):
  """Ratios from one process: a dict of floats by column name and precision."""
  rng = np.random.default_rng(0)
  # 64 MiB of F32 in four leaves.
  host = {f"layer{i}/kernel": rng.standard_normal((2048, 2048), np.float32) for i in range(4)}
  tree = {name: jnp.asarray(value) for name, value in host.items()}
  schema = gmjax.Schema.from_tree(tree)
  shapes = {name: value.shape for name, value in host.items()}
  # For reference only: the same copy into buffers allocated (and faulted in) beforehand.
  targets = {name: np.empty_like(value) for name, value in host.items()}
  # The least any decode can take: XLA writing a fresh 64 MiB F32 output, here filled
  # with a value it only knows at run time.
  fill = jax.jit(lambda value: {name: jnp.full(shape, value) for name, shape in shapes.items()})
  one = jnp.float32(1)
  fns = {
      "copy": lambda: [np.copy(v) for v in host.values()],
      "copy_into": lambda: [np.copyto(targets[n], v) for n, v in host.items()],
      "fill": lambda: jax.block_until_ready(fill(one)),
  }
  np_fns = {"copy": fns["copy"]}
  for precision in PRECISIONS:
    entries = gmjax.encode(tree, precision)
    host_entries = numpy_encode(host, precision)
    fns[precision, "encode"] = (
        lambda p=precision: jax.block_until_ready(gmjax.encode(tree, p)))
    fns[precision, "decode"] = (
        lambda p=precision, e=entries: jax.block_until_ready(gmjax.decode(e, schema, p)))
    np_fns[precision, "encode"] = lambda p=precision: numpy_encode(host, p)
    np_fns[precision, "decode"] = (
        lambda p=precision, e=host_entries: numpy_decode(e, shapes, p))
  t = interleaved_medians(fns, repeats)
  t_np = interleaved_medians(np_fns, max(3, repeats // 3))
  copy = t["copy"]
  out = {
      "copy_ms": copy * 1e3,
      "copy_into_ms": t["copy_into"] * 1e3,
      "numpy_rounds_copy_ms": t_np["copy"] * 1e3,
      "fill": t["fill"] / copy,
  }
  for p in PRECISIONS:
    encode, decode = t[p, "encode"], t[p, "decode"]
    out[f"{p} encode"] = encode / copy
    out[f"{p} decode"] = decode / copy
    out[f"{p} numpy encode"] = t_np[p, "encode"] / encode
    out[f"{p} numpy decode"] = t_np[p, "decode"] / decode
    # How much faster than numpy a decode could be at best: numpy's decode against the
    # fill, each as a multiple of the copy measured in its own rounds.
    out[f"{p} numpy decode / fill"] = (t_np[p, "decode"] / t_np["copy"]) / out["fill"]
  return out


def cell(values, digits):
  """The median, with the range when there are several values."""
  middle = statistics.median(values)
  if len(values) == 1:
    return f"{middle:.{digits}f}"
  return f"{middle:.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})"


def report(runs):
  """Prints the table: each cell the median over ``runs`` (one dict per process)."""
  col = lambda key: [r[key] for r in runs]  # noqa: E731
  print(f"jax {jax.__version__}, numpy {np.__version__}, {platform.machine()},"
        f" {os.cpu_count()} CPUs, {len(runs)} process(es); GLIBC_TUNABLES="
        f"{os.environ.get('GLIBC_TUNABLES', '')!r}")
  print(f"numpy copy of 64 MiB: {cell(col('copy_ms'), 1)} ms; into preallocated buffers:"
        f" {cell(col('copy_into_ms'), 1)} ms; XLA fill of a fresh 64 MiB F32 output (the"
        f" floor for a decode): {cell(col('fill'), 2)}x copy")
  print("| precision | encode / copy | decode / copy | numpy encode / gmjax |"
        " numpy decode / gmjax | numpy decode / XLA fill |")
  print("| --- | --- | --- | --- | --- | --- |")
  for p in PRECISIONS:
    print(f"| {p} | {cell(col(f'{p} encode'), 2)} | {cell(col(f'{p} decode'), 2)} |"
          f" {cell(col(f'{p} numpy encode'), 1)} | {cell(col(f'{p} numpy decode'), 1)} |"
          f" {cell(col(f'{p} numpy decode / fill'), 1)} |", flush=True)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--repeats", type=int, default=21,
                      help="rounds of the gmjax variants and the copy (numpy codec: a third)")
  parser.add_argument("--processes", type=int, default=1,
                      help="measure in this many fresh processes, one after another, and"
                      " report each cell's median and range over them")
  parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.processes > 1:
    runs = []
    for _ in range(args.processes):
      out = subprocess.run(
          [sys.executable, __file__, "--repeats", str(args.repeats), "--json"],
          check=True, capture_output=True, text=True,
      ).stdout
      runs.append(json.loads(out.strip().splitlines()[-1]))
    report(runs)
    return
  result = measure(args.repeats)
  if args.json:
    print(json.dumps(result))
  else:
    report([result])


if __name__ == "__main__":
  main()
