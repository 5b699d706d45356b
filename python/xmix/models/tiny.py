"""Tiny random-weight models built locally and deterministically.

The models exist so that tests and demos can start real vLLM engines without
downloading anything. Weights are random but fixed by the seed, and every file
is byte-identical across runs of the same library versions.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from xmix import settings

KINDS = (
    "tiny-llama",
    "tiny-qwen3",
    "tiny-mixtral",
    "tiny-gemma2",
    "tiny-gemma3",
    "tiny-qwen2",
    "tiny-mistral",
    "tiny-phi3",
    "tiny-olmo2",
    "tiny-qwen3-moe",
    "tiny-deepseek-v2",
    "tiny-gpt-oss",
)

# Bump when the output of the recipe changes, so cached folders are rebuilt.
RECIPE_VERSION = 1
MARKER = "xmix-model.json"

CORPUS = Path(__file__).with_name("corpus.txt")
VOCAB_SIZE = 512
SPECIAL_TOKENS = ("<s>", "</s>", "<pad>")  # ids 0, 1, 2
THINK_TOKENS = ("<think>", "</think>")  # the last two ids
# Qwen2's split pattern: unlike GPT-2's, it keeps a run of newlines together and
# away from punctuation, so "\n\n" can be learned as one token.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

_COMMON = dict(
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    # vLLM's CPU attention only has kernels for some head sizes (32, 64, 80, ...).
    head_dim=64,
    intermediate_size=512,
    max_position_embeddings=2048,
    rope_theta=10000.0,  # pinned: the default differs between config classes
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
# Gemma: vLLM always ties the output embedding to the input one (NOTES), so the tiny Gemmas
# are tied; head_dim stays 64 and query_pre_attn_scalar follows it (as in Gemma 2 9B, where
# it equals head_dim). The sliding window is longer than any test prompt, so sliding and
# global layers attend alike; the per-layer-type RoPE bases still differ (Gemma 3).
_GEMMA = {
    **_COMMON,
    "tie_word_embeddings": True,
    "query_pre_attn_scalar": 64,
    "hidden_activation": "gelu_pytorch_tanh",
    "sliding_window": 4096,
}
SPECS: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny-llama": ("LlamaForCausalLM", _COMMON),
    "tiny-qwen3": ("Qwen3ForCausalLM", _COMMON),
    "tiny-mixtral": (
        "MixtralForCausalLM",
        {**_COMMON, "intermediate_size": 256, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    "tiny-gemma2": (
        "Gemma2ForCausalLM",
        {**_GEMMA, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    ),
    "tiny-gemma3": (
        "Gemma3ForCausalLM",
        {
            **{k: v for k, v in _GEMMA.items() if k != "rope_theta"},
            "layer_types": [
                "sliding_attention",
                "sliding_attention",
                "sliding_attention",
                "full_attention",
            ],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            },
        },
    ),
    "tiny-qwen2": ("Qwen2ForCausalLM", _COMMON),  # q/k/v projections with bias
    "tiny-mistral": ("MistralForCausalLM", {**_COMMON, "sliding_window": None}),
    "tiny-phi3": ("Phi3ForCausalLM", _COMMON),  # fused qkv_proj and gate_up_proj
    "tiny-olmo2": ("Olmo2ForCausalLM", _COMMON),  # post-norm blocks, q/k norms
    # Layer 0 dense (mlp_only_layers), layers 1-3 MoE: 8 experts, top-2, renormalised.
    "tiny-qwen3-moe": (
        "Qwen3MoeForCausalLM",
        {
            **_COMMON,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 128,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [0],
            "norm_topk_prob": True,
        },
    ),
    # DeepSeek-V2-Lite's shape, shrunk: MLA without a query LoRA; vLLM's CPU MLA kernel only
    # has the latent size kv_lora_rank + qk_rope_head_dim = 512 + 64. Layer 0 dense
    # (first_k_dense_replace), layers 1-3 one shared + 8 routed experts, top-2 of the best 2
    # of 4 groups (group_limited_greedy, DeepSeek-V2's own scoring), softmax scores.
    "tiny-deepseek-v2": (
        "DeepseekV2ForCausalLM",
        {
            **{k: v for k, v in _COMMON.items() if k != "head_dim"},
            "num_key_value_heads": 4,
            "q_lora_rank": None,
            "kv_lora_rank": 512,
            "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 64,
            "v_head_dim": 64,
            "head_dim": 64,
            "n_routed_experts": 8,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 128,
            "first_k_dense_replace": 1,
            "moe_layer_freq": 1,
            "topk_method": "group_limited_greedy",
            "n_group": 4,
            "topk_group": 2,
            "norm_topk_prob": False,
            "routed_scaling_factor": 1.0,
            "scoring_func": "softmax",
        },
    ),
    # GPT-OSS: router with a bias, top-k on the logits then softmax over the k; attention
    # sinks; alternating sliding / full layers (the window is longer than any test prompt);
    # the config's own YaRN RoPE (vLLM's GPT-OSS attention reads its factor).
    "tiny-gpt-oss": (
        "GptOssForCausalLM",
        {
            **{k: v for k, v in _COMMON.items() if k not in ("rope_theta", "intermediate_size")},
            "intermediate_size": 256,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 4096,
            "layer_types": [
                "sliding_attention",
                "full_attention",
                "sliding_attention",
                "full_attention",
            ],
        },
    ),
}
# Config classes whose name is not the architecture's with "Config" for "ForCausalLM".
CONFIG_CLASSES = {"Gemma3ForCausalLM": "Gemma3TextConfig"}

# Standard deviations of the random weights. Default HF init (std 0.02) gives
# logits with std ~0.3, so top-1/top-2 near-ties are common and kernels that
# differ in rounding (vLLM vs HF) pick different greedy tokens. Instead every
# matrix gets std 1/sqrt(fan_in) so each layer really moves the residual
# stream, and the embedding/lm_head/router are scaled so that their outputs
# have std ~ EMBED_STD / LM_HEAD_GAIN / ROUTER_GAIN.
EMBED_STD = 1.0
LM_HEAD_GAIN = 4.0
ROUTER_GAIN = 4.0
# Per-kind changes to that recipe (kinds not listed use it unchanged, and their recipe hash
# does not mention this table). Gemma's norms scale by (1 + weight): weight 0 is the
# identity. Its tied embedding is also the LM head, and a token's own embedding then pulls
# the next token towards repeating it; so the embedding is small (std 1/16: the stream
# enters with rms 1 after Gemma's sqrt(d) scale), the post-attention / post-feedforward norms
# scale each block's contribution to rms 8 so that the layers decide the next token, and the
# final norm scales by 4 (logits std ~4, as LM_HEAD_GAIN gives the untied kinds).
_GEMMA_INIT = {
    "embed_std": 1.0 / 16,
    "norms": {
        "post_attention_layernorm": 7.0,
        "post_feedforward_layernorm": 7.0,
        "model.norm": 3.0,
    },
    "norm": 0.0,
}
INIT_OVERRIDES: dict[str, dict] = {"tiny-gemma2": _GEMMA_INIT, "tiny-gemma3": _GEMMA_INIT}


def default_cache_root() -> Path:
    """`$XMIX_CACHE/models`, else `~/.cache/xmix/models`."""
    cache = settings.get("XMIX_CACHE")
    if cache:
        return Path(cache) / "models"
    return Path.home() / ".cache" / "xmix" / "models"


def recipe_hash(kind: str, seed: int = 0) -> str:
    """Hash of everything that decides the files of `kind`."""
    arch, spec = SPECS[kind]
    recipe = {
        "version": RECIPE_VERSION,
        "kind": kind,
        "seed": seed,
        "arch": arch,
        "spec": spec,
        "vocab_size": VOCAB_SIZE,
        "tokens": [SPECIAL_TOKENS, THINK_TOKENS],
        "split": SPLIT_PATTERN,
        "chat_template": CHAT_TEMPLATE,
        "init": [EMBED_STD, LM_HEAD_GAIN, ROUTER_GAIN],
        "corpus": hashlib.sha256(CORPUS.read_bytes()).hexdigest(),
    }
    if kind in INIT_OVERRIDES:
        recipe["init_overrides"] = INIT_OVERRIDES[kind]
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()


def _marker_ok(folder: Path, kind: str, seed: int) -> bool:
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("recipe") == recipe_hash(kind, seed)


def train_tokenizer():
    """Byte-level BPE trained on the embedded corpus (deterministic)."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(THINK_TOKENS),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
    )
    tok.train_from_iterator([CORPUS.read_text(encoding="utf-8")], trainer=trainer)
    # Added after training so they are not "special": like Qwen3, decoding with
    # skip_special_tokens keeps the think markers visible in the text.
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    bos = SPECIAL_TOKENS[0]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
    )
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"corpus too small: vocab {tok.get_vocab_size()} != {VOCAB_SIZE}")
    return tok


