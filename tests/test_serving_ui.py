"""The page at ``/`` in headless Chromium (Debian's ``chromium``), driven over the Chrome DevTools Protocol:
load it, submit a prompt below the server's tau, screenshot, check the streamed answer appeared with
each forward's tokens in their own shaded span.  Slow: it serves the embedded SmolLM2-135M.

The screenshot goes to the test's tmp dir, or to ``$MARS_UI_SCREENSHOT`` when set.
"""

import base64
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


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


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium)")
def test_the_page_streams_an_answer_with_shaded_forwards(tmp_path):
    from hydra import compose, initialize_config_dir

    from mars.serving.config import ServeConfig, build_state
    from mars.serving.server import BackgroundServer

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="serve", overrides=["model=smollm2-135m", "max_tokens=64"])
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
