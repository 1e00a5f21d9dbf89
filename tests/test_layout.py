"""The package's own imports: layers that point down, no cycles, none hidden.

Reads every module of `jdist` as source (nothing is imported), so a cycle or
an import moved into a function to hide one fails here, with its place.
"""

import ast
import pathlib
import sys

import pytest

import jdist

ROOT = pathlib.Path(jdist.__file__).parent

# Lowest first; a module may import its own layer and the ones below.
LAYERS = [
    ("jdist._src.errors", "jdist._src.jax_compat"),
    # `jdist launch`: nothing but the standard library (see the test below).
    ("jdist._src.launcher",),
    # The runtime inside each process (`jdist.initialize`).
    ("jdist._src.runtime",),
    ("jdist._src.core",),
    ("jdist._src.input",),
    # The strategies, and what a strategy's scope tells Keras (the
    # keras.distribution it sets while open).
    ("jdist._src.strategies", "jdist._src.keras.distribution",
     "jdist._src.keras.loading"),
    ("jdist._src.current", "jdist._src.ops", "jdist._src.equivalence",
     "jdist._src.diagnose", "jdist._src.planning",
     # Keras models, optimizers, losses and metrics as jdist values.
     "jdist._src.keras"),
    # A separate engine (asynchronous, not one SPMD program): it runs the
    # strategies' steps on workers against parameter servers.
    ("jdist._src.ps",),
    # Checkpoints: orbax, directory claims, preemption; below the Trainer,
    # for custom loops too.
    ("jdist._src.checkpoint",),
    ("jdist._src.training",),
    ("jdist",),  # the facade and public modules, examples
]

# Internal imports inside functions, each with its reason.
ALLOWED_IN_FUNCTIONS = {
    # XLA_FLAGS must be set before JAX (which jdist imports) starts.
    "jdist.examples.demo",
}


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules():
  return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


MODULES = _modules()


def _imports(path):
  """(imported jdist module, line, inside a function?) for each import."""
  tree = ast.parse(path.read_text())
  out = []

  def visit(node, in_function):
    for child in ast.iter_child_nodes(node):
      inside = in_function or isinstance(
          child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
      if isinstance(child, ast.Import):
        out.extend((a.name, child.lineno, in_function) for a in child.names
                   if a.name.split(".")[0] == "jdist")
      elif isinstance(child, ast.ImportFrom) and child.module and \
          child.module.split(".")[0] == "jdist":
        for a in child.names:  # `from jdist._src import x` imports a module
          full = f"{child.module}.{a.name}"
          out.append((full if full in MODULES else child.module, child.lineno,
                      in_function))
      visit(child, inside)

  visit(tree, False)
  return out


def _layer(name: str) -> int:
  best = None
  for i, prefixes in enumerate(LAYERS):
    for prefix in prefixes:
      if name == prefix or name.startswith(prefix + "."):
        if best is None or len(prefix) > best[1]:
          best = (i, len(prefix))
  assert best is not None, f"{name} is in no layer of tests/test_layout.py"
  return best[0]


def test_every_module_has_a_layer_and_a_docstring():
  for name, path in MODULES.items():
    _layer(name)
    doc = ast.get_docstring(ast.parse(path.read_text()))
    if path.name != "__init__.py" or name.count(".") < 2:
      assert doc, f"{name} has no module docstring saying what it owns"


def test_imports_point_down_the_layers():
  wrong = []
  for name, path in MODULES.items():
    for target, line, _ in _imports(path):
      if _layer(target) > _layer(name):
        wrong.append(f"{path.relative_to(ROOT.parent)}:{line}: {name} "
                     f"imports {target}, a higher layer")
  assert not wrong, "\n".join(wrong)


def test_no_internal_imports_inside_functions():
  hidden = [f"{path.relative_to(ROOT.parent)}:{line}: imports {target}"
            for name, path in MODULES.items() if name not in ALLOWED_IN_FUNCTIONS
            for target, line, in_function in _imports(path) if in_function]
  assert not hidden, "\n".join(hidden)


def test_no_import_cycles():
  graph = {name: {t for t, _, inside in _imports(path)
                  if not inside and t in MODULES and t != name}
           for name, path in MODULES.items()}
  # The facade imports its public modules, which may import the facade's
  # submodules back (jdist.testing -> jdist._src...): only _src matters.
  graph = {k: {t for t in v if t.startswith("jdist._src")}
           for k, v in graph.items() if k.startswith("jdist._src")}
  state, stack = {}, []

  def visit(node):
    state[node] = "open"
    stack.append(node)
    for nxt in sorted(graph.get(node, ())):
      if state.get(nxt) == "open":
        cycle = stack[stack.index(nxt):] + [nxt]
        pytest.fail("import cycle: " + " -> ".join(cycle))
      if nxt not in state:
        visit(nxt)
    stack.pop()
    state[node] = "done"

  for node in sorted(graph):
    if node not in state:
      visit(node)


def test_the_launcher_imports_nothing_but_the_standard_library():
  # `jdist launch` and its agents start in a tenth of a second because they
  # load neither JAX nor NumPy (test_launch.py runs it); any import of a
  # package outside the standard library, or of jdist outside the launcher,
  # could bring them in.
  wrong = []
  for name, path in MODULES.items():
    if not name.startswith("jdist._src.launcher"):
      continue
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.level == 0:
        targets = [node.module]
      else:
        continue
      for target in targets:
        top = target.split(".")[0]
        if (top not in sys.stdlib_module_names and
            not target.startswith("jdist._src.launcher")):
          wrong.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: "
                       f"imports {target}")
  assert not wrong, "\n".join(wrong)


