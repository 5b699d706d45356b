"""The host and the kernels share one ABI, csrc/include/xmix/control.h. Python takes every
number from it (``_C.constants()``, field offsets and struct sizes); what Python still declares
itself is the hook surface's names and the type of each struct field it packs. These tests
hold those to the header: a site renumbered, or a field added, moved or widened on one side,
fails here rather than as a write landing on the wrong tensor or a corrupted op."""

from __future__ import annotations

import numpy as np

from xmix import _C
from xmix.lang import sites
from xmix.runtime.control import layout

K = _C.constants()

# The forward order of a decoder layer's sites, as docs/apps.md teaches them.
FORWARD_ORDER = [
    "residual.pre",
    "attention.post",
    "residual.mid",
    "router.logits",
    "mlp.post",
    "residual.post",
]


def test_layer_sites_in_forward_order():
    assert list(sites.LAYER_SITES) == FORWARD_ORDER
    assert list(sites.LAYER_SITES.values()) == list(range(6)) and sites.SITES_PER_LAYER == 6


def test_site_ids_follow_forward_order_and_final_post_closes_the_model():
    n_layers = 3
    ids = [
        sites.site_id(n, layer, n_layers) for layer in range(n_layers) for n in sites.LAYER_SITES
    ]
    assert ids == list(range(n_layers * 6))
    assert sites.site_id("final.post", None, n_layers) == 18
    assert sites.n_sites(n_layers) == 19
    assert sites.site_name(2 * 6 + 3, n_layers) == "layers.2.router.logits"
    assert sites.site_name(18, n_layers) == "final.post"
    assert sites.site_of(7, n_layers) == (1, "attention.post")


def test_condition_flag_bits():
    # control.h TokenFlag: valid is bit 0, then prompt, generated, last token
    assert layout.FLAG_BITS == {"prompt": 1, "generated": 2, "last_token": 3}


def _natural_offsets(fields, sizes):
    """C's layout of the declared fields in order: each at the next multiple of its size."""
    off, out = 0, {}
    for name, fmt in fields:
        n = np.dtype(fmt).itemsize
        assert n == sizes[name], f"{name}: Python packs {n} bytes, control.h has {sizes[name]}"
        off = (off + n - 1) // n * n
        out[name] = off
        off += n
    return out, (off + 7) // 8 * 8


def _check(fields, offsets, sizes):
    names = [n for n, _ in fields]
    assert sorted(names) == sorted(sizes), "Python's declared fields differ from control.h's"
    natural, size = _natural_offsets(fields, sizes)
    assert natural == {n: offsets[n] for n in names}
    assert size == offsets["__size__"]


def test_control_block_layout():
    _check(layout.CONTROL_FIELDS, _C.control_layout(), _C.control_field_sizes())
    assert layout.CTRL_DTYPE.itemsize == _C.control_layout()["__size__"]


def test_op_desc_layout():
    _check(layout.OP_FIELDS, _C.op_layout(), _C.op_field_sizes())
    assert layout.OP_DTYPE.itemsize == layout.OP_SIZE == 10 * 4 + 6 * 8


def test_packed_header_reads_back_at_the_headers_offsets():
    """A header value written through the record type lands at control.h's offset, in the
    field's width (little-endian, as every supported host)."""
    buf = np.zeros(layout.CTRL_SIZE, dtype=np.uint8)
    rec = buf.view(layout.CTRL_DTYPE)
    rec["n_rows"][0] = 0x01020304
    rec["capture_size"][0] = -2
    off = _C.control_layout()
    assert buf[off["n_rows"] : off["n_rows"] + 4].tolist() == [4, 3, 2, 1]
    assert buf[off["capture_size"] : off["capture_size"] + 8].view(np.int64)[0] == -2


def test_sae_flags_decode_as_the_kernels_read_them():
    """lowering packs an SAE op's flags with _C's numbers; the kernels' accessors (control.h
    sae_arch, sae_norm, SAE_B_DEC_IN, SAE_FEATURES) must read back what was packed."""
    from types import SimpleNamespace

    from xmix.lang import catalog
    from xmix.lang.lowering.pack import sae_flags

    for arch, norm, b_dec_in, feats in (
        ("relu", "none", False, False),
        ("jumprelu", "constant_norm_rescale", True, False),
        ("topk", "layer_norm", False, True),
    ):
        sae = SimpleNamespace(
            architecture=arch, normalize_activations=norm, apply_b_dec_to_input=b_dec_in
        )
        f = sae_flags(sae, features_read=feats)
        assert f & K["SAE_ARCH_MASK"] == {"relu": 0, "jumprelu": 1, "topk": 2}[arch]
        assert (f >> K["SAE_NORM_SHIFT"]) & 0xF == {
            "none": 0,
            "constant_norm_rescale": 1,
            "layer_norm": 2,
        }[norm]
        assert bool(f & K["SAE_B_DEC_IN"]) is b_dec_in and bool(f & K["SAE_FEATURES"]) is feats
    # the bounds the app language checks are the kernels' own
    assert (catalog.MAX_TOP_K, catalog.MAX_SAE_FEATURES) == (128, 64)
    assert (K["SAE_MAX_TOP_K"], K["SAE_MAX_FEATURES"]) == (128, 64)
    assert abs(K["SAE_LN_EPS"] - 1e-5) < 1e-12  # SAELens's layer_norm epsilon (as float32)
