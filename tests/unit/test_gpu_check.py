"""The parts of bench/gpu_check.py that decide PASS/FAIL on a GPU, checked here without one:
where the gated cases' threshold comes from, which nodes count as "enabled" when every app is
off, the cuda-bindings return shapes, and the correctness orchestration itself on a tiny CPU
decoder (every graph kind is the eager model there)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from xmix import _C
from xmix.control import Capacity, ControlBlock
from xmix.hooks import ModelShape

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import gpu_check as gc  # noqa: E402

G = _C.graph
NAN = math.nan


@pytest.fixture(autouse=True)
def _no_failures():
    gc.FAILURES.clear()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 8 x 64 matrices: threads only contend on a shared machine
    yield
    torch.set_num_threads(threads)
    gc.FAILURES.clear()


def test_probe_median_reads_the_rows_that_hold_a_value():
    res = torch.tensor([[NAN, 0.2], [NAN, 0.9], [NAN, 0.4], [NAN, NAN]])
    assert gc.probe_median(res, 1) == pytest.approx(0.4)
    # results restored from the snapshot taken before any step: all NaN, no threshold (what
    # the gate-true pass used to read, so that case was never run and counted as a FAIL)
    assert gc.probe_median(torch.full((4, 2), NAN), 1) is None
    assert gc.probe_median(torch.tensor([[0.3], [NAN]]), 0) is None


def test_gated_cases_get_their_threshold_from_the_gate_false_pass(capsys):
    shape = ModelShape(n_layers=3, hidden_size=64, vocab_size=64)
    model = gc.Decoder(3, 64, 128, 4, 8, 8, device="cpu", dtype=torch.float32)
    cap = Capacity(
        max_tokens=16,
        max_slots=16,
        max_apps=8,
        max_params=64,
        max_channels=16,
        max_ops=64,
        max_cond=128,
        capture_floats=1 << 12,
    )
    cb = ControlBlock(shape, "cpu", cap)
    run = gc.Runner(cb)
    x = {8: torch.randn(8, 64, generator=torch.Generator().manual_seed(1))}
    ids = {8: ((torch.arange(8) * 7) % 50).to(torch.int32)}
    run.step(gc.mixed_rows(8, ()), ids[8])
    kinds = {
        "eager": lambda B: model(x[B]),
        "patched": lambda B: model(x[B]),
        "base": lambda B: model(x[B], sites=False),
    }
    cases = [c for c in gc.check_cases(64, 3) if c.gate_param]
    assert [c.name for c in cases] == ["gated_write", "latched_ablate"]
    gc.check_correctness(
        cb,
        run,
        kinds,
        x,
        ids,
        cases,
        [8],
        shape,
        "cpu",
        replan=lambda c: None,
        set_mode=lambda c, n, m: c.set_mode(n, m),
        tol_eager=1e-5,
    )
    out = capsys.readouterr().out
    assert gc.FAILURES == [], out
    gate_lines = [l for l in out.splitlines() if "theta=median" in l]
    assert len(gate_lines) == 2
    for line in gate_lines:
        k, n = line.split("gate true for ")[1].split(" rows")[0].split("/")
        assert 0 < int(k) <= int(n) == 8
    assert "gate true for 8/8" not in gate_lines[0], "gated_write: some rows, not all"


def test_a_write_that_changes_nothing_fails_the_orchestration():
    """The orchestration must not pass a case it did not exercise: a "patched" run that
    drops the write (here: the model without sites) is caught."""
    shape = ModelShape(n_layers=3, hidden_size=64, vocab_size=64)
    model = gc.Decoder(3, 64, 128, 4, 8, 8, device="cpu", dtype=torch.float32)
    cb = ControlBlock(
        shape,
        "cpu",
        Capacity(
            max_tokens=16,
            max_slots=16,
            max_apps=8,
            max_params=64,
            max_channels=16,
            max_ops=64,
            max_cond=128,
        ),
    )
    run = gc.Runner(cb)
    x = {8: torch.randn(8, 64, generator=torch.Generator().manual_seed(1))}
    ids = {8: torch.zeros(8, dtype=torch.int32)}
    run.step(gc.mixed_rows(8, ()), ids[8])
    kinds = {
        "eager": lambda B: model(x[B]),
        "patched": lambda B: model(x[B], sites=False),
        "base": lambda B: model(x[B], sites=False),
    }
    case = next(c for c in gc.check_cases(64, 3) if c.name == "add_all")
    gc.check_correctness(
        cb,
        run,
        kinds,
        x,
        ids,
        [case],
        [8],
        shape,
        "cpu",
        replan=lambda c: None,
        set_mode=lambda c, n, m: c.set_mode(n, m),
        tol_eager=1e-5,
    )
    assert len(gc.FAILURES) == 1 and "add_all B=8 on [patched]" in gc.FAILURES[0]


def test_enabled_xmix_nodes_leaves_out_if_nodes_and_their_bodies():
    nodes = [
        G.Node(0),  # foreign
        G.Node(1, G.NodeType.Kernel, G.Role.Anchor, enabled=False),
        G.Node(2, G.NodeType.Kernel, G.Role.Op, enabled=False),
        G.Node(3, G.NodeType.Kernel, G.Role.Gate, enabled=False),
        G.Node(4, G.NodeType.Conditional, G.Role.If),  # never switched
        G.Node(5, G.NodeType.Kernel, G.Role.Op, parent=4),
    ]  # body: runs per gate
    ir = G.Graph(nodes, [])
    assert gc.enabled_xmix_nodes(ir) == []
    ir.nodes[2].enabled = True
    assert [n.id for n in gc.enabled_xmix_nodes(ir)] == [2]


def test_cuda_bindings_return_shapes():
    # cuGraphNodeGetDependencies(node, 0): CUDA 12 bindings (err, deps, n); CUDA 13 (err,
    # deps, edge_data, n)
    assert gc.n_dependencies((0, [], 2)) == 2
    assert gc.n_dependencies((0, [], [], 3)) == 3
    assert gc.cu_values((0, "name")) == ("name",)
    with pytest.raises(RuntimeError):
        gc.n_dependencies((700, [], [], 0))


def test_changed_rows():
    a = torch.zeros(3, 4)
    b = a.clone()
    b[1, 2] = 1.0
    assert gc.changed_rows(b, a).tolist() == [False, True, False]


def test_write_section_keeps_the_other_runs_sections(tmp_path):
    p = tmp_path / "table.md"
    gc.write_section(p, "quick", "quick v1\n")
    gc.write_section(p, "full", "full, 2 rows\n")
    gc.write_section(p, "quick", "quick v2\n")
    text = p.read_text()
    assert "quick v1" not in text and "quick v2" in text and "full, 2 rows" in text
    assert text.index("quick v2") < text.index("full, 2 rows")


def test_table_rows_are_relative_to_the_graph_without_sites(tmp_path):
    t = gc.Table(tmp_path / "t.md", "quick", [8, 256], "quick")
    t.add("no xmix (graph without sites)", {8: 100.0, 256: 200.0}, base=True)
    t.add("apps deployed, all off", {8: 100.5, 256: 202.0})
    text = (tmp_path / "t.md").read_text()
    assert "| apps deployed, all off | 100.5 µs (+0.50 %) | 202.0 µs (+1.00 %) |" in text


def test_cpu_part_at_the_quick_shape():
    gc.cpu_part(ModelShape(n_layers=2, hidden_size=256, vocab_size=512))
    assert gc.FAILURES == []


# ---------------------------------------------------------------- the build checks of gpu_check.sh
ROOT = Path(__file__).resolve().parents[2]


def test_check_symbols_fails_on_an_undefined_xmix_symbol(tmp_path):
    """What a source missing from the build looks like (gpu_check.sh once linked without
    csrc/site/step_cpu.cpp: `import xmix._C` then failed on the device, not at build time)."""
    import shutil
    import subprocess

    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None or shutil.which("nm") is None:
        pytest.skip("needs a C++ compiler and nm")
    src = tmp_path / "m.cpp"
    src.write_text(
        "namespace xmix { int fill_step_maps(int); }\n"
        "int entry(int n) { return xmix::fill_step_maps(n); }\n"
    )
    so = tmp_path / "m.so"
    subprocess.run([cxx, "-shared", "-fPIC", str(src), "-o", str(so)], check=True)
    bad = subprocess.run(
        [str(ROOT / "bench/check_symbols.sh"), str(so)], capture_output=True, text=True
    )
    assert bad.returncode == 1 and "xmix::fill_step_maps(int)" in bad.stderr
    ok = subprocess.run(
        [str(ROOT / "bench/check_symbols.sh"), _C.__file__], capture_output=True, text=True
    )
    assert ok.returncode == 0, ok.stderr


def test_piecewise_segments_compose_to_the_full_decoder():
    """The piecewise graphs are captured per segment (gpu_check.Piecewise); chained with the
    attention in between, the segments must be the full step, with sites running too."""
    from xmix import ops
    from xmix.api import App
    from xmix.lowering import lower

    shape = ModelShape(n_layers=3, hidden_size=64, vocab_size=64)
    model = gc.Decoder(3, 64, 128, 4, 8, 8, device="cpu", dtype=torch.float32)
    cb = ControlBlock(
        shape,
        "cpu",
        Capacity(
            max_tokens=16,
            max_slots=16,
            max_apps=8,
            max_params=64,
            max_channels=16,
            max_ops=64,
            max_cond=128,
        ),
    )
    app = App("abl")
    app.write("ablate", direction=gc.vec(64, 2)).layers("all").submodule("mlp.post")
    cb.install(lower(app, shape), mode="all")
    run = gc.Runner(cb)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(5))
    prev = ops.get_control()
    try:
        for sites in (False, True):
            run.step(gc.mixed_rows(8, ()), torch.zeros(8, dtype=torch.int32))
            inputs = (x,)
            for k in range(model.L + 1):
                out = model.segment(k, inputs, sites)
                if k < model.L:
                    inputs = (model.attn(k, out[1]), out[0])
            run.step(gc.mixed_rows(8, ()), torch.zeros(8, dtype=torch.int32))
            full = model(x, sites)
            torch.testing.assert_close(out[0], full, rtol=0, atol=0)
        assert not torch.equal(full, model(x, sites=False)), "the sites must have run"
    finally:
        ops.set_control(prev)
