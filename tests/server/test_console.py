"""The xmix console in a real browser: Debian's chromium driven by Selenium through its
chromedriver, against ``xmix serve`` on the tiny Llama (one server for the module).

Each view is checked against what the server answers in JSON to the same request, and a
screenshot of each view is written to build/screenshots/ (git-ignored)."""

from __future__ import annotations

import math
import re
import shutil
import struct
import tempfile
from pathlib import Path

import httpx
import pytest

import xmix
from serve_util import xmix_server

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]
SHOTS = ROOT / "build" / "screenshots"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
CHROME_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1400,1800",
]
XSS = '<script>window.__xss=1</script><img src=x onerror="window.__xss=2"> Once'


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def _browser_missing() -> str | None:
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[test]')"
    if not CHROMIUM or not CHROMEDRIVER:
        return (
            "Debian's chromium and chromium-driver are not installed (scripts/setup.sh installs "
            "them when run as root: apt-get install -y chromium chromium-driver)"
        )
    return None


if _browser_missing():
    pytest.skip(_browser_missing(), allow_module_level=True)

from selenium import webdriver  # noqa: E402
from selenium.common.exceptions import TimeoutException  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402


def _apps(model: Path, out: Path):
    """The demo's apps (steer_the: a write, lens_probe: a read), a gated app, and an app file
    that is not deployed at start (deployed through the page)."""
    from safetensors import safe_open
    from transformers import AutoTokenizer

    from xmix.demo import demo_apps

    paths, _ = demo_apps(model, out)
    tok = AutoTokenizer.from_pretrained(model)
    tid = tok.encode(" the", add_special_tokens=False)[-1]
    with safe_open(str(model / "model.safetensors"), "pt") as f:
        w = f.get_tensor("lm_head.weight")[tid].float()
    u = w / w.norm()
    g = xmix.App("gated", metadata={"note": "<img src=x onerror=\"window.__xss='meta'\">"})
    g.param("theta", 0.5)
    g.read("probe", weight=u, bias=0.0).layers([1]).at("residual.post").named("g")
    g.write("add", vector=u, scale=6.0).layers([3]).at("residual.post").named("push").cond(
        gate="g >= theta"
    )
    paths.append(g.save(out / "gated.xmix"))
    up = xmix.App("uploaded", metadata={"note": "<script>window.__xss='upload'</script>"})
    up.read("probe", weight=u, bias=0.0).layers([2]).at("residual.post").named("u")
    return paths, up.save(out / "uploaded.xmix")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from xmix.models.tiny import tiny_model_path

    tmp = tmp_path_factory.mktemp("console")
    paths, upload = _apps(tiny_model_path("tiny-llama"), tmp)
    with xmix_server(tmp, paths, "--host", "127.0.0.1") as s:
        s["upload"] = upload
        yield s


@pytest.fixture(scope="module")
def page(server):
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    profile = tempfile.mkdtemp(prefix="xmix-chromium-")
    for a in CHROME_FLAGS + [f"--user-data-dir={profile}"]:
        opts.add_argument(a)
    d = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    SHOTS.mkdir(parents=True, exist_ok=True)
    try:
        d.get(server["base"] + "/xmix/ui")
        d.find_element(By.ID, "api-key").send_keys(server["key"])
        d.find_element(By.ID, "key-connect").click()
        wait(d, lambda d: d.find_element(By.ID, "conn-status").text == "connected", 30)
        yield d
    finally:
        d.quit()
        shutil.rmtree(profile, ignore_errors=True)


def wait(d, cond, timeout=60):
    return WebDriverWait(d, timeout, poll_frequency=0.2).until(cond)


def view(d, name):
    renders = d.find_element(By.ID, "apps-list").get_attribute("data-renders")
    d.find_element(By.CSS_SELECTOR, f".tab[data-view={name}]").click()
    wait(d, lambda d: d.find_element(By.ID, f"view-{name}").is_displayed(), 10)
    if name == "apps":  # the view reloads the app list when opened: wait for that render
        wait(
            d,
            lambda d: d.find_element(By.ID, "apps-list").get_attribute("data-renders") != renders,
            10,
        )


