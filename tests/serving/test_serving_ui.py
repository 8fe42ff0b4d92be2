"""The page at ``/`` in headless Chromium (Debian's ``chromium``), driven over the Chrome DevTools Protocol.

On the tiny random model: the threshold the page shows is the one a request is served at (by default and
with "server tau"), and with an API key the page asks for it and sends it.  Slow, on the embedded
SmolLM2-135M: submit a prompt below the server's tau, screenshot, check the streamed answer appeared with
each forward's tokens in their own shaded span.

The screenshot goes to the test's tmp dir, or to ``$MARS_UI_SCREENSHOT`` when set.
"""

import base64
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from serving_fixtures import loaded, one_thread, start_server  # noqa: F401  (fixtures)

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium)")


class DevTools:
    """A minimal CDP client over one page's websocket."""

    def __init__(self, ws_url: str):
        import websocket

        self.ws = websocket.create_connection(ws_url, timeout=60, suppress_origin=True)
        self.next_id = 0

    def call(self, method: str, **params):
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def js(self, expression: str):
        out = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in out:
            raise RuntimeError(out["exceptionDetails"])
        return out["result"].get("value")

    def wait(self, expression: str, timeout: float):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = self.js(expression)
            if value:
                return value
            time.sleep(0.2)
        raise TimeoutError(expression)

    def close(self):
        self.ws.close()


