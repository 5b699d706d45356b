"""Installing xmix changes nothing for an engine that did not ask for it.

- Unit: who asks (``additional_config["xmix"]``, ``XMIX_ENABLE``, ``XMIX_DISABLE`` and their
  precedence), ``xmix serve``'s merge of the operator's ``--additional-config``, and the worker
  gate (not asked: vLLM's load_model alone; asked on a family without a site table: refused
  before the weights load).
- Engines (each in a fresh interpreter, as a user would start them): a plain ``vllm.LLM`` on
  OLMo 2 with the plugin installed but not asked for equals ``VLLM_PLUGINS=none`` (tokens,
  compile-cache key, no module forward replaced, no xmix state in the worker); OLMo 2 is the
  family whose start the plugin used to break ("missing required positional argument:
  hidden_states"). An architecture without a site table (vLLM runs InternLM3 with its Llama
  code) is refused, naming it and listing the supported ones, when xmix is asked for: by
  ``xmix.LLM`` before any engine starts, and by the workers of a plain ``vllm.LLM`` that asks
  through its config (not asked, the worker gate leaves any family to vLLM: unit test).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from xmix.integrations.vllm import enable
from xmix.lang.architectures import UnsupportedArchitecture, supported_architectures
from xmix.models.tiny import tiny_model_path

UNSUPPORTED = "InternLM3ForCausalLM"


def cfg(extra):
    return SimpleNamespace(additional_config=extra)


@pytest.mark.parametrize(
    "extra, env, want",
    [
        ({}, {}, False),
        ({}, {"XMIX_ENABLE": "1"}, True),
        ({"xmix": True}, {}, True),
        ({"xmix": {"version": "x"}}, {}, True),
        ({"xmix": False}, {"XMIX_ENABLE": "1"}, False),  # the config entry wins over the variable
        ({"xmix": "false"}, {}, False),
        ({"xmix": True}, {"XMIX_DISABLE": "1"}, False),  # XMIX_DISABLE wins over everything
        ({"other": 1}, {}, False),
    ],
)
def test_who_asks_for_xmix(monkeypatch, extra, env, want):
    for k in ("XMIX_ENABLE", "XMIX_DISABLE"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert enable.requested(cfg(extra)) is want


def test_xmix_entry_point_options():
    assert enable.with_xmix(None) == {"xmix": {"version": enable.SITES_VERSION}}
    assert enable.with_xmix({"other": 2, "xmix": True}) == {
        "other": 2,
        "xmix": {"version": enable.SITES_VERSION},
    }
    with pytest.raises(ValueError, match="false"):
        enable.with_xmix({"xmix": False})
    with pytest.raises(ValueError, match="unknown option"):
        enable.with_xmix({"xmix": {"colour": "red"}})


def test_xmix_serve_merges_the_operators_additional_config():
    from xmix.integrations.vllm.http.serve_cli import _ask_for_xmix

    want = {"xmix": {"version": enable.SITES_VERSION}}
    out = _ask_for_xmix(["m", "--port", "1"])
    assert (
        out[:3] == ["m", "--port", "1"]
        and json.loads(out[out.index("--additional-config") + 1]) == want
    )
    for form in (["--additional-config", '{"a": 1}'], ['--additional-config={"a": 1}']):
        out = _ask_for_xmix(["m", *form, "--port", "1"])
        assert out.count("--additional-config") == 1 and "--port" in out
        assert json.loads(out[out.index("--additional-config") + 1]) == {"a": 1, **want}
    with pytest.raises(ValueError, match="JSON"):
        _ask_for_xmix(["m", "--additional-config", "{nope"])
    with pytest.raises(ValueError, match="false"):
        _ask_for_xmix(["m", "--additional-config", '{"xmix": false}'])


def test_worker_gate(monkeypatch):
    """Stand-in runner: vLLM's load_model is all that runs when xmix is not asked for; asked
    for on a family without a site table, the start stops before the weights load."""
    from xmix.integrations.vllm.worker import worker

    monkeypatch.delenv("XMIX_ENABLE", raising=False)
    monkeypatch.delenv("XMIX_DISABLE", raising=False)
    calls = []

    class Runner:
        __xmix_stands_for__ = "vllm.v1.worker.cpu_model_runner:CPUModelRunner"

        def __init__(self, extra, arch):
            hf = SimpleNamespace(architectures=[arch])
            self.vllm_config = SimpleNamespace(
                additional_config=extra, model_config=SimpleNamespace(hf_config=hf, model="m")
            )

        def load_model(self):
            calls.append(self)
            return "loaded"

    worker.patch_load_model(Runner)
    plain = Runner({}, "LlamaForCausalLM")
    assert plain.load_model() == "loaded" and calls == [plain]
    assert not hasattr(plain, "_xmix") and plain.vllm_config.additional_config == {}
    # a family without a site table, not asked for: vLLM's load_model alone, as for any other
    other = Runner({}, UNSUPPORTED)
    assert other.load_model() == "loaded" and calls == [plain, other]
    assert not hasattr(other, "_xmix")
    asked = Runner({"xmix": True}, UNSUPPORTED)
    with pytest.raises(UnsupportedArchitecture, match=UNSUPPORTED):
        asked.load_model()
    assert calls == [plain, other]


def test_xmix_llm_refuses_an_unsupported_family_before_starting_an_engine(tmp_path):
    import xmix

    model = _renamed_llama(tmp_path)
    with pytest.raises(xmix.DeployError) as e:
        xmix.LLM(model=model, dtype="float32")
    assert UNSUPPORTED in str(e.value)
    assert all(a in str(e.value) for a in supported_architectures())


def _renamed_llama(tmp_path) -> str:
    """tiny-llama's files, declared as InternLM3 (vLLM serves that with its Llama code)."""
    dst = tmp_path / "tiny-internlm3"
    if not dst.exists():
        shutil.copytree(tiny_model_path("tiny-llama"), dst)
        cfg_path = dst / "config.json"
        c = json.loads(cfg_path.read_text())
        c["architectures"] = [UNSUPPORTED]
        cfg_path.write_text(json.dumps(c, indent=2))
    return str(dst)


