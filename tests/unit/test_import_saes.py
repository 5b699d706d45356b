"""SAE importers against the peers' own code: SAELens (`sae-lens`) folders and its Gemma Scope
and Llama Scope loaders (their downloader pointed at local files), EleutherAI sparsify's
SparseCoder. Each imported SAE runs in xmix's CPU kernel (the `sae` read, through a control
block) on the same activations the peer encodes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from harness import Harness, Req
from xmix.cli import main as xmix_main
from xmix.interop import InteropError, from_saelens_object, load_sae
from xmix.lang import reference as R
from xmix.lang.api import App
from xmix.lang.sae import SAE
from xmix.lang.sites import ModelShape

sae_lens = pytest.importorskip("sae_lens", reason="peer test needs sae-lens (scripts/setup.sh)")

N_ROWS = 12


def kernel_read(sae: SAE, x: torch.Tensor, top_k: int, features: list[int]):
    """xmix's sae reads (top-K and listed features) of rows x, through the CPU kernel."""
    d = x.shape[1]
    site, layer = "residual.post", 0
    app = App("k")
    app.read("sae", sae=sae, top_k=top_k).layers([layer]).at(site).named("top")
    app.read("sae", sae=sae, features=features).layers([layer]).at(site).named("feat")
    hs = Harness(ModelShape(n_layers=2, hidden_size=d, vocab_size=10), [app])
    hs.step({"a": Req(len(x), 0, len(x), ("k",))})
    hs.run(site, layer, x.clone(), None)
    res = hs.drain()["a"]["k"]
    return res["top"]["values"], res["feat"]["values"]


