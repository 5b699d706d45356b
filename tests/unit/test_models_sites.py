"""The site table's meaning, family by family, on the transformers path (no engine).

Oracle: transformers' own ``output_hidden_states`` of an unhooked run (the stream entering
each layer, and the final norm's output) and the decomposition the MI convention promises
(docs/models.md): residual.mid = residual.pre + attention.post and residual.post =
residual.mid + mlp.post, i.e. attention.post / mlp.post are what each block adds to the
stream (after Gemma's and OLMo 2's post-block norms), checked with captures at every site.
"""

from __future__ import annotations

import pytest
import torch

from xmix.integrations.hf import attach
from xmix.lang.api import App
from xmix.lang.architectures import (
    FAMILIES,
    UnsupportedArchitecture,
    family_of,
    require_family,
    supported_architectures,
)
from xmix.lang.lowering import DeployError
from xmix.models.tiny import KINDS, tiny_model_path

transformers = pytest.importorskip("transformers")

TINY = {f.tiny: f for f in FAMILIES}
SITES = ("residual.pre", "attention.post", "residual.mid", "mlp.post", "residual.post")


def load(kind):
    path = tiny_model_path(kind)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    return model, tok


def test_every_tiny_model_has_a_family_and_every_family_a_tiny_model():
    assert sorted(TINY) == sorted(KINDS)
    for kind, fam in TINY.items():
        cfg = transformers.AutoConfig.from_pretrained(tiny_model_path(kind))
        assert family_of(cfg.architectures[0]) is fam


def test_unknown_architecture_is_refused_with_the_supported_list():
    with pytest.raises(UnsupportedArchitecture) as e:
        require_family("GPTNeoXForCausalLM")
    msg = str(e.value)
    assert "'GPTNeoXForCausalLM'" in msg
    for arch in supported_architectures():
        assert arch in msg
    assert isinstance(e.value, DeployError)


@pytest.mark.parametrize("kind", sorted(TINY))
def test_sites_mean_the_same_in_every_family(kind):
    model, tok = load(kind)
    ids = tok.encode("The old lighthouse keeper climbed the stairs every evening")
    with torch.no_grad():
        plain = model(torch.tensor([ids]), output_hidden_states=True)
    hs = [h[0] for h in plain.hidden_states]
    L = model.config.num_hidden_layers
    app = App("cap")
    for site in SITES:
        app.read("capture").layers("all").at(site).named(site.replace(".", "_"))
    app.read("capture").at("final.post").named("final")
    with attach(model, [app], tokenizer=tok) as att:
        logits, res = att.forward(ids, apps=["cap"])
    torch.testing.assert_close(
        logits, plain.logits[0, -1], rtol=1e-5, atol=1e-5
    )  # reads change nothing

    n = len(ids)
    vals = {
        site: torch.stack(
            [torch.tensor(res["cap"][f"{site.replace('.', '_')}.{l}"]["values"]) for l in range(L)]
        )
        for site in SITES
    }  # [L, n, d]
    assert vals["residual.pre"].shape == (L, n, model.config.hidden_size)
    final = torch.tensor(res["cap"]["final"]["values"])
    tol = dict(rtol=1e-4, atol=1e-4)
    for l in range(L):
        torch.testing.assert_close(
            vals["residual.pre"][l], hs[l], **tol, msg=f"{kind} residual.pre[{l}]"
        )
        torch.testing.assert_close(
            vals["residual.mid"][l],
            vals["residual.pre"][l] + vals["attention.post"][l],
            **tol,
            msg=f"{kind} layer {l}: mid != pre + attention.post",
        )
        torch.testing.assert_close(
            vals["residual.post"][l],
            vals["residual.mid"][l] + vals["mlp.post"][l],
            **tol,
            msg=f"{kind} layer {l}: post != mid + mlp.post",
        )
        if l + 1 < L:
            torch.testing.assert_close(vals["residual.post"][l], hs[l + 1], **tol)
    torch.testing.assert_close(final, hs[L], **tol, msg=f"{kind} final.post")
