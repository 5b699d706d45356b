"""``xmix capture``: a prompt set through the engine with capture reads, into sharded
safetensors files (or straight into a trainer as tensors).

Each prompt is one request with ``max_tokens=1`` (its prompt positions are read; the sampled
token is never fed back), one unconditional ``capture`` read per site, the window of positions
and the dtype given, and results as arrays from the worker to here. Prompts are cut into shards
ahead of the engine, from their token counts alone, so that a shard holds at most ``shard_mb``
of activations (at least one prompt): the cut is the same on every run, which is what makes a
run resumable shard by shard, and memory is one shard's activations whatever the dataset size.
A shard is written to a temporary name and renamed, then the index is rewritten (also by
rename); a run that was killed redoes only the shard it was in.

Files in ``out``:
    shard-00000.safetensors   acts.<site> [N, width] (dtype), token_ids int32 [N],
                              positions int32 [N], request_index int64 [N] (prompt number in
                              the dataset); metadata: the shard's prompt range and request ids
    index.json                format, model, sites, widths, dtype, positions, the shards
                              (file, prompt range, tokens, sha256 of the prompts' token ids),
                              prompts skipped (too long for the engine), complete
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from xmix import settings
from xmix.lang.results_codec import DTYPES, Window, _window, positions_from_text, to_tensor

# One scheme for every format tag xmix writes: xmix.<what>/<version> (xmix.app/1,
# xmix.program/1). Captures written before it say "xmix-capture-1": the same format.
FORMAT = "xmix.capture/1"
FORMER_TAGS = ("xmix-capture-1",)
APP_NAME = "xmix_capture"
_SITE = re.compile(r"^(?:layers\.(\d+|\*)\.)?([a-z_]+\.[a-z_]+)$")


class CaptureError(ValueError):
    """A capture that cannot run as asked; the message says why."""


@dataclass(frozen=True)
class Site:
    spec: str  # "layers.10.residual.post", "final.post"
    layer: int | None
    name: str  # the site at that layer: "residual.post"

    @property
    def read_name(self) -> str:
        return (
            ("final" if self.layer is None else f"l{self.layer}")
            + "_"
            + self.name.replace(".", "_")
        )


def parse_sites(sites: str | Iterable[str], n_layers: int | None = None) -> list[Site]:
    """``layers.N.SITE`` (``layers.*.SITE``: every layer) and ``final.post``,
    comma-separated or as a list."""
    from xmix.lang.sites import LAYER_SITES, MODEL_SITES

    items = [
        s.strip() for s in (sites.split(",") if isinstance(sites, str) else sites) if s.strip()
    ]
    if not items:
        raise CaptureError("no sites given (e.g. --sites layers.10.residual.post,final.post)")
    out: list[Site] = []
    for s in items:
        m = _SITE.match(s)
        if not m:
            raise CaptureError(f"site {s!r}: expected layers.N.SITE or final.post")
        layer, sub = m.group(1), m.group(2)
        if layer is None:
            if sub not in MODEL_SITES:
                raise CaptureError(f"site {s!r}: model-level sites are {list(MODEL_SITES)}")
            out.append(Site(s, None, sub))
            continue
        if sub not in LAYER_SITES:
            raise CaptureError(f"site {s!r}: layer sites are {list(LAYER_SITES)}")
        if layer == "*":
            if n_layers is None:
                raise CaptureError(f"site {s!r}: layers.* needs the model's layer count")
            out.extend(Site(f"layers.{i}.{sub}", i, sub) for i in range(n_layers))
        else:
            out.append(Site(s, int(layer), sub))
    seen: set[str] = set()
    for site in out:
        if site.spec in seen:
            raise CaptureError(f"site {site.spec!r} is given twice")
        seen.add(site.spec)
    return out


def parse_positions(spec: Any) -> Window:
    """The window of positions: "prompt", "last_token", "A:B" ranges (Python slice syntax,
    negative bounds count from the prompt's end), comma-separated; or the control's JSON form."""
    try:
        return _window(positions_from_text(spec))
    except ValueError as e:
        raise CaptureError(f"--positions: {e}") from None


@dataclass
class Prompt:
    index: int
    id: str
    token_ids: list[int]


def read_prompts(prompts: str | os.PathLike | Iterable[Any], tokenizer) -> Iterator[Prompt]:
    """Prompts from a JSONL file ({"prompt"|"text": str} or {"prompt_token_ids"|"token_ids":
    [int]}, optional "id") or an iterable of str / list[int] / such dicts, tokenized as vLLM
    does (with the tokenizer's special tokens)."""
    if isinstance(prompts, (str, os.PathLike)):
        path = Path(prompts)

        def records():
            with path.open("rb") as f:
                for n, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            yield json.loads(line)
                        except ValueError as e:
                            raise CaptureError(f"{path}:{n}: not a JSON line ({e})") from None

        source: Iterable[Any] = records()
    else:
        source = prompts
    for i, rec in enumerate(source):
        rid = str(i)
        if isinstance(rec, dict):
            rid = str(rec.get("id", i))
            text = rec.get("prompt", rec.get("text"))
            ids = rec.get("prompt_token_ids", rec.get("token_ids"))
        elif isinstance(rec, str):
            text, ids = rec, None
        else:
            text, ids = None, rec
        if ids is None:
            if not isinstance(text, str):
                raise CaptureError(f'prompt {i}: needs "prompt" (text) or "prompt_token_ids"')
            ids = tokenizer.encode(text)
        ids = list(ids)
        if not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise CaptureError(f"prompt {i}: token ids must be a non-empty list of integers")
        yield Prompt(i, rid, ids)


@dataclass
class Shard:
    number: int
    prompts: list[Prompt] = field(default_factory=list)
    rows: int = 0

    @property
    def first(self) -> int:
        return self.prompts[0].index

    @property
    def end(self) -> int:
        return self.prompts[-1].index + 1

    def digest(self) -> str:
        h = hashlib.sha256()
        for p in self.prompts:
            h.update(np.asarray(p.token_ids, dtype=np.int64).tobytes())
            h.update(b"|")
        return h.hexdigest()


def plan_shards(
    prompts: Iterable[Prompt],
    window: Window,
    row_bytes: int,
    shard_bytes: int,
    max_len: int,
    skipped: list,
) -> Iterator[Shard]:
    """Consecutive prompts per shard, at most ``shard_bytes`` of activations (at least one
    prompt); prompts the engine cannot take (longer than max_len - 1) are recorded and left
    out."""
    cur = Shard(0)
    for p in prompts:
        n = len(p.token_ids)
        if n >= max_len:
            skipped.append(
                {
                    "index": p.index,
                    "id": p.id,
                    "reason": f"{n} tokens; the engine takes "
                    f"at most {max_len - 1} (max_model_len - 1)",
                }
            )
            continue
        rows = int(window.count(0, n, n))
        if cur.prompts and (cur.rows + rows) * row_bytes > shard_bytes:
            yield cur
            cur = Shard(cur.number + 1)
        cur.prompts.append(p)
        cur.rows += rows
    if cur.prompts:
        yield cur


class CaptureRun:
    """Iterate to run: one dict of tensors per shard ({"acts": {site: [N, width]},
    "token_ids", "positions", "request_index", "request_ids", "shard"}), written to ``out``
    first when given. ``run()`` goes through every shard and returns the index."""

    def __init__(
        self,
        model: str | None,
        prompts,
        sites,
        *,
        out: str | os.PathLike | None = None,
        positions: Any = "prompt",
        dtype: str = "float32",
        llm=None,
        shard_mb: float = 256.0,
        progress: bool = True,
        resume: bool = True,
        model_dtype: str | None = None,
        **engine_args,
    ):
        if dtype not in DTYPES:
            raise CaptureError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
        if shard_mb <= 0:
            raise CaptureError("shard_mb must be positive")
        self.model = model
        self.prompts = prompts
        self.sites_spec = sites
        self.out = Path(out) if out is not None else None
        self.window = parse_positions(positions)
        self.dtype = dtype
        self.llm = llm
        self.shard_bytes = int(shard_mb * 2**20)
        self.progress = progress
        self.resume = resume
        self.engine_args = dict(engine_args)
        if model_dtype is not None:  # the engine's dtype ("dtype" is the activations')
            self.engine_args["dtype"] = model_dtype
        self.index: dict | None = None

    # ------------------------------------------------------------------ engine
    def _engine(self):
        from xmix.integrations.vllm.llm import llm_class

        if self.llm is None:
            if self.model is None:
                raise CaptureError("give a model (or llm=)")
            self._capture_room()
            self.llm = llm_class()(model=self.model, **self.engine_args)
        return self.llm

    def _capture_room(self) -> None:
        """Room in the engine's capture buffer for every site (XMIX_CAPTURE_MB, unless set):
        a capture read of width d takes d floats per token of a step."""
        if settings.is_set("XMIX_CAPTURE_MB"):
            return
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(
            str(self.model), trust_remote_code=bool(self.engine_args.get("trust_remote_code"))
        )
        cfg = getattr(cfg, "text_config", None) or cfg
        n = len(parse_sites(self.sites_spec, int(cfg.num_hidden_layers)))
        tokens = max(int(self.engine_args.get("max_num_batched_tokens") or 16384), 512)
        need = n * int(cfg.hidden_size) * tokens * 4
        settings.set_env("XMIX_CAPTURE_MB", str(max(16, math.ceil(need / 2**20) + 1)))

    def _shape(self, llm):
        from xmix.lang.sites import ModelShape

        cfg = llm.llm_engine.model_config
        return ModelShape.from_hf_config(cfg.hf_config, cfg.model), cfg

    def _deploy(self, llm, sites: list[Site], shape):
        from xmix.lang.api import App

        app = App(APP_NAME)
        for s in sites:
            r = app.read("capture").at(s.name).named(s.read_name)
            if s.layer is not None:
                if not 0 <= s.layer < shape.n_layers:
                    raise CaptureError(
                        f"site {s.spec!r}: the model has layers 0..{shape.n_layers - 1}"
                    )
                r.layers([s.layer])
        names = {a["name"] for a in llm.xmix.apps()}
        if APP_NAME in names:  # a previous capture on this engine
            llm.xmix.undeploy(APP_NAME)
        llm.xmix.deploy(app)

    # ------------------------------------------------------------------ run
    def __iter__(self) -> Iterator[dict]:
        # The result cap protects a server's responses; here the results go to disk. The
        # frontend (this process) reads it at each admission.
        with settings.overridden("XMIX_MAX_RESULT_BYTES", str(1 << 50)):
            yield from self._iter()

    def _iter(self) -> Iterator[dict]:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        llm = self._engine()
        shape, cfg = self._shape(llm)
        sites = parse_sites(self.sites_spec, shape.n_layers)
        width = shape.hidden_size
        row_bytes = width * DTYPES[self.dtype] * len(sites)
        self._deploy(llm, sites, shape)
        control = {"apps": [APP_NAME], "dtype": self.dtype, "positions": self.window.to_control()}
        params = SamplingParams(
            max_tokens=1,
            temperature=0.0,
            output_kind=RequestOutputKind.FINAL_ONLY,
            extra_args={"xmix": control},
        )
        header = {
            "format": FORMAT,
            "model": str(cfg.model),
            "sites": [s.spec for s in sites],
            "width": width,
            "dtype": self.dtype,
            "positions": self.window.to_control(),
            "max_model_len": int(cfg.max_model_len),
            "shard_bytes": self.shard_bytes,
        }
        done = self._load_index(header)
        skipped: list = []
        index = {**header, "shards": [], "skipped": skipped, "complete": False}
        tok = llm.get_tokenizer()
        total = self._count()
        bar = None
        if self.progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=total, unit="prompt", desc="xmix capture")
        try:
            for shard in plan_shards(
                read_prompts(self.prompts, tok),
                self.window,
                row_bytes,
                self.shard_bytes,
                int(cfg.max_model_len),
                skipped,
            ):
                entry: dict[str, Any] = {
                    "file": f"shard-{shard.number:05d}.safetensors",
                    "first_prompt": shard.first,
                    "end_prompt": shard.end,
                    "prompts": len(shard.prompts),
                    "tokens": shard.rows,
                    "sha256_token_ids": shard.digest(),
                }
                prev = done.get(shard.number)
                if prev is not None and self._still_valid(prev, entry):
                    index["shards"].append(prev)
                    if bar is not None:
                        bar.update(len(shard.prompts))
                    continue
                batch = self._run_shard(llm, shard, params, sites, bar)
                if self.out is not None:
                    entry["bytes"] = self._write(shard, batch, sites, entry["file"])
                    index["shards"].append(entry)
                    self._write_index(index)
                yield batch
            index["complete"] = True
            if self.out is not None:
                self._write_index(index)
            self.index = index
        finally:
            if bar is not None:
                bar.close()

    def run(self) -> dict:
        for _ in self:
            pass
        assert self.index is not None  # set by the iteration's last step
        return self.index

    def _count(self) -> int | None:
        if isinstance(self.prompts, (str, os.PathLike)):
            with open(self.prompts, "rb") as f:
                return sum(1 for line in f if line.strip())
        try:
            return len(self.prompts)
        except TypeError:
            return None

    def _run_shard(self, llm, shard: Shard, params, sites: list[Site], bar) -> dict:
        """Every prompt of the shard through the engine at once (the engine batches them);
        the results are arrays from the worker on, assembled in prompt order."""
        import torch

        eng = llm.llm_engine
        got: dict[str, Any] = {}
        order = []
        for p in shard.prompts:
            rid = f"xmix-capture-{shard.number}-{p.index}"
            order.append(rid)
            eng.add_request(rid, {"prompt_token_ids": p.token_ids}, params)
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    got[o.request_id] = o
                    if bar is not None:
                        bar.update(1)
        acts: dict[str, list] = {s.spec: [] for s in sites}
        toks, poss, reqs = [], [], []
        for p, rid in zip(shard.prompts, order):
            res = got[rid].xmix.get(APP_NAME, {})
            err = getattr(got[rid], "xmix_error", None)
            if err:
                raise CaptureError(f"prompt {p.index}: {err}")
            first = res.get(sites[0].read_name)
            pos = first.positions if first is not None else np.zeros(0, np.int32)
            for s in sites:
                r = res.get(s.read_name)
                if r is None or not np.array_equal(r.positions, pos):
                    raise CaptureError(f"prompt {p.index}: site {s.spec} reported other positions")
                acts[s.spec].append(r.values)
            ids = np.asarray(p.token_ids, dtype=np.int32)
            toks.append(ids[pos])
            poss.append(pos)
            reqs.append(np.full(len(pos), p.index, dtype=np.int64))
        w = acts[sites[0].spec][0].shape[1] if shard.rows else 0
        store = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}[self.dtype]
        return {
            "shard": shard.number,
            "acts": {
                k: to_tensor(np.concatenate(v) if v else np.zeros((0, w), store), self.dtype)
                for k, v in acts.items()
            },
            "token_ids": torch.from_numpy(np.concatenate(toks)),
            "positions": torch.from_numpy(np.concatenate(poss)),
            "request_index": torch.from_numpy(np.concatenate(reqs)),
            "request_ids": [p.id for p in shard.prompts],
        }

    # ------------------------------------------------------------------ files
    def _load_index(self, header: dict) -> dict[int, dict]:
        if self.out is None:
            return {}
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / "index.json"
        if not path.exists():
            return {}
        old = json.loads(path.read_text())
        if old.get("format") in FORMER_TAGS:
            old["format"] = FORMAT
        if not self.resume:
            raise CaptureError(
                f"{self.out} already holds a capture (index.json); resume it or use "
                f"another directory"
            )
        diff = [k for k in header if old.get(k) != header[k]]
        if diff:
            raise CaptureError(
                f"{self.out} holds a capture made with other settings ({', '.join(diff)}); "
                f"use another directory"
            )
        return {i: e for i, e in enumerate(old.get("shards", []))}

    def _still_valid(self, prev: dict, entry: dict) -> bool:
        for k in ("file", "first_prompt", "end_prompt", "tokens", "sha256_token_ids"):
            if prev.get(k) != entry[k]:
                raise CaptureError(
                    f"{self.out}: shard {entry['file']} was made from other prompts "
                    f"({k} differs); use another directory"
                )
        f = self.out / prev["file"]
        return f.exists() and f.stat().st_size == prev.get("bytes")

    def _write(self, shard: Shard, batch: dict, sites: list[Site], name: str) -> int:
        from safetensors.torch import save_file

        tensors = {f"acts.{k}": v.contiguous() for k, v in batch["acts"].items()}
        tensors.update(
            token_ids=batch["token_ids"],
            positions=batch["positions"],
            request_index=batch["request_index"],
        )
        meta = {
            "format": FORMAT,
            "shard": str(shard.number),
            "first_prompt": str(shard.first),
            "end_prompt": str(shard.end),
            "request_ids": json.dumps(batch["request_ids"]),
            "sites": json.dumps([s.spec for s in sites]),
        }
        out = self._directory()
        tmp = out / (name + ".tmp")
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, out / name)
        return (out / name).stat().st_size

    def _write_index(self, index: dict) -> None:
        out = self._directory()
        tmp = out / "index.json.tmp"
        tmp.write_text(json.dumps(index, indent=1))
        os.replace(tmp, out / "index.json")

    def _directory(self) -> Path:
        # only the writing steps ask, and they run only with an output directory
        assert self.out is not None
        return self.out


