"""Import circles of the swarmlm package: modules that import each other (a circle of two or more files), found
with `ast` over swarmlm/**/*.py, once per kind of import statement and once for all of them together:
module level (runs at import), under `if TYPE_CHECKING` (annotations only) and inside functions (runs when called).
The graph and the circle finder are tests/test_layering.py's, which fails on any circle. Usage:

    .venv/bin/python benchmarks/import_circles.py [--json]
"""
from __future__ import annotations

import argparse
import json

from tests.test_layering import IMPORT_KINDS, circles, import_graph


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    args = ap.parse_args()
    found = {kind: circles(import_graph((kind,))) for kind in IMPORT_KINDS}
    found["all"] = circles(import_graph())
    edges = {kind: sum(map(len, import_graph((kind,)).values())) for kind in IMPORT_KINDS}
    if args.json:
        print(json.dumps({"edges": edges, "circles": {k: sorted(map(sorted, v)) for k, v in found.items()}}))
        return
    for kind, parts in found.items():
        print(f"{kind:14s} {edges.get(kind, sum(edges.values())):5d} imports, {len(parts)} circles")
        for part in parts:
            print("    " + " <-> ".join(sorted(part)))


if __name__ == "__main__":
    main()
