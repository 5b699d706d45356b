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
from xmix.lang.sites import ModelShape
from xmix.runtime.control import Capacity, ControlBlock

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


def test_gate_threshold_lies_between_two_values_that_were_read():
    res = torch.tensor([[NAN, 0.2], [NAN, 0.9], [NAN, 0.4], [NAN, NAN], [NAN, 0.6]])
    # values 0.2 0.4 0.6 0.9: between the middle two, so no read lies on the threshold
    assert gc.gate_threshold(res, 1) == pytest.approx(0.5)
    assert gc.gate_threshold(torch.tensor([[0.3], [0.3], [0.7]]), 0) == pytest.approx(0.5)
    # results restored from the snapshot taken before any step: all NaN, no threshold (what
    # the gate-true pass used to read, so that case was never run and counted as a FAIL)
    assert gc.gate_threshold(torch.full((4, 2), NAN), 1) is None
    assert gc.gate_threshold(torch.tensor([[0.3], [NAN], [0.3]]), 0) is None


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
    gate_lines = [l for l in out.splitlines() if "theta=threshold" in l and "[patched]" in l]
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
    from xmix.lang.api import App
    from xmix.lang.lowering import lower
    from xmix.runtime import ops

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
    app.write("ablate", direction=gc.vec(64, 2)).layers("all").at("mlp.post")
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


# ---------------------------------------------------------------- every size the GPU stages check
def _row_kinds(rows) -> set[tuple[str, bool]]:
    kinds = set()
    for n, start, plen, apps in rows:
        if start + n == plen and n > 1:
            kinds.add(("prompt chunk with its last token", bool(apps)))
        elif start + n < plen:
            kinds.add(("partial prefill", bool(apps)))
        elif start >= plen and n == 1:
            kinds.add(("decode row", bool(apps)))
    return kinds


@pytest.mark.parametrize("B", gc.CHECKED_BATCHES)
def test_every_checked_batch_holds_every_kind_of_row(B):
    """At B = 64 and 256 the batch was all decode rows: the prompt, clamp-not-last and CAST
    cases selected nothing there and failed their "effect > 0" checks on correct code."""
    rows = gc.mixed_rows(B, ("a",))
    assert sum(n for n, *_ in rows) == B
    kinds = _row_kinds(rows)
    for k in ("prompt chunk with its last token", "partial prefill", "decode row"):
        assert (k, True) in kinds, (k, B)
    assert ("decode row", False) in kinds
    if B >= 16:
        assert ("prompt chunk with its last token", False) in kinds
    with pytest.raises(ValueError):
        gc.mixed_rows(4, ())


def _stage_runs() -> dict[str, list[str]]:
    """The gpu_check.py arguments of each GPU stage in bench/gpu_check.sh."""
    import shlex

    text = (ROOT / "bench/gpu_check.sh").read_text().replace("\\\n", " ")
    runs = {}
    for line in text.splitlines():
        words = line.split()
        if words[:1] == ["stage"] and "bench/gpu_check.py" in line and "--cpu-only" not in line:
            argv = shlex.split(
                line.split("bench/gpu_check.py", 1)[1].replace("${GPU_CHECK_ARGS:-}", "")
            )
            runs[words[1]] = argv
    return runs


def test_the_cpu_part_covers_every_batch_and_shape_the_gpu_stages_check():
    runs = _stage_runs()
    assert set(runs) == {"quick", "full"}
    for name, argv in runs.items():
        args = gc.parser().parse_args(argv)
        batches = gc.checked_batches(sorted(int(b) for b in args.batches.split(",")))
        assert batches and set(batches) <= set(gc.CHECKED_BATCHES), (name, batches)
        assert (args.layers, args.d) in gc.GPU_STAGE_SHAPES, (name, args.layers, args.d)
    assert gc.parser().parse_args(runs["quick"]).d == 5120


def test_cpu_orchestration_passes_every_case_at_every_checked_batch(capsys):
    gc.cpu_orchestration(None)
    out = capsys.readouterr().out
    assert gc.FAILURES == [], [l for l in out.splitlines() if "FAIL" in l]
    names = [c.name for c in gc.check_cases(64, 3)]
    assert "custom_write" in names
    for name in names:
        for B in gc.CHECKED_BATCHES:
            assert f"PASS  {name} B={B} on" in out and f"{name} B={B} on" in out
            assert any(
                l.startswith(f"  PASS  {name} B={B} on") and "[eager vs reference]" in l
                for l in out.splitlines()
            ), (name, B)


def _broken_kernel(how: str):
    """xmix's site op, then one deliberate mistake of a kind a kernel could make."""
    from xmix.lang.sites import site_id
    from xmix.runtime import ops

    def impl(h, r, site, layer):
        cb = ops.get_control()
        h0, res0, cap0 = h.clone(), cb.dev["results"].clone(), cb.dev["capture"].clone()
        torch.ops.xmix.site(h, r, site_id(site, layer, 3))
        changed = (h != h0).any(dim=1)
        if how == "write 1 % too strong":
            h[changed] += 1e-2 * (h - h0)[changed]
        elif how == "condition selects one row too many":
            if changed.any() and not changed.all():
                i, j = int(changed.nonzero()[0]), int((~changed).nonzero()[0])
                h[j] += (h - h0)[i]
        elif how == "read value off by 1 %":
            res = cb.dev["results"]
            moved = (res != res0) & ~torch.isnan(res)
            res[moved] += 1e-2 * (1 + res[moved].abs())
        elif how == "captured vector off by 1 %":
            cap = cb.dev["capture"]
            moved = cap != cap0
            cap[moved] += 1e-2 * (1 + cap[moved].abs())

    return impl


@pytest.mark.parametrize(
    "case,how",
    [
        ("add_all", "write 1 % too strong"),
        ("ablate_all_layers", "write 1 % too strong"),
        ("clamp_not_last", "write 1 % too strong"),
        ("affine_last", "write 1 % too strong"),
        ("custom_write", "write 1 % too strong"),
        ("add_last_token", "condition selects one row too many"),
        ("add_in_span", "condition selects one row too many"),
        ("add_token_in", "condition selects one row too many"),
        ("gated_write", "condition selects one row too many"),
        ("latched_ablate", "condition selects one row too many"),
        ("probe_reads", "read value off by 1 %"),
        ("distance_read", "read value off by 1 %"),
        ("cosine_prompt", "read value off by 1 %"),
        ("capture_last", "captured vector off by 1 %"),
    ],
)
def test_a_broken_kernel_fails_the_check(case, how, capsys):
    """Every graph kind runs xmix's kernels, so a kernel wrong the same way everywhere passes
    every comparison between kinds: the PyTorch reference must catch it."""
    cases = [c for c in gc.check_cases(64, 3) if c.name == case]
    assert cases, case
    gc.cpu_orchestration(None, batches=(8,), cases=cases, kernel=_broken_kernel(how))
    out = capsys.readouterr().out
    caught = [f for f in gc.FAILURES if f.startswith(f"{case} B=8") and "vs reference" in f]
    assert caught, out
