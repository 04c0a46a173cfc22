"""Tiny random HF checkpoints built with transformers itself, plus reference helpers.

Shared by several test files: ``make_tiny_checkpoint`` writes a complete snapshot dir
(config.json, generation_config.json, *.safetensors [+ index], tokenizer.json,
tokenizer_config.json, chat template); ``hf_logits`` / ``hf_greedy`` run transformers on it.
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any

import numpy as np

ARCHS = ("llama", "mistral", "qwen2", "qwen3")
HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, VOCAB = 64, 128, 2, 4, 2, 300
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2
BOS_ID, EOS_ID = 0, 2
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello world!",
    "poly is a local LLM inference toolkit written in Python.",
    "Once upon a time there was a tiny model that loved numbers 0123456789.",
    "Héllo wörld, ça va? Ünïcödé text is welcome here.",
]

# Per-architecture config class and extra keyword arguments (qwen3: heads*head_dim != hidden).
_ARCH_CONFIG: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 4096}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 24}),
    # Mixture of experts (tests/test_moe_hf.py).
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {"num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        {
            "num_experts": 6,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
            "norm_topk_prob": False,
            "mlp_only_layers": [1],
        },
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "head_dim": 24,
        },
    ),
    # Issue 58's MoE families (tests/test_families_moe.py): OLMoE's q/k norm spans all heads and
    # it never renormalises; GraniteMoE's multipliers; GPT-OSS's sinks, windows, yarn, biases.
    "olmoe": (
        "OlmoeConfig",
        "OlmoeForCausalLM",
        {"num_experts": 6, "num_experts_per_tok": 2, "intermediate_size": 32},
    ),
    "granitemoe": (
        "GraniteMoeConfig",
        "GraniteMoeForCausalLM",
        {
            "num_local_experts": 5,
            "num_experts_per_tok": 2,
            "intermediate_size": 32,
            "embedding_multiplier": 3.0,
            "residual_multiplier": 0.7,
            "attention_multiplier": 0.2,
            "logits_scaling": 2.5,
        },
    ),
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "intermediate_size": 64,
            "head_dim": 24,
            "sliding_window": 6,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
            },
        },
    ),
    # LayerNorm families (tests/test_families_layernorm.py): head_dim 18 (hidden 72 / 4 heads)
    "starcoder2": (
        "Starcoder2Config",
        "Starcoder2ForCausalLM",
        {"hidden_size": 72, "sliding_window": 6, "norm_epsilon": 1e-5, "use_bias": True},
    ),
    # Phi-3 (tests/test_families_phi3.py): fused qkv_proj / gate_up_proj, longrope over the
    # head_dim 18 (9 factors), a window of 6
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        {
            "hidden_size": 72,
            "sliding_window": 6,
            "pad_token_id": 0,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0 + 0.1 * i for i in range(9)],
                "long_factor": [2.0 + 0.3 * i for i in range(9)],
            },
        },
    ),
    # GPT-NeoX (tests/test_families_gpt_neox.py): head_dim 18, RoPE over int(18 * 0.25) = 4 dims
    "gpt_neox": (
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        {
            "hidden_size": 72,
            "num_key_value_heads": None,
            "layer_norm_eps": 1e-5,
            "rope_parameters": {"rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        },
    ),
    # Phi-2 (tests/test_families_phi.py): head_dim 20, RoPE over 8 dims, GQA, biased LM head
    "phi": (
        "PhiConfig",
        "PhiForCausalLM",
        {
            "hidden_size": 80,
            "layer_norm_eps": 1e-5,
            "rope_parameters": {"rope_theta": 10000.0, "partial_rotary_factor": 0.4},
        },
    ),
    # Command-R (tests/test_families_cohere.py): head_dim 18, GQA, logit_scale 0.25
    "cohere": (
        "CohereConfig",
        "CohereForCausalLM",
        {"hidden_size": 72, "layer_norm_eps": 1e-5, "logit_scale": 0.25, "pad_token_id": 0},
    ),
}
MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe")


def build_tokenizer():
    """A byte-level BPE (vocab <= VOCAB) trained on a fixed corpus with the tokenizers library."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 10, trainer)
    return tok