def run_playground(d, prompt, apps, params=None, max_tokens=12, kind="completion"):
    view(d, "playground")
    Select(d.find_element(By.ID, "pg-kind")).select_by_value(kind)
    for box in d.find_elements(By.CSS_SELECTOR, "#pg-app-list input[type=checkbox]"):
        if box.is_selected() != (box.get_attribute("data-app") in apps):
            box.click()
    for inp in d.find_elements(By.CSS_SELECTOR, "#pg-app-list input[data-param]"):
        inp.clear()
        v = (
            (params or {})
            .get(inp.get_attribute("data-app"), {})
            .get(inp.get_attribute("data-param"))
        )
        if v is not None:
            inp.send_keys(str(v))
    mt = d.find_element(By.ID, "pg-max-tokens")
    mt.clear()
    mt.send_keys(str(max_tokens))
    box = d.find_element(By.ID, "pg-prompt")
    box.clear()
    box.send_keys(prompt)
    d.find_element(By.ID, "pg-run").click()
    wait(d, lambda d: d.find_element(By.ID, "pg-status").text not in ("", "running…"), 120)
    status = d.find_element(By.ID, "pg-status")
    assert status.text.startswith("done"), status.text


def completion(server, prompt, xargs=None, max_tokens=12):
    body = {
        "model": server["name"],
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "seed": 0,
    }
    if xargs is not None:
        body["vllm_xargs"] = xargs
    r = server["client"].post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def cells(d, column, app, key, kind="read"):
    sel = f"#pg-{column} .heatmap[data-app='{app}'][data-{kind}='{key}'] .tok"
    return d.find_elements(By.CSS_SELECTOR, sel)


def metric(server, name, **labels):
    text = server["client"].get("/metrics").text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


# ---------------------------------------------------------------------- tests
def test_the_page_is_served_without_the_key_but_its_data_is_not(server):
    base = server["base"]
    r = httpx.get(base + "/xmix/ui", follow_redirects=True)
    assert r.status_code == 200 and r.url.path == "/xmix/ui/"
    assert "script-src 'self'" in r.headers["content-security-policy"]
    assert (
        httpx.get(base + "/xmix/ui/console.js")
        .headers["content-type"]
        .startswith("text/javascript")
    )
    assert httpx.get(base + "/xmix/ui/../server.py").status_code == 404
    assert httpx.get(base + "/xmix/ui/secret.txt").status_code == 404
    for path in ("/xmix/v1/console/info", "/xmix/v1/console/live"):
        assert httpx.get(base + path).status_code == 401
    assert httpx.post(base + "/xmix/v1/console/tokens", json={"ids": [1]}).status_code == 401
    assert (
        server["client"].post("/xmix/v1/console/tokens", json={"ids": [10**9]}).status_code == 400
    )


