"""Place hook sites in a loaded vLLM model, before torch.compile traces it.

Each site is one call of ``torch.ops.xmix.site(h, r, site_id)``, put in by replacing the
``forward`` of module instances named by the model family's site table
(``xmix.lang.architectures``): a Tap on a module's input runs the site before the module, on its
output after it. Dynamo traces through these forwards, so the compiled graph holds one
opaque in-place op per site and nothing else.

vLLM keeps the stream split as ``hidden + residual`` (the fused add-RMSNorm): a fused Tap
passes both halves, a read sees the sum and a write changes the sum by changing ``hidden``.
Layer 0 of vLLM's decoders gets ``residual=None``: the stream is ``hidden`` alone there.
"""

from __future__ import annotations

import logging
import types

import torch
from torch import nn

import xmix.runtime.ops  # noqa: F401  (registers torch.ops.xmix.site)
from xmix.lang.architectures import EngineMap, Family, Tap, engine_map, resolve
from xmix.lang.sites import LAYER_SITES, MODEL_SITES, ModelShape, site_id

logger = logging.getLogger("vllm.xmix")  # vLLM's handlers and format apply

_site = torch.ops.xmix.site


def _arg(args: tuple, kwargs: dict, where: tuple[int, str]):
    pos, name = where
    return args[pos] if len(args) > pos else kwargs.get(name)


def _wrap_input(module: nn.Module, sid: int, tap: Tap) -> None:
    orig = module.forward

    def forward(self, *args, **kwargs):
        h = _arg(args, kwargs, tap.arg)
        r = _arg(args, kwargs, tap.residual_arg) if tap.fused else None
        _site(h, r, sid)
        return orig(*args, **kwargs)

    module.forward = types.MethodType(forward, module)


def _wrap_output(module: nn.Module, sid: int, tap: Tap) -> None:
    orig = module.forward

    def forward(self, *args, **kwargs):
        out = orig(*args, **kwargs)
        if isinstance(out, tuple):
            _site(out[0], out[1] if tap.fused else None, sid)
        else:
            _site(out, None, sid)
        return out

    module.forward = types.MethodType(forward, module)


def _wrap(module: nn.Module, sid: int, tap: Tap) -> None:
    (_wrap_input if tap.io == "in" else _wrap_output)(module, sid, tap)


def _missing(obj) -> bool:
    return obj is None or type(obj).__name__ == "PPMissingLayer"


def _moe_layers(model: nn.Module, family: Family, n_layers: int) -> frozenset[int]:
    if not family.moe:
        return frozenset()
    config = getattr(model, "config", None)
    if config is None:
        return frozenset(range(n_layers))
    return frozenset(ModelShape.from_hf_config(config).moe_layers)


def place_sites(
    model: nn.Module,
    n_layers: int,
    family: Family,
    sites: list[str] | None = None,
    layers: list[int] | None = None,
) -> tuple[dict[str, int], frozenset[int]]:
    """Put the hook sites of ``family`` in (only the kinds in ``sites`` and, for per-layer
    sites, the ``layers`` given, when given); returns counts per site kind (for the log and
    tests) and the ids of the sites apps may use (placed here, or in a layer another pipeline
    stage owns). A module the table names but the model lacks stops the start: a site that is
    silently absent would make apps there silent no-ops."""
    placed = getattr(model, "_xmix_sites_placed", None)
    if placed is not None:
        return placed  # idempotent: the plugin may be loaded twice
    kinds = set(sites) if sites is not None else None
    at = set(layers) if layers is not None else None
    emap: EngineMap = engine_map(family, model)
    decoder = resolve(model, emap.layers)
    if decoder is None:
        raise RuntimeError(f"xmix: {type(model).__name__} ({family.title}) has no {emap.layers!r}")
    if len(decoder) != n_layers:
        raise RuntimeError(
            f"xmix: {type(model).__name__} has {len(decoder)} decoder layers at "
            f"{emap.layers!r}, the config says {n_layers}"
        )
    counts = {name: 0 for name in (*LAYER_SITES, *MODEL_SITES)}
    # A router exists only in MoE layers (Qwen3-MoE's mlp_only_layers, DeepSeek's first dense
    # layers): the config says which, and a MoE layer without the table's router module is
    # still an error. Lowering refuses router ops at other layers with the MoE layer list.
    moe = _moe_layers(model, family, n_layers)
    # Check every module first, then wrap: nothing half-placed.
    plan: list[tuple[nn.Module, int, Tap, str]] = []
    elsewhere: set[int] = set()  # sites of layers another pipeline stage owns
    for idx, layer in enumerate(decoder):
        if at is not None and idx not in at:
            continue
        for name, tap in emap.sites.items():
            if kinds is not None and name not in kinds:
                continue
            if name == "router.logits" and idx not in moe:
                continue
            if _missing(layer):
                elsewhere.add(site_id(name, idx, n_layers))
                continue
            mod = resolve(layer, tap.module)
            if mod is None:
                raise RuntimeError(
                    f"xmix: {family.title} site table: layer {idx} of "
                    f"{type(model).__name__} has no module {tap.module!r} "
                    f"(for {name}); the table does not fit this implementation"
                )
            plan.append((mod, site_id(name, idx, n_layers), tap, name))
    norm = resolve(model, emap.final_norm)
    if kinds is None or "final.post" in kinds:
        if _missing(norm):
            elsewhere.add(site_id("final.post", None, n_layers))
        else:
            plan.append((norm, site_id("final.post", None, n_layers), Tap("", "out"), "final.post"))
    for mod, sid, tap, name in plan:
        _wrap(mod, sid, tap)
        counts[name] += 1
    placed = (counts, frozenset(sid for _, sid, _, _ in plan) | elsewhere)
    setattr(model, "_xmix_sites_placed", placed)  # noqa: B010 (nn.Module types only tensors and submodules)
    logger.info("xmix: %s hook sites placed: %s", family.title, counts)
    return placed
