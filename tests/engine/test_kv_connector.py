"""xmix with a KV connector that ships with vLLM (``ExampleConnector``: a shared-storage
connector that saves each new prompt's KV to files and loads it for a later request with the
same prompt), against the same engine without a connector: tokens exact, reads 1e-4.
ExampleConnector saves a prompt's KV at the request's first step only, so the prompt must fit
in one step (``max_num_batched_tokens``): with chunked prefill it would save one chunk's slots
under the whole prompt's name and fail to load them.

Two engines, one after the other (connector on, then off), tiny Llama, few tokens. What is
checked (docs/serving.md, "KV connectors"):
- a vanilla request whose prompt KV the connector loaded gives the tokens of a fully computed
  prompt (the connector really loads: its files exist and vLLM reports the loaded tokens);
- a read app and a latch (prompt state) over that same stored prompt give the same tokens and
  reads as without the connector: admission keeps them off external KV;
- a writing app is refused with the reason on this token-keyed connector (switching it to mode
  "all" too), and a request whose
  prompt another instance computed (``do_remote_prefill``) is refused when its apps need the
  prompt; the engine keeps serving;
- read results never reach the connector's ``kv_transfer_params`` (a private key, stripped);
  no connector in vLLM's source uses that key.
"""

from __future__ import annotations

import pathlib

import pytest
import torch

import xmix
from engine_util import PROMPTS, make_llm, shutdown
from xmix.models.tiny import tiny_model_path

pytestmark = pytest.mark.engine

D = 256
MAX_TOKENS = 4
# long enough to cover a whole KV block whatever the CPU engine's block size (ExampleConnector
# stores only block-aligned prompt prefixes)
PROMPT = " ".join(PROMPTS[:8]) + " " + " ".join(PROMPTS[8:])


def _apps():
    g = torch.Generator().manual_seed(7)

    def unit():
        v = torch.randn(D, generator=g)
        return v / v.norm()

    cap = xmix.App("cap")
    cap.read("capture", dims=(0, 16)).layers([1]).at("residual.post").named("h")
    cap.read("probe", weight=unit() * 0.5, bias=0.1).layers([2]).at("residual.post").named("p")
    # a latch over the prompt (state the prompt's computation builds) gating a read
    latch = xmix.App("latch")
    latch.read("probe", weight=unit() * 0.5, bias=0.0).layers([0]).at("residual.post").named("q")
    latch.read("probe", weight=unit() * 0.5, bias=0.0).layers([3]).at("residual.post").named(
        "r"
    ).cond(gate="prompt_mean(q) >= -100.0")
    steer = xmix.App("steer")
    steer.write("add", vector=unit() * 6.0, scale=1.0).layers([1]).at("residual.post")
    return cap, latch, steer


def _gen(llm, control=None, kvp=None):
    from vllm import SamplingParams

    extra = {}
    if control is not None:
        extra["xmix"] = control
    if kvp is not None:
        extra["kv_transfer_params"] = kvp
    sp = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, extra_args=extra or None
    )
    return llm.generate([PROMPT], sp, use_tqdm=False)[0]


def _run(llm, connector: bool) -> dict:
    out: dict = {}
    first = _gen(llm)
    again = _gen(llm)  # with the connector: its prompt KV loaded from the files `first` wrote
    out["vanilla"] = list(first.outputs[0].token_ids)
    out["vanilla_again"] = list(again.outputs[0].token_ids)
    out["cached_again"] = again.num_cached_tokens
    out["kvp"] = again.kv_transfer_params
    for name in ("cap", "latch"):
        o = _gen(llm, {"apps": [name]})
        out[name] = (list(o.outputs[0].token_ids), xmix.results(o, as_tensors=True)[name])
        out[name + "_kvp"] = o.kv_transfer_params
    if connector:
        for control, kvp, words in (
            ({"apps": ["steer"]}, None, ["steer", "ExampleConnector", "cache salt"]),
            ({"apps": ["cap"]}, {"do_remote_prefill": True}, ["do_remote_prefill", "cap"]),
        ):
            with pytest.raises(ValueError) as e:
                _gen(llm, control, kvp)
            for w in words:
                assert w in str(e.value), (w, str(e.value))
        with pytest.raises(Exception, match="mode 'all'"):
            llm.xmix.set_mode("steer", "all")
        out["after_refusals"] = list(_gen(llm).outputs[0].token_ids)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    store = tmp_path_factory.mktemp("kv_store")
    path = str(tiny_model_path("tiny-llama"))
    cap, latch, steer = _apps()
    got = {}
    # no local prefix cache: every reuse of a prompt's KV goes through the connector
    for connector in (True, False):
        kw = dict(enable_prefix_caching=False, max_num_batched_tokens=512)
        if connector:
            kw["kv_transfer_config"] = {
                "kv_connector": "ExampleConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": str(store)},
            }
        llm = make_llm(path, **kw)
        try:
            for a in (cap, latch, steer):
                llm.xmix.deploy(a)
            got[connector] = _run(llm, connector)
        finally:
            shutdown(llm)
    got["files"] = sorted(p for p in pathlib.Path(store).rglob("*") if p.is_file())
    return got


def test_connector_loads_and_vanilla_tokens_match(runs):
    on, off = runs[True], runs[False]
    assert runs["files"], "the connector stored no KV"
    assert on["cached_again"] > 0, "the second request loaded no KV from the connector"
    assert off["cached_again"] == 0
    assert on["vanilla"] == on["vanilla_again"] == off["vanilla"] == on["after_refusals"]
    # the connector's dict as the connector made it: never a key of xmix's
    assert on["kvp"] is None or "_xmix_results" not in on["kvp"]


def _close(a, b, where: str) -> None:
    if isinstance(b, dict):
        assert isinstance(a, dict) and set(a) == set(b), where
        for k in b:
            _close(a[k], b[k], f"{where}.{k}")
    elif isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and a.shape == b.shape, where
        if b.is_floating_point():
            assert torch.allclose(a.float(), b.float(), rtol=1e-4, atol=1e-6), (
                where,
                (a - b).abs().max(),
            )
        else:
            assert torch.equal(a, b), where
    else:
        assert a == b, where


@pytest.mark.parametrize("app", ["cap", "latch"])
def test_reads_and_latches_match_without_connector(runs, app):
    (t_on, r_on), (t_off, r_off) = runs[True][app], runs[False][app]
    assert t_on == t_off
    assert r_off
    _close(r_on, r_off, app)
    assert runs[True][app + "_kvp"] is None or "_xmix_results" not in runs[True][app + "_kvp"]


def test_no_shipped_connector_uses_the_results_key():
    import vllm

    from xmix.integrations.vllm.result_keys import CARRIER

    root = pathlib.Path(vllm.__file__).parent
    hits = [
        p
        for d in ("distributed/kv_transfer", "v1/kv_offload", "distributed/ec_transfer")
        for p in (root / d).rglob("*.py")
        if CARRIER in p.read_text(errors="replace")
    ]
    assert not hits
