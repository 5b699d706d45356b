"""``xmix derive``: compute an app's artifacts from contrastive prompt sets on a serving engine.

    xmix derive refusal     --model M --positive harmful.txt --negative harmless.txt [--layer L]
    xmix derive cast        --model M --positive cond.txt --negative other.txt \\
                            --behavior-positive refuse.txt --behavior-negative comply.txt \\
                            --condition-layer C [C ...] --behavior-layers B [B ...]
    xmix derive truth_probe --model M --positive true.txt --negative false.txt [--layer L]
    xmix derive kl_then_steer --model M --positive bad.txt --negative benign.txt --layer L [L ...]
    xmix derive sake        --model M --positive source.txt --negative target.txt [--unrelated other.txt]
    xmix derive steer_moe   --model M --positive with.txt --negative without.txt
    xmix derive seal        --model M --traces traces.jsonl --layer L
    xmix derive harm_monitor --model M --positive harmful.txt --negative harmless.txt [--layer L]

Activations are collected with xmix's own ``capture`` reads on a vLLM engine (``xmix.LLM``):
every prompt is one request with ``max_tokens=1``, so the reads see exactly the prompt's
forward pass as the server computes it. ``collect.collect_activations`` is the reusable part (it also
takes an existing ``vllm.LLM``); each app's recipe is in ``derivers``; the math is
``xmix.apps.derive``; the result is an app file
(``App.save``) whose metadata records the model, hidden size, layers, method, prompt files and
counts. ``main(argv, llm=...)`` runs the verb in-process on an engine that is already up.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from xmix.apps import derive as D
from xmix.apps.collect import DeriveError, resolve_model
from xmix.apps.derivers import DERIVERS
from xmix.lang.api import App, AppError

DERIVABLE = (
    "refusal",
    "seal",
    "cast",
    "truth_probe",
    "sake",
    "kl_then_steer",
    "steer_moe",
    "harm_monitor",
)


# ---------------------------------------------------------------------------- command line
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="xmix derive",
        description="Compute an app's artifacts from contrastive prompt sets (one prompt per line), "
        "collecting activations with xmix capture reads on a vLLM engine, and write the "
        "app file. Docs: docs/apps.md.",
    )
    p.add_argument("app", choices=DERIVABLE)
    p.add_argument(
        "--model",
        required=True,
        help="model folder, Hugging Face id, or tiny-llama / tiny-qwen3 / tiny-mixtral",
    )
    p.add_argument(
        "--positive",
        help="prompts with the property (harmful, condition, true, source, ...); one per line",
    )
    p.add_argument("--negative", help="prompts without it (harmless, other, false, target, ...)")
    p.add_argument(
        "--layer",
        type=int,
        nargs="+",
        help="layer(s): refusal/truth_probe/seal one; kl_then_steer the steered layers",
    )
    p.add_argument("--out", help="app file to write (default: <app>.xmix)")
    p.add_argument("--name", help="app name (default: the app key)")
    p.add_argument(
        "--position",
        choices=("last", "mean"),
        default="last",
        help="refusal / truth_probe: the last prompt token or the prompt mean",
    )
    p.add_argument(
        "--chat",
        action="store_true",
        help="wrap each prompt in the model's chat template (generation prompt added)",
    )
    p.add_argument("--batch-size", type=int, default=16, help="prompts per engine call")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    g = p.add_argument_group("refusal")
    g.add_argument("--variant", choices=("ablate", "add"), default="ablate")
    g.add_argument(
        "--coeff", type=float, default=1.0, help="refusal add / seal / kl_then_steer coefficient"
    )
    g = p.add_argument_group("cast")
    g.add_argument(
        "--condition-layer",
        type=int,
        nargs="+",
        help="candidate condition layers; the best F1 wins",
    )
    g.add_argument("--behavior-layers", type=int, nargs="+")
    g.add_argument(
        "--behavior-positive",
        help="examples showing the behaviour (paired with --behavior-negative)",
    )
    g.add_argument("--behavior-negative")
    g.add_argument(
        "--method",
        default=None,
        help="cast: pairwise|diff|center (default pairwise); "
        "kl_then_steer: mean|pca (default mean)",
    )
    g.add_argument("--alpha", type=float, default=1.0)
    g.add_argument("--threshold-lo", type=float, default=0.0)
    g.add_argument("--threshold-hi", type=float, default=1.0)
    g.add_argument("--threshold-step", type=float, default=0.01)
    g = p.add_argument_group("truth_probe / kl_then_steer probes")
    g.add_argument("--C", type=float, default=1.0, help="inverse L2 strength (scikit-learn's C)")
    g.add_argument(
        "--tokens",
        choices=("generated", "all", "last_token"),
        default="generated",
        help="truth_probe: which tokens the served probe scores",
    )
    g = p.add_argument_group("kl_then_steer")
    g.add_argument("--probe-layer", type=int)
    g.add_argument("--probe-positive")
    g.add_argument("--probe-negative")
    g.add_argument("--scale", choices=("norm", "unit"), default="norm")
    g.add_argument(
        "--threshold",
        type=float,
        default=0.5,
        help="kl_then_steer's latch; harm_monitor: the probe score that switches steering on",
    )
    g.add_argument(
        "--stop-threshold",
        type=float,
        default=0.95,
        help="harm_monitor: the probe score that stops a request",
    )
    g.add_argument("--reduce", choices=("prompt_mean", "prompt_last"), default="prompt_mean")
    g = p.add_argument_group("sake")
    g.add_argument("--unrelated", help="out-of-scope prompts for the distance threshold")
    g.add_argument("--reg", type=float, default=1e-2)
    g.add_argument("--shrinkage", type=float, default=0.0)
    g.add_argument("--quantile", type=float, default=0.95)
    g = p.add_argument_group("steer_moe")
    g.add_argument("--n-activate", type=int, default=1)
    g.add_argument("--n-deactivate", type=int, default=1)
    g.add_argument("--per-layer", action="store_true")
    g.add_argument("--delta", type=float, default=0.01)
    g = p.add_argument_group("seal")
    g.add_argument("--traces", help='reasoning traces, JSON lines (a string or {"text": ...} each)')
    g = p.add_argument_group("engine")
    g.add_argument("--dtype", default="auto")
    g.add_argument("--max-model-len", type=int, default=2048)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--tensor-parallel-size", type=int, default=1)
    g.add_argument("--gpu-memory-utilization", type=float, default=None)
    g.add_argument("--enforce-eager", action="store_true")
    g.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other vllm.LLM argument (VALUE parsed as JSON when it can be)",
    )
    return p


def _check_args(args, parser) -> None:
    if args.app == "seal":
        if not args.traces:
            parser.error("seal needs --traces FILE")
    elif not (args.positive and args.negative):
        parser.error(f"{args.app} needs --positive FILE and --negative FILE")
    if args.method is None:
        args.method = "mean" if args.app == "kl_then_steer" else "pairwise"
    valid = ("mean", "pca") if args.app == "kl_then_steer" else D.PCA_METHODS
    if args.app in ("cast", "kl_then_steer") and args.method not in valid:
        parser.error(f"--method for {args.app} must be one of {valid}")
    if args.batch_size < 1:
        parser.error("--batch-size must be >= 1")


def engine_kwargs(args) -> dict:
    kw: dict[str, Any] = {
        "dtype": args.dtype,
        "max_model_len": args.max_model_len,
        "seed": args.seed,
        "tensor_parallel_size": args.tensor_parallel_size,
    }
    if args.gpu_memory_utilization is not None:
        kw["gpu_memory_utilization"] = args.gpu_memory_utilization
    if args.enforce_eager:
        kw["enforce_eager"] = True
    for item in args.engine_arg:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise DeriveError(f"--engine-arg expects KEY=VALUE, got {item!r}")
        try:
            kw[k.replace("-", "_")] = json.loads(v)
        except json.JSONDecodeError:
            kw[k.replace("-", "_")] = v
    return kw


def run(args, llm=None) -> tuple[App, Path]:
    """Derive the app of ``args`` (from ``build_parser``) on ``llm`` (started when None) and save it."""
    args.model_path = resolve_model(args.model)
    own = llm is None
    if own:
        import xmix

        llm = xmix.LLM(model=args.model_path, **engine_kwargs(args))
    else:
        served = str(llm.llm_engine.model_config.model)
        same = (
            os.path.realpath(served) == os.path.realpath(args.model_path)
            if os.path.exists(served) and os.path.exists(args.model_path)
            else served == args.model_path
        )
        if not same:
            # The artifacts would fit the served model, but the metadata would name another.
            raise DeriveError(
                f"--model {args.model} is {args.model_path}, but the engine serves {served}"
            )
    try:
        app = DERIVERS[args.app](args, llm)
    finally:
        if own:
            _shutdown(llm)
    out = Path(args.out or f"{app.name}.xmix")
    app.save(out)
    return app, out


def _shutdown(llm) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # the process exits next; a failed shutdown must not hide the result
        pass


def _summary(app: App, out: Path) -> str:
    m = app.metadata
    keep = ("xmix_app", "model", "hidden_size", "n_layers", "layers", "method", "counts", "params")
    return f"wrote {out}\n" + json.dumps({k: m.get(k) for k in keep}, indent=2, default=str)


def main(argv: list[str] | None = None, llm=None) -> int:
    """``xmix derive ...``; ``llm``: an engine already running the same model (tests, notebooks)."""
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    _check_args(args, parser)
    try:
        app, out = run(args, llm)
    except (DeriveError, AppError) as e:
        print(f"xmix derive {args.app}: {e}", file=sys.stderr)
        return 2
    print(_summary(app, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
