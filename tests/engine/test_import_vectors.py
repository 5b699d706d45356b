"""Control-vector importers against the peers' own code.

- repeng: a control vector trained with repeng on the tiny Llama (transformers), exported by
  repeng to GGUF, imported with `xmix import vector`, served by the CPU engine: the same greedy
  tokens as repeng's own ControlModel on transformers (engine-marked; one engine).
- steering_vectors: a SteeringVector applied by the library itself (transformers) against the
  imported app on the transformers path (xmix.integrations.hf).
- file formats: GGUF (llama.cpp / repeng / EasySteer), plain safetensors, refusals.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from xmix.cli import main as xmix_main
from xmix.interop import InteropError, from_control_vector, from_steering_vector, load_vector_app
from xmix.lang.api import App
from xmix.models.tiny import tiny_model_path

D = 32


def _repeng():
    # repeng 0.4.0 (the newest on PyPI) annotates with np.float_, removed in NumPy 2; the alias
    # is restored before importing it (the peer's own code is otherwise untouched).
    if not hasattr(np, "float_"):
        np.float_ = np.float64
    return pytest.importorskip("repeng", reason="peer test needs repeng (scripts/setup.sh)")


def _gguf_file(path, tensors: dict[str, np.ndarray], arch="controlvector", **strings) -> None:
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), arch)
    for k, v in strings.items():
        w.add_string(f"{arch}.{k}", v)
    for name, t in tensors.items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_repeng_gguf_layers_map_to_block_outputs(tmp_path):
    repeng = _repeng()
    g = np.random.default_rng(0)
    dirs = {1: g.standard_normal(D).astype(np.float32), 3: g.standard_normal(D).astype(np.float32)}
    repeng.ControlVector(model_type="llama", directions=dirs).export_gguf(str(tmp_path / "cv.gguf"))
    out = tmp_path / "cv.xmix"
    assert (
        xmix_main(["import", "vector", str(tmp_path / "cv.gguf"), "-o", str(out), "--scale", "2.5"])
        == 0
    )
    app = App.load(out)
    (op,) = app.ops
    assert (op.kernel, op.site, op.layer_spec, op.params) == (
        "add",
        "residual.post",
        [1, 3],
        {"scale": 2.5},
    )
    np.testing.assert_array_equal(op.artifacts["vector"].numpy(), np.stack([dirs[1], dirs[3]]))
    imp = app.metadata["imported"]
    assert imp["format"] == "gguf" and imp["model_hint"] == "llama" and imp["layers"] == [1, 3]
    # the same vector handed over as a repeng object
    app2 = from_control_vector(repeng.ControlVector(model_type="llama", directions=dirs), scale=2.5)
    assert torch.equal(app2.ops[0].artifacts["vector"], op.artifacts["vector"])


def test_gguf_duplicates_are_summed_and_easysteer_metadata_kept(tmp_path):
    v = np.arange(D, dtype=np.float32)
    # EasySteer's StatisticalControlVector.export_gguf writes controlvector.method
    _gguf_file(
        tmp_path / "es.gguf", {"direction.0": v, "direction.2": v}, model_hint="qwen2", method="pca"
    )
    app = load_vector_app(tmp_path / "es.gguf")
    assert app.ops[0].layer_spec == [0, 2] and app.metadata["imported"]["method"] == "pca"
    # two files of one model: llama.cpp sums the directions of a layer; so does vectors_app's caller
    from xmix.interop.vectors import read_gguf_directions

    _gguf_file(tmp_path / "dup.gguf", {"direction.4": v})
    a, _ = read_gguf_directions(tmp_path / "es.gguf")
    b, _ = read_gguf_directions(tmp_path / "dup.gguf")
    assert set(a) | set(b) == {0, 2, 4}


@pytest.mark.parametrize(
    "tensors,arch,msg",
    [
        ({"direction.1": np.zeros(D, np.float16)}, "controlvector", "control vectors are F32"),
        (
            {"blk.0.attn_q.weight": np.zeros(D, np.float32)},
            "controlvector",
            "is not 'direction.<layer>'",
        ),
        ({"direction.1": np.zeros(D, np.float32)}, "llama", "is not a control vector"),
    ],
)
def test_gguf_refusals(tmp_path, tensors, arch, msg):
    _gguf_file(tmp_path / "x.gguf", tensors, arch=arch)
    with pytest.raises(InteropError, match=msg):
        load_vector_app(tmp_path / "x.gguf")


def test_safetensors_vectors(tmp_path):
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(1)
    per = {
        "model.layers.2": torch.randn(D, generator=g),
        "direction.5": torch.randn(D, generator=g),
    }
    save_file(per, str(tmp_path / "per.safetensors"))
    app = load_vector_app(tmp_path / "per.safetensors", scale=-1.0)
    assert app.ops[0].layer_spec == [2, 5]
    assert torch.equal(
        app.ops[0].artifacts["vector"], torch.stack([per["model.layers.2"], per["direction.5"]])
    )
    mat = torch.randn(4, D, generator=g)
    save_file({"vectors": mat}, str(tmp_path / "mat.safetensors"))
    assert load_vector_app(tmp_path / "mat.safetensors").ops[0].layer_spec == [0, 1, 2, 3]
    save_file({"weird": torch.randn(3, 3, 3)}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(InteropError, match="not a per-layer vector"):
        load_vector_app(tmp_path / "bad.safetensors")
    (tmp_path / "v.pt").write_bytes(b"x")
    with pytest.raises(InteropError, match="Python pickles"):
        load_vector_app(tmp_path / "v.pt")


def test_steering_vectors_object_matches_the_library(tmp_path):
    """steering_vectors applies its own vector on transformers; xmix's transformers path runs
    the imported app: the same logits."""
    sv_mod = pytest.importorskip("steering_vectors", reason="peer test needs steering-vectors")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from xmix.integrations.hf import attach

    path = str(tiny_model_path("tiny-llama"))
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    d = model.config.hidden_size
    g = torch.Generator().manual_seed(2)
    sv = sv_mod.SteeringVector(
        layer_activations={1: torch.randn(d, generator=g), 2: torch.randn(d, generator=g)},
        layer_type="decoder_block",
    )
    ids = tok.encode("The old lighthouse keeper climbed")
    with torch.no_grad(), sv.apply(model, multiplier=3.0):
        want = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
    with torch.no_grad():
        plain = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
    app = from_steering_vector(sv, name="sv", scale=3.0)
    assert app.ops[0].site == "residual.post" and app.ops[0].layer_spec == [1, 2]
    with attach(model, [app], tokenizer=tok) as att:
        got, _ = att.forward(ids, apps=["sv"])
    assert not torch.allclose(want, plain, atol=1e-3), "the vector should change the logits"
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    sv_attn = sv_mod.SteeringVector(layer_activations={0: torch.zeros(d)}, layer_type="self_attn")
    assert from_steering_vector(sv_attn).ops[0].site == "attention.post"
    with pytest.raises(InteropError, match="no xmix site"):
        from_steering_vector(
            sv_mod.SteeringVector(
                layer_activations={0: torch.zeros(d)}, layer_type="input_layernorm"
            )
        )


@pytest.mark.engine
def test_repeng_vector_on_the_engine_matches_repeng_control_model(tmp_path):
    """Train with repeng, export its GGUF, `xmix import vector`, serve: the engine's greedy
    tokens equal repeng's ControlModel.generate on transformers."""
    repeng = _repeng()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine_util import PROMPTS, greedy, make_llm, shutdown, tokenize

    path = str(tiny_model_path("tiny-llama"))
    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    pos = [
        "I feel wonderful and happy today",
        "What a joyful bright morning",
        "Such a lovely kind friend",
        "We laughed and sang together",
        "The sun is warm and the sky is blue",
        "Good news makes me smile",
    ]
    neg = [
        "I feel terrible and sad today",
        "What a gloomy dark morning",
        "Such a cruel cold enemy",
        "We cried and sat alone",
        "The rain is cold and the sky is grey",
        "Bad news makes me frown",
    ]
    data = [repeng.DatasetEntry(positive=p, negative=n) for p, n in zip(pos, neg)]
    cv = repeng.ControlVector.train(model, tok, data, batch_size=4)
    assert sorted(cv.directions) == [1, 2, 3]  # repeng's default: every block but the first
    cv.export_gguf(str(tmp_path / "happy.gguf"))
    coeff = 6.0
    assert (
        xmix_main(
            [
                "import",
                "vector",
                str(tmp_path / "happy.gguf"),
                "-o",
                str(tmp_path / "happy.xmix"),
                "--name",
                "happy",
                "--scale",
                str(coeff),
            ]
        )
        == 0
    )

    prompts = [tokenize(tok, p) for p in PROMPTS[:4]]
    max_tokens = 16
    cm = repeng.ControlModel(model, list(cv.directions))
    cm.set_control(cv, coeff=coeff)
    want = []
    with torch.no_grad():
        for ids in prompts:
            out = cm.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
            )
            want.append(out[0, len(ids) :].tolist())
        cm.reset()
        plain = [
            cm.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
            )[0, len(ids) :].tolist()
            for ids in prompts
        ]
    assert want != plain, "the control vector should change some answer"

    llm = make_llm(path)
    try:
        llm.xmix.deploy(App.load(tmp_path / "happy.xmix"))
        outs = greedy(llm, prompts, max_tokens, [{"apps": ["happy"]}] * len(prompts))
        got = [list(o.outputs[0].token_ids) for o in outs]
    finally:
        shutdown(llm)
    assert got == want
