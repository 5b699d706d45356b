"""The settings module (issue 30, item 5): every XMIX_* variable typed, defaulted and documented
once; bad values and unknown names refused with the variable's name, at the start of
``xmix serve``, ``xmix.LLM`` and any vLLM engine (the plugin's register()); docs/settings.md
generated from the table. Expectations are written by hand."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from xmix import settings
from xmix.settings import SettingError

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "python" / "xmix"
NAME = re.compile(r"\bXMIX_[A-Z0-9]+(?:_[A-Z0-9]+)*\b")
# XMIX_ names in the package's source that are not environment variables
NOT_VARIABLES = {
    "XMIX_STATUSES": "http_routes.XMIX_STATUSES, the HTTP status table",
    "XMIX_APPS": "a misspelt request key in request_controls' examples",
}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("XMIX_"):
            monkeypatch.delenv(name)


def test_defaults_when_unset_or_empty(monkeypatch):
    assert settings.get("XMIX_SYNC_S") == 0.25
    assert settings.get("XMIX_RPC_TIMEOUT_S") == 30.0
    assert settings.get("XMIX_MAX_RESULT_BYTES") == 16777216
    assert settings.get("XMIX_MAX_APP_BYTES") == 1073741824
    assert settings.get("XMIX_MAX_CONTROL_BYTES") == 65536
    assert settings.get("XMIX_MAX_APPS") == 64
    assert settings.get("XMIX_MAX_OPS") is None  # the engine's room
    assert settings.get("XMIX_CAPTURE_MB") == 16.0
    assert settings.get("XMIX_GRAPH_PATCH") is True
    assert settings.get("XMIX_GRAPH_VERIFY") is False
    assert settings.get("XMIX_ENABLE") is False
    assert settings.get("XMIX_METRICS_APP_LABELS") == "names"
    assert settings.get("XMIX_STATE_DIR") is None
    assert settings.get("XMIX_DEPLOYMENT_SECRET") is None
    assert list(settings.get("XMIX_ADMIN_KEY")) == []
    monkeypatch.setenv("XMIX_SYNC_S", "")  # empty counts as unset
    assert settings.get("XMIX_SYNC_S") == 0.25
    assert not settings.is_set("XMIX_SYNC_S")


def test_values_parse(monkeypatch):
    for raw, want in (("0.5", 0.5), (" 2 ", 2.0), ("1e-3", 0.001), ("0", 0.0)):
        monkeypatch.setenv("XMIX_SYNC_S", raw)
        assert settings.get("XMIX_SYNC_S") == want
    monkeypatch.setenv("XMIX_MAX_APPS", "3")
    assert settings.get("XMIX_MAX_APPS") == 3
    for raw, want in (("1", True), ("TRUE", True), ("yes", True), ("On", True)):
        monkeypatch.setenv("XMIX_GRAPH_VERIFY", raw)
        assert settings.get("XMIX_GRAPH_VERIFY") is want
    for raw in ("0", "false", "No", "OFF"):
        monkeypatch.setenv("XMIX_GRAPH_PATCH", raw)
        assert settings.get("XMIX_GRAPH_PATCH") is False
    monkeypatch.setenv("XMIX_ADMIN_KEY", "k1, k2,,k3")
    assert settings.get("XMIX_ADMIN_KEY") == ["k1", "k2", "k3"]
    monkeypatch.setenv("XMIX_DEPLOYMENT_SECRET", "0123456789abcdef")
    assert settings.get("XMIX_DEPLOYMENT_SECRET") == b"0123456789abcdef"
    monkeypatch.setenv("XMIX_SERVE_APPS", '[["/a.xmix", "all", true]]')
    assert settings.get("XMIX_SERVE_APPS") == [["/a.xmix", "all", True]]


@pytest.mark.parametrize(
    "name, raw, message",
    [
        (
            "XMIX_SYNC_S",
            "abc",
            "XMIX_SYNC_S='abc' is not a number (seconds between an API server's reads of the "
            "engines' ledger of app changes)",
        ),
        ("XMIX_RPC_TIMEOUT_S", "-1", "XMIX_RPC_TIMEOUT_S='-1' is negative ("),
        ("XMIX_CAPTURE_MB", "nan", "XMIX_CAPTURE_MB='nan' is not a finite number ("),
        ("XMIX_MAX_APPS", "abc", "XMIX_MAX_APPS='abc' is not an integer (apps deployed at once"),
        ("XMIX_MAX_APP_OPS", "1.5", "XMIX_MAX_APP_OPS='1.5' is not an integer ("),
        ("XMIX_MAX_RESULT_BYTES", "-5", "XMIX_MAX_RESULT_BYTES='-5' is negative ("),
        (
            "XMIX_GRAPH_CHECK",
            "maybe",
            "XMIX_GRAPH_CHECK='maybe' is not a yes/no value (one of 1, true, yes, on, 0, "
            "false, no, off) (check a patched graph's first replay",
        ),
        ("XMIX_ENABLE", "2", "XMIX_ENABLE='2' is not a yes/no value"),
        (
            "XMIX_METRICS_APP_LABELS",
            "hidden",
            "XMIX_METRICS_APP_LABELS='hidden' must be one of ['names', 'hashed'] (",
        ),
        ("XMIX_SERVE_APPS", "[1,", "XMIX_SERVE_APPS='[1,' is not JSON ("),
    ],
)
def test_bad_values_name_the_variable_and_the_value(monkeypatch, name, raw, message):
    monkeypatch.setenv(name, raw)
    with pytest.raises(SettingError) as e:
        settings.get(name)
    assert str(e.value).startswith(message), str(e.value)
    with pytest.raises(SettingError) as e:
        settings.check_environment()
    assert str(e.value).startswith(message), str(e.value)


def test_a_secret_is_named_never_shown(monkeypatch):
    monkeypatch.setenv("XMIX_DEPLOYMENT_SECRET", "hunter2")
    with pytest.raises(SettingError) as e:
        settings.check_environment()
    msg = str(e.value)
    assert msg.startswith(
        "XMIX_DEPLOYMENT_SECRET has 7 bytes; a deployment secret needs at least 16"
    ), msg
    assert "hunter2" not in msg


def test_unknown_names_are_refused_with_the_closest_and_without_the_value():
    env = {
        "XMIX_SYNC": "0.5",
        "XMIX_DEPLOYMENT_SECRT": "s3cret-value-s3cret-value",
        "XMIX_SOMETHING_ELSE": "1",
        "XMIX_NO_APT": "1",  # a script's variable: known
        "XMIX_MAX_APPS": "4",  # fine
        "OTHER": "x",
    }
    with pytest.raises(SettingError) as e:
        settings.check_environment(env)
    assert str(e.value).splitlines() == [
        "XMIX_DEPLOYMENT_SECRT is not an xmix setting; did you mean XMIX_DEPLOYMENT_SECRET? "
        "(docs/settings.md lists them; xmix settings)",
        "XMIX_SOMETHING_ELSE is not an xmix setting (docs/settings.md lists them; xmix settings)",
        "XMIX_SYNC is not an xmix setting; did you mean XMIX_SYNC_S? (docs/settings.md lists "
        "them; xmix settings)",
    ]
    settings.check_environment({"XMIX_SYNC_S": "1", "XMIX_TEST_WORKERS": "4", "PATH": "/x"})


def test_overridden_sets_checks_and_restores(monkeypatch):
    with settings.overridden("XMIX_MAX_RESULT_BYTES", "5"):
        assert settings.get("XMIX_MAX_RESULT_BYTES") == 5
    assert "XMIX_MAX_RESULT_BYTES" not in os.environ
    monkeypatch.setenv("XMIX_MAX_RESULT_BYTES", "7")
    with settings.overridden("XMIX_MAX_RESULT_BYTES", "5"):
        assert settings.get("XMIX_MAX_RESULT_BYTES") == 5
    assert os.environ["XMIX_MAX_RESULT_BYTES"] == "7"
    with pytest.raises(SettingError, match="XMIX_MAX_RESULT_BYTES='x' is not an integer"):
        settings.set_env("XMIX_MAX_RESULT_BYTES", "x")
    with pytest.raises(KeyError):
        settings.get("XMIX_NOT_A_SETTING")


def test_serve_flags_come_from_the_table():
    from xmix.integrations.vllm import tenants

    assert tenants.SERVE_FLAGS == {
        "--xmix-admin-key": "XMIX_ADMIN_KEY",
        "--xmix-policy": "XMIX_POLICY",
        "--xmix-audit-log": "XMIX_AUDIT_LOG",
        "--xmix-metrics-app-labels": "XMIX_METRICS_APP_LABELS",
        "--xmix-max-request-apps": "XMIX_MAX_REQUEST_APPS",
        "--xmix-max-request-params": "XMIX_MAX_REQUEST_PARAMS",
        "--xmix-max-apps": "XMIX_MAX_APPS",
        "--xmix-max-ops": "XMIX_MAX_OPS",
        "--xmix-max-result-bytes": "XMIX_MAX_RESULT_BYTES",
        "--xmix-max-response-bytes": "XMIX_MAX_RESPONSE_BYTES",
    }


# ---------------------------------------------------------------------- one place
def test_docs_table_is_the_generated_one():
    text = (ROOT / "docs" / "settings.md").read_text()
    begin = "<!-- BEGIN generated: xmix settings --markdown -->\n"
    end = "<!-- END generated -->"
    assert begin in text and end in text
    committed = text.split(begin, 1)[1].split(end, 1)[0]
    assert committed == settings.markdown(), (
        "docs/settings.md is out of date: paste `xmix settings --markdown` between its markers"
    )
    for s in settings.SETTINGS:  # every variable, internal ones included, is in the docs
        assert f"`{s.name}`" in committed


def test_every_xmix_name_in_the_package_is_declared():
    seen: dict[str, str] = {}
    for path in sorted(PKG.rglob("*.py")):
        for name in NAME.findall(path.read_text()):
            seen.setdefault(name, str(path.relative_to(ROOT)))
    undeclared = {
        n: where
        for n, where in seen.items()
        if n not in settings.BY_NAME and n not in settings.TOOL_VARIABLES and n not in NOT_VARIABLES
    }
    assert not undeclared, (
        f"XMIX_ names in python/xmix missing from settings.SETTINGS: {undeclared}"
    )
    unused = [s.name for s in settings.SETTINGS if not _read_outside_settings(s.name)]
    assert not unused, f"declared but read nowhere in the package: {unused}"


def _read_outside_settings(name: str) -> bool:
    for path in PKG.rglob("*.py"):
        if path.name != "settings.py" and f'"{name}"' in path.read_text():
            return True
    return False


def test_no_direct_environment_read_of_an_xmix_variable_in_the_package():
    direct = re.compile(
        r"environ(?:\.get\(|\[|\.pop\(|\.setdefault\()\s*\"XMIX_|\"XMIX_\w+\" in os\.environ"
    )
    found = []
    for path in sorted(PKG.rglob("*.py")):
        if path.name == "settings.py":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if direct.search(line):
                found.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not found, "read XMIX_* through xmix.settings:\n" + "\n".join(found)


def test_variables_the_repository_sets_or_reads_are_known():
    """check_environment() must not refuse what the repository's own scripts, tests and
    benchmarks set: every XMIX_ variable they read or set is in a table."""
    shell = re.compile(r"\$\{?(XMIX_[A-Z0-9_]+)")
    py = re.compile(
        r"(?:environ(?:\.get\(|\[|\.pop\(|\.setdefault\()|setenv\(|delenv\()\s*\"(XMIX_[A-Z0-9_]+)\""
    )
    known = set(settings.BY_NAME) | set(settings.TOOL_VARIABLES)
    found: dict[str, str] = {}
    for top in ("scripts", "bench", "tests"):
        for path in sorted((ROOT / top).rglob("*")):
            if path.suffix not in (".sh", ".py") or path.name == "test_settings.py":
                continue
            text = path.read_text()
            pattern = shell if path.suffix == ".sh" else py
            for name in pattern.findall(text):
                found.setdefault(name, str(path.relative_to(ROOT)))
    unknown = {n: where for n, where in found.items() if n not in known}
    assert not unknown, f"set or read by the repository but in no table: {unknown}"
    assert set(settings.TOOL_VARIABLES) <= set(found), "a tool variable no script reads"


def test_settings_imports_neither_vllm_nor_torch():
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('s', {str(PKG / 'settings.py')!r})\n"
        "m = importlib.util.module_from_spec(spec); sys.modules['s'] = m\n"
        "spec.loader.exec_module(m)\n"
        "print(sorted(k for k in sys.modules if k.split('.')[0] in ('vllm', 'torch', 'xmix')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---------------------------------------------------------------------- refused at start
def test_xmix_serve_refuses_a_bad_value_before_anything_starts(monkeypatch, capsys):
    from xmix.integrations.vllm.http import serve_cli

    def no(*a, **k):
        raise AssertionError("reached past the settings check")

    monkeypatch.setattr(serve_cli, "_run_vllm_serve", no)
    monkeypatch.setattr("xmix.lang.architectures.check_architecture", no)
    monkeypatch.setenv("XMIX_MAX_APPS", "1")  # serve_main sets it below; put back after
    monkeypatch.setenv("XMIX_SYNC_S", "abc")
    assert serve_cli.serve_main(["some/model"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("xmix serve: XMIX_SYNC_S='abc' is not a number (seconds between"), err
    monkeypatch.delenv("XMIX_SYNC_S")
    monkeypatch.setenv("XMIX_MAX_APP", "4")  # a typo
    assert serve_cli.serve_main(["some/model"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("xmix serve: XMIX_MAX_APP is not an xmix setting; did you mean "), err
    monkeypatch.delenv("XMIX_MAX_APP")
    # a flag sets its variable, checked the same way
    assert serve_cli.serve_main(["some/model", "--xmix-max-apps", "lots"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("xmix serve: XMIX_MAX_APPS='lots' is not an integer ("), err


def test_xmix_llm_and_the_plugin_refuse_a_bad_value(monkeypatch):
    import xmix
    from xmix.integrations.vllm import plugin

    monkeypatch.setenv("XMIX_GRAPH_CHECK_GRAPHS", "eight")
    with pytest.raises(SettingError, match=r"^XMIX_GRAPH_CHECK_GRAPHS='eight' is not an integer"):
        xmix.LLM(model="no/such-model-is-looked-up")
    with pytest.raises(SettingError, match=r"^XMIX_GRAPH_CHECK_GRAPHS='eight' is not an integer"):
        plugin.register()
    # vLLM's EngineArgs (what vllm.LLM and vllm serve build first, before any engine process)
    # loads the general plugins: a plain vLLM engine start is refused there. vLLM loads them
    # once per process, so its flag is put back for this check.
    import vllm.plugins
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    with pytest.raises(SettingError, match=r"^XMIX_GRAPH_CHECK_GRAPHS='eight' is not an integer"):
        EngineArgs(model="no/such-model-is-looked-up")
    monkeypatch.setenv("XMIX_DISABLE", "1")  # xmix off: nothing else is checked
    plugin.register()
