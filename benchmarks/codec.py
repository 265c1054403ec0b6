"""Codec throughput: gmjax.encode / gmjax.decode of a 64 MiB F32 pytree, per precision.

Reported as ratios, measured in one run: to a numpy copy of the same arrays (np.copy of
64 MiB), and to a numpy + ml_dtypes implementation of the same codec (written below).
Each time is the median of several repetitions after a warm-up call (compilation), with
``block_until_ready`` on the results.

Run: .venv/bin/python benchmarks/codec.py [--repeats N]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
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


def median_seconds(fn, repeats):
  fn()  # warm-up: compilation and first-touch
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--repeats", type=int, default=9)
  args = parser.parse_args()
  rng = np.random.default_rng(0)
  # 64 MiB of F32 in four leaves.
  host = {f"layer{i}/kernel": rng.standard_normal((2048, 2048), np.float32) for i in range(4)}
  tree = {name: jnp.asarray(value) for name, value in host.items()}
  schema = gmjax.Schema.from_tree(tree)
  shapes = {name: value.shape for name, value in host.items()}
  copy = median_seconds(lambda: [np.copy(v) for v in host.values()], args.repeats)
  # For reference only: the same copy into buffers allocated (and faulted in) beforehand.
  targets = {name: np.empty_like(value) for name, value in host.items()}
  copy_into = median_seconds(
      lambda: [np.copyto(targets[n], v) for n, v in host.items()], args.repeats)
  print(f"jax {jax.__version__}, numpy {np.__version__}, {platform.machine()},"
        f" {os.cpu_count()} CPUs; numpy copy of 64 MiB: {copy * 1e3:.1f} ms"
        f" (into preallocated buffers: {copy_into * 1e3:.1f} ms)")
  print("| precision | encode / copy | decode / copy | numpy encode / gmjax | numpy decode / gmjax |")
  print("| --- | --- | --- | --- | --- |")
  for precision in PRECISIONS:
    entries = gmjax.encode(tree, precision)
    encode = median_seconds(
        lambda p=precision: jax.block_until_ready(gmjax.encode(tree, p)), args.repeats)
    decode = median_seconds(
        lambda p=precision, e=entries: jax.block_until_ready(gmjax.decode(e, schema, p)),
        args.repeats)
    host_entries = numpy_encode(host, precision)
    reps = max(3, args.repeats // 3)
    np_encode = median_seconds(lambda p=precision: numpy_encode(host, p), reps)
    np_decode = median_seconds(
        lambda p=precision, e=host_entries: numpy_decode(e, shapes, p), reps)
    print(f"| {precision} | {encode / copy:.2f} | {decode / copy:.2f} |"
          f" {np_encode / encode:.1f} | {np_decode / decode:.1f} |", flush=True)


if __name__ == "__main__":
  main()
