"""The main job: ``xmix serve`` on the embedded tiny Llama with three demo apps, then one
vanilla, one steered and one probed request over HTTP (flat ``vllm_xargs`` controls), a
monitor that stops one request beside one it lets run, the console's URL, and the server
stopped again; with ``--keep`` the server stays up so the console can be opened, until
``--stop``.

Demo apps (the tiny model has random weights, so the apps are built from its own weights to
have an effect one can read):
  steer_the   add a multiple of the unembedding row of one token to the residual stream
              leaving the last layer: generation is pushed towards that token.
  lens_probe  a logit-lens probe: sigmoid(w . x + b) on the final-norm output with w the same
              unembedding row, i.e. "how much does the model lean towards that token now".
  the_guard   a monitor on the same lens: the request stops at the first generated token where
              the lean reaches theta (App.stop); theta is set per request, between the lean of the
              vanilla and of the steered answer, so it stops the steered request only.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
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

    steer = xmix.App(
        "steer_the", metadata={"demo": f"push generation towards {tok.decode([tid])!r}"}
    )
    steer.write("add", vector=u, scale=12.0).layers([n_layers - 1]).at("residual.post")
    probe = xmix.App("lens_probe", metadata={"demo": f"logit lens towards {tok.decode([tid])!r}"})
    probe.read("probe", weight=u, bias=-2.0).at("final.post").named("lean")
    guard = xmix.App(
        "the_guard", metadata={"demo": f"stop once the lens leans towards {tok.decode([tid])!r}"}
    )
    guard.param("theta", 0.99)
    guard.read("probe", weight=u, bias=-2.0).at("final.post").named("lean")
    guard.stop(when="lean >= theta and generated")
    paths = [
        steer.save(out_dir / "steer_the.xmix"),
        probe.save(out_dir / "lens_probe.xmix"),
        guard.save(out_dir / "the_guard.xmix"),
    ]
    return paths, str(tok.decode([tid]))


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


STATE_DIR = Path(tempfile.gettempdir()) / "xmix-demo"  # a kept server's apps, log and pid


def stop_kept() -> int:
    """Stop the server a ``--keep`` run left up (its whole process group)."""
    pid_file = STATE_DIR / "server.pid"
    if not pid_file.is_file():
        print("[demo] no kept demo server (nothing in " + str(pid_file) + ")")
        return 0
    pgid = int(pid_file.read_text().split()[0])
    try:
        os.killpg(pgid, signal.SIGTERM)
        for _ in range(60):
            os.killpg(pgid, 0)
            time.sleep(1)
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    pid_file.unlink(missing_ok=True)
    print(f"[demo] kept demo server (process group {pgid}) stopped")
    return 0


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m xmix.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--port", type=int, default=8642)
    ap.add_argument("--prompt", default="Once upon a time")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument(
        "--keep",
        action="store_true",
        help="leave the server up afterwards (to open the console); stop it with --stop",
    )
    ap.add_argument("--stop", action="store_true", help="stop the server a --keep run left up")
    return ap


def _serve_command(
    model: Path, port: int, apps: list[Path], api_key: str, admin_key: str
) -> list[str]:
    # Loopback only: the demo's API key is printed in the open.
    cmd = [
        sys.executable,
        "-m",
        "xmix.cli",
        "serve",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--api-key",
        api_key,
        "--xmix-admin-key",
        admin_key,
        "--served-model-name",
        "tiny-llama",
    ]
    for p in apps:
        cmd += ["--app", str(p)]
    return cmd


def _stop_server(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    print("[demo] server stopped")


def _show_deployed(client: httpx.Client) -> None:
    deployed = client.get("/xmix/v1/apps").json()["apps"]
    print("[demo] deployed apps:")
    for a in deployed:
        print(
            f"         {a['name']:11s} mode={a['mode']:8s} sites={a['sites']}  ({a['metadata'].get('demo', '')})"
        )


def _completer(client: httpx.Client, prompt: str, max_tokens: int) -> Callable[..., dict]:
    """One greedy completion of the prompt with the apps named (flat ``vllm_xargs``)."""

    def complete(apps_used: list[str], **xargs: float) -> dict:
        body: dict[str, Any] = {
            "model": "tiny-llama",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        if apps_used:
            body["vllm_xargs"] = {"xmix_apps": apps_used, **xargs}
        r = client.post("/v1/completions", json=body)
        r.raise_for_status()
        return r.json()

    return complete


def _steer_and_probe(
    complete: Callable[..., dict], prompt: str, word: str
) -> tuple[dict, dict, dict[str, float]]:
    """Vanilla, steered, probed, steered and probed; returns the vanilla and the probed answer
    and the probe's peak lean over generated tokens fed back, without and with steering."""
    vanilla = complete([])
    steered = complete(["steer_the"])
    probed = complete(["lens_probe"])
    both = complete(["steer_the", "lens_probe"])
    print(f"\n[demo] prompt: {prompt!r}")
    print(f"[demo] vanilla : {vanilla['choices'][0]['text']!r}")
    print(
        f"[demo] steered : {steered['choices'][0]['text']!r}   (steer_the pushes towards {word!r})"
    )
    peak = {}
    for label, resp in (("probe, vanilla", probed), ("probe, steered", both)):
        lean = resp["xmix"]["lens_probe"]["lean"]
        gen = [
            v
            for p, v in zip(lean["positions"], lean["values"])
            if p >= resp["usage"]["prompt_tokens"] - 1
        ]
        mean = sum(gen) / max(len(gen), 1)
        fed = [
            v
            for p, v in zip(lean["positions"], lean["values"])
            if p >= resp["usage"]["prompt_tokens"]
        ]
        peak[label] = max(fed, default=0.0)  # over generated tokens fed back
        print(
            f"[demo] {label}: lean towards {word!r} per generated token = "
            f"{', '.join(f'{v:.2f}' for v in gen[:8])}{' ...' if len(gen) > 8 else ''}  (mean {mean:.3f})"
        )
    return vanilla, probed, peak


