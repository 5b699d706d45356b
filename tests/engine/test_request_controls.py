"""Flat per-request controls (``xmix_apps``, ``xmix.<app>.<param>``): the translation to the
canonical control, refusals, and the offline engine treating both forms alike."""

from __future__ import annotations

import json

import pytest
import torch

import xmix
from engine_util import make_llm, shutdown
from xmix.integrations.vllm.request_controls import control_from_args, has_control


class Refused(Exception):
    pass


def flat(args):
    return control_from_args(args, Refused)


def test_flat_form_becomes_the_canonical_control():
    assert flat({"xmix_apps": ["steer", "probe"], "xmix.steer.scale": 2.0}) == {
        "apps": ["steer", "probe"],
        "params": {"steer": {"scale": 2.0}},
    }
    # a comma-separated string, as vllm_xargs allows plain strings; spaces around names dropped
    assert flat({"xmix_apps": "steer, probe"}) == {"apps": ["steer", "probe"], "params": {}}
    # op-qualified parameter names keep their dot: the app name ends at the first dot
    assert flat({"xmix_apps": "steer", "xmix.steer.push.scale": 3, "xmix.steer.theta": -1.5}) == {
        "apps": ["steer"],
        "params": {"steer": {"push.scale": 3, "theta": -1.5}},
    }
    # params alone (for an app in mode "all"); admission decides whether that is allowed
    assert flat({"xmix.always.scale": 1.0}) == {"apps": [], "params": {"always": {"scale": 1.0}}}
    assert flat({"xmix_apps": ""}) == {"apps": [], "params": {}}


def test_json_form_and_no_control_pass_through():
    raw = json.dumps({"apps": ["steer"]})
    assert flat({"xmix": raw}) is raw
    d = {"apps": ["steer"]}
    assert flat({"xmix": d}) is d
    assert flat(None) is None and flat({}) is None
    # other extensions' keys are not xmix's business
    assert flat({"session_id": "abc", "xmixer": 1, "kv_transfer_params": {}}) is None
    assert has_control({"xmix_apps": "a"}) and has_control({"xmix": "{}"})
    assert has_control({"XMIX_APPS": "a"})  # refused as a control, not passed by
    assert not has_control({"xmixer": 1}) and not has_control(None)


@pytest.mark.parametrize(
    "args, words",
    [
        ({"xmix": "{}", "xmix_apps": ["steer"]}, ['"xmix"', "'xmix_apps'", "one of them"]),
        ({"xmix": {"apps": []}, "xmix.steer.scale": 1.0}, ['"xmix"', "'xmix.steer.scale'"]),
        ({"xmix_app": ["steer"]}, ["'xmix_app'", "unknown flat control"]),
        ({"xmix.steer": 1.0}, ["'xmix.steer'", "xmix.<app>.<parameter>"]),
        ({"xmix..scale": 1.0}, ["'xmix..scale'"]),
        ({"xmix.steer.scale": "2.0"}, ["'xmix.steer.scale'", "must be a number"]),
        ({"xmix.steer.scale": True}, ["must be a number"]),
        ({"xmix.steer.scale": [1.0]}, ["must be a number"]),
        ({"xmix_apps": [1, 2]}, ["as strings"]),
        ({"xmix_apps": 3}, ["list of app names"]),
        ({"xmix_apps": "steer,,probe"}, ["empty app name"]),
        # xmix's keys in another spelling were silently ignored (issue 33 item 5): refused,
        # naming the right one
        ({"XMIX_APPS": "steer"}, ["'XMIX_APPS'", "did you mean 'xmix_apps'?"]),
        ({"Xmix_apps": "steer"}, ["'Xmix_apps'", "did you mean 'xmix_apps'?"]),
        ({"xmix-apps": "steer"}, ["did you mean 'xmix_apps'?"]),
        ({"xmix_APPS": "steer"}, ["unknown flat control", "did you mean 'xmix_apps'?"]),
        ({"XMIX": "{}"}, ["did you mean 'xmix'?"]),
        ({"Xmix.steer.scale": 1.0}, ["did you mean 'xmix.steer.scale'?"]),
        ({"XMIX_DTYPE": "float16"}, ["did you mean 'xmix_dtype'?"]),
        ({"XMIX_STEER": 1}, ["'XMIX_STEER'", "in lower case"]),
        ({"xmix": "{}", "XMIX_APPS": "steer"}, ["did you mean 'xmix_apps'?"]),
    ],
)
def test_bad_flat_controls_are_refused_by_name(args, words):
    with pytest.raises(Refused) as e:
        flat(args)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_default_error_is_a_value_error():
    with pytest.raises(ValueError, match="both"):
        control_from_args({"xmix": "{}", "xmix_apps": "a"})


