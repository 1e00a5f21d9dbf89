"""`python -m jdist launch ...`: the `jdist` command."""

import sys

from jdist._src.launcher.launch import USAGE, main

if __name__ == "__main__":
  if len(sys.argv) < 2 or sys.argv[1] != "launch":
    print(f"usage: {USAGE}", file=sys.stderr)
    sys.exit(2)
  sys.exit(main(sys.argv[2:]))
