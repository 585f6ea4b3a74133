"""Fine-tuning through the swarm equals fine-tuning locally: 2 server processes against the same model in plain
transformers + PEFT, fp32. Gradients of the loss w.r.t. the input embeddings, shallow and deep prompts and a
client-owned LoRA within 1e-4 relative; 5 optimizer steps give the same loss curve (1e-3)."""
from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, PromptTuningConfig, get_peft_model
from transformers import AutoModelForCausalLM

from swarmlm.client.model import DistributedModelForCausalLM
from swarmlm.swarm.local import even_split
from tests.swarm_helpers import client_of, server_processes

pytestmark = pytest.mark.slow
torch.set_num_threads(1)
K = 3  # prompt tokens


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm().clamp_min(1e-12)).item()


@pytest.fixture(scope="module", params=["llama", "bloom"])
def swarm(request, checkpoints):
    path = checkpoints[request.param]
    with server_processes(path, even_split(6, 2), dht=False) as processes:
        yield request.param, path, processes


def client(swarm, **tuning) -> DistributedModelForCausalLM:
    return client_of(swarm[2], dtype="float32", **tuning)


def reference(swarm):
    return AutoModelForCausalLM.from_pretrained(swarm[1], dtype=torch.float32).eval()


def batch(vocab: int = 512, rows: int = 2, tokens: int = 9, seed: int = 0,
          left: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and a mask padding one row: on the right (training's usual side), or on the left. (Left padding
    after a soft prompt: transformers' forward numbers positions 0..T-1 whatever the mask, the servers from the
    mask as generate() does; the two agree when padding is at either end of what the server sees.)"""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, tokens), generator=g)
    mask = torch.ones(rows, tokens, dtype=torch.long)
    if left:
        mask[1, :3] = 0
    else:
        mask[1, -3:] = 0
    return ids, mask


def backward_both(model, peft, seed: int = 0):
    """The same labelled batch's loss through the swarm and through PEFT locally, each backpropagated; the model is
    closed. Returns both outputs."""
    ids, mask = batch(seed=seed)
    labels = ids.masked_fill(mask == 0, -100)
    out = model(ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    want = peft(input_ids=ids, attention_mask=mask, labels=labels)
    want.loss.backward()
    model.close()
    return out, want


def test_inputs_embeds_give_the_logits_of_input_ids(swarm):
    model, ref = client(swarm), reference(swarm)
    ids, mask = batch(left=True)
    embeds = ref.get_input_embeddings()(ids).detach()
    with torch.no_grad():
        by_ids = model(ids, attention_mask=mask).logits
        by_embeds = model(inputs_embeds=embeds, attention_mask=mask).logits
        want = ref(inputs_embeds=embeds, attention_mask=mask).logits
    model.close()
    assert (by_embeds - by_ids).abs().max().item() < 1e-4
    real = mask.bool()
    assert (by_embeds - want)[real].abs().max().item() < 1e-4


def test_gradient_wrt_input_embeddings(swarm):
    model, ref = client(swarm), reference(swarm)
    ids, mask = batch()
    labels = ids.masked_fill(mask == 0, -100)
    embeds = ref.get_input_embeddings()(ids).detach()
    x = embeds.clone().requires_grad_(True)
    out = model(inputs_embeds=x, attention_mask=mask, labels=labels)
    out.loss.backward()
    y = embeds.clone().requires_grad_(True)
    want = ref(inputs_embeds=y, attention_mask=mask, labels=labels)
    want.loss.backward()
    model.close()
    assert abs(out.loss.item() - want.loss.item()) < 1e-4 * abs(want.loss.item())
    assert rel(x.grad, y.grad) < 1e-4


def test_shallow_prompt_gradients_equal_peft(swarm):
    model, ref = client(swarm, tuning_mode="ptune", pre_seq_len=K), reference(swarm)
    peft = get_peft_model(ref, PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=K))
    with torch.no_grad():
        peft.prompt_encoder["default"].embedding.weight.copy_(model.prompts.prompt_embeddings)
    out, want = backward_both(model, peft)
    assert abs(out.loss.item() - want.loss.item()) < 1e-4 * abs(want.loss.item())
    assert out.logits.shape == (2, 9, 512)  # the prompt's positions are not the caller's
    assert rel(model.prompts.prompt_embeddings.grad, peft.prompt_encoder["default"].embedding.weight.grad) < 1e-4


def _add_deep_prompts(ref, prompts: torch.Tensor) -> list:
    """transformers' decoder layers with prompts[i] added to the first K positions of layer i's input."""
    layers = ref.model.layers if hasattr(ref, "model") else ref.transformer.h

    def hook_for(i):
        def pre(module, args, kwargs):
            h = args[0] if args else kwargs["hidden_states"]
            h = torch.cat([h[:, :K] + prompts[i], h[:, K:]], dim=1)
            if args:
                return (h, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": h}
        return pre

    return [layer.register_forward_pre_hook(hook_for(i), with_kwargs=True) for i, layer in enumerate(layers)]


def test_deep_prompt_gradients_equal_local(swarm):
    model, ref = client(swarm, tuning_mode="deep_ptune", pre_seq_len=K), reference(swarm)
    with torch.no_grad():
        model.prompts.deep_prompts.normal_(0, 0.1)  # nonzero, so every block's prompt matters
    peft = get_peft_model(ref, PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=K))
    deep = model.prompts.deep_prompts.detach().clone().requires_grad_(True)
    with torch.no_grad():
        peft.prompt_encoder["default"].embedding.weight.copy_(model.prompts.prompt_embeddings)
    _add_deep_prompts(ref, deep)
    ids, mask = batch(seed=1)
    out = model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    out.loss.backward()
    want = peft(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    want.loss.backward()
    model.close()
    assert abs(out.loss.item() - want.loss.item()) < 1e-4 * abs(want.loss.item())
    assert rel(model.prompts.deep_prompts.grad, deep.grad) < 1e-4
    assert rel(model.prompts.prompt_embeddings.grad, peft.prompt_encoder["default"].embedding.weight.grad) < 1e-4


def _lora_pair(swarm, r: int = 4, alpha: float = 8.0):
    family = swarm[0]
    targets = ("q_proj", "v_proj") if family == "llama" else ("query_key_value", "dense_4h_to_h")
    model = client(swarm, tuning_mode="lora", lora_r=r, lora_alpha=alpha, lora_target_modules=targets)
    peft = get_peft_model(reference(swarm), LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets),
                                                       lora_dropout=0.0, task_type="CAUSAL_LM"))
    torch.manual_seed(3)
    with torch.no_grad():
        for b in model.lora.b:
            b.normal_(0, 0.05)  # B = 0 at PEFT's init: nonzero here so A's gradient is too
    layers = {name: m for name, m in peft.named_modules() if hasattr(m, "lora_A")}
    pairs = []
    for spec, a, b in model.lora.triples():
        block_prefix = "model.layers" if family == "llama" else "transformer.h"
        layer = layers[f"base_model.model.{block_prefix}.{spec.block}.{spec.module}"]
        with torch.no_grad():
            layer.lora_A["default"].weight.copy_(a)
            layer.lora_B["default"].weight.copy_(b)
        pairs.append((a, b, layer.lora_A["default"].weight, layer.lora_B["default"].weight))
    return model, peft, pairs


def test_client_lora_gradients_equal_peft(swarm):
    model, peft, pairs = _lora_pair(swarm)
    out, want = backward_both(model, peft, seed=2)
    assert abs(out.loss.item() - want.loss.item()) < 1e-4 * abs(want.loss.item())
    got = torch.cat([torch.cat([a.grad.flatten(), b.grad.flatten()]) for a, b, _, _ in pairs])
    ref = torch.cat([torch.cat([pa.grad.flatten(), pb.grad.flatten()]) for _, _, pa, pb in pairs])
    assert rel(got, ref) < 1e-4


def _five_steps(model_params, run_loss) -> list[float]:
    opt = torch.optim.AdamW(model_params, lr=1e-2)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = run_loss()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_five_steps_of_prompt_tuning_and_lora_follow_the_local_loss_curve(swarm):
    ids, mask = batch(rows=4, tokens=8, seed=4)
    labels = ids.masked_fill(mask == 0, -100)
    model = client(swarm, tuning_mode="ptune", pre_seq_len=K, train_chunk_tokens=16)  # 2 rows per request
    peft = get_peft_model(reference(swarm), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=K))
    with torch.no_grad():
        peft.prompt_encoder["default"].embedding.weight.copy_(model.prompts.prompt_embeddings)
    got = _five_steps(list(model.prompts.parameters()),
                      lambda: model(ids, attention_mask=mask, labels=labels).loss)
    want = _five_steps([peft.prompt_encoder["default"].embedding.weight],
                       lambda: peft(input_ids=ids, attention_mask=mask, labels=labels).loss)
    model.close()
    assert max(abs(g - w) / abs(w) for g, w in zip(got, want)) < 1e-3
    assert got[-1] < got[0]

    model, peft, pairs = _lora_pair(swarm)
    got = _five_steps(list(model.lora.parameters()), lambda: model(ids, attention_mask=mask, labels=labels).loss)
    want = _five_steps([t for _, _, pa, pb in pairs for t in (pa, pb)],
                       lambda: peft(input_ids=ids, attention_mask=mask, labels=labels).loss)
    model.close()
    assert max(abs(g - w) / abs(w) for g, w in zip(got, want)) < 1e-3
    assert got[-1] < got[0]


def test_trained_prompts_save_and_load(swarm, tmp_path):
    model = client(swarm, tuning_mode="deep_ptune", pre_seq_len=K)
    with torch.no_grad():
        model.prompts.deep_prompts.normal_()
    model.save_trainable(tmp_path / "prompts.safetensors")
    other = client(swarm, tuning_mode="deep_ptune", pre_seq_len=K)
    other.load_trainable(tmp_path / "prompts.safetensors")
    for (name, a), (_, b) in zip(model.named_parameters(), other.named_parameters()):
        assert torch.equal(a, b), name
    wrong = client(swarm, tuning_mode="ptune", pre_seq_len=K)
    with pytest.raises(ValueError, match="do not match"):
        wrong.load_trainable(tmp_path / "prompts.safetensors")
    for m in (model, other, wrong):
        m.close()


def test_a_prompt_tuned_model_generates_as_peft_does(swarm):
    """generate(use_cache=False): every step one stateless pass with the soft prompt in front."""
    model = client(swarm, tuning_mode="ptune", pre_seq_len=K)
    peft = get_peft_model(reference(swarm), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=K))
    with torch.no_grad():
        model.prompts.prompt_embeddings.normal_()
        peft.prompt_encoder["default"].embedding.weight.copy_(model.prompts.prompt_embeddings)
    ids = torch.randint(0, 512, (1, 6), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        got = model.generate(ids, max_new_tokens=5, do_sample=False, use_cache=False)
        want = peft.generate(input_ids=ids, max_new_tokens=5, do_sample=False, use_cache=False)
    model.close()
    assert torch.equal(got, want[:, -got.shape[1]:])


def test_a_deep_prompt_generates_with_the_servers_caches_as_transformers_does(swarm):
    """A deep prompt in cached sessions (each server holds its blocks' part from the open): the same greedy tokens
    and scores as transformers + PEFT's soft prompt with the deep prompt added at every layer, run stateless."""
    model = client(swarm, tuning_mode="deep_ptune", pre_seq_len=K)
    ref = reference(swarm)
    peft = get_peft_model(ref, PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=K))
    with torch.no_grad():
        model.prompts.prompt_embeddings.normal_(0, 1.0, generator=torch.Generator().manual_seed(7))
        model.prompts.deep_prompts.normal_(0, 1.0, generator=torch.Generator().manual_seed(8))
        peft.prompt_encoder["default"].embedding.weight.copy_(model.prompts.prompt_embeddings)
    _add_deep_prompts(ref, model.prompts.deep_prompts.detach().clone())
    ids = torch.randint(0, 512, (1, 6), generator=torch.Generator().manual_seed(5))
    kwargs = dict(max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        got = model.generate(ids, **kwargs)  # cached: the servers add the prompt at positions 0..K-1
        want = peft.generate(input_ids=ids, use_cache=False, **kwargs)  # (the hooks see the whole sequence)
        shallow = client(swarm, tuning_mode="ptune", pre_seq_len=K)  # the same soft prompt, no deep prompt
        shallow.prompts.prompt_embeddings.copy_(model.prompts.prompt_embeddings)
        plain = shallow.generate(ids, **kwargs)
    model.close()
    shallow.close()
    assert torch.equal(got.sequences, want.sequences[:, -got.sequences.shape[1]:])
    assert max((a - b).abs().max().item() for a, b in zip(got.scores, want.scores)) < 1e-4
    assert max((a - b).abs().max().item() for a, b in zip(got.scores, plain.scores)) > 1e-3  # the deep part counts


def test_a_client_lora_generates_with_the_servers_caches_as_peft_does(swarm):
    """A client's own LoRA in cached sessions (each server holds its blocks' matrices from the open and applies them
    in every forward of the session): PEFT's greedy tokens and scores, both with their caches."""
    model, peft, pairs = _lora_pair(swarm)
    with torch.no_grad():
        for _, b, _, peft_b in pairs:
            b.mul_(10.0)  # a LoRA that changes the answer
            peft_b.copy_(b)
    ids = torch.randint(0, 512, (1, 6), generator=torch.Generator().manual_seed(5))
    kwargs = dict(max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True)
    plain = client(swarm)
    with torch.no_grad():
        got = model.generate(ids, **kwargs)
        want = peft.generate(input_ids=ids, **kwargs)
        base = plain.generate(ids, **kwargs)
    model.close()
    plain.close()
    assert torch.equal(got.sequences, want.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(got.scores, want.scores)) < 1e-4
    assert max((a - b).abs().max().item() for a, b in zip(got.scores, base.scores)) > 1e-3  # the LoRA counts
