"""Transformer[T]: embeddings, a grid of pre-norm blocks, final norm and LM head."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Generic, TypeVar

import numpy as np

from poly import layout
from poly.config import TransformerConfig
from poly.errors import InvalidTokenError, LayerConfigError
from poly.layer import LayerType, VolumetricLayer
from poly.layers.embedding import lookup
from poly.network import VolumetricNetwork
from poly.ops import linear, rms_norm

T = TypeVar("T")

# Sub-layer slots of one block: [RMSNorm, MHA, Residual(input), RMSNorm, SwiGLU, Residual(2)].
ATTN_NORM, ATTN, ATTN_RES, MLP_NORM, MLP, MLP_RES = range(6)


def build_block(cfg: TransformerConfig, allocate: bool = True) -> VolumetricLayer:
    """One pre-norm decoder block as a Sequential layer of six sub-layers."""
    h = cfg.hidden_size
    subs = [
        VolumetricLayer(
            type=LayerType.RMSNORM, input_height=h, rms_norm_eps=cfg.rms_norm_eps, allocate=allocate
        ),
        VolumetricLayer(
            type=LayerType.MHA,
            d_model=h,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            query_dim=cfg.query_dim,
            max_seq_len=cfg.max_seq_len,
            rope_freq_base=cfg.rope_theta,
            rope_scaling=cfg.rope_scaling,
            rms_norm_eps=cfg.rms_norm_eps,
            qk_norm=cfg.qk_norm,
            allocate=allocate,
        ),
        VolumetricLayer(type=LayerType.RESIDUAL, skip="input"),
        VolumetricLayer(
            type=LayerType.RMSNORM, input_height=h, rms_norm_eps=cfg.rms_norm_eps, allocate=allocate
        ),
        VolumetricLayer(
            type=LayerType.SWIGLU,
            input_height=h,
            output_height=cfg.intermediate_size,
            allocate=allocate,
        ),
        VolumetricLayer(type=LayerType.RESIDUAL, skip=ATTN_RES),
    ]
    return VolumetricLayer(type=LayerType.SEQUENTIAL, sequential_layers=subs)


_BLOCK_KINDS = (
    LayerType.RMSNORM,
    LayerType.MHA,
    LayerType.RESIDUAL,
    LayerType.RMSNORM,
    LayerType.SWIGLU,
    LayerType.RESIDUAL,
)


def is_plain_block(blk: VolumetricLayer) -> bool:
    """The block `build_block` makes, untiled and fully enabled: it can skip generic dispatch."""
    subs = blk.sequential_layers
    return (
        len(subs) == 6
        and all(
            s.type == k and not s.is_disabled and not s.use_tiling
            for s, k in zip(subs, _BLOCK_KINDS)
        )
        and subs[ATTN_RES].skip == "input"
        and subs[MLP_RES].skip == ATTN_RES
    )


def _gamma(norm: VolumetricLayer) -> np.ndarray:
    """An RMSNorm's gamma, cached per weight object (layout views are re-carved otherwise)."""
    store = norm.weights
    key = (store.active, id(store.master), id(store.versions.get(store.active)))
    cached = getattr(norm, "_gamma_cache", None)
    if cached is None or cached[0] != key:
        cached = (key, layout.components(norm)["gamma"])
        norm._gamma_cache = cached
    return cached[1]


def run_block(blk: VolumetricLayer, x: np.ndarray, caches: list | None = None) -> np.ndarray:
    """x + attn(norm(x)), then + mlp(norm(.)): the plain block without per-sub-layer dispatch.
    With `caches` (one KVCache per row of x) every row is a separate sequence's next token."""
    from poly.layers import mha, swiglu

    subs = blk.sequential_layers
    norm1, attn, norm2, mlp = subs[ATTN_NORM], subs[ATTN], subs[MLP_NORM], subs[MLP]
    h = rms_norm(x, _gamma(norm1), norm1.rms_norm_eps)
    a = mha.forward(attn, h) if caches is None else mha.forward_rows(attn, h, caches)
    x = x + a
    h = rms_norm(x, _gamma(norm2), norm2.rms_norm_eps)
    x += swiglu.forward(mlp, h)
    return x