def launch(user_dir: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            "--no-default-browser-check",
            f"--user-data-dir={user_dir}",
            "--remote-debugging-address=127.0.0.1",
            "--remote-debugging-port=0",
            "--window-size=1200,900",
            "about:blank",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    port_file = user_dir / "DevToolsActivePort"
    deadline = time.monotonic() + 60
    while not (port_file.is_file() and port_file.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("chromium did not start")
        time.sleep(0.1)
    port = int(port_file.read_text().split()[0])
    pages = [t for t in httpx.get(f"http://127.0.0.1:{port}/json/list").json() if t["type"] == "page"]
    return proc, pages[0]["webSocketDebuggerUrl"]


class Page:
    """A headless Chromium with one tab on ``url``, loaded and polled once."""

    def __init__(self, url: str, user_dir: Path):
        self.proc, ws_url = launch(user_dir)
        self.tab = DevTools(ws_url)
        self.tab.call("Page.enable")
        self.tab.call("Page.navigate", url=url)
        self.tab.wait("document.readyState === 'complete' && document.getElementById('model').textContent", 30)

    def close(self):
        self.tab.close()
        self.proc.terminate()
        self.proc.wait(10)

    def text(self, element_id: str) -> str:
        return self.tab.js(f"document.getElementById('{element_id}').textContent")

    def send(self, timeout: float = 60) -> str:
        """Click Send; the finish reason (or the error shown)."""
        self.tab.js("""(() => { const o = document.getElementById('output'); delete o.dataset.done;
            document.getElementById('error').textContent = '';
            document.getElementById('max-tokens').value = '6'; document.getElementById('send').click(); })()""")
        return self.tab.wait(
            "document.getElementById('output').dataset.done || document.getElementById('error').textContent", timeout
        )


def served_tau(page: Page) -> str:
    m = re.search(r"served at tau (\S+)", page.text("req"))
    assert m, page.text("req")
    return m.group(1)


def test_the_page_markup_starts_with_the_slider_in_charge():
    """Without a browser (Chromium may be missing): at load, before any script runs, the threshold sent is
    the slider's and the label shows that value."""
    from html.parser import HTMLParser

    from mars.serving.ui import PAGE

    inputs, labels = {}, {}

    class Collect(HTMLParser):
        def __init__(self):
            super().__init__()
            self.in_label = None

        def handle_starttag(self, tag, attrs):
            attrs = dict(attrs)
            if tag == "input" and "id" in attrs:
                inputs[attrs["id"]] = attrs
            self.in_label = attrs.get("id") if tag == "b" else None

        def handle_endtag(self, tag):
            self.in_label = None

        def handle_data(self, data):
            if self.in_label:
                labels[self.in_label] = data.strip()

    Collect().feed(PAGE)
    assert "checked" not in inputs["use-server"]  # the box was ticked: no threshold sent, 1.0 served
    assert "disabled" not in inputs["threshold"]
    assert labels["threshold-value"] == f"{float(inputs['threshold']['value']):.2f}"


@needs_chromium
def test_the_page_serves_the_threshold_it_shows(loaded, tmp_path):
    """What the label shows is what the request is served at: the slider's 0.90 at load, the value it is
    moved to, and with "server tau" ticked the server's own 1.0."""
    srv = start_server(loaded, "threshold=1.0", "tau_min=0.5")
    page = Page(srv.url + "/", tmp_path / "profile")
    try:
        shown = page.text("threshold-value")
        assert shown == "0.90"
        assert page.send() in ("stop", "length")
        assert served_tau(page) == f"{float(shown):.3f}"
        # moving the slider changes the request, not just the label
        page.tab.js("""(() => { const s = document.getElementById('threshold'); s.value = '0.62';
            s.dispatchEvent(new Event('input')); })()""")
        assert page.text("threshold-value") == "0.62"
        assert page.send() in ("stop", "length")
        assert served_tau(page) == "0.620"
        page.tab.js("document.getElementById('use-server').click()")  # leave tau to the server
        page.tab.wait("document.getElementById('threshold-value').textContent === '1.00'", 5)
        assert page.send() in ("stop", "length")
        assert served_tau(page) == "1.000"
    finally:
        page.close()
        srv.stop()


@needs_chromium
def test_the_page_sends_the_api_key_the_server_asks_for(loaded, tmp_path, monkeypatch):
    monkeypatch.setenv("MARS_API_KEY", "page-key")
    srv = start_server(loaded)
    page = Page(srv.url + "/", tmp_path / "profile")
    try:
        page.tab.wait("!document.getElementById('api-key-box').hidden", 5)
        assert "401" in page.send()  # no key yet: the server's refusal is shown
        page.tab.js("document.getElementById('api-key').value = 'page-key'")
        assert page.send() in ("stop", "length")
    finally:
        page.close()
        srv.stop()


@pytest.mark.slow
@needs_chromium
def test_the_page_streams_an_answer_with_shaded_forwards(tmp_path):
    from hydra import compose, initialize_config_dir

    from mars.serving.config import ServeConfig
    from mars.serving.server import BackgroundServer, build_state

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        # MARS_UI_CHECKPOINT=<trained checkpoint>: the committed screenshot is taken from a trained model
        model = f"checkpoint={os.environ['MARS_UI_CHECKPOINT']}" if os.environ.get("MARS_UI_CHECKPOINT") else None
        cfg = compose(config_name="serve", overrides=[model or "model=smollm2-135m", "max_tokens=64"])
    srv = BackgroundServer(build_state(ServeConfig.from_cfg(cfg))).start()
    proc, ws_url = launch(tmp_path / "chromium-profile")
    page = DevTools(ws_url)
    try:
        page.call("Page.enable")
        page.call("Page.navigate", url=srv.url + "/")
        page.wait("document.readyState === 'complete' && document.getElementById('model').textContent", 30)
        page.js("""(() => {
            document.getElementById('prompt').value = 'List three facts about the moon.';
            const box = document.getElementById('use-server'); box.checked = false;
            box.dispatchEvent(new Event('change'));
            const s = document.getElementById('threshold'); s.value = '0.9';
            s.dispatchEvent(new Event('input'));
            document.getElementById('max-tokens').value = '48';
            document.getElementById('send').click();
        })()""")
        reason = page.wait(
            "document.getElementById('output').dataset.done || document.getElementById('error').textContent", 180
        )
        assert reason in ("stop", "length"), reason
        time.sleep(1.2)  # one more poll of the live figures
        text = page.js("document.getElementById('output').textContent")
        spans = page.js("[...document.querySelectorAll('#output .fwd')].map(s => +s.dataset.tokens)")
        stats = page.js("document.getElementById('req').textContent")
        shot = base64.b64decode(page.call("Page.captureScreenshot", format="png")["data"])
        out = Path(os.environ.get("MARS_UI_SCREENSHOT") or tmp_path / "ui.png")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(shot)
        print(f"screenshot: {out}")
        assert len(text.strip()) > 10 and len(spans) >= 2
        assert sum(spans) >= len(spans) and max(spans) >= 1
        assert "served at tau 0.900" in stats and "tokens/forward" in stats
        assert shot[:8] == b"\x89PNG\r\n\x1a\n" and len(shot) > 10_000
    finally:
        page.close()
        proc.terminate()
        proc.wait(10)
        srv.stop()
