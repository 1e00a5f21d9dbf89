"""5,000 steps on fake CPU devices finish (ARCHITECTURE.md, "CPU throttle").

Runs in a child process: the deadlock aborts the whole process after 40 s,
which must fail this test, not kill the test runner.
"""

import os
import subprocess
import sys
import textwrap

import pytest

from conftest import xla_flags

SCRIPT = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, numpy as np, optax
    import jdist
    from jdist.examples.models import MLP
    from jdist.examples.steps import classifier_step
    n = len(jax.local_devices())
    strategy = jdist.MirroredStrategy()
    model, tx = MLP(), optax.sgd(1e-2)
    x = np.random.default_rng(0).standard_normal((256, 10)).astype(np.float32)
    y = (np.arange(256) % 10).astype(np.int32)
    params = model.init(jax.random.key(0), x[:1])["params"]
    state = strategy.replicate((params, tx.init(params)))

    step = strategy.function(classifier_step(
        lambda p, x: model.apply({"params": p}, x), tx))

    batch = next(iter(strategy.experimental_distribute_dataset([{"x": x, "y": y}])))
    for i in range(5000):
      state, loss = step(state, batch)
    print("done", n, float(strategy.reduce("sum", loss)), step.num_compilations)
""")


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 4])
def test_5000_steps_do_not_deadlock(n):
  env = dict(os.environ,
             XLA_FLAGS=xla_flags(n),
             JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  words = proc.stdout.split()
  assert words[0] == "done" and words[1] == str(n)
  assert float(words[2]) < 2.3  # it trained (log(10) ~ 2.303 at the start)
  assert words[3] == "1"
