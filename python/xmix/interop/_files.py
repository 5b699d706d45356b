"""What every importer shares: refusing code-bearing files, reading JSON, provenance."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl", ".pickle", ".ckpt", ".joblib")


class InteropError(ValueError):
    """A file that cannot be imported; the message names the file and what is wrong."""


def refuse_pickle(path: Path) -> None:
    """Importers read data only: pickled checkpoints can run code when loaded."""
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise InteropError(
            f"{path}: {path.suffix} files are Python pickles, which can run code when loaded; "
            f"xmix imports data only (safetensors, npz, GGUF, JSON). Convert it once where you "
            f"trust the file, e.g.\n"
            f'  python -c "import torch, safetensors.torch as s; '
            f"d = torch.load('{path.name}', weights_only=True); "
            f"s.save_file({{k: v.contiguous() for k, v in d.items()}}, '{path.stem}.safetensors')\"\n"
            f"then import the .safetensors file"
        )


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise InteropError(f"{path}: cannot read ({e.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise InteropError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise InteropError(f"{path}: expected a JSON object")
    return data


def read_safetensors(path: Path) -> dict:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    refuse_pickle(path)
    try:
        return load_file(str(path))
    except FileNotFoundError:
        raise InteropError(f"{path}: no such file") from None
    except (OSError, SafetensorError) as e:
        raise InteropError(f"{path}: not a readable safetensors file ({e})") from None


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def provenance(fmt: str, files: list[Path], **extra: Any) -> dict[str, Any]:
    """Where an artifact came from: the format, each file with its size and sha256, and the
    original names (hook point, layers) the importer mapped."""
    from xmix.version import __version__

    return {
        "imported": {
            "format": fmt,
            "files": [
                {"path": str(p), "bytes": p.stat().st_size, "sha256": sha256(p)} for p in files
            ],
            "xmix_version": __version__,
            **{k: v for k, v in extra.items() if v is not None},
        }
    }
