"""int8 / int4 weights of a float checkpoint (swarmlm/model/quant.py: weight-only, blocks of 32 with their own
scale): logits within a stated bound of fp32 transformers, less memory, announced to clients, refused by clients
that require full precision; bad settings refused."""
from __future__ import annotations

import pytest
import torch

from swarmlm.client.model import DistributedModelForCausalLM
from swarmlm.config import ClientConfig, ServerConfig
from swarmlm.errors import MissingBlocks
from swarmlm.model.checkpoint import load_blocks, load_client_modules, load_config
from swarmlm.model.packed import PackedEmbedding, PackedLinear
from swarmlm.model.quant import check_quant, loaded_bytes, quantize_client_modules, quantize_linears
from swarmlm.server.stage import Stage
from swarmlm.swarm.records import ServerRecord, record_from_info
from swarmlm.types import BlockRange
from swarmlm.wire import swarm_pb2 as pb
from tests.swarm_helpers import InProcessSwarm, in_process_server, reference_model

# relative L2 of the logits against fp32 transformers, blocks and/or head + embeddings quantized: tiny random models
# quantize worse than trained ones (measured up to 1.35 % int8, 19 % int4 on tiny-llama, 0.7 % / 10.5 % tiny-bloom);
# on trained SmolLM2: docs/RESULTS-perf.md "Packed weights"
LOGITS_REL_L2 = {"int8": 0.03, "int4": 0.3}


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


def local_logits(path: str, ids: torch.Tensor, server_quant: str, client_quant: str) -> torch.Tensor:
    """The swarm's computation in one process: client modules around one Stage of all blocks."""
    _, _, mods = load_client_modules(path)
    quantize_client_modules(mods, client_quant)
    n = int(load_config(path).num_hidden_layers)
    stage = Stage(path, BlockRange(0, n), quant=server_quant)
    with torch.no_grad():
        h = mods.embed(ids)
        h = mods.embed_norm(h) if mods.embed_norm is not None else h
        h = stage.forward(BlockRange(0, n), h, torch.ones_like(ids))
        return mods.lm_head(mods.final_norm(h))


@pytest.mark.parametrize("family", ["bloom", "llama"])
@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quantized_logits_within_bound_of_fp32_transformers(checkpoints, family, quant):
    path = checkpoints[family]
    ids = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = reference_model(path)(ids).logits
    exact = local_logits(path, ids, "none", "none")
    assert rel_l2(exact, want) < 1e-5  # the same path unquantized is exact: the error below is the quantization's
    for server_quant, client_quant in [(quant, "none"), ("none", quant), (quant, quant)]:
        err = rel_l2(local_logits(path, ids, server_quant, client_quant), want)
        assert 0 < err < LOGITS_REL_L2[quant], (server_quant, client_quant, err)


def test_quantized_blocks_hold_their_blocks_bytes(tiny_bloom):
    fp32 = Stage(tiny_bloom, BlockRange(0, 3))
    int8, int4 = (Stage(tiny_bloom, BlockRange(0, 3), quant=q) for q in ("int8", "int4"))
    assert (int8.announced_quant, int4.announced_quant, fp32.announced_quant) == ("int8", "int4", "none")
    assert 0 < int4.weight_bytes < int8.weight_bytes < 0.34 * fp32.weight_bytes
    assert {m.packed.type_name for m in int8.modules.modules() if isinstance(m, PackedLinear)} == {"Q8_M"}
    assert {m.packed.type_name for m in int4.modules.modules() if isinstance(m, PackedLinear)} == {"Q4_1"}
    assert loaded_bytes([64, 256], 4, "int8") == 64 * 8 * 40 and loaded_bytes([64, 256], 4, "none") == 64 * 256 * 4


def test_blocks_quantized_while_loading_equal_blocks_quantized_after(tiny_bloom):
    """The server quantizes each block as it is read (its memory follows the quantized size): same result."""
    _, _, loaded = load_blocks(tiny_bloom, 0, 3, quant="int8")
    _, _, after = load_blocks(tiny_bloom, 0, 3, quant="none")
    quantize_linears(after, "int8")
    assert not any(type(m) is torch.nn.Linear for m in loaded.modules())
    assert sum(isinstance(m, PackedLinear) for m in loaded.modules()) == 12  # 4 linears per BLOOM block
    a = [m.packed.data for m in loaded.modules() if isinstance(m, PackedLinear)]
    b = [m.packed.data for m in after.modules() if isinstance(m, PackedLinear)]
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
    # bfloat16 compute over int8 weights works too (activations are cast to float32 for the kernel)
    _, _, bf16 = load_blocks(tiny_bloom, 0, 1, "bfloat16", quant="int8")
    assert any(isinstance(m, PackedLinear) for m in bf16.modules())