def test_the_training_layer_does_not_know_the_parameter_server_engine():
  # It reads and writes state through the strategy's StatePlacement, so a
  # strategy of either engine (or a new one) needs no branch in training/.
  wrong = [f"{path.relative_to(ROOT.parent)}:{line}: imports {target}"
           for name, path in MODULES.items()
           if name.startswith("jdist._src.training")
           for target, line, _ in _imports(path)
           if target.startswith("jdist._src.ps")]
  assert not wrong, "\n".join(wrong)


# Underscored names that are public API: a function of `os`, and a named
# tuple's public methods and fields (`_replace`, `_asdict`, `_fields`).
PUBLIC_PRIVATE_NAMES = {"os._exit"}
PUBLIC_UNDERSCORED_ATTRIBUTES = {"_fields", "_replace", "_asdict"}


def _private_reads(path):
  """`(line, expression)` of each `obj._x` where obj is not self or cls."""
  out = []
  for node in ast.walk(ast.parse(path.read_text())):
    if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")
            and not node.attr.startswith("__") and
            node.attr not in PUBLIC_UNDERSCORED_ATTRIBUTES):
      continue
    owner = node.value
    if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
      continue
    if isinstance(owner, ast.Call) and getattr(owner.func, "id", "") == "super":
      continue
    text = ast.unparse(node)
    if text not in PUBLIC_PRIVATE_NAMES:
      out.append((node.lineno, text))
  for node in ast.walk(ast.parse(path.read_text())):
    if (isinstance(node, ast.Call) and getattr(node.func, "id", "") in
        ("getattr", "setattr", "hasattr") and len(node.args) > 1 and
        isinstance(node.args[1], ast.Constant) and
        str(node.args[1].value).startswith("_") and
        not str(node.args[1].value).startswith("__") and
        node.args[1].value not in PUBLIC_UNDERSCORED_ATTRIBUTES and
        not (isinstance(node.args[0], ast.Name) and
             node.args[0].id in ("self", "cls"))):
      out.append((node.lineno, ast.unparse(node)))
  return out


def test_no_module_reads_another_objects_private_attributes():
  # jax_compat.py is where every private JAX API is used, on purpose, and
  # keras/loading.py every private Keras one.
  wrong = [f"{path.relative_to(ROOT.parent)}:{line}: {text}"
           for name, path in MODULES.items()
           if name not in ("jdist._src.jax_compat", "jdist._src.keras.loading")
           for line, text in _private_reads(path)]
  assert not wrong, "\n".join(wrong)




def _reads_text(expr, name: str) -> bool:
  for node in ast.walk(expr):
    if isinstance(node, ast.Call) and getattr(node.func, "id", "") in (
        "str", "repr") and node.args and \
        getattr(node.args[0], "id", None) == name:
      return True
    if isinstance(node, ast.Attribute) and node.attr == "args" and \
        getattr(node.value, "id", None) == name:
      return True
  return False


def test_no_except_matches_on_an_errors_text():
  wrong = []
  for name, path in MODULES.items():
    for handler in ast.walk(ast.parse(path.read_text())):
      if not (isinstance(handler, ast.ExceptHandler) and handler.name):
        continue
      for node in ast.walk(handler):
        if isinstance(node, ast.Compare) and _reads_text(node, handler.name):
          wrong.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: "
                       f"{ast.unparse(node)}")
  assert not wrong, "\n".join(wrong)


def test_private_jax_is_used_in_one_place():
  users = sorted(name for name, path in MODULES.items()
                 if "jax._src" in path.read_text() and
                 name != "jdist._src.jax_compat")
  assert users == [], f"private JAX APIs outside jax_compat.py: {users}"


MAX_FUNCTION_LINES = 60


