"""Transformer[T]: embeddings, a grid of pre-norm blocks, final norm and LM head."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Generic, TypeVar

import numpy as np

from poly.config import TransformerConfig
from poly.errors import DTypeError, InvalidTokenError, LayerConfigError
from poly.filesnapshot import keep_in_memory
from poly.layer import LayerType, VolumetricLayer
from poly.model import prefill
from poly.model.block import build_block, is_recipe_block, norm_layer, run_block, slots
from poly.model.hooks import need
from poly.network import VolumetricNetwork
from poly.nn import layernorm, rmsnorm
from poly.nn.embedding import lookup
from poly.ops import linear, rms_norm
from poly.weights import Generations

T = TypeVar("T")
ACTIVATION_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


class Transformer(Generic[T]):
    """A decoder-only language model on the grid. T is the activation dtype: np.float32 (the
    default) or np.float64 (the high-precision reference: activations, KV cache and norms in
    float64, weights upcast; `Transformer[np.float64].from_config(...)` or
    `model.activation_dtype = np.float64`)."""

    _class_dtype: Any = None

    def __class_getitem__(cls, item: Any) -> type:
        dt = check_activation_dtype(item)
        return type(f"Transformer[{dt.name}]", (cls,), {"_class_dtype": dt})

    def __init__(
        self,
        config: TransformerConfig,
        network: VolumetricNetwork,
        *,
        activation_dtype: Any = None,
    ):
        self._dtype = check_activation_dtype(activation_dtype or self._class_dtype or np.float32)
        self.config = config
        self.network = network
        h, v = config.hidden_size, config.vocab_size
        self._embeddings: Any = np.zeros((v, h), dtype=np.float32)
        self._lm_head: Any = self._embeddings
        if not config.tie_word_embeddings:
            self._lm_head = np.zeros((v, h), dtype=np.float32)
        self.final_norm_layer = norm_layer(config)
        # the LM head's bias [V] (config.lm_head_bias: Phi-2), else None
        self.lm_head_bias = np.zeros(v, np.float32) if config.lm_head_bias else None
        self._slots = slots(config.block)  # role -> sub-layer index of every block
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
            net.set_layer(0, 0, 0, i, build_block(config, allocate, i))
        model = cls(config, net)
        rmsnorm.views(model.final_norm_layer).gamma[...] = 1.0
        return model

    @property
    def activation_dtype(self) -> np.dtype:
        return self._dtype

    @activation_dtype.setter
    def activation_dtype(self, value: Any) -> None:
        self._dtype = check_activation_dtype(value)

    @property
    def kv_cache_dtype(self) -> np.dtype:
        """What the KV caches store for float32 activations: float32 (default, exact against
        transformers), float16 (half the memory and the bytes attention reads a position) or
        int8, llama.cpp's q8_0 blocks (set as "q8_0": 8.5 bits a value; the reference path)."""
        return np.dtype(getattr(self.attn(0), "kv_dtype", np.float32))

    @kv_cache_dtype.setter
    def kv_cache_dtype(self, value: Any) -> None:
        dt = check_kv_dtype(value)
        layers = [self.attn(i) for i in range(self.config.num_layers)]
        if dt == np.int8 and any(a.head_dim % 32 for a in layers):
            raise DTypeError("a q8_0 KV cache needs head_dim a multiple of 32 (blocks of 32)")
        for a in layers:
            a.kv_dtype = dt
        self.reset()  # caches of the old dtype are replaced on next use: none continues
        Generations.bump()  # the fused plan checks the cache dtype (no C kernel reads q8_0)

    # --- parts ---------------------------------------------------------------------------------
    def block(self, i: int) -> VolumetricLayer:
        return self.network.layers[i]

    def blocks(self) -> list[VolumetricLayer]:
        return list(self.network.layers)

    def role(self, i: int, name: str) -> VolumetricLayer:
        """Sub-layer `name` of block i (the roles of poly.model.block.layout)."""
        at = self._slots.get(name)
        if at is None:
            raise LayerConfigError(f"the {self.config.architecture} block has no {name}")
        return self.block(i).sequential_layers[at]

    def attn_norm(self, i: int) -> VolumetricLayer:
        return self.role(i, "attn_norm")

    def attn(self, i: int) -> VolumetricLayer:
        return self.role(i, "attn")

    def mlp_norm(self, i: int) -> VolumetricLayer:
        return self.role(i, "mlp_norm")

    def mlp(self, i: int) -> VolumetricLayer:
        return self.role(i, "mlp")

    def attn_post_norm(self, i: int) -> VolumetricLayer:
        return self.role(i, "attn_post_norm")

    def mlp_post_norm(self, i: int) -> VolumetricLayer:
        return self.role(i, "mlp_post_norm")

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
        keep_in_memory(value)  # looked up every step: never released to the file (a tied head)
        if self._lm_head is self._embeddings and self.config.tie_word_embeddings:
            self._lm_head = value
        self._embeddings = value
        Generations.bump()

    @property
    def lm_head(self) -> Any:
        return self._lm_head

    @lm_head.setter
    def lm_head(self, value: Any) -> None:
        self._check_table("lm_head", value)
        self._lm_head = value
        Generations.bump()

    @property
    def tied(self) -> bool:
        return self._lm_head is self._embeddings

    @property
    def final_norm(self) -> np.ndarray:
        return rmsnorm.gamma(self.final_norm_layer)

    @final_norm.setter
    def final_norm(self, value: np.ndarray) -> None:
        rmsnorm.views(self.final_norm_layer).gamma[...] = value

    @property
    def final_norm_bias(self) -> np.ndarray | None:
        """The final LayerNorm's beta (None when the final norm is an RMSNorm)."""
        layer = self.final_norm_layer
        return layernorm.views(layer).beta if layer.type == LayerType.LAYERNORM else None

    @final_norm_bias.setter
    def final_norm_bias(self, value: np.ndarray) -> None:
        if self.final_norm_layer.type != LayerType.LAYERNORM:
            raise LayerConfigError(f"the {self.config.architecture} final norm has no bias")
        layernorm.views(self.final_norm_layer).beta[...] = value

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

    def check_ids(self, ids: Sequence[int]) -> np.ndarray:
        """Token ids as int64 [n]; an empty sequence is an error."""
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
        if arr.size == 0:
            raise InvalidTokenError("empty token sequence")
        return arr

    def hidden_states(self, ids: Sequence[int], pace: Any = None, last: bool = False) -> np.ndarray:
        """Run the blocks on new tokens (continuing the KV cache) -> normed hidden [n, H] in the
        activation dtype (the reference path: no fused step). `pace` (optional) gets
        `before(i)` / `after(i)` around block i (the runtime's prefill thread tuner, which
        compares the blocks' times: no `after` for a block cut to one row). `last`:
        the last token's row only, [1, H]: the last block's FFN skips the other rows, which no
        later block reads (every row's keys and values are cached all the same)."""
        x = self.embed(self.check_ids(ids), self.activation_dtype)  # [n, H]
        live = [i for i, blk in enumerate(self.network.layers) if not blk.is_disabled]
        cfg = self.config
        for i in live:
            blk = self.network.layers[i]
            if pace is not None:
                pace.before(i)
            rows = slice(-1, None) if last and i == live[-1] else None
            x = (
                run_block(blk, x, rows=rows, cfg=cfg)
                if is_recipe_block(blk, cfg.block)
                else blk.forward(x)
            )
            if pace is not None and rows is None:  # a cut block's time compares with no other
                pace.after(i)
        return self.norm_final(x[-1:] if last else x)

    def embed(self, ids: np.ndarray, dtype: Any = np.float32) -> np.ndarray:
        """Rows of the embedding table for checked ids [n] -> [n, H], times embedding_scale
        (rounded to float32 first, as transformers' Gemma normalizer)."""
        x = lookup(self._embeddings, ids, dtype)
        scale = self.config.embedding_scale
        if scale != 1:
            x *= np.asarray(np.float32(scale), x.dtype)
        return x

    def norm_final(self, x: np.ndarray) -> np.ndarray:
        """The final norm of hidden rows [n, H]."""
        layer = self.final_norm_layer
        if layer.type == LayerType.RMSNORM:
            return rms_norm(x, rmsnorm.gamma(layer), self.config.rms_norm_eps)
        return layer.forward(x)

    def logits(self, h: np.ndarray) -> np.ndarray:
        """Normed hidden rows [n, H] -> logits [n, V]: the LM head (and its bias), logit_scale,
        soft-capping."""
        out = linear(h, self._lm_head)
        if self.lm_head_bias is not None:
            out += self.lm_head_bias.astype(out.dtype, copy=False)
        cfg = self.config
        if cfg.logit_scale != 1:
            out *= np.asarray(cfg.logit_scale, out.dtype)
        if cfg.final_logit_softcap:
            cap = np.asarray(cfg.final_logit_softcap, out.dtype)
            out = np.tanh(out / cap) * cap
        return out

    def reference_forward(self, ids: Sequence[int], pace: Any = None) -> np.ndarray:
        """Logits [V] of the last new token by the reference path (`pace`: see hidden_states)."""
        h = self.hidden_states(ids, pace, last=True)  # [1, H]
        return self.logits(h)[0]  # [1, H] @ [V, H].T

    def forward(self, ids: Sequence[int]) -> np.ndarray:
        """Logits [V] (activation dtype) of the last of the new tokens. The runtime decides
        whether the fused step or the reference path runs (poly/runtime/dispatch.py). A prompt
        longer than poly.model.prefill.PREFILL_CHUNK runs in chunks; an error in one rolls the cache back."""
        return prefill.in_chunks(self, self.check_ids(ids), need("forward"))

    def forward_all(self, ids: Sequence[int]) -> np.ndarray:
        """Logits [n, V] of every new token."""
        return self.logits(self.hidden_states(ids))

    def new_state(self) -> list:
        """An empty KV state (one cache per attention layer) for an independent sequence."""
        return [None] * self.config.num_layers

    def swap_state(self, state: list) -> list:
        """Install `state` as the live KV caches and return the previous ones."""
        old = [self.attn(i).state for i in range(self.config.num_layers)]
        for i, s in enumerate(state):
            self.attn(i).state = s
        return old

    def save_state(self, path: Any, *, tokens: Any = None, meta: dict | None = None) -> int:
        """Write the KV caches (and `tokens`, the ids they hold, and `meta`, a JSON object) to
        `path` atomically -> bytes written (poly/model/state.py)."""
        from poly.model import state

        return state.save(self, path, tokens, meta)

    def load_state(self, path: Any) -> Any:
        """Restore caches saved by `save_state` -> SavedState(position, tokens, meta); a file of
        another model is a StateMismatchError, a damaged one a StateFileError."""
        from poly.model import state_load

        return state_load.load(self, path)

    def forward_batch(
        self, sequences: Sequence[Sequence[int]], states: list | None = None
    ) -> np.ndarray:
        """Logits [B, V] for several independent sequences, each continuing its own state."""
        return need("forward_batch")(self, sequences, states)

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
        return need("prompt_ids")(self, prompt, chat=chat, system=system)

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
        ids = self.prompt_ids(prompt, chat=chat, system=system)
        return need("stream")(self, ids, options, overrides, stop=stop)

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
                names = state.arrays() if hasattr(state, "arrays") else ("k", "v")  # q8_0 scales
                held = sum(getattr(state, name).nbytes for name in names)
                kinds["kv_cache"] = kinds.get("kv_cache", 0) + held
        report.update(kinds)
        report["final_norm"] = self.final_norm_layer.weights.nbytes()
        return report


def check_activation_dtype(dtype: Any) -> np.dtype:
    """float32 or float64 as np.dtype; DTypeError for anything else."""
    try:
        dt = None if dtype is None else np.dtype(dtype)
    except TypeError:
        dt = None
    if dt is None or dt not in ACTIVATION_DTYPES:
        raise DTypeError(
            f"activation dtype {dtype!r} is not supported (Transformer[T]: float32 or float64)"
        )
    return dt


def check_kv_dtype(dtype: Any) -> np.dtype:
    """float32, float16 or int8 (q8_0 blocks; also "f32"/"f16"/"q8_0") as np.dtype; DTypeError
    for anything else."""
    names = {"f32": "float32", "f16": "float16", "q8_0": "int8", "q8": "int8"}
    names.update(float32="float32", float16="float16")  # a string: one of these names
    name = names.get(dtype, "?") if isinstance(dtype, str) else dtype
    try:
        dt = np.dtype(name)
    except TypeError:
        dt = None
    if dt not in (np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.int8)):
        raise DTypeError(f"KV cache dtype {dtype!r} is not supported (float32, float16 or q8_0)")
    return dt