def _config(arch: str, tied: bool, overrides: dict[str, Any]):
    import transformers

    cls_name, _, extra = _ARCH_CONFIG[arch]
    kwargs: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        # Larger than HF's 0.02 so logits are spread out and greedy argmax has clear margins.
        initializer_range=0.2,
        tie_word_embeddings=tied,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )
    kwargs.update(extra)
    kwargs.update(overrides)
    return getattr(transformers, cls_name)(**kwargs)


def randomize_norms_and_biases(model, seed: int) -> None:
    # HF initializes norms to 1 and biases to 0, which would hide mapping mistakes.
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif "norm" in name:
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))


def make_tiny_checkpoint(
    tmp_dir: str | Path,
    arch: str,
    *,
    dtype: str = "float32",
    tied: bool = False,
    seed: int = 0,
    shards: int = 1,
    config_overrides: dict[str, Any] | None = None,
    generation: dict[str, Any] | None = None,
) -> Path:
    """Write a complete tiny HF snapshot of ``arch`` into ``tmp_dir`` and return its path.

    Same ``seed`` → identical weights regardless of ``shards``. ``dtype`` is "float32" or
    "bfloat16" (the stored dtype). qwen2 gets non-zero q/k/v biases; all norms get random gammas.
    """
    import torch
    import transformers
    from transformers import PreTrainedTokenizerFast

    out = Path(tmp_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = _config(arch, tied, config_overrides or {})
    torch.manual_seed(seed)
    model = getattr(transformers, _ARCH_CONFIG[arch][1])(config).eval()
    randomize_norms_and_biases(model, seed)
    model = model.to({"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype])
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, **(generation or {})
    )
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    shard_size = total if shards <= 1 else total // shards + 1024
    model.save_pretrained(
        out, safe_serialization=True, max_shard_size=max(shard_size, 1024) if shards > 1 else "5GB"
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(),
        bos_token=SPECIALS[0],
        eos_token=SPECIALS[2],
        pad_token=SPECIALS[0],
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(out)
    return out


def set_config_keys(model_dir: str | Path, **changes: Any) -> None:
    """Edit config.json in place (None deletes a key) — for error-case tests."""
    path = Path(model_dir) / "config.json"
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data, indent=2))


@functools.lru_cache(maxsize=8)
def cached_hf_model(model_dir: str):
    import torch
    from transformers import AutoModelForCausalLM

    # One thread: on this shared 2-core machine torch's thread pool makes tiny models ~50x slower.
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


def hf_logits(model_dir: str | Path, ids: list[int]) -> np.ndarray:
    """transformers' float32 logits for every position: float32 [len(ids), vocab]."""
    import torch

    model = cached_hf_model(str(model_dir))
    with torch.no_grad():
        out = model(torch.tensor([ids], dtype=torch.long), use_cache=False)
    return out.logits[0].float().numpy()  # [n, vocab]


def hf_greedy(model_dir: str | Path, ids: list[int], n: int, use_cache: bool = True) -> list[int]:
    """The ``n`` new token ids of ``generate(do_sample=False)``; EOS does not stop it."""
    import torch

    model = cached_hf_model(str(model_dir))
    gc = copy.deepcopy(model.generation_config)
    gc.eos_token_id = []  # None would fall back to the model's EOS; [] never stops
    gc.pad_token_id = 0
    gc.do_sample = False
    gc.max_new_tokens = n
    gc.min_new_tokens = None
    gc.use_cache = use_cache
    with torch.no_grad():
        seq = model.generate(
            torch.tensor([ids], dtype=torch.long),
            generation_config=gc,
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        )
    return seq[0, len(ids) :].tolist()
