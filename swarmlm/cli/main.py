"""`swarmlm VERB ...`: one thin module per verb in swarmlm/cli/, each with `add_parser(sub)` and `run(args) -> int`."""
from __future__ import annotations

import argparse
import importlib
import sys

# verb -> module in swarmlm.cli; imported only when used, so `swarmlm plan` does not load torch.
VERBS = {
    "model": "model_cmd",
    "dht": "dht_cmd",
    "server": "server_cmd",
    "generate": "generate_cmd",
    "demo": "demo_cmd",
    "profile": "profile_cmd",
    "plan": "plan_cmd",
    "simulate": "simulate_cmd",
    "bench": "bench_cmd",
    "api": "api_cmd",
    "status": "status_cmd",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="swarmlm", description=__doc__)
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    verb = next((a for a in argv if not a.startswith("-")), None)
    modules = {}
    for name, module in VERBS.items():
        if verb is None or verb == name:  # import only what is needed (help lists all)
            try:
                modules[name] = importlib.import_module(f"swarmlm.cli.{module}")
            except ModuleNotFoundError as exc:
                if exc.name != f"swarmlm.cli.{module}":
                    raise
                continue
            modules[name].add_parser(sub)
    args = parser.parse_args(argv)
    if args.verb is None or args.verb not in modules:
        parser.print_help()
        return 2
    return int(modules[args.verb].run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
