"""Whether xmix is asked for on an engine: installing xmix changes nothing otherwise.

vLLM loads the ``vllm.general_plugins`` entry point in every process of every engine, also
for people who never use xmix. The plugin's class patches therefore do nothing on an engine
that did not ask for xmix: no hook sites, no control block, no compile-cache key, the same
tokens as with ``VLLM_PLUGINS=none``.

An engine asks for xmix through its config, which travels in ``vllm_config`` to every
process (engine core, workers, Ray workers on other nodes):

    additional_config={"xmix": True}             # vllm.LLM(..., additional_config=...)
    --additional-config '{"xmix": true}'         # vllm serve
    additional_config={"xmix": {...options}}     # the same, with options (docs/models.md)

``xmix.LLM`` and ``xmix serve`` set it. For plain ``vllm serve`` / ``vllm.LLM`` users the
environment variable ``XMIX_ENABLE=1`` is the alternative (it reaches only processes that
inherit the environment: not Ray workers on other nodes).

Precedence: ``XMIX_DISABLE=1`` turns xmix off whatever else says; otherwise an
``additional_config["xmix"]`` entry decides (``false`` turns it off even with
``XMIX_ENABLE=1``); otherwise ``XMIX_ENABLE=1``.
"""

from __future__ import annotations

from typing import Any

from xmix import settings

CONFIG_KEY = "xmix"
# The hook-site placement: part of the compile-cache key (see canonical()). Bump it when
# where sites sit in the traced graph changes. Spelled as every xmix format tag is
# (xmix.<what>/<version>); it was "xmix-sites-2" for the same placement, so an engine
# compiled before the respelling compiles once more.
SITES_VERSION = "xmix.sites/2"
OPTIONS = ("version", "sites", "layers")

_OFF = {"0", "false", "off", "no", ""}


def _truthy(value: Any) -> bool:
    if isinstance(value, dict):
        return True
    if isinstance(value, str):
        return value.strip().lower() not in _OFF
    return bool(value)


def config_value(vllm_config) -> Any:
    """The ``additional_config["xmix"]`` entry, or None when there is none."""
    extra = getattr(vllm_config, "additional_config", None)
    if isinstance(extra, dict):
        return extra.get(CONFIG_KEY)
    return None


def requested(vllm_config) -> bool:
    """True when the engine of ``vllm_config`` asked for xmix (see the module docstring)."""
    if settings.get("XMIX_DISABLE"):
        return False
    extra = getattr(vllm_config, "additional_config", None)
    if isinstance(extra, dict) and CONFIG_KEY in extra:
        return _truthy(extra[CONFIG_KEY])
    return bool(settings.get("XMIX_ENABLE"))


def options(value: Any) -> dict[str, Any]:
    """The options of an ``additional_config["xmix"]`` value (a dict), checked:

    ``sites``   the site kinds to place (default: every site of the family);
    ``layers``  the layers whose per-layer sites are placed (default: all).
    Apps that need a site not placed are refused at deploy. Fewer sites cost nothing where
    they are absent: at tensor_parallel_size >= 2 this keeps vLLM's all-reduce + RMSNorm
    fusion at the layers without sites (docs/models.md)."""
    from xmix.lang.sites import SITE_NAMES

    if not isinstance(value, dict):
        return {}
    unknown = sorted(set(value) - set(OPTIONS))
    if unknown:
        raise ValueError(
            f"xmix: unknown option(s) {unknown} in additional_config['xmix']; "
            f"known: {list(OPTIONS)}"
        )
    out = dict(value)
    if "sites" in out:
        sites = out["sites"]
        if not isinstance(sites, list) or not all(isinstance(x, str) for x in sites):
            raise ValueError(
                f"xmix: additional_config['xmix']['sites'] must be a list of site names, "
                f"got {sites!r}"
            )
        bad = sorted(set(sites) - set(SITE_NAMES))
        if bad:
            raise ValueError(
                f"xmix: unknown site(s) {bad} in additional_config['xmix']['sites']; "
                f"sites: {list(SITE_NAMES)}"
            )
    if "layers" in out:
        layers = out["layers"]
        if not isinstance(layers, list) or not all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in layers
        ):
            raise ValueError(
                f"xmix: additional_config['xmix']['layers'] must be a list of layer "
                f"indices, got {layers!r}"
            )
    return out


def canonical(value: Any) -> dict[str, Any]:
    """The entry an xmix engine runs with: the options plus the site placement version.
    vLLM reuses compiled graphs across starts keyed by its config hash (which includes
    additional_config) and checks only that the traced source files did not change, not
    which were traced; the version keeps an xmix engine from loading a graph compiled
    without hook sites (or with an older placement), and a plain engine from loading one
    compiled with them."""
    return {**options(value), "version": SITES_VERSION}


def with_xmix(additional_config: Any) -> dict[str, Any]:
    """``additional_config`` with xmix asked for (for xmix.LLM and xmix serve); options the
    caller gave are kept, an explicit ``False`` is refused."""
    extra = dict(additional_config or {})
    value = extra.get(CONFIG_KEY, True)
    if not _truthy(value):
        raise ValueError(
            "xmix: additional_config['xmix'] is false; xmix.LLM / xmix serve always "
            "enable xmix (use vllm.LLM / vllm serve for an engine without it)"
        )
    extra[CONFIG_KEY] = canonical(value)
    return extra