def test_quantized_embedding_rows_close_to_fp32(tiny_bloom):
    _, _, mods = load_client_modules(tiny_bloom)
    ids = torch.arange(0, 512).reshape(8, 64)
    want = mods.embed(ids)
    step = (mods.embed.weight.amax(1) - mods.embed.weight.amin(1))[ids].unsqueeze(-1) / 255  # Q8_M's largest step
    quantize_client_modules(mods, "int8")
    assert isinstance(mods.embed, PackedEmbedding)
    assert ((mods.embed(ids) - want).abs() <= step).all()


def test_bad_quant_settings_are_refused():
    with pytest.raises(ValueError, match="quant"):
        check_quant("nf4")
    with pytest.raises(ValueError, match="quant"):
        ServerConfig(model_dir="x", blocks=None, quant="nf4")
    with pytest.raises(ValueError, match="quant"):
        ClientConfig(quant="fp8")
    base = dict(server_id="s", address="127.0.0.1:1", start=0, end=2)
    assert ServerRecord.from_dict({**base, "quant": "int4", "weight_bytes": 10}).quant == "int4"
    with pytest.raises(ValueError, match="quant"):
        ServerRecord.from_dict({**base, "quant": "auto"})  # a form in memory, not a kind of values: never announced
    with pytest.raises(ValueError):
        ServerRecord.from_dict({**base, "weight_bytes": -1})
    # an older server's Info carries no quant: it serves full precision
    info = pb.InfoReply(server_id="s", start_block=0, end_block=2, decode_s_per_block=0.01)
    assert record_from_info(info, "127.0.0.1:1").quant == "none"


# ---- servers (in this process): an int8 one for blocks [0, 3), an fp32 one for [3, 6) -----------------------------
@pytest.fixture(scope="module")
def mixed_swarm(tiny_bloom):
    with in_process_server(tiny_bloom, BlockRange(0, 3), quant="int8") as int8, \
            in_process_server(tiny_bloom, BlockRange(3, 6)) as fp32:
        yield tiny_bloom, InProcessSwarm(tiny_bloom, [int8, fp32])


def test_quantized_server_in_a_real_swarm(mixed_swarm):
    path, swarm = mixed_swarm
    ids = torch.randint(0, 500, (1, 12), generator=torch.Generator().manual_seed(1))
    ref = reference_model(path)
    client = DistributedModelForCausalLM.from_pretrained(path, servers=swarm.addresses, quant="int8")
    try:
        with client.inference_session(max_length=ids.shape[1] + 4) as session:
            got = client.step_logits(session, ids)
            with torch.no_grad():
                want = ref(ids).logits
            assert 0 < rel_l2(got, want) < LOGITS_REL_L2["int8"]
            for _ in range(4):  # decode steps through the int8 server stay within the bound
                nxt = want[:, -1:].argmax(-1)
                ids = torch.cat([ids, nxt], 1)
                got = client.step_logits(session, nxt)
                with torch.no_grad():
                    want = ref(ids).logits[:, -1:]
                assert rel_l2(got, want) < LOGITS_REL_L2["int8"]
        records = {(r.start, r.end): r for r in client.remote.view.records.values()}
        int8, fp32 = records[(0, 3)], records[(3, 6)]
        assert (int8.quant, fp32.quant) == ("int8", "none")
        assert 0 < int8.weight_bytes < 0.34 * fp32.weight_bytes  # same block count, a third of the bytes or less
    finally:
        client.close()


def test_client_requiring_full_precision_avoids_the_int8_server(mixed_swarm):
    path, swarm = mixed_swarm
    client = DistributedModelForCausalLM.from_pretrained(
        path, servers=swarm.addresses, require_full_precision=True, wait_for_blocks_s=3.0)
    try:
        with pytest.raises(MissingBlocks):  # blocks [0, 3) are served only in int8
            client(torch.tensor([[1, 2, 3]]))
        assert all(r.quant == "none" for r in client.remote.view.records.values())
    finally:
        client.close()
