"""Names as transformers takes them (a directory, or a hub id from the HF cache, offline), dtype "auto", one swarm
per model identity, and weights fingerprints: differently named copies of one checkpoint serve one swarm, a server
with other weights under the same name is refused by clients."""
from __future__ import annotations

import contextlib
import logging
import shutil
import time
from pathlib import Path

import httpx2
import pytest
import torch
from huggingface_hub import constants
from huggingface_hub.errors import RemoteEntryNotFoundError
from transformers import AutoTokenizer, FalconConfig, GPT2Config

import swarmlm.model.checkpoint as checkpoint_module
import swarmlm.model.source as source_module
from swarmlm.client.model import DistributedModelForCausalLM
from swarmlm.config import ClientConfig, ServerConfig
from swarmlm.model.checkpoint import TensorIndex, load_blocks, load_client_modules, load_config, parse_dtype
from swarmlm.model.families import family_for
from swarmlm.model.fingerprint import Fingerprints, WeightsCheck, dht_prefix, model_identity
from swarmlm.model.random_checkpoint import init_checkpoint
from swarmlm.model.source import ModelNotFound, resolve
from swarmlm.swarm.dht import default_dht_prefix
from swarmlm.swarm.local import LocalSwarm
from swarmlm.types import BlockRange
from tests.hub_layout import add_to_hub_cache
from tests.swarm_helpers import reference_generate


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """One tiny Qwen3 (sharded), an identical copy under another name, the same weights sharded differently, and
    the same architecture with other weights (another seed): same config.json, so the same identity."""
    root = tmp_path_factory.mktemp("ckpts")
    first = init_checkpoint("tiny-qwen3", root / "first", seed=5, max_shard_size="100KB")
    second = Path(shutil.copytree(first, root / "second-copy"))
    resharded = init_checkpoint("tiny-qwen3", root / "resharded", seed=5, max_shard_size="300KB")
    other = init_checkpoint("tiny-qwen3", root / "other-weights", seed=6, max_shard_size="100KB")
    return {"first": first, "second": second, "resharded": resharded, "other": other}


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty HF cache, offline: for this process (huggingface_hub's constants) and any process it starts."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


# ---- names ------------------------------------------------------------------------------------------------------
def test_a_hub_id_loads_from_the_offline_cache_like_its_directory(checkpoints, hub_cache):
    add_to_hub_cache(hub_cache, "org/tiny", checkpoints["first"])
    assert resolve("org/tiny").is_hub and not resolve(checkpoints["first"]).is_hub
    by_id, by_dir = load_config("org/tiny").to_dict(), load_config(checkpoints["first"]).to_dict()
    assert by_id.pop("_name_or_path") != by_dir.pop("_name_or_path") and by_id == by_dir
    _, _, by_id = load_blocks("org/tiny", 1, 3)
    _, _, by_dir = load_blocks(checkpoints["first"], 1, 3)
    assert all(torch.equal(a, b) for a, b in zip(by_id.state_dict().values(), by_dir.state_dict().values()))
    _, _, client = load_client_modules("org/tiny")
    assert torch.equal(client.embed.weight, load_client_modules(checkpoints["first"])[2].embed.weight)
    assert (resolve("org/tiny").snapshot_dir() / "tokenizer.json").is_file()  # AutoTokenizer can read it


def test_a_revision_picks_its_snapshot(checkpoints, hub_cache):
    add_to_hub_cache(hub_cache, "org/tiny", checkpoints["first"], commit="a" * 40)
    add_to_hub_cache(hub_cache, "org/tiny", checkpoints["other"], commit="b" * 40)  # refs/main -> b
    add_to_hub_cache(hub_cache, "org/tiny", checkpoints["first"], commit="a" * 40)  # refs/main -> a again
    main, pinned = Fingerprints("org/tiny"), Fingerprints(f"org/tiny@{'b' * 40}")
    assert main.range(0, 4) == Fingerprints(checkpoints["first"]).range(0, 4)
    assert pinned.range(0, 4) == Fingerprints(checkpoints["other"]).range(0, 4)
    assert model_identity(f"org/tiny@{'b' * 40}") == f"org/tiny@{'b' * 40}"  # a pinned revision is its own swarm


def test_unknown_names_fail_with_a_clear_message(hub_cache, tmp_path):
    with pytest.raises(ModelNotFound, match="not in the local HF cache.*HF_HUB_OFFLINE=0"):
        load_config("org/not-there")
    with pytest.raises(ModelNotFound, match="not a checkpoint directory"):
        load_config(str(tmp_path / "no-such-dir"))
    with pytest.raises(ModelNotFound, match="not a hub id"):
        load_config("not a name!")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_config(empty)


def test_online_a_process_downloads_only_the_shards_it_reads(checkpoints, hub_cache, monkeypatch):
    """The hub itself is out of reach here: a stand-in for hf_hub_download serves files from a directory into
    the cache and records what was asked. Servers fetch their blocks' shards, clients their modules' shards."""
    remote = checkpoints["first"]
    fetched: list[str] = []

    def download(repo_id: str, filename: str, revision: str | None = None) -> str:
        fetched.append(filename)
        if not (remote / filename).is_file():
            response = httpx2.Response(404, request=httpx2.Request("GET", f"https://hub/{repo_id}/{filename}"))
            raise RemoteEntryNotFoundError(f"{filename} not found", response=response)
        one = hub_cache.parent / "one-file"
        shutil.rmtree(one, ignore_errors=True)
        one.mkdir()
        shutil.copyfile(remote / filename, one / filename)
        return str(add_to_hub_cache(hub_cache, repo_id, one) / filename)

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(source_module, "hf_hub_download", download)
    monkeypatch.setattr(source_module, "hub_reachable", lambda endpoint: True)  # the stand-in answers
    index = TensorIndex(remote)
    shards = set(index.shard_of.values())
    load_blocks("org/remote", 2, 3)
    block_shards = {index.shard_of[k] for k in index.keys_under("model.layers.2.")}
    assert set(fetched) == {"config.json", "model.safetensors.index.json"} | block_shards
    assert len(block_shards) < len(shards), "the checkpoint should have more shards than block 2 needs"
    fetched.clear()
    load_client_modules("org/remote")
    client_keys = ["model.embed_tokens.weight", "model.norm.weight"]  # tiny-qwen3 ties its head to embeddings
    assert set(fetched) == {index.shard_of[k] for k in client_keys}  # config and index are cached now


# ---- families and dtype -------------------------------------------------------------------------------------------
def test_unsupported_models_are_refused_clearly():
    with pytest.raises(ValueError, match="'gpt2' is not supported; supported: bloom, falcon, gemma2"):
        family_for(GPT2Config())
    with pytest.raises(ValueError, match="alibi=True"):
        family_for(FalconConfig(alibi=True))


@pytest.mark.parametrize("bf16_units", [False, True], ids=["cpu-without-amx", "cpu-with-amx"])
def test_dtype_auto_is_the_checkpoints_own_but_half_precision_follows_the_cpu(checkpoints, tmp_path, caplog,
                                                                              monkeypatch, bf16_units):
    # both branches on any machine: the CPU's answer and the absence of a GPU are set here, not read
    monkeypatch.setattr(checkpoint_module, "cpu_has_bf16_matmul", lambda: bf16_units)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert parse_dtype("auto", checkpoints["first"]) == torch.float32
    bf16 = init_checkpoint("tiny-qwen3", tmp_path / "bf16", dtype=torch.bfloat16)
    fp16 = init_checkpoint("tiny-qwen3", tmp_path / "fp16", dtype=torch.float16)
    want = torch.bfloat16 if bf16_units else torch.float32  # bf16 kept only where the CPU multiplies it natively
    with caplog.at_level(logging.WARNING, logger="swarmlm.model.checkpoint"):
        assert parse_dtype("auto", bf16) == want
        assert ("bfloat16; running it as float32" in caplog.text) == (not bf16_units)  # the server says what it did
        assert parse_dtype("auto", fp16) == torch.float32  # fp16 runs as fp32 on a CPU, AMX or not
        assert "the checkpoint is float16; running it as float32" in caplog.text
    _, _, blocks = load_blocks(bf16, 0, 1, "auto")
    assert next(blocks.parameters()).dtype == want
    _, _, blocks = load_blocks(bf16, 0, 1, "bfloat16")  # asked explicitly: kept
    assert next(blocks.parameters()).dtype == torch.bfloat16
    _, _, blocks = load_blocks(fp16, 0, 1, "float16")
    assert next(blocks.parameters()).dtype == torch.float16
    with pytest.raises(ValueError, match="give the model"):
        parse_dtype("auto")
    with pytest.raises(ValueError, match="dtype must be one of auto"):
        ServerConfig(model_dir="x", blocks=None, dtype="fp8")
    with pytest.raises(ValueError, match="dtype must be one of auto"):
        ClientConfig(dtype="int4")
    assert ClientConfig().dtype == ServerConfig(model_dir="x", blocks=None).dtype == "auto"


def test_dtype_takes_what_transformers_takes(checkpoints):
    """torch dtypes and their names, as transformers' from_pretrained takes them (issue 22: torch.float32 was
    refused); anything else refused with the accepted values named."""
    for given, name in [(torch.float32, "float32"), ("torch.bfloat16", "bfloat16"), ("half", "float16"),
                        ("float", "float32"), (torch.float16, "float16"), ("auto", "auto")]:
        assert ClientConfig(dtype=given).dtype == ServerConfig(model_dir="x", blocks=None, dtype=given).dtype == name
    assert parse_dtype(torch.bfloat16) == parse_dtype("bfloat16") == torch.bfloat16
    for bad in (torch.int8, torch.float64, "fp32", 3):
        with pytest.raises(ValueError, match="dtype must be one of auto, float32, bfloat16, float16"):
            ClientConfig(dtype=bad)
    path = checkpoints["first"]
    for kwargs, want in [(dict(dtype=torch.float32), torch.float32), (dict(torch_dtype=torch.bfloat16), torch.bfloat16),
                         (dict(dtype="bfloat16", torch_dtype="bfloat16"), torch.bfloat16)]:
        client = DistributedModelForCausalLM.from_pretrained(path, servers=["127.0.0.1:9"], **kwargs)  # no dial yet
        try:
            assert client.dtype == want and client.client_modules.lm_head.weight.dtype == want, kwargs
        finally:
            client.close()
    with pytest.raises(ValueError, match="disagree"):
        DistributedModelForCausalLM.from_pretrained(path, servers=["127.0.0.1:9"], dtype="float16",
                                                    torch_dtype=torch.float32)


# ---- identity and fingerprints ------------------------------------------------------------------------------------
def test_identity_is_the_config_not_the_path_and_fingerprints_are_the_weights(checkpoints, tmp_path):
    first, second, resharded, other = (checkpoints[k] for k in ("first", "second", "resharded", "other"))
    assert model_identity(first) == model_identity(second) == model_identity(other)
    assert default_dht_prefix(first) == default_dht_prefix(second) == dht_prefix(first)
    assert model_identity(first).startswith("qwen3-")
    assert model_identity(init_checkpoint("tiny-mistral", tmp_path / "m")) != model_identity(first)
    assert dht_prefix("Org/Some.Model") == "Org--Some-Model"
    want = Fingerprints(first)
    for start, end in [(0, 4), (0, 1), (1, 4), (2, 3)]:
        assert Fingerprints(second).range(start, end) == Fingerprints(resharded).range(start, end) == want.range(start, end)
        assert Fingerprints(other).range(start, end) != want.range(start, end)
    check = WeightsCheck(first)
    assert check(1, 4, want.range(1, 4)) is None
    assert "other weights" in check(1, 4, Fingerprints(other).range(1, 4))
    assert "other weights" in check(0, 2, "")  # a server announcing nothing is not trusted either
    assert "outside" in check(2, 9, want.range(2, 4))


@pytest.mark.slow
def test_copies_serve_one_swarm_and_other_weights_are_refused(checkpoints):
    """Three servers in one DHT: blocks [0, 2) from `first`, [2, 4) from an identical copy under another name,
    and all blocks from a checkpoint with the same config but other weights (same identity, same prefix)."""
    first, second, other = checkpoints["first"], checkpoints["second"], checkpoints["other"]
    with contextlib.ExitStack() as stack:
        swarm = stack.enter_context(LocalSwarm(first))
        swarm.start_dht()
        copy = stack.enter_context(LocalSwarm(second, with_dht=False))  # same DHT, another directory name
        impostor = stack.enter_context(LocalSwarm(other, with_dht=False))
        copy.initial_peers = impostor.initial_peers = swarm.initial_peers
        swarm.start_server(BlockRange(0, 2), wait=False)
        copy.start_server(BlockRange(2, 4), wait=False)
        bad = impostor.start_server(BlockRange(0, 4), wait=False)
        for s in (swarm, copy, impostor):
            s.wait_ready(s.servers)
        client = DistributedModelForCausalLM.from_pretrained(first, initial_peers=swarm.initial_peers)
        stack.callback(client.close)
        deadline = time.monotonic() + 120
        while not any(sid == bad.server_id for sid, _ in client.remote.rejected):  # once its record is read
            assert time.monotonic() < deadline, "the server with other weights was never seen and refused"
            client.remote.refresh()
            time.sleep(0.5)
        why = next(w for (sid, _), w in client.remote.rejected.items() if sid == bad.server_id)
        assert "other weights" in why
        assert bad.server_id not in client.remote.view.records

        ids = AutoTokenizer.from_pretrained(first)("the quick brown fox", return_tensors="pt").input_ids
        want = reference_generate(str(first), ids, max_new_tokens=6)
        got = client.generate(ids, max_new_tokens=6)
        # the impostor refused, the only chain is [0, 2) from `first` + [2, 4) from the copy: one swarm
        assert torch.equal(got.sequences if hasattr(got, "sequences") else got, want)