def _config(kind: str, tok):
    import torch
    import transformers

    arch, spec = SPECS[kind]
    config_cls = getattr(
        transformers, CONFIG_CLASSES.get(arch, arch.replace("ForCausalLM", "Config"))
    )
    ids = dict(
        bos_token_id=tok.token_to_id("<s>"),
        eos_token_id=tok.token_to_id("</s>"),
        pad_token_id=tok.token_to_id("<pad>"),
    )
    config = config_cls(vocab_size=tok.get_vocab_size(), dtype=torch.float32, **spec, **ids)
    config.architectures = [arch]
    return config, ids


def _init_weights(model, seed: int, overrides: dict | None = None) -> None:
    """Refill every parameter from one seeded generator, in name order. A tied LM head is
    the embedding (named_parameters lists it once)."""
    import torch

    over = overrides or {}
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "norm" in name:
                fills = over.get("norms", {})
                hit = next((v for k, v in fills.items() if k in name), None)
                param.fill_(over.get("norm", 1.0) if hit is None else hit)
                continue
            fan_in = param.shape[-1]
            if "embed_tokens" in name:
                std = over.get("embed_std", EMBED_STD)
            elif name.startswith("lm_head"):
                std = LM_HEAD_GAIN / math.sqrt(fan_in)
            elif name.endswith(
                ("mlp.gate.weight", "mlp.router.weight")
            ):  # MoE routers, not gate_proj
                std = ROUTER_GAIN / math.sqrt(fan_in)
            else:
                std = 1.0 / math.sqrt(fan_in)
            param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32) * std)


