"""bench/api_calls.py's tables, on frame counts made by hand: each figure per token is known
from the counts below."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import api_calls  # noqa: E402

SP = "/v/lib/python3.11/site-packages"


def test_package_of_names_xmix_vllm_site_packages_and_the_standard_library():
    assert api_calls.package_of("/w/python/xmix/integrations/vllm/http/auth.py") == "xmix"
    assert api_calls.package_of(f"{SP}/vllm/v1/engine/output_processor.py") == "vllm"
    assert api_calls.package_of(f"{SP}/starlette/responses.py") == "starlette"
    assert api_calls.package_of(f"{SP}/six.py") == "six"
    assert api_calls.package_of("/usr/lib/python3.11/asyncio/queues.py") == "stdlib:asyncio"
    assert api_calls.package_of("/usr/lib/python3.11/enum.py") == "stdlib:enum"
    assert api_calls.package_of("<frozen _collections_abc>") == "frozen"


def test_tables_give_entries_per_token_and_the_differences():
    vanilla = Counter({(f"{SP}/vllm/a.py", "f"): 400, (f"{SP}/starlette/b.py", "g"): 100})
    xmix = Counter(
        {
            (f"{SP}/vllm/a.py", "f"): 200,  # half as many tokens below: the same per token
            (f"{SP}/starlette/b.py", "g"): 50,
            ("/w/python/xmix/http/r.py", "_tap"): 100,
        }
    )
    text = api_calls.tables({"vanilla": vanilla, "unused": xmix}, {"vanilla": 100, "unused": 50})
    lines = text.splitlines()
    assert lines[0] == "| package | vanilla | unused | unused - vanilla |"
    assert lines[2] == "| all | 5.0 | 7.0 | +2.0 |"
    assert "| vllm | 4.0 | 4.0 | +0.0 |" in lines
    assert "| xmix | 0.0 | 2.0 | +2.0 |" in lines
    assert "| starlette | 1.0 | 1.0 | +0.0 |" in lines
    # the functions' table: the largest difference first
    i = lines.index("| function | vanilla | unused | difference |")
    assert lines[i + 2] == "| xmix/http/r.py:_tap | 0.00 | 2.00 | +2.00 |"
