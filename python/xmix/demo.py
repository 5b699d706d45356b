"""The main job: ``xmix serve`` on the embedded tiny Llama with two demo apps, then one
vanilla, one steered and one probed request over HTTP, and the server stopped again.

Demo apps (the tiny model has random weights, so the apps are built from its own weights to
have an effect one can read):
  steer_the   add a multiple of the unembedding row of one token to the residual stream
              leaving the last layer: generation is pushed towards that token.
  lens_probe  a logit-lens probe: sigmoid(w . x + b) on the final-norm output with w the same
              unembedding row, i.e. "how much does the model lean towards that token now".
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from safetensors import safe_open

import xmix
from xmix.models.tiny import tiny_model_path


def demo_apps(model_dir: Path, out_dir: Path, word: str = " the") -> tuple[list[Path], str]:
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok.encode(word, add_special_tokens=False)
    tid = ids[-1]
    n_layers = AutoConfig.from_pretrained(model_dir).num_hidden_layers
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        w_u = f.get_tensor("lm_head.weight")[tid].float()
    u = w_u / w_u.norm()

    steer = xmix.App("steer_the", metadata={"demo": f"push generation towards {tok.decode([tid])!r}"})
    steer.write("add", vector=u, scale=12.0).layers([n_layers - 1]).submodule("residual.post")
    probe = xmix.App("lens_probe", metadata={"demo": f"logit lens towards {tok.decode([tid])!r}"})
    probe.read("probe", weight=u, bias=-2.0).submodule("final.post").named("lean")
    paths = [steer.save(out_dir / "steer_the.xmix"), probe.save(out_dir / "lens_probe.xmix")]
    return paths, tok.decode([tid])


def wait_ready(base: str, proc: subprocess.Popen, timeout: float) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"xmix serve exited with code {proc.returncode}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise TimeoutError(f"xmix serve did not become ready in {timeout:.0f} s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m xmix.demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, default=8642)
    ap.add_argument("--prompt", default="Once upon a time")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args(argv)

    model = tiny_model_path("tiny-llama")
    api_key = "xmix-demo-key"
    with tempfile.TemporaryDirectory() as tmp:
        apps, word = demo_apps(model, Path(tmp))
        cmd = [sys.executable, "-m", "xmix.cli", "serve", str(model), "--port", str(args.port),
               "--dtype", "float32", "--max-model-len", "512", "--api-key", api_key,
               "--served-model-name", "tiny-llama"]
        for p in apps:
            cmd += ["--app", str(p)]
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        log = open(Path(tmp) / "serve.log", "w")
        print(f"[demo] starting: xmix serve {model.name} --app steer_the.xmix --app lens_probe.xmix")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        base = f"http://127.0.0.1:{args.port}"
        try:
            wait_ready(base, proc, args.timeout)
            headers = {"Authorization": f"Bearer {api_key}"}
            client = httpx.Client(base_url=base, headers=headers, timeout=120)
            deployed = client.get("/xmix/v1/apps").json()["apps"]
            print("[demo] deployed apps:")
            for a in deployed:
                print(f"         {a['name']:11s} mode={a['mode']:8s} sites={a['sites']}  ({a['metadata'].get('demo', '')})")

            def complete(control: dict | None) -> dict:
                body = {"model": "tiny-llama", "prompt": args.prompt, "max_tokens": args.max_tokens,
                        "temperature": 0}
                if control is not None:
                    body["vllm_xargs"] = {"xmix": json.dumps(control)}
                r = client.post("/v1/completions", json=body)
                r.raise_for_status()
                return r.json()

            vanilla = complete(None)
            steered = complete({"apps": ["steer_the"]})
            probed = complete({"apps": ["lens_probe"]})
            both = complete({"apps": ["steer_the", "lens_probe"]})
            print(f"\n[demo] prompt: {args.prompt!r}")
            print(f"[demo] vanilla : {vanilla['choices'][0]['text']!r}")
            print(f"[demo] steered : {steered['choices'][0]['text']!r}   (steer_the pushes towards {word!r})")
            for label, resp in (("probe, vanilla", probed), ("probe, steered", both)):
                lean = resp["xmix"]["lens_probe"]["lean"]
                gen = [v for p, v in zip(lean["positions"], lean["values"])
                       if p >= resp["usage"]["prompt_tokens"] - 1]
                mean = sum(gen) / max(len(gen), 1)
                print(f"[demo] {label}: lean towards {word!r} per generated token = "
                      f"{', '.join(f'{v:.2f}' for v in gen[:8])}{' ...' if len(gen) > 8 else ''}  (mean {mean:.3f})")
            assert probed["choices"][0]["text"] == vanilla["choices"][0]["text"], \
                "a read-only app must not change the answer"
            print("\n[demo] the probe-only answer equals the vanilla answer (reads never write).")
            return 0
        finally:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=60)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(proc.pid, signal.SIGKILL)
            log.close()
            print("[demo] server stopped")


if __name__ == "__main__":
    sys.exit(main())