def capture(model: str | None = None, prompts=None, sites=None, **kw) -> CaptureRun:
    """Activations of a prompt set: ``for batch in xmix.capture(model, "data.jsonl",
    "layers.10.residual.post", dtype="bfloat16"): ...`` streams one dict of tensors per shard;
    with ``out=DIR`` each shard is also written (resumable), and ``.run()`` does it all. An
    existing engine can be given as ``llm=`` (the capture app is deployed on it); otherwise
    other keywords are vLLM engine arguments (the engine's dtype is ``model_dtype``)."""
    if prompts is None or sites is None:
        raise CaptureError("capture needs prompts and sites")
    return CaptureRun(model, prompts, sites, **kw)


# ---------------------------------------------------------------------- CLI
def main(argv: list[str]) -> int:
    import argparse
    import sys

    ap = argparse.ArgumentParser(
        prog="xmix capture",
        description="Run a prompt set through the engine with capture reads and write sharded "
        "safetensors files. Arguments not listed here go to the vLLM engine (as for "
        "`vllm serve`; the model's dtype is --model-dtype here).",
    )
    ap.add_argument("model")
    ap.add_argument(
        "--prompts",
        required=True,
        help='JSONL: {"prompt": text} or {"prompt_token_ids": [...]}, optional "id"',
    )
    ap.add_argument(
        "--sites",
        required=True,
        help="comma-separated: layers.N.SITE (layers.* = all), final.post",
    )
    ap.add_argument("--out", required=True, help="directory for shard-*.safetensors and index.json")
    ap.add_argument(
        "--positions",
        default="prompt",
        help="prompt | last_token | START:STOP, comma-separated (default: prompt)",
    )
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=sorted(DTYPES),
        help="dtype of the activations written",
    )
    ap.add_argument(
        "--shard-mb", type=float, default=256.0, help="activations per shard at most (MiB)"
    )
    ap.add_argument("--model-dtype", default=None, help="the engine's --dtype")
    ap.add_argument("--no-progress", action="store_true")
    args, rest = ap.parse_known_args(argv)
    engine = _engine_args(rest)
    engine.pop("dtype", None)
    try:
        run = capture(
            args.model,
            args.prompts,
            args.sites,
            out=args.out,
            positions=args.positions,
            dtype=args.dtype,
            shard_mb=args.shard_mb,
            progress=not args.no_progress,
            model_dtype=args.model_dtype,
            **engine,
        )
        index = run.run()
    except CaptureError as e:
        print(f"xmix capture: {e}", file=sys.stderr)
        return 2
    n = sum(s["tokens"] for s in index["shards"])
    print(
        f"xmix capture: {len(index['shards'])} shards, {n} tokens x {len(index['sites'])} sites "
        f"in {args.out}"
        + (
            f"; {len(index['skipped'])} prompts skipped (see index.json)"
            if index["skipped"]
            else ""
        )
    )
    return 0


def _engine_args(rest: list[str]) -> dict:
    """vLLM engine arguments given after xmix capture's own, as LLM(**kwargs)."""
    if not rest:
        return {}
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    p = FlexibleArgumentParser(prog="xmix capture (engine arguments)")
    EngineArgs.add_cli_args(p)
    ns = p.parse_args(["--model", "placeholder", *rest])
    defaults = p.parse_args(["--model", "placeholder"])
    return {k: v for k, v in vars(ns).items() if k != "model" and v != getattr(defaults, k)}


__all__ = ["CaptureError", "CaptureRun", "capture", "main", "parse_positions", "parse_sites"]