def _guard(complete: Callable[..., dict], peak: dict[str, float]) -> tuple[dict, dict]:
    """The monitor: a threshold the steered answer's lean crosses and the vanilla one's does
    not, so one request is stopped and the other runs to the end."""
    theta = (peak["probe, vanilla"] + peak["probe, steered"]) / 2
    guard = {"xmix.the_guard.theta": theta}
    let_run = complete(["the_guard"], **guard)
    stopped = complete(["steer_the", "the_guard"], **guard)
    print(f"\n[demo] the_guard (stop once the lean reaches {theta:.3f}):")
    for label, resp in (("vanilla", let_run), ("steered", stopped)):
        c = resp["choices"][0]
        stop = resp["xmix_applied"].get("stopped")
        why = (
            f"stopped at position {stop['position']} (lean {stop['value']:.3f})"
            if stop
            else f"not stopped ({c['finish_reason']}, {resp['usage']['completion_tokens']} tokens)"
        )
        print(f"[demo]   {label:8s}: {c['text']!r}   {why}")
    return let_run, stopped


def _check_answers(
    vanilla: dict, probed: dict, let_run: dict, stopped: dict, peak: dict[str, float]
) -> None:
    assert probed["choices"][0]["text"] == vanilla["choices"][0]["text"], (
        "a read-only app must not change the answer"
    )
    print("\n[demo] the probe-only answer equals the vanilla answer (reads never write).")
    if peak["probe, steered"] > peak["probe, vanilla"]:
        assert let_run["choices"][0]["text"] == vanilla["choices"][0]["text"]
        assert "stopped" not in let_run["xmix_applied"]
        assert stopped["choices"][0]["finish_reason"] == "stop"
        assert stopped["xmix_applied"]["stopped"]["app"] == "the_guard"
        print(
            "[demo] the guard let the vanilla answer run to its end and stopped the "
            "steered one at its trigger (finish_reason 'stop')."
        )


def _last_words(
    keep: bool, base: str, proc: subprocess.Popen, api_key: str, admin_key: str, log_path: Path
) -> None:
    """The console's URL and keys, and how the server ends (``--keep``: it stays up)."""
    print(
        f"\n[demo] console: {base}/xmix/ui/   (API key: {api_key}; admin key, to change apps: {admin_key})"
    )
    if keep:
        (STATE_DIR / "server.pid").write_text(f"{proc.pid}\n")
        print(f"[demo] the server keeps running (process group {proc.pid}, log {log_path}).")
        print(f"[demo] stop it with: scripts/demo.sh --stop   (or: kill -TERM -- -{proc.pid})")
    else:
        print("[demo] run scripts/demo.sh --keep to leave the server up and open the console.")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.stop:
        return stop_kept()

    model = tiny_model_path("tiny-llama")
    api_key = "xmix-demo-key"
    admin_key = "xmix-demo-admin-key"  # the control plane's own key (deploy, switch, undeploy)
    work: contextlib.AbstractContextManager[str]
    if args.keep:
        if (STATE_DIR / "server.pid").is_file():
            stop_kept()
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        work = contextlib.nullcontext(str(STATE_DIR))
    else:
        work = tempfile.TemporaryDirectory()
    with work as tmp:
        apps, word = demo_apps(model, Path(tmp))
        cmd = _serve_command(model, args.port, apps, api_key, admin_key)
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        log_path = Path(tmp) / "serve.log"
        log = open(log_path, "w")
        print(
            f"[demo] starting: xmix serve {model.name} --app steer_the.xmix "
            f"--app lens_probe.xmix --app the_guard.xmix"
        )
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        base = f"http://127.0.0.1:{args.port}"
        keep = False
        try:
            wait_ready(base, proc, args.timeout)
            headers = {"Authorization": f"Bearer {api_key}"}
            client = httpx.Client(base_url=base, headers=headers, timeout=120)
            _show_deployed(client)
            complete = _completer(client, args.prompt, args.max_tokens)
            vanilla, probed, peak = _steer_and_probe(complete, args.prompt, word)
            let_run, stopped = _guard(complete, peak)
            _check_answers(vanilla, probed, let_run, stopped, peak)
            _last_words(args.keep, base, proc, api_key, admin_key, log_path)
            keep = args.keep
            return 0
        finally:
            log.close()
            if not keep:
                _stop_server(proc)


if __name__ == "__main__":
    sys.exit(main())
