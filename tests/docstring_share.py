"""How much of `jdist/_src` is docstrings: the share of its lines, per package.

    python tests/docstring_share.py [--limit 0.20]

A docstring is the string that opens a module, class or function (the lines
from its opening to its closing quotes); every other line counts as code,
comments and blank lines included. Prints one row per package of `_src`
(a module directly in `_src` is its own row) and the whole; with `--limit`,
exits 1 when the whole is above it. `share()` is what a test would call.
"""

import argparse
import ast
import pathlib
import sys

SRC = pathlib.Path(__file__).resolve().parent.parent / "jdist" / "_src"


def docstring_lines(source: str) -> int:
  """The lines of `source` that belong to docstrings."""
  count = 0
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                         ast.AsyncFunctionDef)) and node.body:
      first = node.body[0]
      if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
          and isinstance(first.value.value, str)):
        count += first.end_lineno - first.lineno + 1
  return count


def share(root: pathlib.Path = SRC) -> dict:
  """{package: (docstring lines, all lines)} for each package of `root`
  and "all" for the whole."""
  rows = {}
  for path in sorted(root.rglob("*.py")):
    relative = path.relative_to(root)
    package = relative.parts[0] if len(relative.parts) > 1 else relative.stem
    source = path.read_text()
    doc, lines = rows.get(package, (0, 0))
    rows[package] = (doc + docstring_lines(source),
                     lines + len(source.splitlines()))
  rows["all"] = tuple(map(sum, zip(*rows.values())))
  return rows


def main(argv: list) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--limit", type=float, default=None,
                      help="fail when the whole's share is above this")
  args = parser.parse_args(argv)
  rows = share()
  print(f"{'package':<16}{'docstrings':>11}{'lines':>8}{'share':>8}")
  for package, (doc, lines) in rows.items():
    print(f"{package:<16}{doc:>11,}{lines:>8,}{doc / lines:>8.1%}")
  doc, lines = rows["all"]
  if args.limit is not None and doc / lines > args.limit:
    print(f"docstrings are {doc / lines:.1%} of jdist/_src, above "
          f"{args.limit:.0%}")
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
