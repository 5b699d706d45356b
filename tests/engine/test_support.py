"""Engine start: configurations xmix refuses (issue 20.6) and a plugin registration that touches
no CUDA (issue 20.2).

The refusals are checked on real VllmConfig objects (vLLM's EngineArgs, no engine), one
engine start is refused end to end, and register() runs in a fresh interpreter with xmix._C's
CUDA entry points and torch.cuda replaced by recorders.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from engine_util import make_llm
from xmix.integrations.vllm import support
from xmix.models.tiny import tiny_model_path

MODEL = str(tiny_model_path("tiny-llama"))


def config(**kw):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=MODEL, dtype="float32", max_model_len=512, **kw).create_engine_config()


@pytest.fixture(scope="module")
def plain():
    return config()


def test_plain_config_is_supported(plain):
    assert support.problems(plain) == []
    support.check(plain)


def _refused(cfg, words: str) -> str:
    with pytest.raises(support.UnsupportedConfig) as e:
        support.check(cfg)
    msg = str(e.value)
    assert msg.startswith("xmix cannot serve this engine configuration correctly")
    assert words in msg, msg
    assert len(support.problems(cfg)) == 1
    return msg


def test_speculative_decoding_refused():
    _refused(
        config(
            speculative_config={
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_max": 2,
                "prompt_lookup_min": 1,
            }
        ),
        "speculative decoding (ngram",
    )


def test_prompt_embeds_refused():
    _refused(config(enable_prompt_embeds=True), "prompt embeddings (--enable-prompt-embeds)")


def test_kv_connector_served():
    # Admission decides per request (tests/engine/test_kv_connector.py); the engine starts.
    assert (
        support.problems(
            config(kv_transfer_config={"kv_connector": "ExampleConnector", "kv_role": "kv_both"})
        )
        == []
    )


def test_several_api_servers_and_data_parallel_are_served():
    # as `vllm serve --api-server-count 2 --data-parallel-size 2` sets them
    # (entrypoints/cli/serve.py): the registry follows the engines' ledger (docs/serving.md,
    # Scale-out), so neither is refused any more
    assert support.problems(config(_api_process_count=2)) == []


def test_pipeline_with_tensor_parallel_refused(plain):
    import copy

    cfg = copy.deepcopy(plain)
    cfg.parallel_config.pipeline_parallel_size = 2
    assert support.problems(cfg) == []  # pipeline parallel alone is served (pp.py)
    cfg.parallel_config.tensor_parallel_size = 2
    _refused(cfg, "pipeline parallel (2 stages) together with tensor parallel (2 ranks)")


# vLLM's CPU platform turns dual-batch overlap off and validates context parallelism against the
# world size, so these two are set on a real config's ParallelConfig as a GPU engine has them.
def test_dual_batch_overlap_refused(plain):
    import copy

    cfg = copy.deepcopy(plain)
    cfg.parallel_config.enable_dbo = True
    _refused(cfg, "dual-batch overlap / micro-batching")
    cfg.parallel_config.enable_dbo = False
    cfg.parallel_config.ubatch_size = 2
    _refused(cfg, "dual-batch overlap / micro-batching")


def test_prefill_context_parallel_refused(plain):
    import copy

    cfg = copy.deepcopy(plain)
    cfg.parallel_config.prefill_context_parallel_size = 2
    _refused(cfg, "prefill context parallelism")


def test_all_problems_listed_at_once():
    cfg = config(
        enable_prompt_embeds=True,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 2,
            "prompt_lookup_max": 2,
            "prompt_lookup_min": 1,
        },
    )
    assert len(support.problems(cfg)) == 2


def test_engine_start_refused_with_the_reason(capfd):
    """A real engine start with prompt embeddings: the worker refuses where xmix attaches
    (load_model), the engine does not start, and the reason is in the engine's log."""
    with pytest.raises(RuntimeError, match="Engine core initialization failed"):  # vLLM's words
        make_llm(MODEL, inproc=False, enable_prompt_embeds=True)  # vLLM's engine-core process
    out = capfd.readouterr()
    text = out.out + out.err
    assert "xmix cannot serve this engine configuration correctly" in text
    assert "prompt embeddings (--enable-prompt-embeds)" in text


PROBE = textwrap.dedent("""
    import json, traceback
    import torch
    import xmix._C as C

    calls = []
    here = __import__("os").path.dirname(__import__("xmix").__file__)

    def by_xmix():
        # the immediate caller: vLLM's own imports probe torch.cuda too, which is not ours
        f = traceback.extract_stack(limit=3)[0]
        return f.filename.startswith(here)

    def recorder(name, value):
        def call(*a, **k):
            calls.append(name)
            return value
        return call

    # every entry point of xmix._C that reaches the CUDA runtime
    for n in dir(C):
        if (n.startswith("launch") or "cuda" in n) and n != "built_with_cuda":
            setattr(C, n, recorder("xmix._C." + n, True))

    def torch_recorder(name, value):
        def call(*a, **k):
            if by_xmix():
                calls.append("torch.cuda." + name)
            return value
        return call

    # pretend a GPU is there, so code that would go on to use it does
    for n, v in (("is_available", True), ("device_count", 1), ("init", None), ("_lazy_init", None),
                 ("current_device", 0), ("set_device", None), ("synchronize", None),
                 ("get_device_capability", (9, 0)), ("current_stream", None),
                 ("mem_get_info", (1, 1))):
        setattr(torch.cuda, n, torch_recorder(n, v))

    from xmix.integrations.vllm import plugin
    plugin.register()
    print("CALLS=" + json.dumps(calls))
""")


def test_register_touches_no_cuda():
    """Issue 20.2: register() runs in the process that forks vLLM's engine core; it must not
    initialise CUDA (the capture hook is installed by the worker's load_model instead)."""
    env = {k: v for k, v in os.environ.items() if k != "XMIX_DISABLE"}
    r = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("CALLS=")]
    assert line, r.stdout[-2000:] + r.stderr[-2000:]
    calls = json.loads(line[0][len("CALLS=") :])
    assert calls == [], f"register() reached CUDA: {calls}"
