"""A small decoder-only transformer language model in flax nnx, for the demo job."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  vocab: int = 256
  d_model: int = 64
  layers: int = 2
  heads: int = 4
  mlp: int = 256
  seq_len: int = 64


class Block(nnx.Module):
  """Pre-norm attention and MLP with residual connections."""

  def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
    self.norm1 = nnx.LayerNorm(config.d_model, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(
        num_heads=config.heads, in_features=config.d_model, decode=False, rngs=rngs
    )
    self.norm2 = nnx.LayerNorm(config.d_model, rngs=rngs)
    self.up = nnx.Linear(config.d_model, config.mlp, rngs=rngs)
    self.down = nnx.Linear(config.mlp, config.d_model, rngs=rngs)

  def __call__(self, x, mask):
    x = x + self.attention(self.norm1(x), mask=mask)
    return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class TransformerLM(nnx.Module):
  """Token and position embeddings, ``layers`` blocks, a final norm and an output head."""

  def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
    self.config = config
    self.embed = nnx.Embed(config.vocab, config.d_model, rngs=rngs)
    self.position = nnx.Embed(config.seq_len, config.d_model, rngs=rngs)
    self.blocks = nnx.List([Block(config, rngs) for _ in range(config.layers)])
    self.norm = nnx.LayerNorm(config.d_model, rngs=rngs)
    self.head = nnx.Linear(config.d_model, config.vocab, rngs=rngs)

  def __call__(self, tokens):
    length = tokens.shape[-1]
    x = self.embed(tokens) + self.position(jnp.arange(length))
    mask = nnx.make_causal_mask(tokens)
    for block in self.blocks:
      x = block(x, mask)
    return self.head(self.norm(x))


def loss_fn(model: TransformerLM, batch: jax.Array) -> jax.Array:
  """Mean next-token cross-entropy over a ``(batch, seq_len + 1)`` token array."""
  logits = model(batch[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def parameter_count(config: ModelConfig) -> int:
  """The parameters ``build(config)`` makes, counted from the sizes alone."""
  d, mlp = config.d_model, config.mlp
  norm = 2 * d
  attention = 4 * d * d + 4 * d  # query, key, value and output kernels and biases
  block = 2 * norm + attention + (d * mlp + mlp) + (mlp * d + d)
  return (config.vocab * d + config.seq_len * d + config.layers * block + norm
          + d * config.vocab + config.vocab)


def build(config: ModelConfig, seed: int = 0):
  """``(graphdef, params)`` of a fresh model: params is the ``nnx.Param`` state."""
  model = TransformerLM(config, nnx.Rngs(seed))
  graphdef, params = nnx.split(model, nnx.Param)
  return graphdef, params


def init_state(optimizer: optax.GradientTransformation, params):
  """``optimizer.init(params)``, committed to the device ``params`` are on (``placed``)."""
  return placed(optimizer.init(params), params)


def placed(tree, params):
  """``tree`` committed to the device ``params`` are on.

  ``optimizer.init`` makes its counters as uncommitted arrays, while the state a jitted
  step returns is committed, and ``jax.jit`` compiles again for committed arguments: the
  step's second call compiled as long as its first.
  """
  return jax.device_put(tree, jax.tree.leaves(params)[0].sharding)


def make_train_step(graphdef, optimizer: optax.GradientTransformation):
  """A jitted ``(params, opt_state, batch) -> (params, opt_state, loss)`` inner step."""

  def compute_loss(params, batch):
    return loss_fn(nnx.merge(graphdef, params), batch)

  @jax.jit
  def train_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(compute_loss)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  @jax.jit
  def evaluate(params, batch):
    return compute_loss(params, batch)

  return train_step, evaluate
