"""The complete programs of README.md and of the documentation's pages
(docs/*.md) run as printed, and print what the text says they print.

Every ```python block is a complete program, unless its first line is a
comment starting with `# fragment` (visible to the reader: it says what the
fragment leaves out). All the pages' programs run one after another in one
process (tests/run_programs.py), each as a script in a scratch directory of
its own, on 4 fake CPU devices.
"""

import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

from conftest import xla_flags

REPO = pathlib.Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md"] + sorted((REPO / "docs").glob("*.md"))
BLOCK = re.compile(
    r"^([ \t]*)```(?:python|py|\{code-block\} python)[ \t]*\n(.*?)^\1```",
    re.S | re.M)
FRAGMENT = "# fragment"


def programs(page: pathlib.Path) -> list:
  """[{"name": "page:line", "code": ...}] of the page's complete programs."""
  text = page.read_text()
  where = page.relative_to(REPO) if page.is_relative_to(REPO) else page.name
  found = []
  for match in BLOCK.finditer(text):
    code = textwrap.dedent(match.group(2))  # a block inside a list item
    if code.lstrip().lower().startswith(FRAGMENT):
      continue
    line = text.count("\n", 0, match.start()) + 1
    found.append({"name": f"{where}:{line}", "code": code})
  return found


def _losses_fall(out: str) -> None:
  losses = [float(line.split()[1]) for line in out.splitlines()]
  assert len(losses) == 3 and losses[-1] < losses[0], out


def _nnx_recipe(out: str) -> None:
  accuracy = float(re.search(r"test accuracy: (\S+)", out).group(1))
  assert accuracy > 0.9, out
  assert out.count("epoch ") == 3, out


def _parameter_servers(out: str) -> None:
  first, last = map(float, re.search(r"loss (\S+) -> (\S+);", out).groups())
  assert last < first, out
  assert "updates per server {0: 200}" in out, out


def _sharded_optimizer(out: str) -> None:
  state_bytes = int(out.split("adam state on one device:")[1])
  assert state_bytes == 602_196, out  # the page: 0.250x of mirrored's 2,408,532


def _partition_metadata(out: str) -> None:
  spec, losses = out.splitlines()
  assert spec == "P(None, 'model') (32, 32)", out  # the page: what it prints
  losses = [float(v) for v in losses.split()[1:]]
  assert len(losses) == 3 and losses[-1] < losses[0], out


def _fit(out: str) -> None:
  history, evaluation = out.splitlines()
  accuracy = eval(history)["accuracy"]  # noqa: S307 -- a printed dict
  assert len(accuracy) == 3 and accuracy[-1] > accuracy[0], out
  assert set(eval(evaluation)) == {"loss", "accuracy"}, out  # noqa: S307


def _jax_meshes(out: str) -> None:
  *losses, spec = out.splitlines()
  losses = [float(line.split()[1]) for line in losses]
  assert len(losses) == 4 and losses == sorted(losses, reverse=True), out
  assert spec == "P(None, 'model')", out  # the page: still split


def _planning(out: str) -> None:
  assert re.search(r"^  parameters +53\.1 KB$", out, re.M), out
  assert re.search(r"^  optimizer state +106\.2 KB$", out, re.M), out
  assert ("What fits (compiled and planned): FSDP over 'fsdp' (2 devices, 2 "
          "replica(s)): parameters + optimizer state 159.4 KB -> 79.7 KB") in out


def _keras_trainer(out: str) -> None:
  keys, same = out.splitlines()[-2:]
  assert keys == ("['accuracy', 'loss', "
                  "'sparse_top_k_categorical_accuracy']"), out
  assert same == "True", out  # the Keras model holds the trained values


def _keras_fit_in_scope(out: str) -> None:
  devices, distribution = out.strip().splitlines()[-2:]
  assert devices == "Number of devices: 4", out
  assert distribution.startswith("<JdistDataParallel"), out


