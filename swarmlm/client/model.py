"""`DistributedModelForCausalLM`: the client's embeddings and LM head around the swarm's blocks."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence

import torch

from swarmlm.client.generate import GenerationStats, SamplingConfig, generate_tokens
from swarmlm.client.remote import RemoteSequence
from swarmlm.client.session import InferenceSession
from swarmlm.config import ClientConfig
from swarmlm.errors import InvalidRequest
from swarmlm.model.checkpoint import load_client_modules, parse_dtype
from swarmlm.swarm.dht import default_prefix


class DistributedModelForCausalLM:
    def __init__(self, model_dir: str | Path, config: ClientConfig) -> None:
        self.model_dir = str(model_dir)
        self.client_config = config
        torch.set_num_threads(config.threads)
        self.dtype = parse_dtype(config.dtype)
        self.config, self.adapter, self.modules = load_client_modules(model_dir, self.dtype)
        self.num_blocks = int(self.config.num_hidden_layers)
        self.remote = RemoteSequence(config, self.num_blocks, config.dht_prefix or default_prefix(model_dir))
        gen = getattr(self.config, "eos_token_id", None)
        self.eos_token_id: tuple[int, ...] = tuple(gen if isinstance(gen, list) else [gen] if gen is not None else [])
        self.pad_token_id = getattr(self.config, "pad_token_id", None)
        self.last_stats: GenerationStats | None = None
        self.last_session: InferenceSession | None = None

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, initial_peers: Sequence[str] = (), servers: Sequence[str] = (),
                        **kwargs) -> "DistributedModelForCausalLM":
        """Load the client's modules from a local checkpoint; find servers through the DHT or a fixed list."""
        if not initial_peers and not servers:
            raise ValueError("give initial_peers (a DHT address) or servers (host:port list)")
        return cls(model_dir, ClientConfig(initial_peers=tuple(initial_peers), servers=tuple(servers), **kwargs))

    # ---- the client's own compute ------------------------------------------------------------------------
    @torch.inference_mode()
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.min() < 0 or input_ids.max() >= self.config.vocab_size:
            raise InvalidRequest(f"token ids must be in [0, {self.config.vocab_size})")
        hidden = self.modules.embed(input_ids)
        return self.modules.embed_norm(hidden) if self.modules.embed_norm is not None else hidden

    @torch.inference_mode()
    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.modules.lm_head(self.modules.final_norm(hidden.to(self.dtype)))

    # ---- through the swarm ---------------------------------------------------------------------------------
    def inference_session(self, max_length: int, batch_size: int = 1, l_in_hint: int = 16,
                          l_out_hint: int = 16) -> InferenceSession:
        """`with model.inference_session(max_length=...) as s:` then `model.step_logits(s, ids)` per step."""
        return InferenceSession(self.remote, batch_size, max_length, l_in_hint, l_out_hint)

    def step_logits(self, session: InferenceSession, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                    stats: GenerationStats | None = None, last_only: bool = False) -> torch.Tensor:
        """New tokens [B, T] -> logits [B, T, V] ([B, 1, V] with last_only), keeping the session's caches on the
        servers. Generation needs only the last position: with a 250k vocabulary the head is the costly part."""
        t0 = time.perf_counter()
        hidden = self.embed(input_ids)
        t1 = time.perf_counter()
        out = session.step(hidden, attention_mask)
        t2 = time.perf_counter()
        logits = self.head(out[:, -1:] if last_only else out)
        if stats is not None:
            stats.embed_s += t1 - t0
            stats.head_s += time.perf_counter() - t2
        return logits

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for whole sequences [B, T] -> [B, T, V] (a one-step session)."""
        with self.inference_session(max_length=input_ids.shape[1], batch_size=input_ids.shape[0],
                                    l_in_hint=input_ids.shape[1], l_out_hint=1) as session:
            return self.step_logits(session, input_ids, attention_mask)

    __call__ = forward

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, max_new_tokens: int = 20,
                 do_sample: bool = False, temperature: float = 1.0, top_k: int | None = 50, top_p: float = 1.0,
                 generator: torch.Generator | None = None, session: InferenceSession | None = None) -> torch.Tensor:
        """Same core arguments and return value as `transformers`' generate(): prompt + new tokens."""
        cfg = SamplingConfig(
            max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
            eos_token_id=self.eos_token_id, pad_token_id=self.pad_token_id,
        )
        ids, stats = generate_tokens(self, input_ids, attention_mask, cfg, generator, session)
        self.last_stats = stats
        return ids

    def close(self) -> None:
        self.remote.close()