class Transformer(Generic[T]):
    """A decoder-only language model on the grid. T is the activation dtype (np.float32)."""

    def __init__(
        self,
        config: TransformerConfig,
        network: VolumetricNetwork,
        *,
        activation_dtype: Any = np.float32,
    ):
        if np.dtype(activation_dtype) != np.float32:
            raise LayerConfigError("only float32 activations are implemented")
        self.config = config
        self.network = network
        h, v = config.hidden_size, config.vocab_size
        self._embeddings: Any = np.zeros((v, h), dtype=np.float32)
        self._lm_head: Any = self._embeddings
        if not config.tie_word_embeddings:
            self._lm_head = np.zeros((v, h), dtype=np.float32)
        self.final_norm_layer = VolumetricLayer(
            type=LayerType.RMSNORM, input_height=h, rms_norm_eps=config.rms_norm_eps
        )
        self.tokenizer = None
        self.chat_template = None
        self.eos_token_ids: tuple[int, ...] = ()
        self.generation_defaults = None
        self.source: dict = {}

    @classmethod
    def from_config(cls, config: TransformerConfig, *, allocate: bool = True) -> Transformer:
        """Zero-filled model; allocate=False leaves layer masters empty for quantized loads."""
        net = VolumetricNetwork(1, 1, 1, config.num_layers)
        for i in range(config.num_layers):
            net.set_layer(0, 0, 0, i, build_block(config, allocate))
        model = cls(config, net)
        layout.rmsnorm(model.final_norm_layer).gamma[...] = 1.0
        return model

    # --- parts ---------------------------------------------------------------------------------
    def block(self, i: int) -> VolumetricLayer:
        return self.network.layers[i]

    def blocks(self) -> list[VolumetricLayer]:
        return list(self.network.layers)

    def attn_norm(self, i: int) -> VolumetricLayer:
        return self.block(i).sequential_layers[ATTN_NORM]

    def attn(self, i: int) -> VolumetricLayer:
        return self.block(i).sequential_layers[ATTN]

    def mlp_norm(self, i: int) -> VolumetricLayer:
        return self.block(i).sequential_layers[MLP_NORM]

    def mlp(self, i: int) -> VolumetricLayer:
        return self.block(i).sequential_layers[MLP]

    def _check_table(self, name: str, value: Any) -> None:
        want = (self.config.vocab_size, self.config.hidden_size)
        if tuple(value.shape) != want:
            raise LayerConfigError(f"{name} has shape {tuple(value.shape)}, expected {want}")

    @property
    def embeddings(self) -> Any:
        return self._embeddings

    @embeddings.setter
    def embeddings(self, value: Any) -> None:
        self._check_table("embeddings", value)
        if self._lm_head is self._embeddings and self.config.tie_word_embeddings:
            self._lm_head = value
        self._embeddings = value

    @property
    def lm_head(self) -> Any:
        return self._lm_head

    @lm_head.setter
    def lm_head(self, value: Any) -> None:
        self._check_table("lm_head", value)
        self._lm_head = value

    @property
    def tied(self) -> bool:
        return self._lm_head is self._embeddings

    @property
    def final_norm(self) -> np.ndarray:
        return layout.components(self.final_norm_layer)["gamma"]

    @final_norm.setter
    def final_norm(self, value: np.ndarray) -> None:
        layout.rmsnorm(self.final_norm_layer).gamma[...] = value

    # --- running -------------------------------------------------------------------------------
    @property
    def position(self) -> int:
        state = self.attn(0).state
        return 0 if state is None else state.length

    def reset(self) -> None:
        self.network.reset()

    def truncate(self, n: int) -> None:
        """Forget cached positions >= n (KV rollback)."""
        for i in range(self.config.num_layers):
            state = self.attn(i).state
            if state is not None:
                state.truncate(n)

    def _check_ids(self, ids: Sequence[int]) -> np.ndarray:
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
        if arr.size == 0:
            raise InvalidTokenError("empty token sequence")
        return arr

    def hidden_states(self, ids: Sequence[int]) -> np.ndarray:
        """Run the blocks on new tokens (continuing the KV cache) -> normed hidden [n, H]."""
        x = lookup(self._embeddings, self._check_ids(ids))  # [n, H]
        for blk in self.network.layers:
            if blk.is_disabled:
                continue
            x = run_block(blk, x) if is_plain_block(blk) else blk.forward(x)
        return rms_norm(x, _gamma(self.final_norm_layer), self.config.rms_norm_eps)

    def forward(self, ids: Sequence[int]) -> np.ndarray:
        """Logits float32 [V] of the last of the new tokens."""
        arr = self._check_ids(ids)
        if arr.size == 1:  # a decode step: the fused C step when it applies (poly/fused.py)
            from poly import fused

            p = fused.plan(self)
            if p is not None:
                logits = fused.step(self, p, lookup(self._embeddings, arr)[0])  # x [H]
                if logits is not None:
                    return logits
        h = self.hidden_states(arr)[-1:]  # [1, H]
        return linear(h, self._lm_head)[0]

    def forward_all(self, ids: Sequence[int]) -> np.ndarray:
        """Logits float32 [n, V] of every new token."""
        return linear(self.hidden_states(ids), self._lm_head)

    def new_state(self) -> list:
        """An empty KV state (one cache per attention layer) for an independent sequence."""
        return [None] * self.config.num_layers

    def swap_state(self, state: list) -> list:
        """Install `state` as the live KV caches and return the previous ones."""
        old = [self.attn(i).state for i in range(self.config.num_layers)]
        for i, s in enumerate(state):
            self.attn(i).state = s
        return old

    def forward_batch(
        self, sequences: Sequence[Sequence[int]], states: list | None = None
    ) -> np.ndarray:
        """Logits [B, V] for several independent sequences, each continuing its own state."""
        from poly.batch import forward_batch

        return forward_batch(self, sequences, states)

    def enable_tiling(self, tile_size: int = 0) -> None:
        self.network.enable_tiling(tile_size)
        self.final_norm_layer.use_tiling = True

    def disable_tiling(self) -> None:
        self.network.disable_tiling()

    # --- generation ----------------------------------------------------------------------------
    def prompt_ids(
        self, prompt: Any, *, chat: bool | None = None, system: str | None = None
    ) -> list[int]:
        """Token ids for a prompt: ids as given, a message list or (chat=True) a string through the
        chat template, or a plain string tokenized as the HF tokenizer would."""
        from poly.prompting import prompt_to_ids

        return prompt_to_ids(self, prompt, chat=chat, system=system)

    def stream(
        self,
        prompt: Any,
        options: Any = None,
        *,
        chat: bool | None = None,
        system: str | None = None,
        stop: Any = None,
        **overrides: Any,
    ) -> Iterator[Any]:
        """Yield TokenEvents then a DoneEvent; starts from a fresh KV cache."""
        from poly.generation import stream_tokens
        from poly.prompting import resolve_options

        ids = self.prompt_ids(prompt, chat=chat, system=system)
        return stream_tokens(self, ids, resolve_options(self, options, overrides), stop=stop)

    def generate(self, prompt: Any, options: Any = None, **kw: Any) -> Any:
        """Run `stream` to the end and return its DoneEvent (text, tokens, metrics)."""
        done = None
        for event in self.stream(prompt, options, **kw):
            done = event
        return done

    def memory_report(self) -> dict[str, int]:
        """Bytes held per component (masters, stored versions, embeddings, head)."""
        report = {"embeddings": int(getattr(self._embeddings, "nbytes", 0))}
        report["lm_head"] = 0 if self.tied else int(getattr(self._lm_head, "nbytes", 0))
        kinds: dict[str, int] = {}
        for layer in self.network.walk():
            if layer.weights is not None and layer.weights.size:
                key = layer.type.label
                kinds[key] = kinds.get(key, 0) + layer.weights.nbytes()
            state = layer.state
            if state is not None and hasattr(state, "k"):
                kinds["kv_cache"] = kinds.get("kv_cache", 0) + state.k.nbytes + state.v.nbytes
        report.update(kinds)
        report["final_norm"] = self.final_norm_layer.weights.nbytes()
        return report
