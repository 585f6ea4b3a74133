"""Issue 39, hole 7: adapters are known by their weights, not their name alone. A server announces each adapter as
`name@fingerprint` (a hash of its matrices, in its record and its signed Info); a client asking for `name` routes to
one version only (chosen once, kept), or pins one (`name@fingerprint`); a server refuses a session asking for
another version than the one it holds. Before, two servers announcing `my-adapter` with other weights both passed,
and fresh clients got either one, silently."""
from __future__ import annotations

import grpc
import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from swarmlm.bench.swarm_attacks import make_lora
from swarmlm.client.model import DistributedModelForCausalLM
from swarmlm.server.adapters import adapter_fingerprint
from swarmlm.types import BlockRange
from swarmlm.wire import swarm_pb2 as pb
from tests.swarm_helpers import in_process_server, stub

pytestmark = pytest.mark.slow
torch.set_num_threads(1)


def _adapter(tiny_llama, path, seed: int) -> str:
    return make_lora(tiny_llama, path, seed)


def test_two_versions_of_one_adapter_name_are_told_apart_and_never_mixed(tiny_llama, tmp_path):
    one = _adapter(tiny_llama, tmp_path / "a" / "my-adapter", seed=0)
    two = _adapter(tiny_llama, tmp_path / "b" / "my-adapter", seed=1)
    fp = {one: adapter_fingerprint(one), two: adapter_fingerprint(two)}
    assert fp[one] != fp[two] and fp[one] == adapter_fingerprint(one)
    ids = torch.randint(0, 512, (1, 10), generator=torch.Generator().manual_seed(1))
    want = {}
    for path in (one, two):
        base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
        with torch.no_grad():
            want[fp[path]] = PeftModel.from_pretrained(base, path).eval()(ids).logits
    with in_process_server(tiny_llama, BlockRange(0, 3), adapters=(one,)) as a0, \
            in_process_server(tiny_llama, BlockRange(3, 6), adapters=(one,)) as a1, \
            in_process_server(tiny_llama, BlockRange(0, 3), adapters=(two,)) as b0, \
            in_process_server(tiny_llama, BlockRange(3, 6), adapters=(two,)) as b1:
        version = {s.address: v for v, group in ((fp[one], (a0, a1)), (fp[two], (b0, b1))) for s in group}
        assert [list(stub(s.address).Info(pb.InfoRequest()).adapters) for s in (a0, b1)] == \
            [[f"my-adapter@{fp[one]}"], [f"my-adapter@{fp[two]}"]]
        addresses = list(version)
        for asked in ["my-adapter"] * 4 + [f"my-adapter@{fp[two]}"]:
            client = DistributedModelForCausalLM.from_pretrained(tiny_llama, servers=addresses, dtype="float32",
                                                                 active_adapter=asked)
            for _ in range(2):
                with torch.no_grad(), client.inference_session(max_length=16) as session:
                    got = client.step_logits(session, ids)
                    used = {version[s.address] for s in session.route_spans()}
                assert len(used) == 1, used  # one version per generation
                (v,) = used
                assert (got - want[v]).abs().max().item() < 1e-4
                assert "@" not in asked or v == asked.split("@")[1]  # a pinned one is the one used
            client.close()
        request = pb.InferenceRequest(open=pb.OpenSession(start_block=0, end_block=3, batch_size=1, max_length=8,
                                                          adapter=f"my-adapter@{fp[two]}"))
        with pytest.raises(grpc.RpcError) as err:  # another version than the one held: refused
            list(stub(a0.address).Inference(iter([request]), timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "version" in err.value.details()