# ---------------------------------------------------------------------------- engines
SCRIPT = textwrap.dedent("""
    import json, os, sys
    if __name__ == "__main__":
        import vllm
        from vllm import SamplingParams
        mode, model = sys.argv[1], sys.argv[2]
        kw = dict(dtype="float32", max_model_len=512, seed=0, gpu_memory_utilization=0.3,
                  max_num_batched_tokens=64, max_num_seqs=8)
        if mode == "asked":
            kw["additional_config"] = {"xmix": True}
        if os.environ.get("PROBE_EAGER") == "1":
            kw["enforce_eager"] = True
        try:
            llm = vllm.LLM(model=model, **kw)
        except Exception as e:
            print("XMIX-RESULT " + json.dumps({"error": repr(e)}), flush=True)
            sys.exit(0)

        def probe(worker):
            runner = worker.model_runner
            return {"replaced": sorted(n for n, m in runner.model.named_modules() if "forward" in m.__dict__),
                    "runner_xmix": hasattr(runner, "_xmix"),
                    "sites": hasattr(runner.model, "_xmix_sites_placed"),
                    "additional_config": dict(worker.vllm_config.additional_config)}

        prompts = json.loads(sys.argv[3])
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
        res = {"tokens": [list(o.outputs[0].token_ids) for o in outs], "probe": llm.collective_rpc(probe),
               "has_xmix_attr": any(hasattr(o, "xmix") for o in outs)}
        print("XMIX-RESULT " + json.dumps(res), flush=True)
""")


