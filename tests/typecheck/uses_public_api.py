"""A user's program, typed as a user types one: mypy must accept it.

tests/test_typing.py runs mypy over it and runs it. It trains a linear
model twice, once with a hand-written step under a strategy, once with the
Trainer, through the names IDEs and type checkers read from
`jdist/__init__.pyi`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jdist


def make_data(n: int) -> tuple[np.ndarray, np.ndarray]:
  rng = np.random.default_rng(0)
  x = rng.normal(size=(n, 4)).astype(np.float32)
  y = x @ np.arange(1.0, 5.0, dtype=np.float32)[:, None]
  return x, y


def train_by_hand(strategy: jdist.Strategy, x: np.ndarray,
                  y: np.ndarray) -> float:
  """A custom loop: mirrored weights, a step per replica, reduced losses."""
  w = strategy.replicate(jnp.zeros((4, 1)))

  @strategy.function
  def step(w: jax.Array,
           batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    def loss_fn(w: jax.Array) -> jax.Array:
      per_example = jnp.sum((batch["x"] @ w - batch["y"]) ** 2, axis=-1)
      return jdist.compute_average_loss(per_example)

    loss, grad = jax.value_and_grad(loss_fn)(w)
    return w - 0.05 * grad, loss

  batches = [{"x": x[i:i + 8], "y": y[i:i + 8]} for i in range(0, len(x), 8)]
  total = 0.0
  for batch in strategy.experimental_distribute_dataset(batches):
    w, loss = step(w, batch)
    total += float(strategy.reduce(jdist.ReduceOp.SUM, loss, axis=None))
  return total / len(batches)


def apply(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
  return x @ params["w"] + params["b"]


def train_with_trainer(strategy: jdist.Strategy, x: np.ndarray,
                       y: np.ndarray) -> list[float]:
  """Keras' fit, evaluate and callbacks through jdist.Trainer."""
  trainer = jdist.Trainer(
      apply, params={"w": jnp.zeros((4, 1)), "b": jnp.zeros((1,))},
      optimizer=optax.sgd(0.05), loss="mse", strategy=strategy)
  stop = jdist.EarlyStopping(monitor="loss", patience=2)
  history: jdist.History = trainer.fit(x, y, batch_size=8, epochs=3,
                                       verbose=0, callbacks=[stop])
  logs: dict = trainer.evaluate(x, y, batch_size=8)
  assert set(logs) == {"loss"}, logs
  return [float(v) for v in history.history["loss"]]


def main() -> None:
  x, y = make_data(32)
  strategy = jdist.MirroredStrategy(axis_name="batch")
  replicas: int = strategy.num_replicas_in_sync
  by_hand = train_by_hand(strategy, x, y)
  losses = train_with_trainer(strategy, x, y)
  assert replicas >= 1 and np.isfinite(by_hand) and losses[-1] < losses[0]
  print(f"replicas={replicas} by_hand={by_hand:.3f} fit={losses}")


if __name__ == "__main__":
  main()
