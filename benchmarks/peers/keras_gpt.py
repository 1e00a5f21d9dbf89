"""Keras 3 worker for benchmarks/model_parallel.py: the example GPT under
`keras.distribution.ModelParallel`, trained with `model.fit`.

The GPT of `jdist.examples.models` built from Keras layers (token and
position embeddings, pre-norm blocks of causal `MultiHeadAttention` and a
gelu MLP, a final layer norm, a head), loaded with jdist's initial weights
(`--weights`, an .npz keyed by flax's parameter paths), adam (optax's
epsilon), tensor parallel over `DeviceMesh((1, N), ["batch", "model"])` with
the `LayoutMap` equivalent to `gpt_layout_map`. Each timed block is one `fit`
epoch over exactly the block's batches (the same synthetic batches as
model_parallel.py, in the same order). Protocol: benchmarks/peers/common.py.
Run with XLA_FLAGS=--xla_force_host_platform_device_count=N.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ["KERAS_BACKEND"] = "jax"

import numpy as np  # noqa: E402

import common  # noqa: E402

NUM_BATCHES = 4


def tokens(cfg: dict, batch: int) -> list:
  """model_parallel.py's batches: the same generator, the same seed."""
  rng = np.random.default_rng(0)
  return [rng.integers(0, cfg["vocab_size"], (batch, cfg["max_len"] + 1))
          .astype(np.int32) for _ in range(NUM_BATCHES)]


def layout_map(mesh):
  """`gpt_layout_map`'s Megatron split, over Keras's variable paths."""
  import keras
  lm = keras.distribution.LayoutMap(mesh)
  lm["token_embed/embeddings"] = ("model", None)
  lm[r"block_\d+_attn/(query|key|value)/kernel"] = (None, "model", None)
  lm[r"block_\d+_attn/(query|key|value)/bias"] = ("model", None)
  lm[r"block_\d+_attn/attention_output/kernel"] = ("model", None, None)
  lm[r"block_\d+_mlp_in/kernel"] = (None, "model")
  lm[r"block_\d+_mlp_in/bias"] = ("model",)
  lm[r"block_\d+_mlp_out/kernel"] = ("model", None)
  lm["head/kernel"] = (None, "model")
  lm["head/bias"] = ("model",)
  return lm


def build(cfg: dict):
  import keras
  from keras import layers, ops

  class PositionEmbedding(layers.Layer):
    def __init__(self, max_len, dim, **kw):
      super().__init__(**kw)
      self.max_len, self.dim = max_len, dim

    def build(self, shape):
      self.embeddings = self.add_weight(shape=(self.max_len, self.dim),
                                        name="embeddings")

    def call(self, x):
      return x + ops.expand_dims(self.embeddings[:ops.shape(x)[1]], 0)

  gelu = lambda x: keras.activations.gelu(x, approximate=True)  # flax's
  d, heads = cfg["embed_dim"], cfg["num_heads"]
  inp = keras.Input((cfg["max_len"],), dtype="int32")
  x = layers.Embedding(cfg["vocab_size"], d, name="token_embed")(inp)
  x = PositionEmbedding(cfg["max_len"], d, name="position_embed")(x)
  for i in range(cfg["num_layers"]):
    h = layers.LayerNormalization(epsilon=1e-6, name=f"block_{i}_attn_norm")(x)
    x = x + layers.MultiHeadAttention(heads, d // heads, name=f"block_{i}_attn")(
        h, h, use_causal_mask=True)
    h = layers.LayerNormalization(epsilon=1e-6, name=f"block_{i}_mlp_norm")(x)
    h = layers.Dense(cfg["mlp_dim"], activation=gelu, name=f"block_{i}_mlp_in")(h)
    x = x + layers.Dense(d, name=f"block_{i}_mlp_out")(h)
  x = layers.LayerNormalization(epsilon=1e-6, name="final_norm")(x)
  return keras.Model(inp, layers.Dense(cfg["vocab_size"], name="head")(x))


def keras_path(flax_path: str) -> str:
  """flax's parameter path -> the Keras variable's path."""
  parts = flax_path.split("/")
  leaf = {"embedding": "embeddings", "scale": "gamma"}.get(parts[-1], parts[-1])
  if parts[-2].endswith("norm"):
    leaf = {"bias": "beta"}.get(leaf, leaf)
  if parts[0].startswith("block_"):
    layer = f"{parts[0]}_{parts[1]}"
    inner = {"out": "attention_output"}.get(parts[2], parts[2]) \
        if len(parts) == 4 else None
    return "/".join(p for p in (layer, inner, leaf) if p)
  return f"{parts[0]}/{leaf}"


class Trainer:

  def __init__(self, cfg: dict, batch: int, weights: str):
    import keras
    self.batch = batch
    self.data = tokens(cfg, batch)
    self.model = build(cfg)
    saved = np.load(weights)
    by_path = {v.path: v for v in self.model.weights}
    for name in saved.files:
      by_path.pop(keras_path(name)).assign(saved[name])
    if by_path:
      raise SystemExit(f"Keras variables without jdist's weights: {sorted(by_path)}")
    self.model.compile(
        optimizer=keras.optimizers.Adam(1e-3, epsilon=1e-8),  # optax's adam
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    self.position = 0

  def run(self, steps: int) -> float:
    import jax
    idx = common.batch_indices(self.position, steps)
    self.position += steps
    seqs = np.concatenate([self.data[i] for i in idx])
    start = time.perf_counter()
    self.model.fit(seqs[:, :-1], seqs[:, 1:], batch_size=self.batch, epochs=1,
                   shuffle=False, verbose=0)
    jax.block_until_ready([v.value for v in self.model.trainable_variables])
    return time.perf_counter() - start

  def evaluate(self) -> float:
    seqs = self.data[0]
    logits = np.asarray(self.model(seqs[:, :-1], training=False))
    v = logits.shape[-1]
    return common.cross_entropy(logits.reshape(-1, v), seqs[:, 1:].reshape(-1))


def main(argv=None):
  argv = list(sys.argv[1:] if argv is None else argv)
  cfg = json.loads(common.pop_option(argv, "--config", "{}"))
  batch = common.pop_option(argv, "--batch", 16)
  weights = common.pop_option(argv, "--weights", "")
  args = common.parse_args(argv)
  proto = common.Protocol()
  import jax
  import keras
  devices = common.local_devices(args.replicas)
  mesh = keras.distribution.DeviceMesh((1, len(devices)), ["batch", "model"],
                                       devices)
  keras.distribution.set_distribution(keras.distribution.ModelParallel(
      layout_map=layout_map(mesh), batch_dim_name="batch"))
  trainers = {"gpt": Trainer(cfg, batch, weights)}
  variables = trainers["gpt"].model.weights
  split = [v.path for v in variables
           if any(a is not None for a in v.value.sharding.spec)]
  loss0 = {"gpt": trainers["gpt"].evaluate()}
  common.warm_all(trainers, args.warmup)
  common.serve(trainers, proto=proto, info={
      "loss0": loss0, "version": f"keras {keras.__version__} (jax {jax.__version__})",
      "layout": f"{len(split)} of {len(variables)} variables split over 'model'",
      "path": "model.fit (one epoch per block)"})


if __name__ == "__main__":
  main()
