"""A real browser as the client: headless Chromium's own JavaScript `WebSocket` holds a session.

Chromium is driven over the DevTools protocol; the page runs plain browser JavaScript against the
server, so what is tested is what a web page would do (including `?api_key=` auth, the only way
a browser's WebSocket can carry a key).
"""

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request

import pytest
from websockets.sync.client import connect as ws_connect

from server_process import running_server

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium here (make test installs Debian's chromium when it can)")

PAGE_SCRIPT = """
(async () => {
  const ws = new WebSocket(%(url)s);
  const seen = [];
  const done = new Promise((resolve, reject) => {
    ws.onmessage = (event) => {
      const message = JSON.parse(event.data);
      seen.push(message);
      if (message.type === "session.created") {
        ws.send(JSON.stringify({type: "generate", request_id: "browser-1", user: "Hello from a browser",
                                sampling: {temperature: 0, max_tokens: 12, ignore_eos: true}}));
        ws.send("{this is not json");
      }
      if (message.type === "done") resolve();
    };
    ws.onerror = () => reject(new Error("websocket error"));
    setTimeout(() => reject(new Error("timed out")), 60000);
  });
  await done;
  ws.close();
  return JSON.stringify(seen);
})()
"""


class Browser:
    def __init__(self, tmp_path):
        profile = tmp_path / "profile"
        self.proc = subprocess.Popen(
            [
                CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                f"--user-data-dir={profile}", "--remote-debugging-port=0", "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text().strip():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                raise RuntimeError("Chromium did not start")
            time.sleep(0.05)
        port = int(port_file.read_text().split()[0])
        targets = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list"))
        self.page_url = next(t for t in targets if t["type"] == "page")["webSocketDebuggerUrl"]

    def evaluate(self, expression: str):
        """Run `expression` in the page, await its promise, return its value."""
        with ws_connect(self.page_url, max_size=None) as devtools:
            devtools.send(json.dumps({
                "id": 1, "method": "Runtime.evaluate",
                "params": {"expression": expression, "awaitPromise": True, "returnByValue": True},
            }))
            while True:
                reply = json.loads(devtools.recv(timeout=90))
                if reply.get("id") == 1:
                    result = reply["result"]
                    if "exceptionDetails" in result:
                        raise AssertionError(result["exceptionDetails"])
                    return result["result"]["value"]

    def stop(self):
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(self.proc.pid, signal.SIGKILL)


def test_browser_websocket_session(tiny_model_dir, tmp_path):
    with running_server(tiny_model_dir("llama3"), "--api-key", "browser-key") as server:
        browser = Browser(tmp_path)
        try:
            url = json.dumps(server.ws_url + "?api_key=browser-key")
            seen = json.loads(browser.evaluate(PAGE_SCRIPT % {"url": url}))
        finally:
            browser.stop()
    kinds = [m["type"] for m in seen]
    assert kinds[0] == "session.created"
    assert {"code": "invalid_json"}.items() <= next(m for m in seen if m["type"] == "error").items()
    deltas = [m for m in seen if m["type"] == "delta"]
    assert sum(len(m["token_ids"]) for m in deltas) == 12
    done = seen[-1]
    assert done["type"] == "done" and done["request_id"] == "browser-1" and done["finish_reason"] == "length"
    assert done["usage"]["completion_tokens"] == 12
