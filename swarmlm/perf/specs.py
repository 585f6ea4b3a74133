"""What the planner and the simulator are told about a model, its servers, clients and workload."""
from __future__ import annotations

from dataclasses import dataclass

from swarmlm.perf.nonnegative import check_nonneg
from swarmlm.perf.compute import ComputeProfile


@dataclass(frozen=True)
class ModelSpec:
    """What placement needs to know about the model: block count and memory footprints."""

    num_blocks: int  # L, transformer blocks
    block_bytes: float  # s_m, weights of one block
    cache_bytes_per_session_block: float  # s_c, attention cache of one session (l_in_max + l_max tokens) in one block
    hidden_bytes_per_token: float = 0.0  # h, activations sent per token per hop (0: folded into the RTT)
    session_tokens: int = 0  # l_in_max + l_max that s_c was sized for (0: unknown); lets Petals' 4096-token rule scale

    def __post_init__(self) -> None:
        if not isinstance(self.num_blocks, int) or self.num_blocks < 1:
            raise ValueError(f"ModelSpec.num_blocks must be an integer >= 1, got {self.num_blocks!r}")
        check_nonneg("ModelSpec", block_bytes=self.block_bytes,
                      cache_bytes_per_session_block=self.cache_bytes_per_session_block,
                      hidden_bytes_per_token=self.hidden_bytes_per_token, session_tokens=self.session_tokens)
        if self.block_bytes <= 0 or self.cache_bytes_per_session_block <= 0:
            raise ValueError("ModelSpec.block_bytes and cache_bytes_per_session_block must be > 0")

    def cache_bytes_per_token_block(self) -> float | None:
        return self.cache_bytes_per_session_block / self.session_tokens if self.session_tokens else None

    @classmethod
    def from_config(cls, config: object, l_in_max: int, l_max: int, dtype_bytes: float = 2.0,
                    weight_bytes_per_param: float | None = None,
                    cache_bytes_per_value: float | None = None) -> "ModelSpec":
        """Sizes from a transformers config: s_c = 2 * kv_dim * (l_in_max + l_max) * cache_bytes_per_value.

        kv_dim = num_key_value_heads * head_dim (grouped-query attention keeps fewer K/V heads than query heads).
        Block weights are estimated from the usual decoder shapes (attention + MLP), `weight_bytes_per_param`
        bytes each (defaults to dtype_bytes; 0.5 for NF4); cached keys and values `cache_bytes_per_value` each (defaults
        to dtype_bytes; a server's own: server/kv_dtype.py).
        """
        hidden = int(getattr(config, "hidden_size", 0) or getattr(config, "n_embd", 0))
        layers = int(getattr(config, "num_hidden_layers", 0) or getattr(config, "n_layer", 0))
        heads = int(getattr(config, "num_attention_heads", 0) or getattr(config, "n_head", 0) or 1)
        kv_heads = int(getattr(config, "num_key_value_heads", 0) or heads)
        head_dim = int(getattr(config, "head_dim", 0) or hidden // heads)
        inter = int(getattr(config, "intermediate_size", 0) or getattr(config, "n_inner", 0) or 4 * hidden)
        if hidden <= 0 or layers <= 0:
            raise ValueError("config has no hidden_size/num_hidden_layers")
        kv_dim = kv_heads * head_dim
        # q and o are hidden x hidden, k and v are hidden x kv_dim; gated MLPs (Llama) have 3 matrices, others 2
        mlp_mats = 3 if getattr(config, "hidden_act", "") in ("silu", "swiglu") else 2
        params = 2 * hidden * hidden + 2 * hidden * kv_dim + mlp_mats * hidden * inter
        wbytes = dtype_bytes if weight_bytes_per_param is None else weight_bytes_per_param
        n_tokens = l_in_max + l_max
        return cls(num_blocks=layers, block_bytes=float(params * wbytes),
                   cache_bytes_per_session_block=float(2 * kv_dim * n_tokens * (cache_bytes_per_value or dtype_bytes)),
                   hidden_bytes_per_token=float(hidden * dtype_bytes), session_tokens=n_tokens)


@dataclass(frozen=True)
class ServerSpec:
    name: str
    memory_bytes: float  # M_j, GPU memory available for blocks and caches
    profile: ComputeProfile
    cluster: str | None = None  # network location when RTTs come from clusters

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("ServerSpec.name must be non-empty")
        check_nonneg(f"server {self.name}", memory_bytes=self.memory_bytes)


@dataclass(frozen=True)
class ClientSpec:
    name: str
    cluster: str | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("ClientSpec.name must be non-empty")


@dataclass(frozen=True)
class Workload:
    input_tokens: int  # l_in, prompt length
    output_tokens: int  # l_out, generated tokens (>= 1)
    concurrency: int | None = None  # R, concurrent sessions to plan for
    arrival_rate: float | None = None  # lambda, requests per second over all clients (R derived from it)

    def __post_init__(self) -> None:
        if self.input_tokens < 1 or self.output_tokens < 1:
            raise ValueError(f"Workload needs input_tokens >= 1 and output_tokens >= 1, "
                             f"got {self.input_tokens} and {self.output_tokens}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"Workload.concurrency must be >= 1, got {self.concurrency}")
        if self.arrival_rate is not None and not self.arrival_rate > 0:
            raise ValueError(f"Workload.arrival_rate must be > 0, got {self.arrival_rate}")
