"""The command line as a user meets it: --version, --help listing every verb without torch, one-line errors with
exit code 2 (a traceback only with --log-level debug), a server that says what it is doing while it starts."""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import socket
import subprocess
import sys

import pytest

from swarmlm import __version__
from swarmlm.cli.main import VERBS, main
from swarmlm.types import BlockRange
from tests.swarm_helpers import server_processes


def swarmlm(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "swarmlm.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout)


def last_line(done: subprocess.CompletedProcess) -> str:
    return done.stderr.strip().splitlines()[-1]


def test_version():
    done = swarmlm("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"swarmlm {__version__}"


def test_help_lists_every_verb_without_loading_torch():
    code = ("import sys, contextlib, io\nfrom swarmlm.cli.main import main\nout = io.StringIO()\n"
            "with contextlib.redirect_stdout(out):\n    try: main(['--help'])\n    except SystemExit: pass\n"
            "print(out.getvalue()); print('torch loaded:', 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for verb in VERBS:
        assert f"\n    {verb} " in done.stdout, verb
    assert "torch loaded: False" in done.stdout


@pytest.mark.parametrize("verb", list(VERBS))
def test_every_verb_has_help(verb):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        main([verb, "--help"])
    assert exit_.value.code == 0 and f"swarmlm {verb}" in out.getvalue()


def _verb_parsers():
    import argparse

    from swarmlm.cli.main import build_parser

    for verb in VERBS:
        sub = next(a for a in build_parser(verb)._actions if isinstance(a, argparse._SubParsersAction))
        stack = [(verb, sub.choices[verb])]
        while stack:  # and the verbs' own subcommands (model init / fetch)
            name, parser = stack.pop()
            yield name, parser
            for action in parser._actions:
                if isinstance(action, argparse._SubParsersAction):
                    stack += [(f"{name} {child}", p) for child, p in action.choices.items()]


def test_every_flag_has_a_help_line_and_help_shows_defaults():
    for name, parser in _verb_parsers():
        missing = [a.option_strings or a.dest for a in parser._actions if not a.help]
        assert not missing, (name, missing)
        parser.format_help()  # every help string formats (a stray % would raise)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(out.getvalue().split())
    assert "tokens to generate at most (default: 20)" in text and "(default: waiting-aware)" in text


def test_bad_path_is_one_line_and_exit_2(tmp_path):
    done = swarmlm("server", "--model", str(tmp_path / "nope"), "--blocks", "0:3")
    assert done.returncode == 2 and done.stderr.strip() == f"swarmlm server: error: {tmp_path / 'nope'}: not a checkpoint directory"


def test_debug_log_level_shows_the_traceback(tmp_path):
    done = swarmlm("--log-level", "debug", "server", "--model", str(tmp_path / "nope"), "--blocks", "0:3")
    assert done.returncode != 0 and "Traceback" in done.stderr and "FileNotFoundError" in done.stderr


@pytest.mark.parametrize("blocks", ["5:2", "a:b", "3"])
def test_bad_block_range(tiny_bloom, blocks):
    done = swarmlm("server", "--model", tiny_bloom, "--blocks", blocks)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert "--blocks" in done.stderr and "Traceback" not in done.stderr


# (in-process: these get as far as loading torch and the model, which a subprocess pays for again)
def test_blocks_outside_the_model(tiny_bloom, capsys):
    assert main(["profile", "--model", tiny_bloom, "--blocks", "0:99"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "swarmlm profile: error: blocks [0, 99) outside the model's [0, 6)")


def test_unknown_family(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    assert main(["profile", "--model", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        "swarmlm profile: error: model type 'gpt2' is not supported; supported: ")


def test_revision_of_a_directory_is_refused(tiny_bloom):
    done = swarmlm("generate", "--model", tiny_bloom, "--revision", "main", "--servers", "127.0.0.1:1",
                   "--input-ids", "1")
    assert done.returncode == 2 and "--revision applies to hub ids" in last_line(done)


@pytest.mark.slow
def test_refused_connection_is_named(tiny_bloom):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = swarmlm("generate", "--model", tiny_bloom, "--servers", f"127.0.0.1:{port}", "--wait-for-blocks", "1",
                   "--input-ids", "1,2")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert last_line(done).startswith("swarmlm generate: error: ") and "connection refused" in last_line(done)


@pytest.mark.slow
def test_blocks_nobody_serves_are_named_and_the_server_reports_progress(tiny_bloom):
    with server_processes(tiny_bloom, [BlockRange(0, 3)]) as swarm:  # the CLI is the client
        done = swarmlm("generate", "--model", tiny_bloom, "--initial-peers", *swarm.initial_peers,
                       "--wait-for-blocks", "1", "--input-ids", "1,2")
        log = swarm.servers[0].log_path.read_text()
        ready = swarm.servers[0].ready  # its one JSON line on stdout, for scripts and other machines
    assert ready["blocks"] == [0, 3] and ready["address"].startswith("127.0.0.1:") and ready["server_id"], ready
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "no server in the swarm serves blocks 3-5" in last_line(done) and "refused" not in last_line(done)
    for step in ("loading blocks [0, 3)", "block 2 loaded (3 of 3)", "compute", "serving blocks [0, 3) at"):
        assert step in log, (step, log[-2000:])


@pytest.mark.slow
def test_unreachable_initial_peers_are_named(tiny_bloom):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    peer = f"/ip4/127.0.0.1/tcp/{port}/p2p/12D3KooWHVRnpBpA3ZfXBqBJVrA32NntLPDwd4v814FbXaKdnesZ"
    done = swarmlm("generate", "--model", tiny_bloom, "--initial-peers", peer, "--input-ids", "1,2")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert last_line(done).startswith("swarmlm generate: error: cannot join the swarm through --initial-peers")


def test_top_level_api_is_lazy():
    code = ("import sys, swarmlm\nassert 'torch' not in sys.modules\n"
            "from swarmlm import AutoDistributedModelForCausalLM, DistributedModelForCausalLM\n"
            "assert AutoDistributedModelForCausalLM.from_pretrained and DistributedModelForCausalLM.generate\n"
            "print(swarmlm.__version__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == __version__, done.stderr[-2000:]


def test_server_flags_default_to_the_config_fields(tiny_bloom):
    """Each server setting is defined once (config.py): the CLI's defaults are ServerConfig's."""
    from swarmlm.cli.main import build_parser
    from swarmlm.cli.server_cmd import server_config
    from swarmlm.config import ServerConfig

    args = build_parser("server").parse_args(["server", "--model", tiny_bloom])
    assert server_config(args) == ServerConfig(model_dir=tiny_bloom, blocks=None)


def test_gateway_flags_default_to_the_config_fields(tiny_bloom):
    """Each gateway setting is defined once (api/config.py): `swarmlm api`'s defaults are GatewayConfig's, its
    waits ClientConfig's."""
    import dataclasses

    from swarmlm.api.config import LOCAL_HOSTS, GatewayConfig
    from swarmlm.cli.api_cmd import gateway_config
    from swarmlm.cli.main import build_parser
    from swarmlm.config import ClientConfig

    args = build_parser("api").parse_args(["api", "--model", tiny_bloom])
    config = gateway_config(args)
    assert config.allowed_hosts == (*LOCAL_HOSTS, "127.0.0.1")  # and --host, one address
    assert config == dataclasses.replace(GatewayConfig(model_name=config.model_name), allowed_hosts=LOCAL_HOSTS + (
        "127.0.0.1",), model_aliases=config.model_aliases)
    client = ClientConfig()
    assert (args.wait_for_blocks, args.wait_for_loading, args.push) == \
        (client.wait_for_blocks_s, client.wait_for_loading_s, client.push)


def test_a_server_computes_on_every_core_it_may_use_by_default(tiny_bloom):
    """Issue 37: a server uses the machine's cores unless told (--threads N), within its affinity mask."""
    import os

    from swarmlm.cli.main import build_parser
    from swarmlm.cli.server_cmd import server_config

    parser = build_parser("server")
    assert server_config(parser.parse_args(["server", "--model", tiny_bloom])).threads == len(os.sched_getaffinity(0))
    assert server_config(parser.parse_args(["server", "--model", tiny_bloom, "--threads", "1"])).threads == 1


def test_server_frame_idle_timeout_flag_reaches_the_config(tiny_bloom):
    """How long a kept framed connection waits for its client's next stream is a server flag like the other limits."""
    from swarmlm.cli.main import build_parser
    from swarmlm.cli.server_cmd import server_config

    args = build_parser("server").parse_args(["server", "--model", tiny_bloom, "--frame-idle-timeout", "7.5"])
    assert server_config(args).frame_idle_timeout_s == 7.5


@pytest.mark.parametrize("verb", ["server", "generate", "chat", "api"])
def test_help_lists_the_common_options_first_and_the_rest_as_advanced(verb, capsys):
    """Issue 37: --help groups options (basic / advanced); every flag is in one of the groups, each with its help."""
    from swarmlm.cli.main import build_parser

    parser = build_parser(verb)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[verb]
    text = sub.format_help()
    common, advanced = text.index("\ncommon options:\n"), text.index("\nadvanced options:\n")
    assert common < advanced and text.index("--model") < advanced  # --model is common everywhere
    assert text.index("--initial-peers") < advanced and text.index("--log-level") > advanced
    assert text.splitlines()[0].startswith(f"usage: swarmlm {verb} --model") and len(text.splitlines()[0]) < 100
    flags = {o for a in sub._actions for o in a.option_strings if o.startswith("--")}
    assert all(f in text for f in flags)


def test_the_dht_prints_the_line_other_machines_need():
    """Issue 37: `swarmlm dht` says which --initial-peers another machine passes (not a loopback address), or that
    none can join while it listens on 127.0.0.1."""
    from swarmlm.cli.dht_cmd import join_hint

    lan = ["/ip4/127.0.0.1/tcp/31337/p2p/12D3KooWA", "/ip4/192.168.1.10/tcp/31337/p2p/12D3KooWA"]
    assert join_hint(lan, "0.0.0.0") == "other machines join with: --initial-peers " + lan[1]
    local = join_hint(lan[:1], "127.0.0.1")
    assert "other machines cannot join" in local and "--host 0.0.0.0" in local and lan[0] in local


def test_profile_and_api_compute_on_every_core_they_may_use_by_default(tiny_bloom):
    """Issue 37: --threads defaults to the usable cores on every verb that computes, as on `server`."""
    import os

    from swarmlm.cli.main import build_parser

    for verb in ("profile", "api"):
        args = build_parser(verb).parse_args([verb, "--model", tiny_bloom])
        assert args.threads == len(os.sched_getaffinity(0)), verb


def test_a_checkpoint_without_a_dtype_prints_no_transformers_deprecation(tiny_llama, tmp_path):
    """Issue 37: reading a checkpoint's dtype (a GGUF's config, or a config.json without one) printed transformers'
    "`torch_dtype` is deprecated" before our own errors (in a fresh process: transformers warns once per process)."""
    import shutil

    model = tmp_path / "no-dtype"
    shutil.copytree(tiny_llama, model)
    config = json.loads((model / "config.json").read_text())
    config.pop("dtype", None)
    config.pop("torch_dtype", None)
    (model / "config.json").write_text(json.dumps(config))
    code = ("from swarmlm.model.checkpoint import checkpoint_dtype, load_config; "
            f"print(checkpoint_dtype(load_config({str(model)!r})))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "torch.float32", done.stderr
    assert "deprecated" not in done.stderr, done.stderr


def test_the_dht_stops_quietly_when_its_process_group_is_signalled():
    """Issue 37: `timeout` (and Ctrl-C in a terminal) signal the whole process group, the p2pd daemon with the
    node: its stop is no fault, and printed p2pd errors and asyncio tracebacks."""
    import os
    import signal

    proc = subprocess.Popen([sys.executable, "-m", "swarmlm.cli.main", "dht"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout.readline().startswith("/ip4/127.0.0.1/tcp/")  # up, with its p2pd
        os.killpg(proc.pid, signal.SIGTERM)  # as `timeout` does
        _, err = proc.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0
    assert "Traceback" not in err and "ERROR" not in err and "error" not in err.lower(), err