def _keras_custom_loop(out: str) -> None:
  losses = [float(line.split()[-1]) for line in out.splitlines()
            if line.startswith("epoch ")]
  assert len(losses) == 3 and losses[-1] < losses[0], out
def _pipelines(out: str) -> None:
  spec, equal = out.splitlines()
  assert spec == "P('stage', None, 'model') (2, 16, 8)", out  # the page
  assert equal == "equal to one device within 1e-6: True", out


# What the text says a program prints, by a line that only that program has.
EXPECTED = {
    "print(epoch, strategy.reduce(jdist.ReduceOp.SUM, loss))": _losses_fall,
    "nnx.split((model, optimizer))": _nnx_recipe,
    "ClusterCoordinator(strategy)": _parameter_servers,
    "jdist.ShardedOptimizer(": _sharded_optimizer,
    "ModelParallelStrategy(device_mesh=mesh)": _partition_metadata,
    "history = trainer.fit(x, y, batch_size=128, epochs=3": _fit,
    "model = DotReluDot(16, rngs=nnx.Rngs(0))": _jax_meshes,
    "trainer.fit(x, y, batch_size=64, epochs=3, verbose=0)": _keras_trainer,
    "print(keras.distribution.distribution())": _keras_fit_in_scope,
    "model_fns.assign(variables)": _keras_custom_loop,
    "jdist.plan(step, shapes, batch, memory_budget=budget)": _planning,
    "@nnx.vmap(in_axes=0, out_axes=0)  # 4 blocks, stacked": _pipelines,
}
PAGES_WITH_PROGRAMS = [p for p in PAGES if programs(p)]


def test_every_expectation_has_its_program():
  everything = [p["code"] for page in PAGES for p in programs(page)]
  for marker in EXPECTED:
    assert any(marker in code for code in everything), (
        f"no complete program has {marker!r} any more: update EXPECTED")
  assert programs(REPO / "README.md"), "README.md shows a complete program"


def test_a_fragment_is_marked_and_left_out(tmp_path):
  page = tmp_path / "page.md"
  page.write_text("```python\nprint(1)\n```\n\n```python\n"
                  "# fragment: the step of the first example\nstep(state)\n```\n")
  assert programs(page) == [{"name": "page.md:1", "code": "print(1)\n"}]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
  """{page: [{"name", "stdout", "error"}]}: every page's programs, run one
  after another in one process (each as its own script in a scratch
  directory: tests/run_programs.py), which imports JAX and jdist once for
  all of them instead of once per page."""
  todo = {page: programs(page) for page in PAGES_WITH_PROGRAMS}
  everything = [p for page in todo.values() for p in page]
  tmp = tmp_path_factory.mktemp("programs")
  (tmp / "programs.json").write_text(json.dumps(everything))
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(4),
             PYTHONPATH=os.pathsep.join(
                 [str(REPO)] + [p for p in os.environ.get(
                     "PYTHONPATH", "").split(os.pathsep) if p]))
  proc = subprocess.run(
      [sys.executable, str(REPO / "tests" / "run_programs.py"),
       "programs.json", "results.json"],
      env=env, cwd=tmp, capture_output=True, text=True,
      timeout=120 + 120 * len(everything))
  assert proc.returncode == 0, proc.stderr[-3000:]
  ran = iter(json.loads((tmp / "results.json").read_text()))
  return {page: [next(ran) for _ in mine] for page, mine in todo.items()}


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES_WITH_PROGRAMS,
                         ids=lambda p: str(p.relative_to(REPO)))
def test_the_pages_programs_run_as_printed(page, results):
  todo, ran = programs(page), results[page]
  assert [r["name"] for r in ran] == [p["name"] for p in todo]
  failed = [f"{r['name']}:\n{r['error']}" for r in ran if r["error"]]
  assert not failed, (
      "programs that fail as printed (make them run, or mark a fragment's "
      f"first line `{FRAGMENT}: ...`):\n" + "\n".join(failed))
  for program, result in zip(todo, ran):
    for marker, check in EXPECTED.items():
      if marker in program["code"]:
        check(result["stdout"])
