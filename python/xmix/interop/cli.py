"""``xmix import``: SAEs and control vectors from other tools into xmix files.

xmix import sae PATH -o sae.safetensors            an SAE artifact (xmix.SAE.load)
xmix import sae PATH -o app.xmix --top-k 16        an app reading the SAE's top-16 features
xmix import vector happy.gguf -o happy.xmix        an app adding the vector at each layer
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from xmix.interop._files import InteropError
from xmix.interop.saes import FORMATS, load_sae
from xmix.interop.vectors import VECTOR_FORMATS, load_vector_app
from xmix.lang.api import App, AppError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="xmix import",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="what", required=True)
    s = sub.add_parser("sae", help=f"an SAE ({', '.join(FORMATS)})")
    s.add_argument("path", help="SAE folder or file (cfg.json + safetensors, params.npz, ...)")
    s.add_argument(
        "-o",
        "--output",
        required=True,
        help="*.safetensors: the SAE artifact; *.xmix: an app with an sae read",
    )
    s.add_argument("--format", default="auto", choices=("auto",) + FORMATS)
    s.add_argument(
        "--hook", help="site override: layers.12.residual.post, blocks.12.hook_resid_post, ..."
    )
    s.add_argument(
        "--scaling-factor",
        type=float,
        help="fold a dataset normalisation constant s (input x * s) into the weights",
    )
    s.add_argument("--name", help="app name (with -o *.xmix); default: the output file's stem")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--top-k", type=int, help="app: read the K largest active features per token")
    g.add_argument("--features", help="app: read these features, e.g. 12,345")
    v = sub.add_parser("vector", help=f"a control vector ({', '.join(VECTOR_FORMATS)})")
    v.add_argument("path")
    v.add_argument("-o", "--output", required=True, help="the app file (*.xmix)")
    v.add_argument("--format", default="auto", choices=("auto",) + VECTOR_FORMATS)
    v.add_argument("--name", help="app name; default: the input file's stem")
    v.add_argument("--scale", type=float, default=1.0, help="strength (per request: params.scale)")
    v.add_argument(
        "--site",
        default="residual.post",
        help="site of each layer the vectors are added at (default residual.post, "
        "the block output that llama.cpp and repeng use)",
    )
    return p


def _app_name(args, out: Path) -> str:
    import re

    return args.name or re.sub(r"[^A-Za-z0-9_\-]", "_", out.stem)[:64] or "imported"


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    out = Path(args.output)
    try:
        if args.what == "sae":
            sae = load_sae(
                args.path, format=args.format, hook=args.hook, scaling_factor=args.scaling_factor
            )
            if out.suffix == ".xmix":
                app = App(_app_name(args, out), metadata={"imported": sae.metadata.get("imported")})
                if args.features:
                    feats = [int(f) for f in args.features.split(",") if f.strip()]
                    app.read("sae", sae=sae, features=feats).named("sae")
                else:
                    app.read("sae", sae=sae, top_k=args.top_k or 16).named("sae")
                app.save(out)
                print(f"wrote app {app.name!r} to {out}: {sae!r}, read 'sae' at {sae.hook}")
            else:
                if args.top_k or args.features:
                    raise InteropError("--top-k / --features make an app: give -o NAME.xmix")
                sae.save(out)
                print(f"wrote {sae!r} to {out}")
        else:
            app = load_vector_app(
                args.path, name=args.name, format=args.format, scale=args.scale, site=args.site
            )
            app.save(out)
            op = app.ops[0]
            print(
                f"wrote app {app.name!r} to {out}: add at layers {op.layer_spec} "
                f"({op.site}), scale {args.scale}"
            )
    except (InteropError, AppError, ValueError) as e:
        print(f"xmix import: {e}", file=sys.stderr)
        return 2
    return 0
