"""Control / steering vector importers: each produces an xmix app with one ``add`` write.

Layer convention (the one thing to get right). llama.cpp's control vectors, repeng's
``ControlVector`` and EasySteer's steer vectors all key a direction by the 0-based index k of
a decoder block and add it to that block's output (llama.cpp ``common_control_vector_load_one``
puts ``direction.k`` in ``tensors[k]``, and ``build_cvec(cur, il)`` adds ``tensors[il]`` right
after block il's final residual add; repeng's ``ControlModel`` wraps ``model.model.layers[k]``
and adds to its output; repeng's training reads ``hidden_states[k + 1]``, the output of block
k). In xmix that is ``layers.k.residual.post``, on every token, prompt included, scaled by the
app's ``scale`` (llama.cpp's ``--control-vector-scaled`` strength, repeng's ``coeff``).
llama.cpp refuses ``direction.0``; xmix applies it, as repeng does. Directions that appear
twice (several files) are summed, as llama.cpp does.

``steering_vectors.SteeringVector`` keys by layer index and ``layer_type``: "decoder_block"
(the block's output: residual.post), "self_attn" (attention.post), "mlp" (mlp.post).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from xmix.interop._files import InteropError, provenance, read_safetensors, refuse_pickle
from xmix.lang.api import App

VECTOR_FORMATS = ("gguf", "safetensors")
_LAYER_KEY = re.compile(r"^(?:(?:direction|layer|layers|model\.layers|blocks)[._])?(\d+)$")
_SV_SITES = {"decoder_block": "residual.post", "self_attn": "attention.post", "mlp": "mlp.post"}


def vectors_app(
    name: str,
    directions: Mapping[int, Any],
    *,
    site: str = "residual.post",
    scale: float = 1.0,
    metadata: dict[str, Any] | None = None,
    source: str = "<vectors>",
) -> App:
    """An app that adds ``scale * directions[k]`` at ``layers.k.<site>`` on every token."""
    if not directions:
        raise InteropError(f"{source}: no direction vectors")
    layers = sorted(int(k) for k in directions)
    rows = []
    width = None
    for k in layers:
        v = directions[k]
        v = torch.as_tensor(
            np.asarray(v, dtype=np.float32) if not isinstance(v, torch.Tensor) else v
        )
        v = (
            v.detach().float().reshape(-1)
            if v.dim() > 1 and v.shape[0] == 1
            else v.detach().float()
        )
        if v.dim() != 1:
            raise InteropError(
                f"{source}: the direction of layer {k} has shape {tuple(v.shape)}; "
                f"expected a vector"
            )
        if width is not None and v.numel() != width:
            raise InteropError(
                f"{source}: directions have different widths ({width} and {v.numel()} at layer {k})"
            )
        width = v.numel()
        rows.append(v)
    if layers[0] < 0:
        raise InteropError(f"{source}: negative layer index {layers[0]}")
    app = App(name, metadata=metadata)
    app.write("add", vector=torch.stack(rows), scale=scale).layers(layers).at(site).named("steer")
    return app


# ------------------------------------------------------------------------------ files
def read_gguf_directions(path: Path) -> tuple[dict[int, np.ndarray], dict[str, Any]]:
    """``direction.<k>`` tensors of a llama.cpp / repeng / EasySteer GGUF file (F32, 1-D),
    duplicates summed; plus the controlvector.* metadata."""
    try:
        import gguf
    except ImportError:
        raise InteropError(
            "reading GGUF needs the 'gguf' package: pip install 'xmix[interop]'"
        ) from None
    refuse_pickle(path)
    try:
        reader = gguf.GGUFReader(str(path))
    except FileNotFoundError:
        raise InteropError(f"{path}: no such file") from None
    except (ValueError, OSError, KeyError) as e:
        raise InteropError(f"{path}: not a readable GGUF file ({e})") from None
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key == "general.architecture" or key.startswith(("controlvector.", "steervector.")):
            try:
                val = field.contents()
            except Exception:  # noqa: BLE001 - a field gguf cannot decode is left out
                continue
            if isinstance(val, (str, int, float)):
                meta[key] = val
    arch = meta.get("general.architecture")
    if arch not in (None, "controlvector", "steervector"):
        raise InteropError(
            f"{path}: GGUF architecture {arch!r} is not a control vector "
            f"(controlvector / steervector)"
        )
    dirs: dict[int, np.ndarray] = {}
    for t in reader.tensors:
        m = re.fullmatch(r"direction\.(\d+)", t.name)
        if not m:
            raise InteropError(f"{path}: tensor {t.name!r} is not 'direction.<layer>'")
        if t.tensor_type != gguf.GGMLQuantizationType.F32:
            raise InteropError(
                f"{path}: tensor {t.name!r} is {t.tensor_type.name}; control vectors are F32"
            )
        data = np.array(t.data, dtype=np.float32).reshape(-1)
        k = int(m.group(1))
        dirs[k] = dirs[k] + data if k in dirs else data
    if not dirs:
        raise InteropError(f"{path}: no direction.<layer> tensors")
    return dirs, meta


def read_safetensors_directions(path: Path) -> dict[int, torch.Tensor]:
    """Per-layer vectors in a plain safetensors file: one 1-D tensor per layer named
    ``direction.<k>``, ``layers.<k>``, ``model.layers.<k>``, ``layer_<k>`` or ``<k>``; or one
    2-D tensor [n_layers, d] whose row k is layer k."""
    t = read_safetensors(path)
    if len(t) == 1 and next(iter(t.values())).dim() == 2:
        mat = next(iter(t.values()))
        return {k: mat[k] for k in range(mat.shape[0])}
    out: dict[int, torch.Tensor] = {}
    for name, v in t.items():
        m = _LAYER_KEY.match(name)
        if not m or v.dim() != 1:
            raise InteropError(
                f"{path}: tensor {name!r} {tuple(v.shape)} is not a per-layer vector "
                f"('direction.<k>', 'layers.<k>', '<k>'; 1-D) nor a single "
                f"[n_layers, d] matrix"
            )
        k = int(m.group(1))
        if k in out:
            raise InteropError(f"{path}: layer {k} is given twice")
        out[k] = v
    if not out:
        raise InteropError(f"{path}: no tensors")
    return out


def load_vector_app(
    path: str | Path,
    name: str | None = None,
    format: str = "auto",
    scale: float = 1.0,
    site: str = "residual.post",
) -> App:
    """A control-vector file as an app (see the module doc for the layer convention)."""
    path = Path(path)
    refuse_pickle(path)
    fmt = format
    if fmt == "auto":
        guessed = {".gguf": "gguf", ".safetensors": "safetensors"}.get(path.suffix.lower())
        if guessed is None:
            raise InteropError(
                f"{path}: cannot tell the vector format from the suffix; give "
                f"--format ({', '.join(VECTOR_FORMATS)})"
            )
        fmt = guessed
    name = name or re.sub(r"[^A-Za-z0-9_\-]", "_", path.stem)[:64] or "vectors"
    dirs: dict[int, Any]
    if fmt == "gguf":
        dirs, meta = read_gguf_directions(path)
        hint = meta.get("controlvector.model_hint") or meta.get("steervector.model_hint")
        method = meta.get("controlvector.method") or meta.get("steervector.method")
        md = provenance(
            "gguf",
            [path],
            model_hint=hint,
            method=method,
            layers=sorted(dirs),
            convention="direction.k -> layers.k.residual.post",
        )
    elif fmt == "safetensors":
        dirs = read_safetensors_directions(path)
        md = provenance("safetensors", [path], layers=sorted(dirs), site=site)
    else:
        raise InteropError(
            f"unknown vector format {fmt!r}; xmix imports {', '.join(VECTOR_FORMATS)}"
        )
    return vectors_app(name, dirs, site=site, scale=scale, metadata=md, source=str(path))


# ------------------------------------------------------------------------------ objects
def from_control_vector(cv, name: str = "control_vector", scale: float = 1.0) -> App:
    """repeng's ``ControlVector`` (``model_type``, ``directions``: layer -> ndarray)."""
    dirs = getattr(cv, "directions", None)
    if not isinstance(dirs, Mapping):
        raise InteropError(f"expected a repeng ControlVector, got {type(cv).__name__}")
    md = {
        "imported": {
            "format": "repeng.ControlVector",
            "model_hint": getattr(cv, "model_type", None),
            "layers": sorted(int(k) for k in dirs),
        }
    }
    return vectors_app(name, dirs, scale=scale, metadata=md, source="ControlVector")


def from_steering_vector(sv, name: str = "steering_vector", scale: float = 1.0) -> App:
    """``steering_vectors.SteeringVector`` (``layer_activations``: layer -> tensor,
    ``layer_type``); ``scale`` is its ``multiplier``."""
    acts = getattr(sv, "layer_activations", None)
    if not isinstance(acts, Mapping):
        raise InteropError(f"expected a steering_vectors.SteeringVector, got {type(sv).__name__}")
    layer_type = getattr(sv, "layer_type", "decoder_block")
    if layer_type not in _SV_SITES:
        raise InteropError(
            f"SteeringVector layer_type {layer_type!r} has no xmix site "
            f"({', '.join(f'{k} -> {v}' for k, v in _SV_SITES.items())})"
        )
    md = {
        "imported": {
            "format": "steering_vectors.SteeringVector",
            "layer_type": layer_type,
            "layers": sorted(int(k) for k in acts),
        }
    }
    return vectors_app(
        name, acts, site=_SV_SITES[layer_type], scale=scale, metadata=md, source="SteeringVector"
    )
