"""A capture directory's index.json when a run resumes: the format tag as written before the
one tag scheme (``xmix-capture-1``) is the same format as ``xmix.capture/1``; any other
difference of settings is refused, naming the setting."""

from __future__ import annotations

import json

import pytest

from xmix.capture_run import FORMAT, CaptureError, CaptureRun

HEADER = {
    "format": FORMAT,
    "model": "/models/tiny",
    "sites": ["final.post"],
    "width": 256,
    "dtype": "float32",
    "positions": "prompt",
    "max_model_len": 512,
    "shard_bytes": 1 << 20,
}
SHARD = {"file": "shard-00000.safetensors", "first_prompt": 0, "end_prompt": 4}


def _run(tmp_path, index: dict) -> CaptureRun:
    (tmp_path / "index.json").write_text(json.dumps(index))
    return CaptureRun(None, [], "final.post", out=tmp_path, progress=False)


def test_an_index_with_the_former_tag_resumes(tmp_path):
    assert FORMAT == "xmix.capture/1"
    run = _run(tmp_path, {**HEADER, "format": "xmix-capture-1", "shards": [SHARD]})
    assert run._load_index(dict(HEADER)) == {0: SHARD}


def test_other_settings_or_an_unknown_tag_are_refused(tmp_path):
    run = _run(tmp_path, {**HEADER, "width": 128, "shards": []})
    with pytest.raises(CaptureError, match=r"other settings \(width\)"):
        run._load_index(dict(HEADER))
    run = _run(tmp_path, {**HEADER, "format": "xmix-capture-2", "shards": []})
    with pytest.raises(CaptureError, match=r"other settings \(format\)"):
        run._load_index(dict(HEADER))