# ---------------------------------------------------------------------- offline engine
D = 256


@pytest.fixture(scope="module")
def llm():
    from xmix.models.tiny import tiny_model_path

    g = torch.Generator().manual_seed(11)
    steer = xmix.App("steer")
    steer.write("add", vector=torch.randn(D, generator=g), scale=4.0).layers([1]).at(
        "residual.post"
    ).named("push")
    probe = xmix.App("probe")
    probe.read("probe", weight=torch.randn(D, generator=g) / 16, bias=0.0).layers([2]).at(
        "residual.post"
    ).named("p2")
    engine = make_llm(str(tiny_model_path("tiny-llama")), apps=[steer, probe])
    yield engine
    shutdown(engine)


@pytest.mark.engine
def test_offline_flat_and_json_forms_give_the_same_request(llm):
    from vllm import SamplingParams

    def run(extra):
        sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, extra_args=extra)
        return llm.generate(["The river"], sp, use_tqdm=False)[0]

    vanilla = run(None)
    by_json = run({"xmix": {"apps": ["steer", "probe"], "params": {"steer": {"scale": -3.0}}}})
    by_flat = run({"xmix_apps": ["steer", "probe"], "xmix.steer.scale": -3.0})
    by_string = run({"xmix_apps": "steer,probe", "xmix.steer.push.scale": -3.0})
    default_scale = run({"xmix_apps": ["steer", "probe"]})
    assert by_flat.outputs[0].token_ids == by_json.outputs[0].token_ids
    assert by_string.outputs[0].token_ids == by_json.outputs[0].token_ids
    assert by_flat.outputs[0].token_ids != vanilla.outputs[0].token_ids
    # the flat parameter took effect: scale -3 is not the app's default of 4
    assert default_scale.outputs[0].token_ids != by_flat.outputs[0].token_ids
    r_json, r_flat = xmix.results(by_json)["probe"]["p2"], xmix.results(by_flat)["probe"]["p2"]
    assert r_flat["positions"] == r_json["positions"] and r_flat["values"] == r_json["values"]
    assert xmix.results(vanilla) == {}


@pytest.mark.engine
def test_offline_conflicting_or_misspelt_controls_raise_and_the_engine_serves_on(llm):
    from vllm import SamplingParams

    bad = [
        ({"xmix": {"apps": ["steer"]}, "xmix_apps": ["steer"]}, "both"),
        ({"xmix_app": ["steer"]}, "unknown flat control 'xmix_app'"),
        ({"xmix_apps": ["nope"]}, "unknown app 'nope'"),
        ({"xmix.probe.scale": 1.0}, "which this request does not use"),
    ]
    for extra, msg in bad:
        with pytest.raises(ValueError, match=msg):
            llm.generate(["x"], SamplingParams(max_tokens=2, extra_args=extra), use_tqdm=False)
    out = llm.generate(
        ["The river"],
        SamplingParams(max_tokens=4, temperature=0, extra_args={"xmix_apps": "probe"}),
        use_tqdm=False,
    )
    assert len(out[0].outputs[0].token_ids) == 4
    assert len(xmix.results(out[0])["probe"]["p2"]["positions"]) > 0
