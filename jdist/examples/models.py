"""The seed tutorials' models, in flax linen.

`MLP`: Dense 16 then Dense 10 (the toy model of the seed tutorial).
`CNN`: Conv 32, Conv 64, Dense 64, Dense 10, with optional batch norm and
dropout. Both compute in the dtype of their inputs and parameters unless
`dtype` says otherwise (flax's rule), so a mixed precision policy that casts
them (`jdist.Trainer(..., dtype_policy="mixed_bfloat16")`) runs them in
bfloat16. Dropout uses `jdist.dropout`, keyed by global example position, so
the model trains the same on any number of replicas.
`GPT`: a small decoder-only transformer for model parallelism, with
`gpt_layout_map` (Megatron-style tensor parallelism, and pipeline stages over
its stacked blocks) and `gpt_fsdp_strategy`.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

import jdist


class MLP(nn.Module):
  hidden: int = 16
  classes: int = 10
  param_dtype: Any = jnp.float32
  dtype: Any = None  # None: the inputs' and parameters' dtype

  @nn.compact
  def __call__(self, x, train: bool = False):
    del train
    dense = functools.partial(nn.Dense, param_dtype=self.param_dtype,
                              dtype=self.dtype)
    x = nn.relu(dense(self.hidden)(x))
    return dense(self.classes)(x)


class CNN(nn.Module):
  """Conv 32, Conv 64, Dense 64, Dense 10.

  Attributes:
    batch_norm: add BatchNorm after the first convolution.
    bn_axis_name: mesh axis to average batch statistics over (the strategy's
      `axis_name`), or None for per-replica statistics.
    dropout_rate: dropout before the last layer (0 to disable).
    param_dtype: the parameters' dtype.
    dtype: the computation's dtype; None (default): that of the inputs and
      parameters.
  """

  classes: int = 10
  batch_norm: bool = False
  bn_axis_name: str | None = None
  dropout_rate: float = 0.0
  param_dtype: Any = jnp.float32
  dtype: Any = None

  @nn.compact
  def __call__(self, x, train: bool = False):
    kw = dict(param_dtype=self.param_dtype, dtype=self.dtype)
    # A bias right before BatchNorm has no effect but noise for the optimiser.
    x = nn.Conv(32, (3, 3), use_bias=not self.batch_norm, **kw)(x)
    if self.batch_norm:
      x = nn.BatchNorm(use_running_average=not train, momentum=0.9,
                       axis_name=self.bn_axis_name if train else None, **kw)(x)
    x = nn.relu(x)
    x = nn.relu(nn.Conv(64, (3, 3), **kw)(x))
    x = x.reshape((x.shape[0], -1))
    x = nn.relu(nn.Dense(64, **kw)(x))
    if self.dropout_rate and train:
      x = jdist.dropout(self.make_rng("dropout"), self.dropout_rate, x)
    return nn.Dense(self.classes, **kw)(x)



class GPTBlock(nn.Module):
  """Pre-norm decoder block: causal multi-head attention, then an MLP."""

  num_heads: int
  mlp_dim: int

  @nn.compact
  def __call__(self, x):
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
    h = nn.LayerNorm(name="attn_norm")(x)
    x = x + nn.MultiHeadDotProductAttention(
        num_heads=self.num_heads, name="attn")(h, h, mask=mask)
    h = nn.LayerNorm(name="mlp_norm")(x)
    h = nn.gelu(nn.Dense(self.mlp_dim, name="mlp_in")(h))
    return x + nn.Dense(x.shape[-1], name="mlp_out")(h)


class GPT(nn.Module):
  """A small GPT: token and position embeddings, `num_layers` decoder blocks
  (causal multi-head attention, MLP, layer norms), a final layer norm and a
  language-model head. Maps int tokens `(batch, length)` to logits
  `(batch, length, vocab_size)`; `length` is at most `max_len`.

  Parameter paths (what a `LayoutMap` key names): `token_embed/embedding`,
  `position_embed/embedding`, `block_{i}/attn/{query,key,value}/kernel`
  (embed, heads, head_dim), `block_{i}/attn/out/kernel` (heads, head_dim,
  embed), `block_{i}/mlp_in/kernel`, `block_{i}/mlp_out/kernel`, their
  biases, `block_{i}/{attn,mlp}_norm/{scale,bias}`, `final_norm`, `head`.

  With `stacked=True` the blocks' parameters are stacked instead: one tree
  `blocks/...` (`blocks/attn/query/kernel` of shape (num_layers, embed,
  heads, head_dim), ...) whose leading dimension is the block, run by
  `jdist.pipeline`: as pipeline stages under a strategy with a pipeline
  axis, one block after another elsewhere.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jdist.examples.models import GPT
    >>> model = GPT(vocab_size=32, max_len=8, embed_dim=16, num_heads=4,
    ...             num_layers=1, mlp_dim=32)
    >>> tokens = jnp.zeros((2, 8), jnp.int32)
    >>> variables = model.init(jax.random.key(0), tokens)
    >>> model.apply(variables, tokens).shape
    (2, 8, 32)
  """

  vocab_size: int = 64
  max_len: int = 16
  embed_dim: int = 32
  num_heads: int = 4
  num_layers: int = 2
  mlp_dim: int = 128
  stacked: bool = False

  def train_flops(self, tokens) -> float:
    """FLOPs of one training step (forward and backward pass) on `tokens`,
    by the model's own count: what model FLOPs utilization (MFU) counts.

    Each matrix product of an `(m, k)` by a `(k, n)` matrix is `2 m k n`
    FLOPs: per token and block, attention's query, key, value and output
    projections `8 d^2`, the MLP `4 d f`, and attention's scores and
    weighted values `4 d` per key attended to, of which a causal mask
    leaves `(length + 1) / 2` on average (the masked half is computed by
    the program but not counted); the head `2 d v` per token. Embedding
    lookups, layer norms, softmax and the optimizer are not counted. The
    backward pass is twice the forward.

    Args:
      tokens: the model's input `(batch, length)`: an array, a
        `jax.ShapeDtypeStruct`, or its shape.

    Example:
      >>> from jdist.examples.models import GPT
      >>> GPT(vocab_size=32, max_len=8, embed_dim=16, num_heads=4,
      ...     num_layers=1, mlp_dim=64).train_flops((2, 8))
      357888.0
    """
    batch, length = tuple(getattr(tokens, "shape", tokens))[-2:]
    d, f = self.embed_dim, self.mlp_dim
    attention = 4 * d * (length + 1) / 2
    per_token = (self.num_layers * (8 * d * d + 4 * d * f + attention) +
                 2 * d * self.vocab_size)
    return 3.0 * batch * length * per_token

  @nn.compact
  def __call__(self, tokens, train: bool = False):
    del train  # no dropout
    length = tokens.shape[-1]
    x = nn.Embed(self.vocab_size, self.embed_dim, name="token_embed")(tokens)
    x = x + nn.Embed(self.max_len, self.embed_dim,
                     name="position_embed")(jnp.arange(length))
    if self.stacked:
      x = self._stacked_blocks(x)
    else:
      for i in range(self.num_layers):
        x = GPTBlock(self.num_heads, self.mlp_dim, name=f"block_{i}")(x)
    x = nn.LayerNorm(name="final_norm")(x)
    return nn.Dense(self.vocab_size, name="head")(x)

  def _stacked_blocks(self, x):
    """The blocks as one stacked tree of parameters, run by `jdist.pipeline`."""
    block = GPTBlock(self.num_heads, self.mlp_dim, parent=None)
    one = jnp.zeros((1,) + x.shape[1:], x.dtype)

    def init(key):
      keys = jax.random.split(key, self.num_layers)
      return jax.vmap(lambda k: block.init(k, one)["params"])(keys)

    blocks = self.param("blocks", init)
    return jdist.pipeline(lambda p, h: block.apply({"params": p}, h),
                          blocks, x)


def gpt_layout_map(mesh: jdist.DeviceMesh, model_axis: str | None = "model",
                   *, stage_axis: str | None = None) -> jdist.LayoutMap:
  """Megatron-style tensor parallelism for `GPT` over `model_axis`, and
  pipeline stages over `stage_axis` for the stacked GPT.

  Attention's query, key and value kernels are split by heads (a column
  split: each device computes its heads whole), its output kernel by heads
  too (a row split: one all-reduce of the block's output); the MLP's input
  kernel is column-split, its output kernel row-split. The token embedding
  and the head are split over the vocabulary; the position embedding, layer
  norms and row-split layers' biases stay whole. That is Megatron's count of
  all-reduces, two per block forward and two backward (benchmarks/
  model_parallel.py reads them in the compiled step): a position embedding
  split over the features would split the residual stream with it, and
  every layer norm would then all-reduce its statistics and every split
  matmul all-gather its input. The number of heads, `mlp_dim` and
  `vocab_size` must be multiples of the axis's size (the strategy says
  which is not).

  With `stage_axis` the keys are those of `GPT(stacked=True)`: every
  `blocks/...` parameter has its block dimension split over `stage_axis`
  (each stage holds its blocks) and the rest as above.

  Args:
    mesh: the `jdist.DeviceMesh` with `model_axis`.
    model_axis: the mesh axis the parameters are split over, or None for no
      tensor parallelism.
    stage_axis: the pipeline's mesh axis, for `GPT(stacked=True)`; None for
      the GPT with one parameter tree per block.

  Returns:
    A `jdist.LayoutMap` for `jdist.ModelParallelStrategy`.

  Example:
    >>> import jax, jdist
    >>> from jdist.examples.models import gpt_layout_map
    >>> mesh = jdist.DeviceMesh((1, len(jax.devices())), ("data", "model"))
    >>> layout_map = gpt_layout_map(mesh)
    >>> layout_map["block_0/attn/query/kernel"]
    P(None, 'model', None)
  """
  m = model_axis
  layout_map = jdist.LayoutMap(mesh)
  if stage_axis is None:
    block, lead = r"block_\d+", ()
  else:  # every stacked parameter: its blocks over the stages
    block, lead = "blocks", (stage_axis,)
    layout_map[r"blocks/.*(norm/(scale|bias)|out/bias)"] = (stage_axis, None)
  layout_map["token_embed/embedding"] = (m, None)
  layout_map[rf"{block}/attn/(query|key|value)/kernel"] = lead + (None, m, None)
  layout_map[rf"{block}/attn/(query|key|value)/bias"] = lead + (m, None)
  layout_map[rf"{block}/attn/out/kernel"] = lead + (m, None, None)
  layout_map[rf"{block}/mlp_in/kernel"] = lead + (None, m)
  layout_map[rf"{block}/mlp_in/bias"] = lead + (m,)
  layout_map[rf"{block}/mlp_out/kernel"] = lead + (m, None)
  layout_map["head/kernel"] = (None, m)
  layout_map["head/bias"] = (m,)
  return layout_map


def gpt_fsdp_strategy(mesh: jdist.DeviceMesh, batch_dim_name: str = "data",
                      fsdp_axis: str = "fsdp") -> jdist.ModelParallelStrategy:
  """FSDP (ZeRO-3) for `GPT`: every parameter, its gradient and optimizer
  state split over `fsdp_axis` (its largest dimension the axis divides),
  each replica's batch too; no layout rules.

  Args:
    mesh: a `jdist.DeviceMesh` with the two axes.
    batch_dim_name: the replicas' axis (size 1 for FSDP alone).
    fsdp_axis: the axis that splits the parameters and each replica's batch.

  Example:
    >>> import jax, jdist
    >>> from jdist.examples.models import gpt_fsdp_strategy
    >>> mesh = jdist.DeviceMesh((1, len(jax.devices())), ("data", "fsdp"))
    >>> gpt_fsdp_strategy(mesh).fsdp_axis
    'fsdp'
  """
  return jdist.ModelParallelStrategy(layout_map=jdist.LayoutMap(mesh),
                                     batch_dim_name=batch_dim_name,
                                     fsdp_axis=fsdp_axis)
