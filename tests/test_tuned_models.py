"""Tuned models are first-class (issue 37): a soft prompt or LoRA trained through the swarm is saved with its
settings (PEFT's folder format), loads with one call, generates with the servers' caches the same tokens as without
them, and a LoRA is what `server --adapters` serves -- checked at start, before any block loads."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from swarmlm.client.model import DistributedModelForCausalLM
from swarmlm.config import ServerConfig
from swarmlm.server.adapters import check_adapters
from swarmlm.server.server import Server
from swarmlm.types import BlockRange
from tests.swarm_helpers import gateway_stack, in_process_server

torch.set_num_threads(1)
IDS = torch.tensor([[5, 17, 42, 99, 3, 250, 7]])


def _greedy(model, **kwargs) -> list[int]:
    return model.generate(IDS, max_new_tokens=8, do_sample=False, **kwargs)[0, IDS.shape[1]:].tolist()


@pytest.mark.parametrize("family", ["llama", "bloom"])  # BLOOM normalises the prompt with the tokens
def test_a_soft_prompt_saved_and_reloaded_generates_with_the_cache_as_without(checkpoints, family, tmp_path):
    model_dir = checkpoints[family]
    with in_process_server(model_dir, BlockRange(0, 6)) as server:
        tuned = DistributedModelForCausalLM.from_pretrained(model_dir, servers=[server.address], dtype="float32",
                                                            tuning_mode="ptune", pre_seq_len=4)
        with torch.no_grad():
            tuned.prompts.prompt_embeddings.normal_(0, 1.0, generator=torch.Generator().manual_seed(3))
        want = _greedy(tuned, use_cache=False)  # each step one stateless pass with the prompt in front
        tuned.save_adapter(tmp_path / "my-prompt")
        config = json.loads((tmp_path / "my-prompt" / "adapter_config.json").read_text())
        assert config["peft_type"] == "PROMPT_TUNING" and config["num_virtual_tokens"] == 4
        assert config["base_model_name_or_path"] == model_dir.rstrip("/").split("/")[-1]  # a name, not a path
        reloaded = DistributedModelForCausalLM.from_pretrained(model_dir, servers=[server.address], dtype="float32",
                                                               adapter=tmp_path / "my-prompt")
        assert _greedy(reloaded) == want  # cached: the session's first step carries the prompt
        cached, stateless = (reloaded.generate(IDS, max_new_tokens=4, do_sample=False, output_scores=True,
                                               return_dict_in_generate=True, use_cache=c).scores for c in (True, False))
        assert max((a - b).abs().max().item() for a, b in zip(cached, stateless)) < 1e-4
        plain = DistributedModelForCausalLM.from_pretrained(model_dir, servers=[server.address], dtype="float32")
        with torch.no_grad():  # the prompt does change the model's output
            assert (reloaded(IDS).logits - plain(IDS).logits).abs().max().item() > 1e-2
        for m in (tuned, reloaded, plain):
            m.close()


def test_a_lora_and_a_soft_prompt_are_served_beside_the_base_model_by_one_gateway(tiny_llama, tmp_path):
    import httpx2 as httpx
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    folder = tmp_path / "my-lora"
    with in_process_server(tiny_llama, BlockRange(0, 6)) as plain_server:
        tuned = DistributedModelForCausalLM.from_pretrained(
            tiny_llama, servers=[plain_server.address], dtype="float32", tuning_mode="lora", lora_r=4,
            lora_alpha=8, lora_target_modules=("q_proj", "v_proj", "down_proj"))
        with torch.no_grad():
            for b in tuned.lora.b:  # B starts at zero (PEFT's init): a LoRA that changes nothing proves nothing
                b.normal_(0, 0.2, generator=torch.Generator().manual_seed(4))
        want = _greedy(tuned, use_cache=False)
        tuned.save_adapter(folder)
        prompt = "The swarm says"
        ids = torch.tensor([tokenizer(prompt).input_ids])
        want_api = {"my-lora": tuned.generate(ids, max_new_tokens=6, do_sample=False,
                                              use_cache=False)[0, ids.shape[1]:]}
        tuned.close()
        soft = DistributedModelForCausalLM.from_pretrained(tiny_llama, servers=[plain_server.address],
                                                           dtype="float32", tuning_mode="ptune", pre_seq_len=3)
        with torch.no_grad():
            soft.prompts.prompt_embeddings.normal_(0, 1.0, generator=torch.Generator().manual_seed(6))
        soft.save_adapter(tmp_path / "my-prompt")
        want_api["my-prompt"] = soft.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1]:]
        soft.close()
        deep = DistributedModelForCausalLM.from_pretrained(tiny_llama, servers=[plain_server.address],
                                                           dtype="float32", tuning_mode="deep_ptune", pre_seq_len=2)
        with torch.no_grad():
            deep.prompts.prompt_embeddings.normal_(0, 1.0, generator=torch.Generator().manual_seed(7))
            deep.prompts.deep_prompts.normal_(0, 1.0, generator=torch.Generator().manual_seed(8))
        deep.save_adapter(tmp_path / "my-deep")
        want_deep = deep.generate(ids, max_new_tokens=6, do_sample=False, use_cache=False)[0, ids.shape[1]:]
        deep.close()
        plain = DistributedModelForCausalLM.from_pretrained(tiny_llama, servers=[plain_server.address],
                                                            dtype="float32")
        want_api["base"] = plain.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1]:]
        plain.close()
    assert all(len(w) > 0 for w in want_api.values())
    assert len({tuple(w.tolist()) for w in want_api.values()}) == 3  # three models, three answers
    want_api["my-deep"] = want_deep  # (the servers' sessions hold its blocks' prompts)
    base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    peft = PeftModel.from_pretrained(base, folder).eval()  # the folder is PEFT's format
    assert peft.generate(input_ids=IDS, max_new_tokens=8, do_sample=False)[0, IDS.shape[1]:].tolist() == want
    assert check_adapters([str(folder)], tiny_llama) == ["my-lora"]
    with in_process_server(tiny_llama, BlockRange(0, 6), adapters=(str(folder),)) as server:
        by_folder = DistributedModelForCausalLM.from_pretrained(tiny_llama, servers=[server.address],
                                                                dtype="float32", adapter=folder)
        by_name = DistributedModelForCausalLM.from_pretrained(tiny_llama, servers=[server.address],
                                                              dtype="float32", adapter="my-lora")
        assert _greedy(by_folder) == want and _greedy(by_name) == want  # in cached sessions, on the server
        by_folder.close()
        by_name.close()
    # one gateway serves the base model, the LoRA (servers pre-load it), the soft and the deep prompt (the gateway
    # holds them), each under its own id: a request's `model` selects one, and each gives its Python client's tokens
    with gateway_stack(tiny_llama, tmp_path / "logs", ["--adapter", str(folder), "--adapter",
                                                       str(tmp_path / "my-prompt"), "--adapter",
                                                       str(tmp_path / "my-deep")],
                       server_extra=lambda i: ["--adapters", str(folder)]) as (_, gateway):
        listed = [m["id"] for m in httpx.get(f"{gateway.url}/v1/models", timeout=30).json()["data"]]
        assert listed == [Path(tiny_llama).name, "my-lora", "my-prompt", "my-deep"]
        for name in (*listed, str(tmp_path / "my-prompt")):  # (the folder as given is accepted too)
            reply = httpx.post(f"{gateway.url}/v1/completions", timeout=120, json={
                "model": name, "prompt": prompt, "max_tokens": 6, "temperature": 0, "n": 2}).json()
            served = name if name in listed else "my-prompt"
            assert reply["model"] == served, reply
            text = tokenizer.decode(want_api[served if served != listed[0] else "base"], skip_special_tokens=True)
            assert [c["text"] for c in reply["choices"]] == [text, text]  # (n = 2: the prompt's cache copied)


def test_server_adapters_are_checked_before_any_block_loads(tiny_llama, tiny_bloom, tmp_path):
    with in_process_server(tiny_llama, BlockRange(0, 6)) as server:
        lora = DistributedModelForCausalLM.from_pretrained(tiny_llama, servers=[server.address], dtype="float32",
                                                           tuning_mode="lora", lora_r=2)
        lora.save_adapter(tmp_path / "llama-lora")
        prompt = DistributedModelForCausalLM.from_pretrained(tiny_llama, servers=[server.address], dtype="float32",
                                                             tuning_mode="ptune", pre_seq_len=2)
        prompt.save_adapter(tmp_path / "a-prompt")
        lora.close()
        prompt.close()
    cases = [(str(tmp_path / "absent"), FileNotFoundError, "absent"),
             (str(tmp_path / "llama-lora"), ValueError, "tuned on tiny-llama"),  # a LoRA of another model
             (str(tmp_path / "a-prompt"), ValueError, "soft prompt")]
    for ref, error, words in cases:
        server = Server(ServerConfig(model_dir=tiny_bloom, blocks=BlockRange(0, 6), adapters=(ref,)))
        with pytest.raises(error, match=words) as raised:
            asyncio.run(server.start())
        assert "\n" not in str(raised.value) and server.stage is None  # one line; no block was loaded
    with pytest.raises(FileNotFoundError, match="no such directory"):
        DistributedModelForCausalLM.from_pretrained(tiny_llama, servers=["127.0.0.1:1"], adapter="./absent")


def test_the_cli_takes_a_tuned_model_and_a_server_refuses_a_missing_adapter_in_one_line(tiny_llama, tmp_path):
    import subprocess
    import sys

    def swarmlm(*args):
        return subprocess.run([sys.executable, "-m", "swarmlm.cli.main", *args], capture_output=True, text=True,
                              timeout=300)

    done = swarmlm("server", "--model", tiny_llama, "--blocks", "0:6", "--adapters", str(tmp_path / "absent"))
    assert done.returncode == 2 and "absent" in done.stderr and "Traceback" not in done.stderr
    assert "loading blocks" not in done.stderr  # refused before any block loads
    with in_process_server(tiny_llama, BlockRange(0, 6)) as server:
        tuned = DistributedModelForCausalLM.from_pretrained(tiny_llama, servers=[server.address], dtype="float32",
                                                            tuning_mode="ptune", pre_seq_len=3)
        with torch.no_grad():
            tuned.prompts.prompt_embeddings.normal_(0, 1.0, generator=torch.Generator().manual_seed(5))
        want = _greedy(tuned, use_cache=False)
        tuned.save_adapter(tmp_path / "my-prompt")
        tuned.close()
        deep = DistributedModelForCausalLM.from_pretrained(tiny_llama, servers=[server.address], dtype="float32",
                                                           tuning_mode="deep_ptune", pre_seq_len=2)
        with torch.no_grad():
            deep.prompts.deep_prompts.normal_(0, 1.0, generator=torch.Generator().manual_seed(6))
        want_deep = _greedy(deep, use_cache=False)
        deep.save_adapter(tmp_path / "deep-prompt")
        deep.close()
        done = swarmlm("generate", "--model", tiny_llama, "--servers", server.address, "--dtype", "float32",
                       "--adapter", str(tmp_path / "deep-prompt"), "--input-ids", ",".join(map(str, IDS[0].tolist())),
                       "--max-new-tokens", "8", "--json")  # with the servers' caches now
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["token_ids"] == want_deep
        done = swarmlm("generate", "--model", tiny_llama, "--servers", server.address, "--dtype", "float32",
                       "--adapter", str(tmp_path / "my-prompt"), "--input-ids", ",".join(map(str, IDS[0].tolist())),
                       "--max-new-tokens", "8", "--json")
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["token_ids"] == want


@pytest.mark.parametrize("mode", ["ptune", "deep_ptune"])
def test_speculative_generation_with_a_prompt_equals_plain_greedy(tiny_llama, mode):
    """generate(speculative=...) runs the decoding room with the soft (and deep) prompt in front of the session's
    first step: the same tokens as transformers' loop, one row or a left-padded batch, drafts accepted or not."""
    ids = torch.tensor([[5, 17, 42, 99, 5, 17, 42, 99, 5, 17], [0, 0, 8, 9, 10, 8, 9, 10, 8, 9]])
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    with in_process_server(tiny_llama, BlockRange(0, 6)) as server:
        model = DistributedModelForCausalLM.from_pretrained(tiny_llama, servers=[server.address], dtype="float32",
                                                            tuning_mode=mode, pre_seq_len=3)
        with torch.no_grad():
            model.prompts.prompt_embeddings.normal_(0, 1.0, generator=torch.Generator().manual_seed(9))
            if model.prompts.deep_prompts is not None:
                model.prompts.deep_prompts.normal_(0, 1.0, generator=torch.Generator().manual_seed(10))
        for rows in (slice(0, 1), slice(0, 2)):
            kwargs = dict(attention_mask=mask[rows], max_new_tokens=10, do_sample=False, pad_token_id=0)
            want = model.generate(ids[rows], **kwargs)  # transformers' loop over the servers' caches
            for speculative in (2, "auto"):
                got = model.generate(ids[rows], speculative=speculative, **kwargs)
                assert model.last_stats.speculation is not None  # (the decoding room ran it)
                assert torch.equal(got, want), (speculative, got, want)
        model.close()