def test_playground_steered_differs_and_heatmap_cells_equal_the_json(server, page):
    prompt = "Once upon a time"
    run_playground(page, prompt, ["steer_the", "lens_probe"])
    van = completion(server, prompt)
    st = completion(server, prompt, {"xmix_apps": ["steer_the", "lens_probe"]})
    page_van = page.find_element(By.CSS_SELECTOR, "#pg-vanilla pre.answer").text
    page_st = page.find_element(By.CSS_SELECTOR, "#pg-steered pre.answer").text
    assert page_van.strip() == van["choices"][0]["text"].strip()
    assert page_st.strip() == st["choices"][0]["text"].strip()
    assert van["choices"][0]["text"] != st["choices"][0]["text"]
    # one cell per token of prompt + completion; values where the read ran, equal to the JSON
    lean = st["xmix"]["lens_probe"]["lean"]
    n_tokens = st["usage"]["prompt_tokens"] + st["usage"]["completion_tokens"]
    tokens = cells(page, "steered", "lens_probe", "lean")
    assert len(tokens) == n_tokens
    assert [int(c.get_attribute("data-pos")) for c in tokens] == list(range(n_tokens))
    valued = [c for c in tokens if c.get_attribute("data-value") is not None]
    assert [int(c.get_attribute("data-pos")) for c in valued] == lean["positions"]
    assert [float(c.get_attribute("data-value")) for c in valued] == lean["values"]
    # the prompt's text is there, cell by cell; hovering tells position and value
    assert "".join(c.text for c in tokens[: st["usage"]["prompt_tokens"]]).endswith(prompt)
    title = valued[3].get_attribute("title")
    assert title.startswith("position 3 · ")
    assert float(re.search(r"\nvalue (\S+)$", title).group(1)) == lean["values"][3]
    # the vanilla request named no app: no reads
    assert not page.find_elements(By.CSS_SELECTOR, "#pg-vanilla .heatmap")
    page.save_screenshot(str(SHOTS / "playground.png"))


def test_gate_decisions_are_marked_on_the_tokens_they_fired_on(server, page):
    prompt = "The river ran"
    theta = 0.45
    run_playground(page, prompt, ["gated"], {"gated": {"theta": theta}})
    st = completion(server, prompt, {"xmix_apps": "gated", "xmix.gated.theta": theta})
    g = st["xmix"]["gated"]["g"]
    assert (
        page.find_element(By.CSS_SELECTOR, "#pg-steered pre.answer").text.strip()
        == st["choices"][0]["text"].strip()
    )
    by_pos = dict(zip(g["positions"], g["values"]))
    n = st["usage"]["prompt_tokens"] + st["usage"]["completion_tokens"]
    expect = [str(by_pos.get(t, math.nan) >= _f32(theta)).lower() for t in range(n - 1)] + [""]
    marks = cells(page, "steered", "gated", "push", kind="op")
    assert [c.get_attribute("data-fired") for c in marks] == expect
    assert "true" in expect and "false" in expect, "pick a theta that splits the tokens"
    assert [c.get_attribute("class").split().count("fired") for c in marks] == [
        int(e == "true") for e in expect
    ]


def test_playground_chat_streams_and_maps_the_template_tokens(server, page):
    message = "Tell me a story"
    run_playground(page, message, ["lens_probe"], kind="chat", max_tokens=8)
    body = {
        "model": server["name"],
        "messages": [{"role": "user", "content": message}],
        "max_tokens": 8,
        "temperature": 0,
        "seed": 0,
        "vllm_xargs": {"xmix_apps": "lens_probe"},
    }
    r = server["client"].post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    chat = r.json()
    assert (
        page.find_element(By.CSS_SELECTOR, "#pg-steered pre.answer").text.strip()
        == chat["choices"][0]["message"]["content"].strip()
    )
    lean = chat["xmix"]["lens_probe"]["lean"]
    tokens = cells(page, "steered", "lens_probe", "lean")
    assert len(tokens) == chat["usage"]["prompt_tokens"] + chat["usage"]["completion_tokens"]
    valued = [c for c in tokens if c.get_attribute("data-value") is not None]
    assert [float(c.get_attribute("data-value")) for c in valued] == lean["values"]
    # the chat template's tokens are shown: the user's message is inside the prompt cells
    assert message in "".join(c.text for c in tokens[: chat["usage"]["prompt_tokens"]])


def test_model_and_client_text_renders_as_text(server, page):
    run_playground(page, XSS, ["lens_probe"], max_tokens=4)
    assert page.execute_script("return window.__xss") is None
    reads = page.find_element(By.CSS_SELECTOR, "#pg-steered .reads")
    assert not reads.find_elements(By.CSS_SELECTOR, "script, img")
    heat = page.find_element(By.CSS_SELECTOR, "#pg-steered .heatmap[data-app='lens_probe']")
    text = heat.get_attribute("textContent")
    assert (
        "<script>window.__xss=1</script>" in text and '<img src=x onerror="window.__xss=2">' in text
    )
    # app metadata (a client's text) in the Apps view
    view(page, "apps")
    card = page.find_element(By.CSS_SELECTOR, ".app-card[data-app='gated']")
    assert "<img src=x onerror=" in card.find_element(By.CSS_SELECTOR, "pre.metadata").text
    assert not page.find_elements(By.CSS_SELECTOR, "#apps-list img, #apps-list script")
    assert page.execute_script("return window.__xss") is None