def assert_matches_peer(sae: SAE, x: torch.Tensor, peer_acts: torch.Tensor, top_k=8) -> None:
    peer_acts = peer_acts.detach().float()
    feats = [int(i) for i in peer_acts.sum(0).argsort(descending=True)[:3]] + [0]
    top, feat = kernel_read(sae, x, top_k, feats)
    expect = R.sae_top(peer_acts, top_k)
    assert any(len(e[0]) for e in expect), "the test SAE should have active features"
    for t in range(len(x)):
        assert top[t]["ids"] == expect[t][0], f"row {t}"
        np.testing.assert_allclose(top[t]["acts"], expect[t][1], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(
            feat[t]["acts"], peer_acts[t, feats].numpy(), rtol=1e-4, atol=1e-5
        )


def rows(d: int, seed=0) -> torch.Tensor:
    return torch.randn(N_ROWS, d, generator=torch.Generator().manual_seed(seed)) * 3


def _randomise(sae, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sae.named_parameters():
            if name == "threshold":
                p.copy_(torch.rand(p.shape, generator=g) * 0.4)
            else:
                p.copy_(
                    torch.randn(p.shape, generator=g)
                    * (0.3 if p.dim() == 1 else 1 / math.sqrt(p.shape[0]))
                )


def lens_classes(arch: str):
    import sae_lens as L

    name = {"standard": "Standard", "jumprelu": "JumpReLU", "topk": "TopK"}[arch]
    return getattr(L, f"{name}SAEConfig"), getattr(L, f"{name}SAE")


SAELENS_CASES = [
    (
        "standard",
        dict(apply_b_dec_to_input=True),
        "blocks.1.hook_resid_post",
        "layers.1.residual.post",
    ),
    (
        "jumprelu",
        dict(apply_b_dec_to_input=False, normalize_activations="layer_norm"),
        "blocks.0.hook_mlp_out",
        "layers.0.mlp.post",
    ),
    (
        "topk",
        dict(
            k=10, normalize_activations="constant_norm_rescale", rescale_acts_by_decoder_norm=True
        ),
        "blocks.2.hook_resid_pre",
        "layers.2.residual.pre",
    ),
    (
        "topk",
        dict(k=5, apply_b_dec_to_input=True),
        "blocks.3.hook_attn_out",
        "layers.3.attention.post",
    ),
]


@pytest.mark.parametrize("arch,kw,tl_hook,site", SAELENS_CASES)
def test_saelens_folder_matches_saelens_encode(tmp_path, arch, kw, tl_hook, site):
    from sae_lens.saes.sae import SAEMetadata

    cfg_cls, sae_cls = lens_classes(arch)
    cfg = cfg_cls(
        d_in=48, d_sae=200, metadata=SAEMetadata(hook_name=tl_hook, model_name="tiny"), **kw
    )
    lens = sae_cls(cfg)
    _randomise(lens, 7)
    lens.save_model(tmp_path / "sae")
    out = tmp_path / "imported.safetensors"
    assert xmix_main(["import", "sae", str(tmp_path / "sae"), "-o", str(out)]) == 0
    sae = SAE.load(out)
    assert sae.hook == site
    prov = sae.metadata["imported"]
    assert prov["format"] == "saelens" and prov["hook_name"] == tl_hook
    assert [Path(f["path"]).name for f in prov["files"]] == ["cfg.json", "sae_weights.safetensors"]
    x = rows(48)
    with torch.no_grad():
        assert_matches_peer(sae, x, lens.encode(x))
    # the same SAE handed over as a Python object
    with torch.no_grad():
        assert_matches_peer(from_saelens_object(lens), x, lens.encode(x))


def test_sparsify_folder_matches_sparse_coder(tmp_path):
    sparsify = pytest.importorskip(
        "sparsify", reason="peer test needs eai-sparsify (scripts/setup.sh)"
    )
    sc = sparsify.SparseCoder(40, sparsify.SparseCoderConfig(num_latents=160, k=12))
    _randomise(sc, 3)
    sc.save_to_disk(tmp_path / "layers.2")
    sae = load_sae(tmp_path / "layers.2")
    assert sae.hook == "layers.2.residual.post" and sae.architecture == "topk" and sae.k == 12
    x = rows(40, 1)
    with torch.no_grad():
        enc = sc.encode(x)
        dense = torch.zeros(len(x), 160).scatter_(1, enc.top_indices, enc.top_acts.float())
    assert_matches_peer(sae, x, dense)
    (tmp_path / "layers.2.mlp").mkdir()
    for f in ("cfg.json", "sae.safetensors"):
        (tmp_path / "layers.2.mlp" / f).write_bytes((tmp_path / "layers.2" / f).read_bytes())
    assert load_sae(tmp_path / "layers.2.mlp").hook == "layers.2.mlp.post"


def _lens_from_loader(monkeypatch, loader, repo_id, folder, files: dict[str, Path], overrides):
    """Run one of SAELens's pretrained loaders on local files, then build the SAE as
    SAE.from_pretrained_with_cfg_and_sparsity does."""
    import sae_lens.loading.pretrained_sae_loaders as L
    from sae_lens import SAE as LensSAE
    from sae_lens.loading.pretrained_sae_loaders import handle_config_defaulting

    def local(repo_id, filename, subfolder=None, **_):
        key = f"{subfolder}/{filename}" if subfolder else filename
        return str(files[key])

    monkeypatch.setattr(L, "hf_hub_download", local)
    cfg, state, _ = loader(repo_id, folder, device="cpu", cfg_overrides=overrides)
    cfg = handle_config_defaulting(cfg)
    sae_cfg = LensSAE.get_sae_config_class_for_architecture(cfg["architecture"]).from_dict(cfg)
    lens = LensSAE.get_sae_class_for_architecture(sae_cfg.architecture())(sae_cfg)
    lens.process_state_dict_for_loading(state)
    lens.load_state_dict(state, assign=True)
    return lens


def test_gemma_scope_npz_matches_saelens_gemma_loader(tmp_path, monkeypatch):
    from sae_lens.loading.pretrained_sae_loaders import gemma_2_sae_huggingface_loader

    d, F = 2304, 64  # gemma-2-2b's width: the loader takes it from the repo name
    g = torch.Generator().manual_seed(5)
    params = {
        "W_enc": torch.randn(d, F, generator=g) / 48,
        "W_dec": torch.randn(F, d, generator=g),
        "b_enc": torch.randn(F, generator=g) * 0.1,
        "b_dec": torch.randn(d, generator=g),
        "threshold": torch.rand(F, generator=g) * 0.3,
    }
    folder = tmp_path / "gemma-scope-2b-pt-res" / "layer_1" / "width_16k" / "average_l0_10"
    folder.mkdir(parents=True)
    np.savez(folder / "params.npz", **{k: v.numpy() for k, v in params.items()})
    sae = load_sae(folder / "params.npz")
    assert sae.hook == "layers.1.residual.post" and sae.architecture == "jumprelu"
    lens = _lens_from_loader(
        monkeypatch,
        gemma_2_sae_huggingface_loader,
        "google/gemma-scope-2b-pt-res",
        "layer_1/width_16k/average_l0_10",
        {"layer_1/width_16k/average_l0_10/params.npz": folder / "params.npz"},
        {"d_sae": F},
    )
    x = rows(d, 2) / 10
    with torch.no_grad():
        assert_matches_peer(sae, x, lens.encode(x))
    # an mlp release maps to mlp.post; attention SAEs (per-head z) have no site
    mlp = tmp_path / "gemma-scope-2b-pt-mlp" / "layer_3" / "width_16k" / "l0_5"
    att = tmp_path / "gemma-scope-2b-pt-att" / "layer_3" / "width_16k" / "l0_5"
    for f in (mlp, att):
        f.mkdir(parents=True)
        (f / "params.npz").write_bytes((folder / "params.npz").read_bytes())
    assert load_sae(mlp).hook == "layers.3.mlp.post"
    with pytest.raises(InteropError, match="att SAE has no xmix site"):
        load_sae(att)


def test_llama_scope_matches_saelens_llama_loader(tmp_path, monkeypatch):
    from sae_lens.loading.pretrained_sae_loaders import llama_scope_sae_huggingface_loader
    from safetensors.torch import save_file

    d, F, avg_norm = 64, 256, 9.5
    g = torch.Generator().manual_seed(6)
    folder = tmp_path / "Llama3_1-8B-Base-L2R-8x"
    (folder / "checkpoints").mkdir(parents=True)
    hp = {
        "d_model": d,
        "d_sae": F,
        "hook_point_in": "blocks.2.hook_resid_post",
        "hook_point_out": "blocks.2.hook_resid_post",
        "act_fn": "jumprelu",
        "jump_relu_threshold": 0.05,
        "norm_activation": "dataset-wise",
        "dataset_average_activation_norm": {"in": avg_norm, "out": avg_norm},
        "apply_decoder_bias_to_pre_encoder": False,
    }
    (folder / "hyperparams.json").write_text(json.dumps(hp))
    save_file(
        {
            "encoder.weight": torch.randn(F, d, generator=g) / 8,
            "encoder.bias": torch.randn(F, generator=g) * 0.1,
            "decoder.weight": torch.randn(d, F, generator=g),
            "decoder.bias": torch.randn(d, generator=g),
        },
        str(folder / "checkpoints" / "final.safetensors"),
    )
    sae = load_sae(folder)
    assert sae.hook == "layers.2.residual.post"
    s = math.sqrt(d) / avg_norm
    assert sae.metadata["imported"]["folded_scaling_factor"] == pytest.approx(s)
    lens = _lens_from_loader(
        monkeypatch,
        llama_scope_sae_huggingface_loader,
        "fnlp/x",
        folder.name,
        {
            f"{folder.name}/hyperparams.json": folder / "hyperparams.json",
            f"{folder.name}/checkpoints/final.safetensors": folder
            / "checkpoints"
            / "final.safetensors",
        },
        {"dtype": "float32"},
    )
    lens.fold_activation_norm_scaling_factor(s)  # what from_pretrained does with the yaml's factor
    x = rows(d, 3)
    with torch.no_grad():
        assert_matches_peer(sae, x, lens.encode(x))


# ---------------------------------------------------------------- refusals
def test_pickles_are_refused_with_a_conversion_hint(tmp_path):
    p = tmp_path / "ae.pt"
    p.write_bytes(b"\x80\x04not really")
    with pytest.raises(
        InteropError, match=r"(?s)pickles.*torch.load\('ae.pt', weights_only=True\)"
    ):
        load_sae(p)
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "sae.pt").write_bytes(b"x")
    with pytest.raises(InteropError, match="Python pickles"):
        load_sae(tmp_path / "folder")
    assert xmix_main(["import", "sae", str(p), "-o", str(tmp_path / "o.safetensors")]) == 2


def test_npz_with_objects_is_refused(tmp_path):
    folder = tmp_path / "gemma-scope-2b-pt-res" / "layer_1" / "w"
    folder.mkdir(parents=True)
    np.savez(folder / "params.npz", W_enc=np.array([{"a": 1}], dtype=object))
    with pytest.raises(InteropError, match="object arrays are refused"):
        load_sae(folder / "params.npz")


@pytest.mark.parametrize(
    "hook,msg",
    [
        ("blocks.3.attn.hook_z", "per-head attention outputs"),
        ("blocks.3.mlp.hook_post", "no xmix equivalent"),
        ("hook_embed", "no xmix equivalent"),
    ],
)
def test_hooks_without_an_xmix_site_are_refused(tmp_path, hook, msg):
    from sae_lens.saes.sae import SAEMetadata

    cfg_cls, sae_cls = lens_classes("standard")
    lens = sae_cls(cfg_cls(d_in=16, d_sae=32, metadata=SAEMetadata(hook_name=hook)))
    lens.save_model(tmp_path / "s")
    with pytest.raises(InteropError, match=msg):
        load_sae(tmp_path / "s")
    if "hook_z" in hook:  # per-head inputs cannot be read at any site, whatever the user says
        with pytest.raises(InteropError, match=msg):
            load_sae(tmp_path / "s", hook="layers.0.residual.post")
    else:  # an explicit site is taken as given
        assert (
            load_sae(tmp_path / "s", hook="layers.0.residual.post").hook == "layers.0.residual.post"
        )


def test_import_to_an_app_and_serve_shape(tmp_path):
    from sae_lens.saes.sae import SAEMetadata

    cfg_cls, sae_cls = lens_classes("standard")
    sae_cls(
        cfg_cls(d_in=16, d_sae=32, metadata=SAEMetadata(hook_name="blocks.1.hook_resid_post"))
    ).save_model(tmp_path / "s")
    out = tmp_path / "feat.xmix"
    assert xmix_main(["import", "sae", str(tmp_path / "s"), "-o", str(out), "--top-k", "4"]) == 0
    app = App.load(out)
    op = app.ops[0]
    assert (op.kernel, op.site, op.layer_spec, op.options) == (
        "sae",
        "residual.post",
        [1],
        {"top_k": 4},
    )
    assert app.metadata["imported"]["format"] == "saelens"
