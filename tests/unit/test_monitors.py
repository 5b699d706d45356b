"""Monitors in the app language: ``App.stop(when=...)`` and ``since(...)`` conditions, their
parsing, app files and deploy-time lowering (placement and the site-order rules). No model:
apps are checked against a ModelShape; the semantics are checked against transformers in
tests/unit/test_hf.py and the engine in tests/engine/test_engine.py."""

from __future__ import annotations

import pytest
import torch

from xmix.lang import conditions as C
from xmix.lang.api import App, AppError
from xmix.lang.lowering import DeployError, lower
from xmix.lang.sites import ModelShape, site_id

D, L, V = 32, 4, 100
S = ModelShape(n_layers=L, hidden_size=D, vocab_size=V)


def monitor_app() -> App:
    app = App("mon")
    app.param("theta", 0.5)
    app.token_set("bad", ids=[7, 9])
    app.read("probe", weight=torch.ones(D)).layers([1]).at("residual.post").named("p")
    app.read("probe", weight=torch.ones(D)).layers([2]).at("residual.mid").named("q")
    return app


def test_since_parses_and_prints():
    n = C.parse("since(p > theta and not token_in(bad)) or last_token")
    assert isinstance(n, C.Or) and isinstance(n.a, C.Since)
    assert C.to_text(n) == "(since(p > theta and not token_in(bad)) or last_token)"
    assert C.parse(C.to_text(n)) == n
    # one instruction in the using op's program; its condition is a program of its own
    assert C.n_instructions(n) == 3
    assert C.reads_named(n) == ["p"]
    assert C.sinces(C.parse("since(p > 1) and since(p > 1) or since(q < 0)")) == [
        C.Since(C.parse("p > 1")),
        C.Since(C.parse("q < 0")),
    ]


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("since(since(p > 1))", "since(...) inside since(...)"),
        ("since(p > 1 and since(q > 2))", "since(...) inside since(...)"),
        ("since p > 1", "expected ("),
        ("since()", "expected name"),
        ("since(p > 1", "expected )"),
    ],
)
def test_malformed_since(text, fragment):
    with pytest.raises(C.ConditionError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        C.parse(text)


def test_since_is_a_reserved_word():
    with pytest.raises(AppError, match="word of the condition language"):
        App("a").read("probe", weight=torch.ones(D)).named("since")


def test_stop_builder_and_file_round_trip(tmp_path):
    app = monitor_app()
    stop = app.stop(when="p > theta or token_in(bad)")
    assert stop.kernel == "stop" and stop.primitive == "control"
    with pytest.raises(AppError, match="one stop condition per app"):
        app.stop(when="q > 0")
    with pytest.raises(AppError, match="needs a condition"):
        App("b").stop(when=None)  # type: ignore[arg-type]
    with pytest.raises(AppError, match="cannot read condition|expected"):
        App("b").stop(when="p >")
    b = App("b")
    with pytest.raises(AppError):
        b.stop(when="p >>> 1")
    assert b.ops == []  # a refused stop leaves nothing behind
    with pytest.raises(AppError, match="use app.stop"):
        App("c").read("stop")
    with pytest.raises(AppError, match="since is a condition"):
        App("c").write("since")
    loaded = App.load(app.save(tmp_path / "mon.xmix"))
    assert loaded.spec() == app.spec()
    lw = lower(loaded, S)
    assert lw.stop is not None and lw.stop.site == "final.post"
    assert lw.stop.monitor_read == "p" and lw.stateful and not lw.writes


def test_stop_runs_after_the_reads_of_its_site_whatever_the_order():
    app = App("early")
    app.stop(when="p > 0.5").layers([1]).at("residual.post")  # declared before its read
    app.read("probe", weight=torch.ones(D)).layers([1]).at("residual.post").named("p")
    lw = lower(app, S)
    assert [o.kernel for o in lw.ops] == ["probe", "stop"]
    with pytest.raises(DeployError, match="runs later in the forward pass"):
        bad = App("late")
        bad.read("probe", weight=torch.ones(D)).layers([2]).at("residual.post").named("p")
        bad.stop(when="p > 0.5").layers([1]).at("residual.post")
        lower(bad, S)
    with pytest.raises(DeployError, match="a stop runs at one site"):
        two = monitor_app()
        two.stop(when="p > 0.5").layers([2, 3]).at("residual.post")
        lower(two, S)


def test_since_is_decided_after_its_last_read_and_used_later():
    app = monitor_app()
    app.write("add", vector=torch.ones(D)).layers([3]).at("residual.pre").cond(
        when="since(p > theta and q > 0.1)"
    )
    app.write("add", vector=torch.ones(D)).layers([3]).at("mlp.post").cond(
        "since(q > 0.1 and p > theta)"  # another term
    )
    app.stop(when="since(p > theta and q > 0.1) and token_in(bad)")
    lw = lower(app, S)
    assert sorted(lw.sinces) == [
        "since(p > theta and q > 0.1)",
        "since(q > 0.1 and p > theta)",
    ]
    for text, op in lw.sinces.items():
        assert op.kernel == "since" and op.sticky == text
        assert op.site_id == site_id("residual.mid", 2, L)  # q's site, the later of the two
        assert lw.ops.index(op) > lw.ops.index(lw.reads["q"])
    assert lw.sinces["since(p > theta and q > 0.1)"].monitor_read == "p"
    assert lw.stateful


@pytest.mark.parametrize(
    "layer, site",
    [(2, "residual.mid"), (2, "residual.pre"), (1, "residual.post")],
)
def test_an_op_at_or_before_the_deciding_site_is_refused(layer, site):
    app = monitor_app()
    app.write("add", vector=torch.ones(D)).layers([layer]).at(site).cond(when="since(q > 0.1)")
    with pytest.raises(
        DeployError, match=r"since\(q > 0.1\) is decided after layers.2.residual.mid"
    ):
        lower(app, S)


def test_since_on_tokens_alone_is_decided_at_the_first_site():
    app = monitor_app()
    app.read("capture").layers([0]).at("attention.post").named("x").cond("since(token_in(bad))")
    lw = lower(app, S)
    (op,) = lw.sinces.values()
    assert op.site_id == site_id("residual.pre", 0, L) and op.monitor_read is None
    bad = monitor_app()
    bad.read("capture").layers([0]).at("residual.pre").named("x").cond("since(token_in(bad))")
    with pytest.raises(DeployError, match="must be at a later site"):
        lower(bad, S)


def test_since_names_unknown_things():
    app = monitor_app()
    app.write("add", vector=torch.ones(D)).layers([3]).at("residual.post").cond("since(r > 1)")
    with pytest.raises(DeployError, match="'r', which is not a read of this app"):
        lower(app, S)
    app = monitor_app()
    app.write("add", vector=torch.ones(D)).layers([3]).at("residual.post").cond(
        "since(token_in(nope))"
    )
    with pytest.raises(DeployError, match="unknown token set 'nope'"):
        lower(app, S)
    app = monitor_app()
    app.stop(when="p > nope")
    with pytest.raises(DeployError, match="unknown parameter 'nope'"):
        lower(app, S)
