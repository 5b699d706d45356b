"""A step's read results from the worker to the engine core, the two forms side by side: the
worker's ``ReadResult`` objects pickled as vLLM's shm MessageQueue pickles a
ModelRunnerOutput (protocol 5) and packed by the engine core, against the worker packing them
(``results_codec.pack_results``) and the engine core passing the bytes on. One scalar read
(a probe) per request and step, or a capture of width --width; median of --rounds rounds of
--steps steps each, both forms in every round.

    python bench/results_wire.py [--requests 8] [--width 1] [--steps 2000] [--rounds 7]

Nothing here asserts; the forms are checked equal once (decoded) before timing.
"""

from __future__ import annotations

import argparse
import pickle
import platform
import statistics
import time

import numpy as np

from xmix.lang.results_codec import ReadResult, pack_results, unpack_results


def step_results(n_req: int, width: int, step: int) -> dict:
    """What the worker's drain hands out for one decode step: a view per request of the
    step's arrays."""
    pos = np.full(n_req, 128 + step, dtype=np.int32)
    vals = np.random.default_rng(step).standard_normal((n_req, width)).astype(np.float32)
    if width == 1:
        vals = vals[:, 0]
    kind = "scalar" if width == 1 else "vector"
    return {
        f"r{i}": {
            "probe": {
                "p": ReadResult.views(kind, pos[i : i + 1], vals[i : i + 1], None, "float32", ())
            }
        }
        for i in range(n_req)
    }


def objects_then_core_packs(res: dict) -> dict:
    wire = pickle.dumps(res, protocol=pickle.HIGHEST_PROTOCOL)
    got = pickle.loads(wire)
    return {rid: pack_results(apps) for rid, apps in got.items()}


def worker_packs(res: dict) -> dict:
    wire = pickle.dumps(
        {rid: pack_results(apps) for rid, apps in res.items()}, protocol=pickle.HIGHEST_PROTOCOL
    )
    return pickle.loads(wire)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--width", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    steps = [step_results(args.requests, args.width, s) for s in range(64)]
    a, b = objects_then_core_packs(steps[0]), worker_packs(steps[0])
    assert {k: unpack_results(v) for k, v in a.items()} == {
        k: unpack_results(v) for k, v in b.items()
    }
    forms = {
        "objects pickled, engine core packs": objects_then_core_packs,
        "worker packs": worker_packs,
    }
    per_step: dict[str, list[float]] = {k: [] for k in forms}
    for rnd in range(args.rounds):
        order = list(forms) if rnd % 2 == 0 else list(forms)[::-1]
        for name in order:
            fn = forms[name]
            t0 = time.perf_counter()
            for s in range(args.steps):
                fn(steps[s % 64])
            per_step[name].append((time.perf_counter() - t0) / args.steps * 1e6)
    base = statistics.median(per_step["objects pickled, engine core packs"])
    print(
        f"# a step's results, worker to engine core: {args.requests} requests, read width "
        f"{args.width}; median of {args.rounds} rounds x {args.steps} steps; "
        f"{platform.machine()}, Python {platform.python_version()}, numpy {np.__version__}"
    )
    print("| form | µs per step | ratio |")
    print("|---|---|---|")
    for name, xs in per_step.items():
        m = statistics.median(xs)
        print(f"| {name} | {m:.1f} | {m / base:.3f} |")


if __name__ == "__main__":
    main()
