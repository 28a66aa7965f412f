"""A real browser as the client: headless Chromium's own JavaScript `WebSocket` holds a session.

Chromium is driven over the DevTools protocol; the page runs plain browser JavaScript against the
server, so what is tested is what a web page would do (including `?api_key=` auth, the only way
a browser's WebSocket can carry a key).
"""

import base64
import json
import os
import shutil
import signal
import struct
import subprocess
import time
import urllib.request
import zlib

import pytest
from server_process import running_server
from websockets.sync.client import connect as ws_connect

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

    def call(self, method: str, **params):
        """One DevTools command; its result."""
        with ws_connect(self.page_url, max_size=None) as devtools:
            devtools.send(json.dumps({"id": 1, "method": method, "params": params}))
            while True:
                reply = json.loads(devtools.recv(timeout=90))
                if reply.get("id") == 1:
                    if "error" in reply:
                        raise AssertionError(reply["error"])
                    return reply["result"]

    def evaluate(self, expression: str):
        """Run `expression` in the page, await its promise, return its value."""
        result = self.call("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in result:
            raise AssertionError(result["exceptionDetails"])
        return result["result"]["value"]

    def navigate(self, url: str) -> None:
        """Open `url` and return once its document has loaded (Page.navigate returns before: a
        script evaluated at once could run in the previous document)."""
        self.call("Page.navigate", url=url)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            state = self.evaluate("JSON.stringify([location.href, document.readyState])")
            if json.loads(state) == [url, "complete"]:
                return
            time.sleep(0.05)
        raise AssertionError(f"{url} did not load within 60 s")

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


# --- the playground page at / --------------------------------------------------------------------

PLAYGROUND_SCRIPT = """
(async () => {
  const wait = (test, what) => new Promise((resolve, reject) => {
    const started = Date.now();
    const poll = () => {
      const value = test();
      if (value) return resolve(value);
      if (Date.now() - started > 60000) return reject(new Error("timed out waiting for " + what));
      setTimeout(poll, 20);
    };
    poll();
  });
  const $ = (id) => document.getElementById(id);
  const stats = () => document.querySelectorAll(".turn-stats");
  await wait(() => $("status").textContent === "connected" && $("policy").options.length > 0, "the session");
  $("system").value = "You are a terse tutor.";
  $("p-temperature").value = "0";
  $("p-max_tokens").value = "8";
  $("ignore_eos").checked = true;
  for (const [i, text] of ["What is paged attention?", "And a prefix cache?"].entries()) {
    $("prompt").value = text;
    $("send").click();
    await wait(() => stats().length === i + 1, "turn " + (i + 1));
  }
  $("p-max_tokens").value = "400";
  $("prompt").value = "Now explain everything.";
  $("send").click();
  const answer = () => document.querySelectorAll(".assistant")[2];
  await wait(() => answer() && answer().textContent.length > 0, "the third answer to start");
  $("stop").click();
  await wait(() => stats().length === 3, "the interrupted turn");
  return JSON.stringify({
    stats: [...stats()].map((s) => ({text: s.textContent, ...s.dataset})),
    users: [...document.querySelectorAll(".user")].map((u) => u.textContent),
    answers: [...document.querySelectorAll(".assistant")].map((a) => a.textContent),
    errors: [...document.querySelectorAll(".error")].map((e) => e.textContent),
    sendEnabled: !$("send").disabled,
  });
})()
"""


def png_colors(data: bytes) -> int:
    """How many distinct colours an 8-bit RGB(A) PNG holds (Chromium's screenshots are such)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width, height, channels = 8, b"", 0, 0, 0
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        chunk = data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, colour = struct.unpack(">IIBB", chunk[:10])
            assert depth == 8 and colour in (2, 6), (depth, colour)
            channels = 3 if colour == 2 else 4
        elif kind == b"IDAT":
            idat += chunk
        pos += 12 + length
    raw, stride = zlib.decompress(idat), width * channels
    previous, colours = bytearray(stride), set()
    for y in range(height):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for x in range(stride):  # undo the PNG filter of this row
            a = line[x - channels] if x >= channels else 0
            b, c = previous[x], previous[x - channels] if x >= channels else 0
            if kind == 1:
                line[x] = (line[x] + a) & 255
            elif kind == 2:
                line[x] = (line[x] + b) & 255
            elif kind == 3:
                line[x] = (line[x] + (a + b) // 2) & 255
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[x] = (line[x] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        colours.update(bytes(line[x : x + 3]) for x in range(0, stride, channels * 7))  # every 7th pixel
        previous = line
    return len(colours)


def test_playground_chats_interrupts_and_renders(tiny_model_dir, tmp_path):
    with running_server(tiny_model_dir("llama3"), "--api-key", "browser-key") as server:
        browser = Browser(tmp_path)
        try:
            browser.call("Emulation.setDeviceMetricsOverride", width=1000, height=700, deviceScaleFactor=1, mobile=False)
            browser.navigate(server.url + "/?api_key=browser-key")
            seen = json.loads(browser.evaluate(PLAYGROUND_SCRIPT))
            shot = base64.b64decode(browser.call("Page.captureScreenshot", format="png")["data"])
        finally:
            browser.stop()
    (tmp_path / "playground.png").write_bytes(shot)
    assert seen["errors"] == [] and seen["sendEnabled"]
    assert seen["users"] == ["What is paged attention?", "And a prefix cache?", "Now explain everything."]
    first, second, third = seen["stats"]
    assert first["finish"] == second["finish"] == "length" and all(a for a in seen["answers"])
    assert "TTFT" in first["text"] and "tok/s" in first["text"]
    assert int(second["cached"]) > 0, "the follow-up turn was served from the cached prefix"
    assert third["finish"] == "abort" and third["interrupted"] == "true"
    # Not blank: the page's text, panels and buttons make many colours (a blank page has one).
    assert png_colors(shot) > 20