def test_deploy_mode_params_and_undeploy_through_the_page_take_effect(server, page):
    prompt = "Once upon a time"
    view(page, "apps")
    status = page.find_element(By.ID, "apps-status")
    page.find_element(By.ID, "deploy-file").send_keys(str(server["upload"]))
    Select(page.find_element(By.ID, "deploy-mode")).select_by_value("request")
    page.find_element(By.ID, "deploy-button").click()
    wait(page, lambda d: "uploaded" in status.text)
    assert status.text == "uploaded: deployed (mode request)", status.text
    wait(page, lambda d: d.find_elements(By.CSS_SELECTOR, ".app-card[data-app='uploaded']"))
    card = page.find_element(By.CSS_SELECTOR, ".app-card[data-app='uploaded']")
    assert (
        card.find_element(By.CSS_SELECTOR, "td.on").get_attribute("title")
        == "layers.2.residual.post"
    )
    assert (
        "<script>window.__xss='upload'</script>"
        in card.find_element(By.CSS_SELECTOR, "pre.metadata").text
    )
    page.save_screenshot(str(SHOTS / "apps.png"))
    before = completion(server, prompt, {"xmix_apps": "uploaded"})["xmix"]["uploaded"]["u"]

    # a parameter changed on the page: probe values are sigmoid(w.x + b), so every logit moves by
    # exactly the change of b
    inp = card.find_element(By.CSS_SELECTOR, "input[data-param='u.bias']")
    inp.clear()
    inp.send_keys("1.5")
    card.find_element(By.CSS_SELECTOR, "button.save-params").click()
    wait(page, lambda d: status.text.startswith("uploaded: params changed"))
    after = completion(server, prompt, {"xmix_apps": "uploaded"})["xmix"]["uploaded"]["u"]
    logit = lambda p: math.log(p / (1 - p))  # noqa: E731
    assert after["positions"] == before["positions"]
    for a, b in zip(after["values"], before["values"]):
        assert logit(a) - logit(b) == pytest.approx(1.5, abs=2e-4)

    # mode off: the next request naming it is refused; mode all: a request naming nothing gets it
    card = page.find_element(By.CSS_SELECTOR, ".app-card[data-app='uploaded']")
    Select(card.find_element(By.CSS_SELECTOR, "select.mode-select")).select_by_value("off")
    wait(page, lambda d: status.text == "uploaded: mode changed")
    body = {
        "model": server["name"],
        "prompt": prompt,
        "max_tokens": 2,
        "vllm_xargs": {"xmix_apps": "uploaded"},
    }
    r = server["client"].post("/v1/completions", json=body)
    assert r.status_code == 400 and "switched off" in r.text
    card = page.find_element(By.CSS_SELECTOR, ".app-card[data-app='uploaded']")
    Select(card.find_element(By.CSS_SELECTOR, "select.mode-select")).select_by_value("all")
    wait(page, lambda d: status.text == "uploaded: mode changed")
    assert "uploaded" in completion(server, prompt)["xmix"]
    assert [
        a["mode"]
        for a in server["client"].get("/xmix/v1/apps").json()["apps"]
        if a["name"] == "uploaded"
    ] == ["all"]

    # undeploy: gone from the control plane, and the next request naming it is refused
    card = page.find_element(By.CSS_SELECTOR, ".app-card[data-app='uploaded']")
    card.find_element(By.CSS_SELECTOR, "button.undeploy").click()
    wait(page, lambda d: status.text == "uploaded: undeployed")
    wait(page, lambda d: not d.find_elements(By.CSS_SELECTOR, ".app-card[data-app='uploaded']"))
    assert "uploaded" not in [
        a["name"] for a in server["client"].get("/xmix/v1/apps").json()["apps"]
    ]
    r = server["client"].post("/v1/completions", json=body)
    assert r.status_code == 400 and "unknown app 'uploaded'" in r.text
    assert "uploaded" not in (completion(server, prompt).get("xmix") or {})


