"""Python frame entries of a server's API server process, for bench/api_calls.py: loaded by
every process of the server through PYTHONPATH, active only in the first (the API server;
the engine processes it spawns inherit a marker and skip). SIGUSR1 starts counting in the
main thread (where the API server's event loop runs), SIGUSR2 writes the counts to
$BENCH_API_CALLS as JSON. A frame entry is a call or a resumption of a generator or
coroutine frame (sys.setprofile's "call" event). Bench tooling only: nothing in xmix reads it."""

import json
import os
import signal
import sys

_OUT = os.environ.get("BENCH_API_CALLS")

if _OUT and not os.environ.get("BENCH_API_CALLS_CHILD"):
    os.environ["BENCH_API_CALLS_CHILD"] = "1"
    _counts: dict = {}

    def _prof(frame, event, arg):
        if event == "call":
            code = frame.f_code
            key = (code.co_filename, code.co_name)
            _counts[key] = _counts.get(key, 0) + 1

    def _start(signum, frame):
        _counts.clear()
        sys.setprofile(_prof)

    def _dump(signum, frame):
        sys.setprofile(None)
        rows = [[f, n, c] for (f, n), c in _counts.items()]
        tmp = _OUT + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(rows, fh)
        os.replace(tmp, _OUT)

    signal.signal(signal.SIGUSR1, _start)
    signal.signal(signal.SIGUSR2, _dump)
