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

KINDS = ("tiny-llama", "tiny-qwen3", "tiny-mixtral")

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
SPECS = {
    "tiny-llama": ("LlamaForCausalLM", _COMMON),
    "tiny-qwen3": ("Qwen3ForCausalLM", _COMMON),
    "tiny-mixtral": (
        "MixtralForCausalLM",
        {**_COMMON, "intermediate_size": 256, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
}

# Standard deviations of the random weights. Default HF init (std 0.02) gives
# logits with std ~0.3, so top-1/top-2 near-ties are common and kernels that
# differ in rounding (vLLM vs HF) pick different greedy tokens. Instead every
# matrix gets std 1/sqrt(fan_in) so each layer really moves the residual
# stream, and the embedding/lm_head/router are scaled so that their outputs
# have std ~ EMBED_STD / LM_HEAD_GAIN / ROUTER_GAIN.
EMBED_STD = 1.0
LM_HEAD_GAIN = 4.0
ROUTER_GAIN = 4.0


def default_cache_root() -> Path:
    """`$XMIX_CACHE/models`, else `~/.cache/xmix/models`."""
    if os.environ.get("XMIX_CACHE"):
        return Path(os.environ["XMIX_CACHE"]) / "models"
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
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()


def _marker_ok(folder: Path, kind: str, seed: int) -> bool:
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("recipe") == recipe_hash(kind, seed)


def train_tokenizer():
    """Byte-level BPE trained on the embedded corpus (deterministic)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

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
    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    ids = dict(
        bos_token_id=tok.token_to_id("<s>"),
        eos_token_id=tok.token_to_id("</s>"),
        pad_token_id=tok.token_to_id("<pad>"),
    )
    config = config_cls(vocab_size=tok.get_vocab_size(), dtype=torch.float32, **spec, **ids)
    config.architectures = [arch]
    return config, ids


def _init_weights(model, seed: int) -> None:
    """Refill every parameter from one seeded generator, in name order."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "norm" in name:
                param.fill_(1.0)
                continue
            fan_in = param.shape[-1]
            if "embed_tokens" in name:
                std = EMBED_STD
            elif name.startswith("lm_head"):
                std = LM_HEAD_GAIN / math.sqrt(fan_in)
            elif name.endswith("mlp.gate.weight"):  # the MoE router, not gate_proj
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
    _init_weights(model, seed)
    model.generation_config = transformers.GenerationConfig(do_sample=False, **ids)
    # transformers 5 always writes safetensors (no safe_serialization argument).
    model.save_pretrained(folder)

    marker = {"kind": kind, "seed": seed, "recipe": recipe_hash(kind, seed), "version": RECIPE_VERSION}
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
    parser = argparse.ArgumentParser(prog="xmix models", description="make the embedded tiny models")
    parser.add_argument("kind", choices=(*KINDS, "all"))
    parser.add_argument("--out", help="folder that gets one subfolder per kind (default: the xmix cache)")
    args = parser.parse_args(argv)
    for kind in KINDS if args.kind == "all" else (args.kind,):
        print(tiny_model_path(kind, args.out), flush=True)
    return 0
