"""The wire codec's public pytree API: ``encode``, ``decode``, ``layout``, ``quantize``.

A tensor travels at a *precision*: cast to F32/F16/BF16 (round to nearest even), or
blockwise quantized to F8_E4M3, F4, I4 or I2 codes with one F32 scale per 32 values, stored
as ``<name>`` and ``<name>.scale`` (``layout``). Layouts, encoding and decoding belong to
``gmjax.core.wire.Wire``; the bit-level kernels are in ``gmjax.core.kernels``, and
``quantize``, ``dequantize`` and the block constants are re-exported here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from gmjax.core.kernels import BLOCK as BLOCK
from gmjax.core.kernels import CODE_BITS as CODE_BITS
from gmjax.core.kernels import QMAX as QMAX
from gmjax.core.kernels import dequantize as dequantize
from gmjax.core.kernels import num_blocks as num_blocks
from gmjax.core.kernels import packed_size as packed_size
from gmjax.core.kernels import quantize as quantize
from gmjax.core.records import QUANTIZED as QUANTIZED
from gmjax.core.records import Precision
from gmjax.core.schema import NUMPY_DTYPES, Schema
from gmjax.core.wire import JNP_DTYPES as JNP_DTYPES
from gmjax.core.wire import Wire
from gmjax.core.wire import check_precision as check_precision


def layout(schema: Schema, precision: Precision) -> Schema:
  """What ``schema``'s tensors travel as at ``precision`` (``Wire(precision).layout``).

  Each leaf in that dtype, or as it is with ``None``; a quantized leaf as its codes (F8:
  ``F8_E4M3`` of the logical shape; F4/I4: ``U8`` of shape ``(ceil(n/2),)``; I2: ``U8`` of
  shape ``(ceil(n/4),)``) and ``<name>.scale`` (``F32`` of shape ``(ceil(n/32),)``).
  """
  return Wire(precision).layout(schema, "gmjax.layout")


def encode(tree: Any, precision: Precision) -> dict[str, jax.Array]:
  """Encodes a parameter pytree to payload entries by name (see ``layout``).

  Args:
    tree: a pytree of F32/F16/BF16 arrays.
    precision: None (each leaf in its own dtype), a parameter dtype, or a quantized format.

  Returns:
    The payload entries, keyed by leaf name (and ``<name>.scale`` when quantized).

  Raises:
    ValueError: an unknown precision, or a leaf holding NaN/Inf (named in the message).

  Example:
    >>> import jax.numpy as jnp
    >>> import gmjax
    >>> delta = {"w": jnp.linspace(-1.0, 1.0, 64).reshape(8, 8)}
    >>> entries = gmjax.encode(delta, "I4")  # 4-bit codes, one F32 scale per 32 values
    >>> {name: (str(v.dtype), v.shape) for name, v in sorted(entries.items())}
    {'w': ('uint8', (32,)), 'w.scale': ('float32', (2,))}
  """
  wire = Wire(precision)
  schema = Schema.from_tree(tree)
  return wire.encode(schema.flatten(tree), schema)


def decode(entries: Mapping[str, Any], schema: Schema, precision: Precision) -> Any:
  """Decodes payload entries to F32: a tree shaped like ``schema``'s source, or a dict.

  Args:
    entries: payload entries by name, as ``encode`` returns them.
    schema: the ``Schema`` of the encoded tree (``Schema.from_tree(tree)``).
    precision: the precision the entries were encoded at.

  Returns:
    F32 arrays: a pytree shaped like the tree ``schema`` was built from, or a dict by
    leaf name when ``schema`` has no tree structure.

  Example:
    >>> import jax.numpy as jnp
    >>> import gmjax
    >>> delta = {"w": jnp.linspace(-1.0, 1.0, 64).reshape(8, 8)}
    >>> schema = gmjax.Schema.from_tree(delta)
    >>> back = gmjax.decode(gmjax.encode(delta, "I4"), schema, "I4")
    >>> back["w"].dtype, back["w"].shape
    (dtype('float32'), (8, 8))
    >>> print(f"{float(jnp.abs(back['w'] - delta['w']).max()):.4f}")  # at most scale / 2
    0.0635
  """
  values = Wire(precision).decode(entries, Schema.given(schema, "gmjax.decode"))
  if schema.treedef is None:
    return values
  return schema.unflatten(values)


def to_numpy(entries: Mapping[str, Any], payload_schema: Schema) -> dict[str, np.ndarray]:
  """Host copies of payload entries, each in the numpy dtype its layout spec names."""
  host = jax.device_get(dict(entries))
  return {
      spec.name: np.asarray(host[spec.name]).astype(NUMPY_DTYPES[spec.dtype], copy=False)
      for spec in payload_schema.parameters
  }
