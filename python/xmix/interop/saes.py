"""SAE importers: SAELens folders, Gemma Scope ``params.npz``, EleutherAI sparsify folders,
Llama Scope folders, and SAELens ``SAE`` objects in Python. Each returns an ``xmix.SAE`` whose
encoder computes what the format's own code computes (cited per importer), with the hook
point mapped to an xmix site and provenance in ``sae.metadata["imported"]``.

Only data is read: safetensors, npz with ``allow_pickle=False``, JSON.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from xmix.interop import hook_names
from xmix.interop._files import InteropError, provenance, read_json, read_safetensors, refuse_pickle
from xmix.lang.sae import SAE, SAEError

FORMATS = ("saelens", "gemma-scope", "sparsify", "llama-scope")


def detect_format(path: Path) -> str:
    """The SAE format of a file or folder, from the files it has."""
    refuse_pickle(path)
    if path.is_file():
        if path.suffix == ".npz":
            return "gemma-scope"
        if path.suffix == ".safetensors" and (path.parent / "hyperparams.json").is_file():
            return "llama-scope"
        if path.suffix == ".safetensors" and (path.parent.parent / "hyperparams.json").is_file():
            return "llama-scope"
        raise InteropError(
            f"{path}: cannot tell the SAE format of this file; give its folder "
            f"or --format ({', '.join(FORMATS)})"
        )
    if not path.is_dir():
        raise InteropError(f"{path}: no such file or folder")
    if (path / "cfg.json").is_file() and (path / "sae_weights.safetensors").is_file():
        return "saelens"
    if (path / "cfg.json").is_file() and (path / "sae.safetensors").is_file():
        return "sparsify"
    if (path / "hyperparams.json").is_file():
        return "llama-scope"
    if (path / "params.npz").is_file():
        return "gemma-scope"
    pickles = sorted(
        p.name for p in path.iterdir() if p.suffix.lower() in (".pt", ".pth", ".bin", ".pkl")
    )
    if pickles:
        refuse_pickle(path / pickles[0])
    raise InteropError(
        f"{path}: not a known SAE folder (SAELens: cfg.json + sae_weights.safetensors; "
        f"sparsify: cfg.json + sae.safetensors; Llama Scope: hyperparams.json + "
        f"checkpoints/final.safetensors; Gemma Scope: params.npz)"
    )


def load_sae(
    path: str | Path,
    format: str = "auto",
    hook: str | None = None,
    scaling_factor: float | None = None,
) -> SAE:
    """Import an SAE. ``hook`` overrides (or supplies) the site; ``scaling_factor`` folds a
    dataset normalisation constant into the weights (SAELens ``expected_average_only_in``)."""
    path = Path(path)
    fmt = detect_format(path) if format == "auto" else format
    loaders = {
        "saelens": from_saelens,
        "gemma-scope": from_gemma_scope,
        "sparsify": from_sparsify,
        "llama-scope": from_llama_scope,
    }
    if fmt not in loaders:
        raise InteropError(f"unknown SAE format {fmt!r}; xmix imports {', '.join(FORMATS)}")
    refuse_pickle(path)
    try:
        sae = loaders[fmt](path, hook=hook)
        if scaling_factor is not None:
            sae.fold_scaling_factor(scaling_factor)
            sae.metadata["imported"]["folded_scaling_factor"] = scaling_factor
    except SAEError as e:
        raise InteropError(f"{path}: {e}") from None
    return sae


def _hook(given: str | None, native: str | None, mapper, source: str) -> tuple[str, str | None]:
    if given is not None:
        return hook_names.resolve(given, source), native
    if not native:
        raise InteropError(
            f"{source}: the SAE does not say where it was trained; give hook= "
            f"(an xmix site such as layers.12.residual.post)"
        )
    return mapper(native, source), native


# ------------------------------------------------------------------------------ SAELens
_SAELENS_ARCH = {"standard": "relu", "jumprelu": "jumprelu", "topk": "topk"}


def _from_saelens_parts(
    cfg: dict[str, Any],
    t: dict[str, torch.Tensor],
    source: str,
    hook: str | None,
    files: list[Path],
) -> SAE:
    """SAELens v6 semantics (sae_lens/saes/{sae,standard_sae,jumprelu_sae,topk_sae}.py;
    pre-6.0 configs are read as sae_lens.loading.handle_pre_6_0_config reads them)."""
    meta = cfg.get("metadata") or cfg.get("meta") or {}
    native = meta.get("hook_name") or cfg.get("hook_name") or cfg.get("hook_point")
    head = meta.get("hook_head_index", cfg.get("hook_head_index", cfg.get("hook_point_head_index")))
    if head is not None:
        raise InteropError(
            f"{source}: the SAE reads one attention head ({head}); xmix has no per-head site"
        )
    if cfg.get("reshape_activations", "none") != "none" or (native or "").endswith("hook_z"):
        raise InteropError(
            f"{source}: the SAE reads per-head attention outputs (hook_z), before "
            f"o_proj; xmix's attention.post is after o_proj and has no equivalent"
        )
    act = cfg.get("activation_fn") or cfg.get("activation_fn_str") or "relu"
    arch = cfg.get("architecture") or "standard"
    k = cfg.get("k")
    if act == "topk" and arch == "standard":  # pre-6.0 TopK SAEs
        arch, k = "topk", (cfg.get("activation_fn_kwargs") or {}).get("k")
    if arch not in _SAELENS_ARCH:
        raise InteropError(
            f"{source}: SAELens architecture {arch!r} is not supported; xmix runs "
            f"{', '.join(_SAELENS_ARCH)} (SAELens names)"
        )
    if arch != "topk" and act not in ("relu", None):
        raise InteropError(f"{source}: activation function {act!r} is not supported (relu only)")
    norm = cfg.get("normalize_activations", "none")
    if isinstance(norm, bool):
        norm = "expected_average_only_in" if norm else "none"
    note = None
    if norm in ("expected_average_only_in", None):
        # SAELens's encode leaves the input as it is for this setting; the dataset scaling
        # factor, when known, is folded into the weights (load_sae(scaling_factor=...)).
        note = "normalize_activations expected_average_only_in: identity at inference (as SAELens)"
        norm = "none"
    for key in ("scaling_factor", "finetuning_scaling_factor"):
        if key in t and not torch.allclose(t[key].float(), torch.ones_like(t[key].float())):
            raise InteropError(f"{source}: a finetuning scaling factor is not supported")
    missing = [n for n in ("W_enc", "W_dec", "b_dec") if n not in t]
    if missing:
        raise InteropError(f"{source}: tensors missing: {missing} (has {sorted(t)})")
    W_enc, W_dec, b_dec = t["W_enc"].float(), t["W_dec"].float(), t["b_dec"].float()
    b_enc = t["b_enc"].float() if "b_enc" in t else torch.zeros(W_enc.shape[1])
    thr = None
    if arch == "jumprelu":
        if "threshold" in t:
            thr = t["threshold"].float()
        elif "log_threshold" in t:
            thr = t["log_threshold"].float().exp()
        else:
            raise InteropError(f"{source}: a jumprelu SAE without 'threshold' or 'log_threshold'")
    if arch == "topk" and cfg.get("rescale_acts_by_decoder_norm"):
        # pre * ||W_dec[f]|| then decode acts / ||W_dec[f]||: the same SAE with the norms folded
        n = W_dec.norm(dim=1)
        W_enc, b_enc, W_dec = W_enc * n, b_enc * n, W_dec / n[:, None]
    site, native = _hook(hook, native, hook_names.from_transformer_lens, source)
    meta_out = provenance(
        "saelens",
        files,
        hook_name=native,
        model_name=meta.get("model_name") or cfg.get("model_name"),
        model_from_pretrained_kwargs=meta.get("model_from_pretrained_kwargs")
        or cfg.get("model_from_pretrained_kwargs"),
        note=note,
        sae_lens_version=meta.get("sae_lens_version") or cfg.get("sae_lens_version"),
    )
    return SAE(
        W_enc,
        b_enc,
        W_dec,
        b_dec,
        architecture=_SAELENS_ARCH[arch],
        threshold=thr,
        k=int(k) if arch == "topk" and k is not None else None,
        apply_b_dec_to_input=bool(cfg.get("apply_b_dec_to_input", True)),
        normalize_activations=norm,
        hook=site,
        metadata=meta_out,
    )


def from_saelens(path: Path, hook: str | None = None) -> SAE:
    """A folder written by ``sae_lens.SAE.save_model``: cfg.json + sae_weights.safetensors."""
    cfg_p, w_p = path / "cfg.json", path / "sae_weights.safetensors"
    return _from_saelens_parts(
        read_json(cfg_p), read_safetensors(w_p), str(path), hook, [cfg_p, w_p]
    )


def from_saelens_object(sae, hook: str | None = None) -> SAE:
    """An ``sae_lens.SAE`` in memory (its config and state dict)."""
    cfg = sae.cfg.to_dict()
    tensors = {k: v.detach().cpu() for k, v in sae.state_dict().items()}
    out = _from_saelens_parts(cfg, tensors, f"sae_lens.{type(sae).__name__}", hook, [])
    out.metadata["imported"]["format"] = "saelens (object)"
    return out


# ------------------------------------------------------------------------------ Gemma Scope
def from_gemma_scope(path: Path, hook: str | None = None) -> SAE:
    """Gemma Scope ``params.npz`` (W_enc [d, F], W_dec [F, d], b_enc, b_dec, threshold):
    JumpReLU on x @ W_enc + b_enc with no b_dec subtraction and no normalisation, as SAELens's
    gemma_2 loader and the Gemma Scope tutorial compute. The site comes from the release path
    (``gemma-scope-2b-pt-res/layer_12/...`` -> layers.12.residual.post; ``-mlp`` -> mlp.post)
    unless ``hook`` is given; attention (``-att``, per-head z) has no xmix site."""
    f = path / "params.npz" if path.is_dir() else path
    try:
        with np.load(f, allow_pickle=False) as z:
            params = {
                k.lower(): torch.from_numpy(np.array(z[k], dtype=np.float32)) for k in z.files
            }
    except FileNotFoundError:
        raise InteropError(f"{f}: no such file") from None
    except ValueError as e:
        raise InteropError(
            f"{f}: not a plain npz of arrays ({e}); object arrays are refused"
        ) from None
    except (OSError, EOFError) as e:
        raise InteropError(f"{f}: not a readable npz file ({e})") from None
    need = ["w_enc", "w_dec", "b_enc", "b_dec", "threshold"]
    missing = [k for k in need if k not in params]
    if missing:
        raise InteropError(f"{f}: Gemma Scope params.npz lacks {missing} (has {sorted(params)})")
    native = None
    if hook is None:
        text = str(f.resolve())
        m = re.search(r"layer_(\d+)", text)
        fam = re.search(r"gemma-scope-[^/]*?-(res|mlp|att|embedding|transcoders)(?:-[^/]*)?/", text)
        if m and fam:
            kind = fam.group(1)
            if kind in ("att", "embedding", "transcoders"):
                raise InteropError(
                    f"{f}: a Gemma Scope {kind} SAE has no xmix site (attention SAEs "
                    f"read per-head z before o_proj)"
                )
            native = f"{fam.group(0).rstrip('/')}/layer_{m.group(1)}"
            hook = f"layers.{int(m.group(1))}.{'residual.post' if kind == 'res' else 'mlp.post'}"
        else:
            raise InteropError(
                f"{f}: cannot tell the layer and site from the path; give hook= "
                f"(e.g. layers.12.residual.post for a gemma-scope-*-res SAE)"
            )
    site = hook_names.resolve(hook, str(f))
    return SAE(
        params["w_enc"],
        params["b_enc"],
        params["w_dec"],
        params["b_dec"],
        architecture="jumprelu",
        threshold=params["threshold"],
        apply_b_dec_to_input=False,
        hook=site,
        metadata=provenance("gemma-scope", [f], hook_name=native),
    )


# ------------------------------------------------------------------------------ sparsify
def from_sparsify(path: Path, hook: str | None = None) -> SAE:
    """EleutherAI sparsify (``SparseCoder.save_to_disk``): cfg.json + sae.safetensors with
    encoder.weight [F, d], encoder.bias, W_dec [F, d], b_dec. Encoding (sparse_coder.py,
    fused_encoder.py): top-k of relu((x - b_dec) @ encoder.weight.T + encoder.bias), which
    gives the same activations as xmix's topk architecture with b_dec subtracted. The folder
    name is the hookpoint (``layers.10`` = the decoder layer's output)."""
    cfg_p, w_p = path / "cfg.json", path / "sae.safetensors"
    cfg, t = read_json(cfg_p), read_safetensors(w_p)
    src = str(path)
    if cfg.get("transcode"):
        raise InteropError(
            f"{src}: a transcoder (transcode=true) maps one site to another; xmix "
            f"imports autoencoders"
        )
    if cfg.get("skip_connection") or "W_skip" in t:
        raise InteropError(f"{src}: skip connections are not supported")
    if cfg.get("activation", "topk") != "topk" or cfg.get("signed"):
        raise InteropError(
            f"{src}: activation {cfg.get('activation')!r}"
            f"{' (signed)' if cfg.get('signed') else ''} is not supported (topk only)"
        )
    for key in ("encoder.weight", "encoder.bias", "W_dec", "b_dec"):
        if key not in t:
            raise InteropError(f"{src}: sae.safetensors lacks {key!r} (has {sorted(t)})")
    if "k" not in cfg:
        raise InteropError(f"{src}: cfg.json has no k")
    site, native = _hook(hook, path.name, hook_names.from_hf_module, src)
    return SAE(
        t["encoder.weight"].float().t(),
        t["encoder.bias"].float(),
        t["W_dec"].float(),
        t["b_dec"].float(),
        architecture="topk",
        k=int(cfg["k"]),
        apply_b_dec_to_input=True,
        hook=site,
        metadata=provenance("sparsify", [cfg_p, w_p], hook_name=native),
    )


# ------------------------------------------------------------------------------ Llama Scope
def from_llama_scope(path: Path, hook: str | None = None) -> SAE:
    """Llama Scope (OpenMOSS lm-saes): hyperparams.json + checkpoints/final.safetensors with
    encoder.weight [F, d], encoder.bias, decoder.weight [d, F], decoder.bias. Converted as
    SAELens does (pretrained_sae_loaders.llama_scope_sae_huggingface_loader, then
    SAE.fold_activation_norm_scaling_factor): s = sqrt(d) / dataset_average_activation_norm.in,
    W_enc * s, JumpReLU threshold * s, W_dec / s, b_dec / s."""
    folder = (
        path
        if path.is_dir()
        else (path.parent.parent if path.parent.name == "checkpoints" else path.parent)
    )
    hp_p = folder / "hyperparams.json"
    hp = read_json(hp_p)
    w_p = path if path.is_file() else folder / "checkpoints" / "final.safetensors"
    t = read_safetensors(w_p)
    src = str(folder)
    h_in, h_out = hp.get("hook_point_in"), hp.get("hook_point_out", hp.get("hook_point_in"))
    if h_in != h_out:
        raise InteropError(
            f"{src}: hook_point_in {h_in!r} != hook_point_out {h_out!r}: a "
            f"transcoder, which xmix does not import"
        )
    if hp.get("act_fn", "jumprelu") != "jumprelu":
        raise InteropError(f"{src}: act_fn {hp.get('act_fn')!r} is not supported (jumprelu only)")
    for key in ("encoder.weight", "encoder.bias", "decoder.weight", "decoder.bias"):
        if key not in t:
            raise InteropError(f"{src}: {w_p.name} lacks {key!r} (has {sorted(t)})")
    d = int(hp["d_model"])
    norm, s = hp.get("norm_activation", "dataset-wise"), None
    if norm == "dataset-wise":
        avg = (hp.get("dataset_average_activation_norm") or {}).get("in")
        if not isinstance(avg, (int, float)) or not avg > 0:
            raise InteropError(
                f"{src}: dataset-wise normalisation without dataset_average_activation_norm.in"
            )
        s = math.sqrt(d) / float(avg)
    elif norm not in ("none", None):
        raise InteropError(f"{src}: norm_activation {norm!r} is not supported")
    thr = float(hp["jump_relu_threshold"]) * (s or 1.0)
    F = int(t["encoder.weight"].shape[0])
    site, native = _hook(hook, h_in, hook_names.from_transformer_lens, src)
    sae = SAE(
        t["encoder.weight"].float().t(),
        t["encoder.bias"].float(),
        t["decoder.weight"].float().t(),
        t["decoder.bias"].float(),
        architecture="jumprelu",
        threshold=torch.full((F,), thr),
        apply_b_dec_to_input=bool(hp.get("apply_decoder_bias_to_pre_encoder", False)),
        hook=site,
        metadata=provenance("llama-scope", [hp_p, w_p], hook_name=native, folded_scaling_factor=s),
    )
    if s is not None:
        sae.fold_scaling_factor(s)
    return sae