def _run(
    tmp_path, mode: str, model: str, prompts, env_extra: dict, cache_name: str | None = None
) -> tuple[dict, list[str], str]:
    script = tmp_path / "engine_probe.py"
    script.write_text(SCRIPT)
    cache = tmp_path / (cache_name or f"cache-{mode}-{os.path.basename(model)}")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("XMIX_ENABLE", "XMIX_DISABLE", "VLLM_PLUGINS")
    }
    env.update(
        {
            "VLLM_CACHE_ROOT": str(cache),
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
            **env_extra,
        }
    )
    r = subprocess.run(
        [sys.executable, str(script), mode, model, json.dumps(prompts)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    out = r.stdout + r.stderr
    lines = [l for l in r.stdout.splitlines() if l.startswith("XMIX-RESULT ")]
    assert r.returncode == 0 and lines, out[-4000:]
    compiled = cache / "torch_compile_cache"
    keys = sorted(p.name for p in compiled.iterdir()) if compiled.is_dir() else []
    return json.loads(lines[-1].split(" ", 1)[1]), keys, out


@pytest.mark.engine
def test_plain_vllm_with_xmix_installed_is_vanilla(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    olmo = str(tiny_model_path("tiny-olmo2"))
    tok = AutoTokenizer.from_pretrained(olmo)
    prompts = [tok.encode(p) for p in ("The river ran past", "She opened the letter and read")]
    # One compile cache for both: vanilla's run fills it; had the installed plugin changed the
    # graph or the config vLLM hashes, the second run would add a key beside vanilla's (and
    # pay a compile; it reuses vanilla's artifacts instead, ~60 s less). Each engine runs in its
    # script's process (VLLM_ENABLE_V1_MULTIPROCESSING=0, a vLLM setting): vLLM loads the
    # entry-point plugins there as in its spawned engine and worker processes, and four process
    # starts fewer cost ~2 min less here.
    inproc = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    vanilla, van_keys, _ = _run(
        tmp_path, "vanilla", olmo, prompts, {"VLLM_PLUGINS": "none", **inproc}, "cache-olmo2"
    )
    installed, inst_keys, log = _run(tmp_path, "installed", olmo, prompts, inproc, "cache-olmo2")
    for said in ("hook sites placed", "control block ready", "attached to"):
        assert said not in log, said
    assert installed["tokens"] == vanilla["tokens"]
    assert installed["probe"] == vanilla["probe"]
    (p,) = installed["probe"]
    assert not p["runner_xmix"] and not p["sites"] and "xmix" not in p["additional_config"]
    assert not installed["has_xmix_attr"]
    assert van_keys and inst_keys == van_keys, (
        "the compile-cache key differs from VLLM_PLUGINS=none"
    )
    # and both are transformers' greedy tokens of the same model
    model = AutoModelForCausalLM.from_pretrained(olmo, dtype=torch.float32).eval()
    for ids, toks in zip(prompts, vanilla["tokens"]):
        with torch.no_grad():
            want = model.generate(
                torch.tensor([ids]), do_sample=False, max_new_tokens=12, eos_token_id=None
            )
        assert toks == want[0, len(ids) :].tolist()


@pytest.mark.engine
def test_family_without_a_site_table(tmp_path):
    # Only the start that asks for xmix runs here. That the same family runs vanilla when
    # nobody asks is the worker gate's first branch (test_worker_gate: not asked -> vLLM's
    # load_model alone, whatever the family), shown end to end on OLMo 2 above; an engine of
    # its own for it cost ~80 s of the suite's budget. The engine core and its worker run in
    # the script's own process (vLLM's VLLM_ENABLE_V1_MULTIPROCESSING=0): the refusal is the
    # worker's load_model either way, and two process starts cost ~60 s here.
    model = _renamed_llama(tmp_path)
    prompts = [[0, 17, 42, 99, 7]]
    asked, _, log = _run(tmp_path, "asked", model, prompts, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert "error" in asked, (
        "an engine that asks for xmix on a family without a table must not start"
    )
    refusal = [l for l in log.splitlines() if "has no site table" in l]
    assert refusal, log[-3000:]
    assert UNSUPPORTED in refusal[0] and all(a in refusal[0] for a in supported_architectures())