def _build_into(kind: str, folder: Path, seed: int) -> None:
    import torch
    import transformers

    tok = train_tokenizer()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=_COMMON["max_position_embeddings"],
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(folder)

    config, ids = _config(kind, tok)
    torch.manual_seed(seed)
    model = getattr(transformers, SPECS[kind][0])(config).to(torch.float32)
    _init_weights(model, seed, INIT_OVERRIDES.get(kind))
    model.generation_config = transformers.GenerationConfig(do_sample=False, **ids)
    # transformers 5 always writes safetensors (no safe_serialization argument).
    model.save_pretrained(folder)

    marker = {
        "kind": kind,
        "seed": seed,
        "recipe": recipe_hash(kind, seed),
        "version": RECIPE_VERSION,
    }
    (folder / MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")


def make_tiny_model(kind: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Build `kind` into `out_dir` (replacing it) and return the folder."""
    if kind not in SPECS:
        raise ValueError(f"unknown model kind {kind!r}; expected one of {KINDS}")
    out = Path(out_dir).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build next to the target and rename, so readers never see half a folder.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        _build_into(kind, tmp, seed)
        # mkdtemp makes 0700 and safetensors writes 0600; others must read the cache.
        os.chmod(tmp, 0o755)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old / out.name)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


@contextlib.contextmanager
def _locked(path: Path):
    # One builder per cache folder; the others wait and then find it built.
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def tiny_model_path(kind: str, cache_dir: str | Path | None = None) -> Path:
    """The cached folder of `kind` (seed 0), built if missing or stale.

    `cache_dir` holds one folder per kind; it defaults to `default_cache_root()`.
    """
    if kind not in SPECS:
        raise ValueError(f"unknown model kind {kind!r}; expected one of {KINDS}")
    folder = Path(cache_dir).absolute() / kind if cache_dir else default_cache_root() / kind
    if _marker_ok(folder, kind, 0):
        return folder
    with _locked(folder.parent / f".{kind}.lock"):
        if not _marker_ok(folder, kind, 0):
            make_tiny_model(kind, folder, seed=0)
    return folder


def main(argv: list[str]) -> int:
    """`xmix models <kind|all> [--out DIR]`: print each model folder."""
    parser = argparse.ArgumentParser(
        prog="xmix models", description="make the embedded tiny models"
    )
    parser.add_argument("kind", choices=(*KINDS, "all"))
    parser.add_argument(
        "--out", help="folder that gets one subfolder per kind (default: the xmix cache)"
    )
    args = parser.parse_args(argv)
    for kind in KINDS if args.kind == "all" else (args.kind,):
        print(tiny_model_path(kind, args.out), flush=True)
    return 0
