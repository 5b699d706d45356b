"""The hook surface is numbered twice, in ``xmix.hooks`` (pure Python, so the API and lowering
import without the extension) and in ``csrc/include/xmix/control.h`` (the kernels). The C++
header is the source: ``_C.constants()`` exports its enum, and this test holds the Python
table to it, so a site added or reordered on one side only fails here, not as a write landing
on the wrong tensor."""

from __future__ import annotations

from xmix import _C, hooks

K = _C.constants()

CPP_KIND = {
    "residual.pre": "SITE_RESIDUAL_PRE",
    "attention.post": "SITE_ATTENTION_POST",
    "residual.mid": "SITE_RESIDUAL_MID",
    "router.logits": "SITE_ROUTER_LOGITS",
    "mlp.post": "SITE_MLP_POST",
    "residual.post": "SITE_RESIDUAL_POST",
}


def test_sites_per_layer_matches_control_h():
    assert hooks.SITES_PER_LAYER == K["SITES_PER_LAYER"] == 6


def test_every_layer_site_has_the_kernels_number():
    assert set(hooks.LAYER_SITES) == set(CPP_KIND)
    for name, kind in hooks.LAYER_SITES.items():
        assert kind == K[CPP_KIND[name]], name


def test_site_ids_follow_forward_order_and_final_post_closes_the_model():
    n_layers = 3
    ids = [hooks.site_id(n, layer, n_layers) for layer in range(n_layers) for n in hooks.LAYER_SITES]
    assert ids == list(range(n_layers * 6))
    assert hooks.site_id("final.post", None, n_layers) == n_layers * K["SITES_PER_LAYER"]
    assert hooks.n_sites(n_layers) == n_layers * 6 + 1
    assert hooks.site_name(2 * 6 + 3, n_layers) == "layers.2.router.logits"
