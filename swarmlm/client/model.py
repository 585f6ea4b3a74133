"""`DistributedModelForCausalLM`: the client's embeddings and LM head around the swarm's blocks.

It is a transformers `GenerationMixin` model: `generate()` is transformers' own (with `speculative=`, the decoder's:
client/decoding/generate.py), driving a `RemoteCache` (the swarm session) through `forward()`, which embeds only
the tokens the session has not seen, steps them through the servers and applies the head (on the last position
only while generating: at a 250k vocabulary the head is the costly part of the client). Sessions running at once
in this process share one head matmul (head_batcher.py).
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Sequence

import torch
from torch import nn
from transformers import GenerationConfig
from transformers.generation.utils import GenerationMixin
from transformers.modeling_outputs import CausalLMOutputWithPast

from swarmlm.client.autograd import RemoteTrainer
from swarmlm.client.remote_cache import GenerationStats, RemoteCache
from swarmlm.client.training_forward import train_forward
from swarmlm.client.tuning import (TUNING_MODES, ClientLora, PromptTuning, TuningMode, adapter_tuning,
                                   load_adapter_weights, load_trainable, save_adapter, save_trainable)
from swarmlm.client.head_batcher import HeadBatcher
from swarmlm.client.remote import RemoteSequence
from swarmlm.client.prefix import client_scope
from swarmlm.client.session import InferenceSession, PrefixContext
from swarmlm.client.decoding.drafts import SpeculativeMode, parse_mode
from swarmlm.client.decoding.generate import decoder_generate, decodes
from swarmlm.client.decoding.sampling import sampling_rng
from swarmlm.config import ClientConfig, dtype_name
from swarmlm.errors import InvalidRequest
from swarmlm.model.checkpoint import load_client_modules, parse_dtype
from swarmlm.model.fingerprint import WeightsCheck
from swarmlm.model.quant import quantize_client_modules
from swarmlm.model.source import gguf_in_snapshot, resolve, with_revision
from swarmlm.small_reads import id_bounds
from swarmlm.types import CacheOp
from swarmlm.swarm.dht import default_dht_prefix


def _generation_config(model_dir: str, config) -> GenerationConfig:
    """generation_config.json's defaults when the checkpoint has one, else the model config's, as transformers."""
    found = resolve(model_dir).optional_file("generation_config.json")  # a directory or a hub id
    if found is not None:
        return GenerationConfig.from_pretrained(found.parent)
    return GenerationConfig.from_model_config(config)


class DistributedModelForCausalLM(nn.Module, GenerationMixin):
    main_input_name = "input_ids"
    _is_stateful = False

    def __init__(self, model_dir: str | Path, config: ClientConfig, tuning_mode: TuningMode | None = None,
                 pre_seq_len: int = 0, lora_r: int = 8, lora_alpha: float = 16.0,
                 lora_target_modules: Sequence[str] = ("q_proj", "v_proj"),
                 base: "DistributedModelForCausalLM | None" = None) -> None:
        """`base`: a loaded model whose embeddings, head and swarm connection this one shares (with_adapter)."""
        super().__init__()
        self.model_dir = str(model_dir)
        self.client_config = config
        torch.set_num_threads(config.threads)
        if base is None:
            self.dtype = parse_dtype(config.dtype, model_dir)  # "auto": the checkpoint's own (checkpoint.auto_dtype)
            self.config, self.adapter, self.client_modules = load_client_modules(model_dir, self.dtype, config.quant)
            quantize_client_modules(self.client_modules, config.quant)  # int8 / int4 head + embeddings (or as loaded)
            self.generation_config = _generation_config(self.model_dir, self.config)
        else:
            self.dtype, self.config, self.adapter = base.dtype, base.config, base.adapter
            self.client_modules, self.generation_config = base.client_modules, base.generation_config
        self.num_blocks = int(self.config.num_hidden_layers)
        if base is None:
            self.remote = RemoteSequence(config, self.num_blocks, config.dht_prefix or default_dht_prefix(model_dir))
            self.remote.weights_check = WeightsCheck(model_dir)  # refuse servers of other weights under this name
        else:  # (a LoRA the servers pre-load: routed to them alone; a soft prompt: the base's servers)
            self.remote = base.remote.sibling(config.active_adapter) if config.active_adapter else base.remote
        self.owns_remote = base is None
        # the servers' prefix caches (client/prefix.py): this client's scope and the keys' salt (not with an
        # adapter: its rows are not the base model's)
        self.prefix_context = PrefixContext(client_scope(config), self.remote.dht_prefix, f"{self.dtype} {config.quant}",
                                            self.embed) \
            if config.prefix_cache and not config.active_adapter and tuning_mode is None else None
        eos = self.generation_config.eos_token_id
        self.eos_token_id: tuple[int, ...] = tuple(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.pad_token_id = self.generation_config.pad_token_id
        self.last_stats: GenerationStats | None = None
        # concurrent sessions' heads as one matmul (a lone session never waits); None: each runs its own
        # (with a base: its batcher, so the base's and its adapters' sessions share one head matmul)
        self.head_batcher = base.head_batcher if base is not None else \
            HeadBatcher(self.head, config.head_batch_wait) if config.head_batch_wait.fraction > 0 else None
        # fine-tuning through the swarm (docs/FINETUNING.md): the only trainable parameters are these
        if tuning_mode is not None and tuning_mode not in TUNING_MODES:
            raise ValueError(f"tuning_mode must be one of {', '.join(TUNING_MODES)} or None, got {tuning_mode!r}")
        self.trainer = RemoteTrainer(self.remote)
        self.prompts = PromptTuning(pre_seq_len, int(self.config.hidden_size), self.num_blocks,
                                    deep=tuning_mode == "deep_ptune") if tuning_mode in ("ptune", "deep_ptune") else None
        self.lora = ClientLora(self.adapter, self.config, lora_r, lora_alpha, lora_target_modules) \
            if tuning_mode == "lora" else None

    @classmethod
    def from_pretrained(cls, name_or_path: str | Path, initial_peers: Sequence[str] = (), servers: Sequence[str] = (),
                        dtype: str | torch.dtype = "auto", dht_prefix: str | None = None,
                        revision: str | None = None, torch_dtype: str | torch.dtype | None = None,
                        gguf_file: str | None = None, tuning_mode: TuningMode | None = None, pre_seq_len: int = 0,
                        lora_r: int = 8, lora_alpha: float = 16.0,
                        lora_target_modules: Sequence[str] = ("q_proj", "v_proj"), adapter: str | Path | None = None,
                        **kwargs) -> "DistributedModelForCausalLM":
        """The client's modules from a checkpoint directory, a GGUF file (`x.gguf`, or `gguf_file` of a hub id's
        snapshot), a catalog name (model/catalog.py) or hub id (`org/name`, at `revision`); servers found
        through the DHT (`initial_peers`) or a fixed `servers` list (host:port). dtype as transformers takes it:
        "auto" (the checkpoint's own), "float32", "bfloat16", "float16" or the torch dtypes (`torch_dtype`, its
        older name, too); dht_prefix None is the model's identity. tuning_mode "ptune" | "deep_ptune" (with
        pre_seq_len prompt tokens) or "lora" (lora_r, lora_alpha, lora_target_modules) adds trainable parameters
        (client/tuning.py, docs/FINETUNING.md). adapter: a tuned model saved by save_adapter (its folder: a soft
        prompt loads here; a LoRA runs on the servers that pre-load it, `server --adapters DIR`), or the name of an
        adapter servers pre-load. Other keyword arguments are ClientConfig fields."""
        if not initial_peers and not servers:
            raise ValueError("give initial_peers (a DHT address) or servers (host:port list)")
        if adapter is not None and tuning_mode is not None:
            raise ValueError(f"adapter={adapter!r} brings its own settings: give no tuning_mode")
        folder, served, saved = adapter_tuning(adapter)
        if served is not None:  # the servers apply it in their cached sessions (server/adapters.py)
            kwargs["active_adapter"] = served
        tuning_mode, pre_seq_len = saved.get("tuning_mode", tuning_mode), saved.get("pre_seq_len", pre_seq_len)
        if torch_dtype is not None:
            if dtype != "auto" and dtype_name(dtype) != dtype_name(torch_dtype):
                raise ValueError(f"dtype={dtype!r} and torch_dtype={torch_dtype!r} disagree: give one")
            dtype = torch_dtype
        config = ClientConfig(initial_peers=tuple(initial_peers), servers=tuple(servers), dtype=dtype,
                              dht_prefix=dht_prefix, **kwargs)
        tuning = dict(tuning_mode=tuning_mode, pre_seq_len=pre_seq_len, lora_r=lora_r, lora_alpha=lora_alpha,
                      lora_target_modules=tuple(lora_target_modules))
        model_dir = gguf_in_snapshot(name_or_path, gguf_file, revision) if gguf_file is not None \
            else with_revision(name_or_path, revision)
        model = cls(model_dir, config, **tuning)
        if served is None and folder is not None:
            load_adapter_weights(model, folder)
        return model

    def with_adapter(self, adapter: str | Path) -> "DistributedModelForCausalLM":
        """This model with a tuned model on top (an `adapter=` of from_pretrained), sharing its embeddings, head and
        swarm connection: a gateway serves the base and several adapters at the cost of one. close() the base last
        (it owns the DHT node)."""
        if self.prompts is not None or self.lora is not None or self.client_config.active_adapter:
            raise ValueError("with_adapter() on a model that is tuned already: call it on the base model")
        folder, served, tuning = adapter_tuning(adapter)
        config = dataclasses.replace(self.client_config, active_adapter=served)
        model = type(self)(self.model_dir, config, base=self, **tuning)
        if served is None:
            load_adapter_weights(model, folder)
        return model

    @property
    def virtual_tokens(self) -> int:
        """Positions a session holds before the tokens: a soft prompt's (0 without one)."""
        return self.prompts.pre_seq_len if self.prompts is not None else 0

    # ---- what GenerationMixin asks of a model ----------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return torch.device("cpu")  # the client's embeddings and head run on the CPU

    @classmethod
    def can_generate(cls) -> bool:
        return True

    @classmethod
    def is_remote_code(cls) -> bool:
        return False

    def get_experts_implementation(self) -> dict[str, str | None]:
        return {"": None}  # no experts on the client: mixture-of-experts layers run on the servers

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, batch_size,
                                      max_cache_length) -> None:
        """transformers reserves a cache here: our session holds prompt + new tokens but the last one; prompt lookup
        verifies up to prompt_lookup_num_tokens drafts past that (its candidates are not capped by max_length)."""
        cache = model_kwargs.get("cache")
        if cache is None:
            return  # use_cache=False: every step is a one-shot session over the whole sequence
        if not isinstance(cache, RemoteCache):
            raise InvalidRequest("the swarm keeps the attention caches: pass no cache= (or session=) to generate()")
        if cache.session is None:
            cache.max_length = max_cache_length + (generation_config.prompt_lookup_num_tokens or 0)

    # ---- the client's own compute ------------------------------------------------------------------------
    @torch.inference_mode()
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.client_modules.embed(self._checked(input_ids))
        norm = self.client_modules.embed_norm
        return norm(hidden) if norm is not None else hidden

    def embed_inputs(self, inputs_embeds: torch.Tensor) -> torch.Tensor:
        """Token embeddings a caller made ([B, T, H], as transformers' inputs_embeds) -> block 0's input (BLOOM
        normalises them first); differentiable."""
        if inputs_embeds.shape[-1] != self.config.hidden_size:
            raise InvalidRequest(f"inputs_embeds: hidden size {inputs_embeds.shape[-1]}, expected "
                                 f"{self.config.hidden_size}")
        hidden = inputs_embeds.to(self.dtype)
        norm = self.client_modules.embed_norm
        return norm(hidden) if norm is not None else hidden

    def head_with_grad(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm + LM head, differentiable (training)."""
        return lm_head(self.client_modules.lm_head, self.client_modules.final_norm(hidden.to(self.dtype)))

    @torch.inference_mode()
    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return lm_head(self.client_modules.lm_head, self.client_modules.final_norm(hidden.to(self.dtype)))

    # ---- through the swarm ---------------------------------------------------------------------------------
    def inference_session(self, max_length: int, batch_size: int = 1, l_in_hint: int = 16,
                          l_out_hint: int = 16, prefix_scope: bytes | None = None) -> InferenceSession:
        """`with model.inference_session(max_length=...) as s:` then `model.step_logits(s, ids)` per step.
        `prefix_scope`: whose cached prefixes the session uses and saves (a gateway's per-user scope; None = this
        client's own, client/prefix.py)."""
        prefix = self.prefix_context
        if prefix is not None and prefix_scope is not None:
            prefix = dataclasses.replace(prefix, scope=prefix_scope)
        deep = self.prompts.deep_prompts if self.prompts is not None else None
        session = InferenceSession(self.remote, batch_size, max_length, l_in_hint, l_out_hint, prefix,
                                   deep.detach().float() if deep is not None else None,
                                   self.lora.wire() if self.lora is not None else ())
        if self.head_batcher is not None:
            self.head_batcher.expect(session)  # its first head (after the prefill) may share a batch already
        return session

    def step_logits(self, session: InferenceSession, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                    stats: GenerationStats | None = None, last_only: bool = False,
                    op: CacheOp | None = None) -> torch.Tensor:
        """New tokens [B, T] -> logits [B, T, V] ([B, 1, V] with last_only), keeping the session's caches on the
        servers (edited first by `op`: B then follows its rows). Generation needs only the last position: with a
        250k vocabulary the head is the costly part."""
        return self._logits(session, input_ids, attention_mask, slice(-1, None) if last_only else slice(None), stats,
                            op)

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                cache: RemoteCache | None = None, use_cache: bool | None = None, logits_to_keep: int = 0,
                inputs_embeds: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                **kwargs) -> CausalLMOutputWithPast:
        """input_ids [B, T] or inputs_embeds [B, T, H] (the token embeddings, as transformers takes them): tokens
        the session has not seen (all of them without a cache); attention_mask [B, past + T] as transformers keeps
        it (1 = token, 0 = left padding). logits_to_keep: the last N positions only (0 = all). labels [B, T]: the
        loss as transformers computes it (-100 = ignored). Without a cache, a one-shot session over the whole
        sequence; differentiable (stateless Forward / Backward RPCs, client/autograd.py) when labels are given,
        the model has trainable parameters or inputs_embeds requires grad."""
        if (input_ids is None) == (inputs_embeds is None):
            raise InvalidRequest("give exactly one of input_ids and inputs_embeds")
        shape = tuple(input_ids.shape) if input_ids is not None else tuple(inputs_embeds.shape)
        if len(shape) != (2 if input_ids is not None else 3) or shape[1] == 0:
            raise InvalidRequest(f"input_ids must be [batch, tokens] (inputs_embeds [batch, tokens, hidden]) with "
                                 f"tokens >= 1, got {list(shape)}")
        batch, n_tokens = shape[:2]
        mask = attention_mask[:, -n_tokens:] if attention_mask is not None else None
        keep = slice(-logits_to_keep, None) if logits_to_keep else slice(None)
        tuned = self.prompts is not None or self.lora is not None
        if cache is None and (labels is not None or tuned or inputs_embeds is not None and inputs_embeds.requires_grad):
            return train_forward(self, input_ids, inputs_embeds, mask, labels, keep)
        if self.prompts is not None:
            return self._prompted_step(cache, input_ids, inputs_embeds, mask, keep)
        tokens_or_embeds = input_ids if input_ids is not None else inputs_embeds
        if cache is None:
            with self.inference_session(max_length=n_tokens, batch_size=batch, l_in_hint=n_tokens,
                                        l_out_hint=1) as session:
                logits = self._logits(session, tokens_or_embeds, mask, keep, None)
            return CausalLMOutputWithPast(logits=logits)
        cache.before_forward()
        # generate()'s prompt (one unpadded sequence) may start from a prefix the servers cached: then its first
        # forward gives the last position's logits only (all that generate() reads of a prefill)
        # (asked only before the session's first step: after it no step starts from a cached prefix, and every
        # decode step would pay for a torch reduction it ignores)
        starting = cache.session is None or not cache.session.steps
        prompt = (input_ids[0] if starting and input_ids is not None and cache.use_prefix and batch == 1
                  and (mask is None or bool(mask.all())) else None)
        session = cache.session_for(batch, n_tokens, prompt)
        if prompt is not None and session.prefix_held(input_ids):
            keep = slice(-1, None)
        logits = self._logits(session, tokens_or_embeds, mask, keep, cache.stats, cache.take_pending())
        cache.after_forward()
        return CausalLMOutputWithPast(logits=logits, cache=cache)

    def _prompted_step(self, cache: RemoteCache, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None,
                       mask: torch.Tensor | None, keep: slice) -> CausalLMOutputWithPast:
        """A cached step of a model with a soft prompt: the session's first step carries the prompt's K positions
        before the tokens (as train_forward sends them); the cache counts the tokens only (its virtual_tokens)."""
        cache.before_forward()
        embeds = inputs_embeds if inputs_embeds is not None else self.client_modules.embed(self._checked(input_ids))
        if cache.session is None or cache.session.position == 0:  # (a decoder of n rows opens it before)
            k = self.prompts.pre_seq_len
            cache.virtual_tokens = k
            ones = torch.ones(embeds.shape[:2], dtype=torch.long)
            embeds, mask = self.prompts.prepend(embeds, ones if mask is None else mask.to(torch.long))
            keep = slice(k, None) if keep == slice(None) else keep  # (no logits for the prompt's positions)
        session = cache.session_for(int(embeds.shape[0]), int(embeds.shape[1]))
        logits = self._logits(session, embeds.detach(), mask, keep, cache.stats, cache.take_pending())
        cache.after_forward()
        return CausalLMOutputWithPast(logits=logits, cache=cache)

    def _checked(self, input_ids: torch.Tensor) -> torch.Tensor:
        return checked_ids(input_ids, int(self.config.vocab_size))

    def _logits(self, session: InferenceSession, inputs: torch.Tensor, mask: torch.Tensor | None, keep: slice,
                stats: GenerationStats | None, op: CacheOp | None = None) -> torch.Tensor:
        """inputs: token ids [B, T], or embeddings [B, T, H] (inputs_embeds)."""
        t0 = time.perf_counter()
        ids = inputs if inputs.dim() == 2 else None
        held = session.prefix_held(ids) if ids is not None else 0  # a cached prefix's tokens are not sent
        if held:
            if keep != slice(-1, None):
                raise InvalidRequest("a session that started from a cached prefix gives the last position's logits "
                                     "only (open it without prompt_ids for all of them)")
            inputs, ids, mask = inputs[:, held:], ids[:, held:], mask[:, held:] if mask is not None else None
        with torch.inference_mode():
            hidden = self.embed(inputs) if ids is not None else self.embed_inputs(inputs)
        t1 = time.perf_counter()
        out = session.step(hidden, mask, op, token_ids=ids)
        if keep != slice(None) and not (keep == slice(-1, None) and out.shape[1] == 1):  # (else all of it: no view
            out = out[:, keep]  # made, a torch call saved per decode step right after the servers' forward)
        t2 = time.perf_counter()
        logits = self.head_batcher(session, out) if self.head_batcher is not None else self.head(out)
        if stats is not None:
            stats.embed_s += t1 - t0
            stats.head_s += time.perf_counter() - t2
        return logits

    @torch.no_grad()
    def generate(self, inputs: torch.Tensor | None = None, generation_config: GenerationConfig | None = None, *,
                 session: InferenceSession | None = None, generator: torch.Generator | None = None,
                 stats: GenerationStats | None = None, speculative: SpeculativeMode = "off", draft_model=None,
                 **kwargs):
        """transformers' `generate()` through the swarm. Extra arguments: `session`, an open session to run in
        (it stays open); `generator`, a torch.Generator for sampling (otherwise torch's global one, as
        transformers); `stats`, a GenerationStats filled in place (also kept as `model.last_stats`);
        `speculative`: "auto" (draft length per pass from the measured acceptance and route cost), a fixed draft
        length, or "off" (client/decoding/decoder.py), drafting by prompt lookup or with `draft_model` (a small local
        transformers model of the same tokenizer; a batch's rows each keep their own draft cache). A batch speculates
        row by row (prompts left-padded or not; sampled num_return_sequences share one prefill); options speculation
        does not cover run plainly."""
        checked, _ = self._prepare_generation_config(generation_config, **kwargs)
        ids = inputs if inputs is not None else kwargs.get("input_ids")
        # (a soft prompt's first step carries the prompt: _prompted_step, in either loop)
        if parse_mode(speculative) != 0 and ids is not None and decodes(checked, ids, kwargs):
            return decoder_generate(self, ids, kwargs.get("attention_mask"), checked, session, generator, stats,
                                    speculative, draft_model, kwargs.get("streamer"))
        remote = RemoteCache(self, session, stats) if checked.use_cache else None
        if remote is not None:
            remote.stats.prompt_tokens = int(ids.shape[1]) if ids is not None else 0
            # drafts verified in the prefill's forward need its logits at every draft position
            remote.use_prefix = kwargs.get("assistant_model") is None and not checked.prompt_lookup_num_tokens
            kwargs["cache"] = remote
        out = None
        try:
            with sampling_rng(generator):
                out = super().generate(inputs, generation_config, **kwargs)
        finally:
            if remote is not None:
                sequences = out if isinstance(out, torch.Tensor) else getattr(out, "sequences", None)
                self.last_stats = remote.finish(sequences)
        return out

    def save_trainable(self, path: str | Path) -> None:
        """The trained prompts / LoRA matrices as a safetensors file (client/tuning.py)."""
        save_trainable(self, path)

    def load_trainable(self, path: str | Path) -> None:
        load_trainable(self, path)

    def save_adapter(self, directory: str | Path) -> None:
        """The tuned model with its settings as a folder in PEFT's format (model/tuned.py): `from_pretrained(...,
        adapter=DIR)` and `swarmlm chat --adapter DIR` load it; a LoRA's folder is what `server --adapters` takes."""
        from swarmlm.model.source import served_name

        save_adapter(self, directory, served_name(self.model_dir))

    def close(self) -> None:
        if self.owns_remote:  # (a model of with_adapter() leaves the shared connection to its base)
            self.remote.close()


def checked_ids(input_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """input_ids, refused unless every id is in [0, vocab_size)."""
    low, high = id_bounds(input_ids) if input_ids.numel() else (0, 0)
    if low < 0 or high >= vocab_size:
        raise InvalidRequest(f"token ids must be in [0, {vocab_size})")
    return input_ids


def lm_head(head: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """head(x), for several rows of a plain linear head as W @ x^T: MKL's single-threaded sgemm takes a few rows
    against bloomz-560m's [250,880 x 1,024] weight ~1.6x faster that way than as x @ W^T (8 rows: 504 vs 800 ms on
    a busy machine; one row: the same), and several rows is what a batch of sessions' heads is."""
    x = x.contiguous()  # a last-position slice of a batch is strided: torch's bf16 matmul then runs 2.6x slower
    if type(head) is not nn.Linear or x.numel() < 2 * x.shape[-1]:
        return head(x)
    out = (head.weight @ x.reshape(-1, x.shape[-1]).T).T
    if head.bias is not None:
        out = out + head.bias
    return out.reshape(*x.shape[:-1], out.shape[-1])
