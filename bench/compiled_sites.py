"""What the hook sites change in the compiled forward of the CPU engine (issue 29).

An xmix server with no app running still differs from vanilla vLLM in its compiled forward:
each hook site is an opaque in-place op (`torch.ops.xmix.site`) that Inductor cannot fuse
across, so it may split fused kernels, materialise the residual stream where vanilla
recomputes it inside the next norm, or add copies. This script compiles the benchmark model
three times, each in a fresh process with fresh Inductor and vLLM caches (vanilla with
plugins off; xmix with `{"xmix": {"sites": []}}`, no site placed; xmix with every site),
reads Inductor's output code (TORCH_LOGS=output_code), and counts what the generated
`call` runs per forward: fused C++ kernels, `xmix.site` calls, every other op (oneDNN
matmuls, vLLM's attention), and copies. The counts are exact and repeatable, unlike seconds
on a shared 2-core machine; a call's price is measured elsewhere (`bench/site_cpu.py`,
`bench/step_host.py --instructions`).

    python bench/compiled_sites.py [--model llama-8x512] [--results FILE.md]

Takes ~1.5 min per configuration here (three cold compiles). A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import subprocess
import sys
import tempfile
import textwrap
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_overhead import bench_model, code_rev  # noqa: E402

CONFIGS = ("vanilla", "nosites", "xmix")

SCRIPT = textwrap.dedent("""
    import sys
    if __name__ == "__main__":
        config, model = sys.argv[1], sys.argv[2]
        from vllm import SamplingParams
        kw = dict(model=model, dtype="float32", max_model_len=512, seed=0)
        if config == "vanilla":
            import vllm
            llm = vllm.LLM(**kw)
        else:
            import xmix
            if config == "nosites":
                kw["additional_config"] = {"xmix": {"sites": []}}
            llm = xmix.LLM(**kw)
        out = llm.generate([{"prompt_token_ids": [1, 5, 9]}], SamplingParams(max_tokens=2),
                           use_tqdm=False)
        print("TOKENS", list(out[0].outputs[0].token_ids))
""")


def output_code(config: str, model: Path, work: Path) -> tuple[str, str]:
    """Inductor's output code of one fresh compile, and the greedy tokens it produced."""
    script = work / "compile_once.py"
    script.write_text(SCRIPT)
    env = {
        **os.environ,
        "TORCH_LOGS": "output_code",
        "TORCHINDUCTOR_CACHE_DIR": str(work / f"inductor-{config}"),
        "VLLM_CACHE_ROOT": str(work / f"vllm-{config}"),
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }
    if config == "vanilla":
        env["VLLM_PLUGINS"] = "none"
    else:
        env.pop("VLLM_PLUGINS", None)
    r = subprocess.run(
        [sys.executable, str(script), config, str(model)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    text = r.stdout + r.stderr
    if r.returncode != 0:
        raise RuntimeError(f"{config}: the compile run failed:\n{text[-3000:]}")
    tokens = next((l for l in text.splitlines() if l.startswith("TOKENS")), "")
    code = "\n".join(
        l.split("[__output_code]", 1)[1] for l in text.splitlines() if "[__output_code]" in l
    )
    if "def call(" not in code:
        raise RuntimeError(f"{config}: no Inductor output code was logged")
    return code, tokens


def call_sequence(code: str) -> list[str]:
    """What the first compiled `call` runs, in order: `kernel:NAME` for a fused C++ kernel
    (its numeric suffix dropped), `NAMESPACE.OP` for an op through the dispatcher,
    `extern:NAME` for Inductor's extern kernels, `copy` for a copy into a buffer."""
    body = code.split("def call(", 1)[1]
    body = re.split(r"\n(?:def |class )", body, maxsplit=1)[0]
    seq = []
    for line in body.splitlines():
        s = line.strip()
        if m := re.match(r"(cpp_fused\w*?)(?:_\d+)?\(", s):
            seq.append("kernel:" + m.group(1))
        elif m := re.match(r"(?:\w+ = )?torch\.ops\.(\w+)\.(\w+)(?:\.\w+)?\(", s):
            seq.append(f"{m.group(1)}.{m.group(2)}")
        elif m := re.match(r"(?:\w+ = )?extern_kernels\.(\w+)\(", s):
            seq.append("extern:" + m.group(1))
        elif ".copy_(" in s or "aten.copy" in s or "clone(" in s:
            seq.append("copy")
    return seq


def counts(seq: list[str]) -> dict[str, int]:
    c = Counter("kernel" if s.startswith("kernel:") else s for s in seq)
    return {
        "fused kernels": c["kernel"],
        "xmix.site calls": c["xmix.site"],
        "copies": c["copy"],
        "other ops": sum(v for k, v in c.items() if k not in ("kernel", "xmix.site", "copy")),
        "calls in all": len(seq),
    }


def table(rows: dict[str, dict[str, int]]) -> str:
    cols = list(next(iter(rows.values())))
    out = ["| configuration | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    out += [f"| {k} | " + " | ".join(str(v[c]) for c in cols) + " |" for k, v in rows.items()]
    return "\n".join(out)


def kernel_diff(a: list[str], b: list[str]) -> list[str]:
    """The fused kernels of b that a lacks, and those of a that b lacks (multisets)."""
    ka = Counter(s for s in a if s.startswith("kernel:"))
    kb = Counter(s for s in b if s.startswith("kernel:"))
    return [f"+{k[7:]} x{v}" for k, v in (kb - ka).items()] + [
        f"-{k[7:]} x{v}" for k, v in (ka - kb).items()
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-8x512")
    ap.add_argument("--results", type=Path)
    args = ap.parse_args()
    model = bench_model(args.model)
    seqs, tokens = {}, {}
    with tempfile.TemporaryDirectory(prefix="xmix-compiled-sites-") as tmp:
        for config in CONFIGS:
            code, tokens[config] = output_code(config, model, Path(tmp))
            seqs[config] = call_sequence(code)
            print(f"{config}: {len(seqs[config])} calls, {tokens[config]}", flush=True)
    rows = {c: counts(s) for c, s in seqs.items()}
    rev = code_rev()
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"# Compiled forward per configuration ({args.model}, {when}, {platform.node()}, "
        f"{os.cpu_count()} cores)",
        "",
        "`python bench/compiled_sites.py " + " ".join(sys.argv[1:]) + "`, code " + rev,
        "",
        table(rows),
        "",
        "Fused kernels xmix has and vanilla has not (+), and the reverse (-): "
        + (", ".join(kernel_diff(seqs["vanilla"], seqs["xmix"])) or "none"),
        "",
        "Fused kernels xmix without sites has and vanilla has not (+), and the reverse (-): "
        + (", ".join(kernel_diff(seqs["vanilla"], seqs["nosites"])) or "none"),
        "",
        "Greedy tokens of the compile run: "
        + "; ".join(f"{c} {t.removeprefix('TOKENS ')}" for c, t in tokens.items()),
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.results:
        args.results.write_text(text)


if __name__ == "__main__":
    main()