def test_live_view_shows_the_metrics_counters_and_refreshes(server, page):
    view(page, "live")

    def cell(app, sel):
        # read in one script call: the view re-renders its table every 2 s
        return page.execute_script(
            "const c = document.querySelector(arguments[0]); return c ? c.textContent : null;",
            f"#live-table tr[data-app='{app}'] {sel}",
        )

    def shown(app):
        return float(cell(app, "td.admitted"))

    try:
        wait(page, lambda d: cell("lens_probe", "td.admitted") is not None)
    except TimeoutException:
        # what the view said and what the endpoint answers, for the next failure's reader
        r = server["client"].get("/xmix/v1/console/live")
        status = page.find_element(By.ID, "live-status").text
        visible = page.execute_script("return document.visibilityState")
        raise AssertionError(
            f"the live table never showed lens_probe: #live-status {status!r}, "
            f"document.visibilityState {visible!r}, GET /xmix/v1/console/live "
            f"{r.status_code}: {r.text[:300]}"
        ) from None
    assert shown("lens_probe") == metric(server, "vllm:xmix_app_requests_total", app="lens_probe")
    tokens = metric(server, "vllm:xmix_gate_tokens_total", app="gated")
    fired = metric(server, "vllm:xmix_gate_fired_tokens_total", app="gated")
    assert tokens > 0
    assert cell("gated", "td.gates div").startswith(f"g >= theta: {int(fired)} / {int(tokens)} = ")
    assert cell("steer_the", "td.finished") != "0"
    before = shown("lens_probe")
    completion(server, "Refresh me", {"xmix_apps": ["lens_probe"]})
    wait(page, lambda d: shown("lens_probe") == before + 1, 15)  # no reload: the view polls
    assert shown("lens_probe") == metric(server, "vllm:xmix_app_requests_total", app="lens_probe")
    # a monitor: the demo's guard stops a steered request; the view shows it per read
    r = completion(
        server,
        "Stop me",
        {"xmix_apps": ["steer_the", "the_guard"], "xmix.the_guard.theta": 0.5},
    )
    assert r["choices"][0]["finish_reason"] == "stop" and r["xmix_applied"]["stopped"]
    stopped = metric(server, "vllm:xmix_requests_stopped_total", app="the_guard")
    assert stopped >= 1
    sel = "td.monitors div[data-action='stopped']"
    wait(page, lambda d: (cell("the_guard", sel) or "").endswith(f": {int(stopped)}"), 15)
    assert cell("the_guard", sel) == f"stopped by lean: {int(stopped)}"
    page.save_screenshot(str(SHOTS / "live.png"))


def test_server_start_logs_each_app_and_the_console_url(server):
    log = server["log"].read_text()
    lines = [l for l in log.splitlines() if re.search(r"xmix: app \w+  mode=", l)]
    assert len(lines) == 4
    assert re.search(
        r"xmix: app steer_the  mode=request  sites=layers\.3\.residual\.post$", lines[0]
    )
    assert re.search(r"xmix: app lens_probe  mode=request  sites=final\.post$", lines[1])
    assert re.search(r"xmix: app the_guard  mode=request  sites=final\.post$", lines[2])
    assert re.search(
        r"xmix: app gated  mode=request  sites=layers\.1\.residual\.post, "
        r"layers\.3\.residual\.post$",
        lines[3],
    )
    assert f"xmix: console at http://127.0.0.1:{server['port']}/xmix/ui/" in log
