"""Server-held LoRA adapters (server --adapters, PEFT's format): announced, routed to only by clients that ask for
them (active_adapter=), and their logits equal PEFT's; the base model stays served as it was, and the servers'
base weights never change."""
from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from swarmlm.client.model import DistributedModelForCausalLM
from swarmlm.server.adapters import adapter_fingerprint
from swarmlm.types import BlockRange
from swarmlm.wire import swarm_pb2 as pb
from swarmlm.wire import swarm_pb2_grpc as pb_grpc
from tests.swarm_helpers import in_process_server

pytestmark = pytest.mark.slow
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def adapter_dir(tiny_llama, tmp_path_factory):
    torch.manual_seed(0)
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32),
                          LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                     lora_dropout=0.0, task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)  # PEFT starts B at zero: an adapter that changes nothing would prove nothing
    path = tmp_path_factory.mktemp("adapters") / "my-adapter"
    peft.save_pretrained(path)
    return str(path)


def test_adapter_sessions_equal_peft_and_route_only_to_its_servers(tiny_llama, adapter_dir):
    from peft import PeftModel

    # the protocol (announce, open, route, refuse): the servers run in this process
    with in_process_server(tiny_llama, BlockRange(0, 6), adapters=(adapter_dir,)) as with_adapter, \
            in_process_server(tiny_llama, BlockRange(0, 6)) as plain:
        addresses = [with_adapter.address, plain.address]
        ids = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(1))
        base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
        with torch.no_grad():
            want_base = base(ids).logits
            want = PeftModel.from_pretrained(base, adapter_dir).eval()(ids).logits
        tuned = DistributedModelForCausalLM.from_pretrained(tiny_llama, servers=addresses, dtype="float32",
                                                            active_adapter="my-adapter")
        with torch.no_grad(), tuned.inference_session(max_length=16) as session:
            got = tuned.step_logits(session, ids)
            assert {s.address for s in session.route_spans()} == {with_adapter.address}
            step = tuned.step_logits(session, ids[:, -1:])  # a decode step with the adapter too
        assert (got - want).abs().max().item() < 1e-4
        assert (got - want_base).abs().max().item() > 1e-2  # the adapter did change the logits
        with torch.no_grad():
            want_step = PeftModel.from_pretrained(
                AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32), adapter_dir).eval()(
                torch.cat([ids, ids[:, -1:]], 1)).logits[:, -1:]
        assert (step - want_step).abs().max().item() < 1e-4
        # the base model, from both servers, is untouched
        for address in addresses:
            client = DistributedModelForCausalLM.from_pretrained(tiny_llama, servers=[address], dtype="float32")
            with torch.no_grad():
                assert (client(ids).logits - want_base).abs().max().item() < 1e-4
            client.close()
        tuned.close()
        with grpc.insecure_channel(plain.address) as channel:  # an adapter the server does not hold: refused
            replies = pb_grpc.SwarmStub(channel).Inference(iter([pb.InferenceRequest(open=pb.OpenSession(
                start_block=0, end_block=6, batch_size=1, max_length=8, adapter="my-adapter"))]), timeout=30)
            with pytest.raises(grpc.RpcError) as err:
                list(replies)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not served" in err.value.details()
        with grpc.insecure_channel(with_adapter.address) as channel:
            assert list(pb_grpc.SwarmStub(channel).Info(pb.InfoRequest(), timeout=30).adapters) == \
                [f"my-adapter@{adapter_fingerprint(adapter_dir)}"]  # (its weights' hash: tests/test_adapter_versions.py)
            # an adapter's rows are not the base model's under the same prefix keys: no prefix cache beside it
            replies = pb_grpc.SwarmStub(channel).Inference(iter([pb.InferenceRequest(open=pb.OpenSession(
                start_block=0, end_block=6, batch_size=1, max_length=40, adapter="my-adapter",
                prefix_scope=b"s" * 16, prefix_keys=[b"k" * 16]))]), timeout=30)
            with pytest.raises(grpc.RpcError) as err:
                list(replies)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prefix cache" in err.value.details()


def test_an_adapter_is_found_by_hub_id_in_the_offline_cache(adapter_dir, tmp_path, monkeypatch):
    """`--adapters org/name`: from the local HF cache (as models are), named by the repo; a missing one is a clear
    FileNotFoundError naming it."""
    from huggingface_hub import constants

    from swarmlm.server.adapters import locate_adapter
    from tests.hub_layout import add_to_hub_cache

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    snapshot = add_to_hub_cache(tmp_path / "hub", "someone/sentiment-lora", adapter_dir)
    name, directory = locate_adapter("someone/sentiment-lora")
    assert name == "sentiment-lora" and directory == snapshot
    assert locate_adapter(adapter_dir) == ("my-adapter", Path(adapter_dir))
    with pytest.raises(FileNotFoundError, match="someone/absent"):
        locate_adapter("someone/absent")
