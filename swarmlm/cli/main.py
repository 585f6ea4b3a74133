"""`swarmlm VERB ...`: one thin module per verb in swarmlm/cli/, each with `add_parser(sub)` and `run(args) -> int`.

Errors a user can fix (a bad path, range or flag, peers that cannot be reached, blocks nobody serves) print one
line and exit 2; `--log-level debug` shows the traceback instead.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

from swarmlm import __version__

# verb -> (module in swarmlm.cli, one line for --help). Only the verb being run is imported, so `swarmlm --help`
# and `swarmlm plan` do not load torch.
VERBS: dict[str, tuple[str, str]] = {
    "model": ("model_cmd", "create model checkpoints (random weights, real architectures) or fetch a trained one"),
    "dht": ("dht_cmd", "start a DHT bootstrap node and print its address"),
    "server": ("server_cmd", "serve a range of the model's blocks"),
    "generate": ("generate_cmd", "generate text through the swarm"),
    "chat": ("chat_cmd", "chat with the swarm's model in the terminal"),
    "api": ("api_cmd", "serve the swarm's model over OpenAI's HTTP API, with a monitor page"),
    "status": ("status_cmd", "show the swarm's servers, their blocks, load and coverage"),
    "demo": ("demo_cmd", "start a local swarm, generate through it, compare with a local run"),
    "profile": ("profile_cmd", "measure per-block prefill and decode times (what servers announce)"),
    "plan": ("plan_cmd", "plan block placement and routes for a topology file"),
    "simulate": ("simulate_cmd", "simulate a deployment: placement, routing, waiting, latencies"),
    "bench": ("bench_cmd", "the scaling study: N servers x execution strategies, measured and reported"),
}
LOG_LEVELS = ("debug", "info", "warning", "error")
# optional packages -> the extra that installs them (pyproject.toml)
EXTRAS = {"matplotlib": "bench", "networkx": "sim", "scipy": "sim", "highspy": "sim", "fastapi": "api",
          "uvicorn": "api", "pydantic": "api"}
DEFAULT_LOG_LEVEL = {"server": "info", "dht": "info"}  # long-running verbs say what they do; others stay quiet


def _verb(argv: list[str]) -> str | None:
    """The first word that is not a global option or its value."""
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--log-level":
            skip = True
        elif not arg.startswith("-"):
            return arg
    return None


class _Parser(argparse.ArgumentParser):
    """A bad flag is one line (argparse's default prints the whole usage first); subcommands inherit the class."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each flag's default, unless its help already states one or there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text.lower() or not action.option_strings
                or action.default in (None, False, [], (), "", argparse.SUPPRESS)):
            return text  # (already %-escaped, as argparse formats every help string)
        return super()._get_help_string(action)


def _with_defaults(parser: argparse.ArgumentParser) -> None:
    """HelpFormatter for a verb's parser and its own subcommands (argparse does not pass it down)."""
    parser.formatter_class = HelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _with_defaults(child)


def _grouped(parser: argparse.ArgumentParser, common: tuple[str, ...]) -> None:
    """--help: the verb's common options first, then the others under "advanced options" (help stays first)."""
    first, rest = parser.add_argument_group("common options"), parser.add_argument_group("advanced options")
    optionals = parser._optionals
    for action in list(optionals._group_actions):
        if "-h" in action.option_strings:
            continue
        optionals._group_actions.remove(action)
        (first if set(action.option_strings) & set(common) else rest)._group_actions.append(action)
    required = [f"{a.option_strings[0]} {a.metavar or a.dest.upper()}" for a in parser._actions if a.required]
    parser.usage = " ".join(["%(prog)s", *required, "[common options] [advanced options]"])  # not 30 lines of flags


def build_parser(verb: str | None) -> argparse.ArgumentParser:
    parser = _Parser(prog="swarmlm", description="Run one language model across many small machines.")
    parser.add_argument("--version", action="version", version=f"swarmlm {__version__}")
    parser.add_argument("--log-level", dest="global_log_level", choices=LOG_LEVELS,
                        help="log verbosity (default: info for server and dht, warning otherwise); "
                             "debug also shows tracebacks")
    sub = parser.add_subparsers(dest="verb", metavar="VERB", title="commands")
    for name, (module, description) in VERBS.items():
        if name != verb:
            sub.add_parser(name, help=description)  # listed by --help without importing its module
            continue
        verb_module = importlib.import_module(f"swarmlm.cli.{module}")
        verb_module.add_parser(sub)
        p = sub.choices[name]
        _with_defaults(p)
        if not any("--log-level" in a.option_strings for a in p._actions):  # api has its own (uvicorn's)
            p.add_argument("--log-level", dest="global_log_level", choices=LOG_LEVELS, default=argparse.SUPPRESS,
                           help="as the global --log-level")
        if hasattr(verb_module, "COMMON"):  # verbs with many flags
            _grouped(p, verb_module.COMMON)
    return parser


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # hivemind logs through its own handler: same threshold
    logging.getLogger("hivemind").setLevel(max(logging.getLevelName(level.upper()), logging.WARNING))
    if level != "debug":  # a DHT that failed to start leaves asyncio complaining at exit, after our one line
        logging.getLogger("asyncio").setLevel(logging.ERROR)


def user_error(exc: BaseException) -> str | None:
    """One line for an error the user can fix, or None for a bug (which keeps its traceback)."""
    from swarmlm.errors import MissingBlocks, SwarmError

    name = type(exc).__name__
    if isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] in EXTRAS:
        package = exc.name.split(".")[0]
        return f"this needs the optional package {package}: pip install 'swarmlm[{EXTRAS[package]}]'"
    if isinstance(exc, MissingBlocks) and "unreachable" not in str(exc):
        return f"{exc}: start servers for them, or check --initial-peers and --dht-prefix"
    if name == "P2PDaemonError" or "bootstrap peers" in str(exc):
        return f"cannot join the swarm through --initial-peers (connection refused or unreachable): {exc}"
    if isinstance(exc, ConnectionRefusedError):
        return f"connection refused: {exc}"
    if isinstance(exc, (SwarmError, OSError, ValueError, TimeoutError)):  # OSError: a file, a port, a connection
        return str(exc) or name
    if name in ("OSError", "EnvironmentError", "HFValidationError", "RepositoryNotFoundError",
                "LocalEntryNotFoundError", "RevisionNotFoundError"):
        return str(exc).splitlines()[0] if str(exc) else name
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    verb = _verb(argv)
    if verb is not None and verb not in VERBS:
        verb = None  # argparse names the valid choices
    parser = build_parser(verb)
    args = parser.parse_args(argv)
    if args.verb is None:
        parser.print_help()
        return 2
    level = getattr(args, "global_log_level", None) or DEFAULT_LOG_LEVEL.get(args.verb, "warning")
    _setup_logging(level)
    module = importlib.import_module(f"swarmlm.cli.{VERBS[args.verb][0]}")
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        message = user_error(exc)
        if message is None or level == "debug":
            raise
        print(f"swarmlm {args.verb}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