def _code_lines(fn) -> int:
  """Lines of a function's code: its body without the docstring, blank lines
  and comment-only lines."""
  body = fn.body
  if (body and isinstance(body[0], ast.Expr) and
      isinstance(body[0].value, ast.Constant) and
      isinstance(body[0].value.value, str)):
    body = body[1:]
  if not body:
    return 0
  lines = set()
  for node in body:
    for sub in ast.walk(node):
      if hasattr(sub, "lineno"):
        lines.update(range(sub.lineno, (sub.end_lineno or sub.lineno) + 1))
  return len(lines)


def test_no_function_is_longer_than_sixty_lines():
  # Examples are programs users read top to bottom; the library is not.
  wrong = []
  for name, path in MODULES.items():
    if name.startswith("jdist.examples"):
      continue
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        n = _code_lines(node)
        if n > MAX_FUNCTION_LINES:
          wrong.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: "
                       f"{node.name} has {n} lines of code")
  assert not wrong, "\n".join(wrong)


def test_importing_jdist_leaves_flax_and_orbax_unimported():
  """Every process of a job imports jdist: flax, orbax and keras (a third
  of a second and more each) load only in programs that use them, also
  once the Trainer and a strategy's scope are used."""
  import subprocess
  import sys
  out = subprocess.run(
      [sys.executable, "-c", "import sys, jdist; jdist.Trainer\n"
       "with jdist.MirroredStrategy().scope(): pass\n"
       "print(sorted({m.split('.')[0] for m in sys.modules} & "
       "{'flax', 'orbax', 'keras', 'tensorflow'}))"],
      capture_output=True, text=True, timeout=120, check=True)
  assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_trainer_is_a_thin_facade_over_small_modules():
  # The Trainer wires the training program, the compiled steps, the loop and
  # the data together; what each does lives in a module of its own.
  trainer = MODULES["jdist._src.training.trainer"]
  imported = sorted({t for t, _, _ in _imports(trainer)})
  assert len(imported) <= 12, imported
  long = [f"{path.relative_to(ROOT.parent)}: {n} lines"
          for name, path in MODULES.items()
          if name.startswith("jdist._src.training")
          for n in [len(path.read_text().splitlines())] if n > 600]
  assert not long, "\n".join(long)


# What a value does depends on its kind, asked of the kind table
# (`core/kinds.py`); only the table and the classes themselves test types.
KIND_TABLE = ("jdist._src.core.kinds", "jdist._src.core.values")


def _value_classes() -> set:
  """The classes the kind table registers (`register(Cls, kind)` in
  kinds.py), and their base `DistributedValue`."""
  tree = ast.parse(MODULES["jdist._src.core.kinds"].read_text())
  registered = {node.args[0].id for node in ast.walk(tree)
                if isinstance(node, ast.Call) and
                getattr(node.func, "id", "") == "register" and node.args and
                isinstance(node.args[0], ast.Name)}
  return registered | {"DistributedValue"}


def _class_names(node) -> set:
  """The class names an `isinstance` argument or a comparison names."""
  parts = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) \
      else [node]
  return {p.id if isinstance(p, ast.Name) else p.attr for p in parts
          if isinstance(p, (ast.Name, ast.Attribute))}


def _type_tests(path, classes: set) -> list:
  """`(line, text)` of each test of a value's class against `classes`:
  isinstance, issubclass, `type(x) is C`, `x.__class__ == C`, `case C()`."""
  out = []
  for node in ast.walk(ast.parse(path.read_text())):
    named = set()
    if isinstance(node, ast.Call) and getattr(node.func, "id", "") in (
        "isinstance", "issubclass") and len(node.args) == 2:
      named = _class_names(node.args[1])
    elif isinstance(node, ast.Compare):
      sides = [node.left] + node.comparators
      if any((isinstance(s, ast.Call) and getattr(s.func, "id", "") == "type")
             or (isinstance(s, ast.Attribute) and s.attr == "__class__")
             for s in sides):
        named = set().union(*(_class_names(s) for s in sides))
    elif isinstance(node, ast.MatchClass):
      named = _class_names(node.cls)
    if named & classes:
      out.append((node.lineno, ast.unparse(node)))
  return out


def test_value_classes_are_told_apart_only_by_the_kind_table():
  classes = _value_classes()
  assert {"PerReplica", "SyncOnRead", "Sharded", "BatchGroup"} <= classes
  wrong = [f"{path.relative_to(ROOT.parent)}:{line}: {text}"
           for name, path in MODULES.items() if name not in KIND_TABLE
           for line, text in _type_tests(path, classes)]
  assert not wrong, (
      "Behaviour per kind of value goes through its ValueKind "
      "(jdist/_src/core/kinds.py: kinds.kind_of(x).<method>): " +
      "\n".join(wrong))
