"""Every measured figure in the tables of README.md and of the documentation
(docs/*.md) is in benchmarks/RESULTS.md.

RESULTS.md's sections are written by the benchmark scripts (`make bench`, or
a script run alone, which the section names with its date and load), so a
figure found there verbatim has a script behind it; one that is not has none.

What counts as a figure, in a table row (a line starting with `|`):
- a number with a unit of time, `s`, `ms`, `us` or `µs` (`3.9 s`), a ratio
  `x` (`0.92x`, not a shape such as `28x28x1`) or a percentage (`4.9%`);
  or a range of them, `3.9-4.5 s`, which must appear as a whole;
- outside inline code: quoted messages (`... within 300 s ...`) and
  arguments (`--stuck-timeout 5`, `timeout_seconds=T`) are what jdist
  prints or what the user types, not measurements;
- not a setting: a number right after "every", "within", "at most",
  "after", "default" or "its" names a period, a timeout or a lease that
  jdist or JAX is configured with (`every 10 s`, `its 60 s lease`).
Numbers without a unit (versions, counts of steps or processes, signal
numbers, exit codes) are never figures.
"""

import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parent.parent
NUMBER = r"\d+(?:\.\d+)?"
FIGURE = re.compile(
    rf"(?<![\w.\-/]){NUMBER}(?:-{NUMBER})?(?: (?:s|ms|us|µs)\b|x\b|%)")
SETTING = re.compile(r"\b(?:every|within|at most|after|default|its) $")


def figures(markdown: str) -> list:
  """[(line number, figure)] of every measured figure in the tables."""
  found = []
  for number, line in enumerate(markdown.splitlines(), 1):
    if not line.startswith("|"):
      continue
    prose = re.sub(r"`[^`]*`", "``", line)
    for match in FIGURE.finditer(prose):
      if not SETTING.search(prose[:match.start()]):
        found.append((number, match.group()))
  return found


def shows(text: str, figure: str) -> bool:
  """`figure` in `text` as a whole (`1.0 s` is not in `21.0 s`)."""
  return re.search(rf"(?<![\w.\-]){re.escape(figure)}(?!\w|\.\d)", text) is not None


def test_the_rule_picks_measurements_only():
  row = ("| a fault (`--stuck-timeout 5`, `within 300 s`) | 3.9-4.5 s (5 runs), "
         "0.92x, +4.9%, every 10 s, its 60 s lease, 28x28x1, exit 143 |")
  assert [f for _, f in figures(row)] == ["3.9-4.5 s", "0.92x", "4.9%"]
  assert figures("3.9 s outside a table") == []
  assert shows("took 1.0 s.", "1.0 s") and shows("| 0.92x |", "0.92x")
  assert not shows("took 21.0 s", "1.0 s") and not shows("4 steps", "4 s")


def test_every_table_figure_of_the_docs_is_in_results():
  results = (REPO / "benchmarks" / "RESULTS.md").read_text()
  pages = [REPO / "README.md"] + sorted((REPO / "docs").glob("*.md"))
  found = [(page.relative_to(REPO), n, f) for page in pages
           for n, f in figures(page.read_text())]
  assert len(found) > 10, found  # the rule still finds the tables' figures
  missing = [f"{page}:{n}: {f}" for page, n, f in found
             if not shows(results, f)]
  assert not missing, (
      "figures in the documentation's tables that no RESULTS.md section "
      "shows (run the script that measures them and add its section, or "
      "reword the cell without the number):\n" + "\n".join(missing))
