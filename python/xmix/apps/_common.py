"""Shared pieces of the app factories: the paper's models, argument checks, metadata."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from xmix.apps.artifacts import SCHEMAS, ArtifactError, validate_artifacts
from xmix.lang.api import App, AppError


@dataclass(frozen=True)
class PaperModel:
    key: str
    hf_id: str
    n_layers: int
    hidden_size: int
    n_experts: int = 0
    top_k: int = 0
    family: str = ""  # xmix.lang.architectures family name


# The three models of the paper's evaluation (section 5).
PAPER_MODELS: dict[str, PaperModel] = {
    m.key: m
    for m in (
        PaperModel(
            "llama-3.1-8b-instruct", "meta-llama/Llama-3.1-8B-Instruct", 32, 4096, family="llama"
        ),
        PaperModel("qwen3-8b", "Qwen/Qwen3-8B", 36, 4096, family="qwen3"),
        PaperModel(
            "mixtral-8x7b-instruct",
            "mistralai/Mixtral-8x7B-Instruct-v0.1",
            32,
            4096,
            8,
            2,
            family="mixtral",
        ),
    )
}
# Models of the other supported families whose layers an app's own source gives (the
# defaults tables cite it): Mistral-7B-Instruct-v0.2 is the truthfulness probe paper's model,
# DeepSeek-R1-Distill-Qwen-1.5B / 7B (Qwen2 architecture) are SEAL's; Qwen3-30B-A3B is one of
# SteerMoE's own models and GPT-OSS-20B one its results are replicated on (MASCing, 2026), both
# with every layer a MoE layer, which is all steer_moe needs. Gemma 2/3, Phi-3, OLMo 2 and
# DeepSeek-V2 have no such source: the factories ask for their layers.
SOURCE_MODELS: dict[str, PaperModel] = {
    m.key: m
    for m in (
        PaperModel(
            "mistral-7b-instruct-v0.2",
            "mistralai/Mistral-7B-Instruct-v0.2",
            32,
            4096,
            family="mistral",
        ),
        PaperModel(
            "deepseek-r1-distill-qwen-7b",
            "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B",
            28,
            3584,
            family="qwen2",
        ),
        PaperModel(
            "deepseek-r1-distill-qwen-1.5b",
            "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B",
            28,
            1536,
            family="qwen2",
        ),
        PaperModel("qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B", 48, 2048, 128, 8, family="qwen3_moe"),
        PaperModel("gpt-oss-20b", "openai/gpt-oss-20b", 24, 2880, 32, 4, family="gpt_oss"),
    )
}
KNOWN_MODELS: dict[str, PaperModel] = {**PAPER_MODELS, **SOURCE_MODELS}


def paper_model(model: str | None) -> PaperModel | None:
    """The known model (the paper's three and SOURCE_MODELS) named by a key, a Hugging Face id
    or a local folder named like one."""
    if not model:
        return None
    name = str(model).rstrip("/").lower()
    base = name.rsplit("/", 1)[-1]
    for m in KNOWN_MODELS.values():
        hf = m.hf_id.lower()
        if name in (m.key, hf) or base in (m.key, hf.rsplit("/", 1)[-1]):
            return m
        # "Mixtral-8x7B-Instruct-v0.1" vs key "mixtral-8x7b-instruct"
        if base.startswith(m.key):
            return m
    return None


def model_defaults(table: dict[str, dict[str, Any]], model: str | None) -> dict[str, Any]:
    m = paper_model(model)
    return dict(table.get(m.key, {})) if m else {}


def with_defaults(
    app: str, table: dict[str, dict[str, Any]], model: str | None, hint: str = "", **given: Any
) -> list[Any]:
    """The given arguments in order, each None filled from the paper model's defaults; an
    error naming every argument still missing (``hint`` says what it means)."""
    dflt = model_defaults(table, model)
    out = {k: dflt.get(k) if v is None else v for k, v in given.items()}
    missing = [k for k, v in out.items() if v is None]
    if missing:
        raise fail(
            app,
            "give "
            + " and ".join(f"{k}=" for k in missing)
            + (f" ({hint})" if hint else "")
            + f"; defaults exist only for {sorted(table)}",
        )
    return list(out.values())


def fail(app: str, msg: str) -> AppError:
    return AppError(f"{app}: {msg}")


def vector(app: str, what: str, value: Any, rank: tuple[int, ...] = (1,)) -> torch.Tensor:
    """A float32 CPU tensor of one of the given ranks (artifacts are stored in fp32)."""
    if value is None:
        raise fail(app, f"{what} is required")
    try:
        t = torch.as_tensor(value)
    except Exception:
        raise fail(app, f"{what} is not a tensor ({type(value).__name__})") from None
    if t.dtype == torch.bool or t.is_complex():
        raise fail(app, f"{what} has dtype {t.dtype}; expected a real tensor")
    if t.dim() not in rank:
        raise fail(
            app, f"{what} has shape {list(t.shape)}; expected rank {' or '.join(map(str, rank))}"
        )
    t = t.detach().to("cpu", torch.float32).contiguous()
    if not bool(torch.isfinite(t).all()):
        raise fail(app, f"{what} contains NaN or Inf")
    return t


def number(
    app: str, what: str, value: Any, *, lo: float | None = None, strict_lo: bool = False
) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise fail(app, f"{what} must be a finite number, got {value!r}")
    v = float(value)
    if lo is not None and (v < lo or (strict_lo and v == lo)):
        raise fail(app, f"{what} must be {'>' if strict_lo else '>='} {lo}, got {v}")
    return v


def layer(app: str, what: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise fail(app, f"{what} must be a non-negative layer index, got {value!r}")
    return int(value)


def layer_list(app: str, what: str, value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    try:
        out = list(value)
    except TypeError:
        raise fail(app, f"{what} must be a list or range of layer indices, got {value!r}") from None
    if not out:
        raise fail(app, f"{what} is empty")
    out = [layer(app, what, v) for v in out]
    if len(set(out)) != len(out):
        raise fail(app, f"{what} lists a layer twice: {out}")
    return out


def check(
    app: str,
    artifacts: dict[str, Any],
    dims: dict[str, int] | None = None,
    model: str | None = None,
) -> dict[str, int]:
    """Validate against the app's schema; with a paper model, also its hidden size."""
    dims = dict(dims or {})
    m = paper_model(model)
    if m and dims.get("d", m.hidden_size) != m.hidden_size:
        raise fail(
            app, f"the artifacts have hidden size {dims['d']} but {m.hf_id} has {m.hidden_size}"
        )
    try:
        return validate_artifacts(app, artifacts, dims)
    except ArtifactError as e:
        raise fail(app, str(e)) from None


def new_app(
    app: str,
    name: str | None,
    *,
    model: str | None,
    hidden_size: int | None,
    sites: list[str],
    layers: Any,
    params: dict[str, Any],
    derivation: str,
    extra: dict[str, Any] | None,
) -> App:
    """An App with the metadata every factory records (JSON-serialisable values only)."""
    schema = SCHEMAS[app]
    m = paper_model(model)
    meta: dict[str, Any] = {
        "xmix_app": app,
        "title": schema.title,
        "source": dict(schema.source),
        "model": m.hf_id if m else (str(model) if model else ""),
        "hidden_size": int(hidden_size)
        if hidden_size is not None
        else (m.hidden_size if m else None),
        "n_layers": m.n_layers if m else None,
        "sites": list(sites),
        "layers": layers,
        "params": params,
        "derivation": derivation,
    }
    if extra:
        meta.update(extra)
    return App(name or app, metadata=meta)
