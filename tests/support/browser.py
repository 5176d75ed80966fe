"""A headless Chromium driven over the DevTools protocol through a pipe: no WebDriver, no
network port, no package beyond the standard library. Used by the browser tests
(``tests/browser``), whose fixtures (``conftest.py``) start one browser per module and one tab
per test.

`make test` installs Chromium where it is missing; without it the browser tests FAIL (never
skip).
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import subprocess
import time
from pathlib import Path
from typing import Any

CHROMIUM = os.environ.get("QKV_CHROMIUM", "/usr/bin/chromium")
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--mute-audio",
    "--remote-debugging-pipe",
)


class BrowserError(RuntimeError):
    """Chromium stopped or answered with an error."""


def _high_pipe() -> tuple[int, int]:
    """A pipe whose two ends are descriptors 10 or above, so that moving them to 3 and 4 in
    the child cannot overwrite one with the other."""
    ends = []
    for fd in os.pipe():
        ends.append(fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10))
        os.close(fd)
    return ends[0], ends[1]


class Browser:
    """Chromium with the DevTools protocol on file descriptors 3 (commands) and 4 (replies):
    JSON messages separated by NUL bytes, as Chromium's ``--remote-debugging-pipe`` speaks."""

    def __init__(self, executable: str, profile: Path) -> None:
        self.profile = profile
        commands_read, self._commands = _high_pipe()
        self._replies, replies_write = _high_pipe()
        self._log = open(profile / "chromium.log", "wb")  # noqa: SIM115 - closed in close()
        # bash moves the pipe ends to descriptors 3 and 4, then runs Chromium.
        move = (
            f'exec "$0" "$@" 3<&{commands_read} 4>&{replies_write} '
            f"{commands_read}<&- {replies_write}>&-"
        )
        self.process = subprocess.Popen(
            ["/bin/bash", "-c", move, executable, *FLAGS, f"--user-data-dir={profile}"],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=self._log,
            pass_fds=(commands_read, replies_write),
        )
        os.close(commands_read)
        os.close(replies_write)
        self._buffer = b""
        self._id = 0
        self.events: list[dict[str, Any]] = []

    def send(self, method: str, params: dict[str, Any] | None = None, session: str | None = None):
        self._id += 1
        message: dict[str, Any] = {"id": self._id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        try:
            os.write(self._commands, json.dumps(message).encode() + b"\0")
        except BrokenPipeError:
            raise BrowserError(f"Chromium has stopped.\n{self.log_tail()}") from None
        return self._id

    def call(
        self,
        method: str,
        params: dict[str, Any] | None = None,
        session: str | None = None,
        timeout: float = 30,
    ) -> dict[str, Any]:
        """Send a command and wait for its reply; events that come meanwhile are kept."""
        wanted = self.send(method, params, session)
        deadline = time.monotonic() + timeout
        while True:
            message = self._receive(deadline)
            if message.get("id") == wanted:
                if "error" in message:
                    raise BrowserError(f"{method}: {message['error']}")
                result: dict[str, Any] = message.get("result", {})
                return result
            if "method" in message:
                self._event(message)

    def pump(self, seconds: float) -> None:
        """Read the events that arrive within ``seconds``."""
        deadline = time.monotonic() + seconds
        while True:
            try:
                message = self._receive(deadline)
            except TimeoutError:
                return
            if "method" in message:  # else the reply to a command sent without waiting
                self._event(message)

    def _event(self, message: dict[str, Any]) -> None:
        self.events.append(message)
        if message["method"] == "Page.javascriptDialogOpening":  # never left blocking
            self.send("Page.handleJavaScriptDialog", {"accept": False}, message.get("sessionId"))

    def _receive(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self._replies], [], [], max(0.0, left))
            if not ready:
                raise TimeoutError("no answer from Chromium in time")
            chunk = os.read(self._replies, 1 << 20)
            if not chunk:
                raise BrowserError(f"Chromium has stopped.\n{self.log_tail()}")
            self._buffer += chunk
        text, _, self._buffer = self._buffer.partition(b"\0")
        message: dict[str, Any] = json.loads(text)
        return message

    def log_tail(self) -> str:
        self._log.flush()
        lines = (self.profile / "chromium.log").read_text(errors="replace").splitlines()
        return "\n".join(line for line in lines[-20:] if "dbus" not in line)

    def close(self) -> None:
        try:
            self.send("Browser.close")
            self.process.wait(timeout=10)
        except (BrowserError, subprocess.TimeoutExpired):
            self.process.kill()
            self.process.wait(timeout=10)
        finally:
            os.close(self._commands)
            os.close(self._replies)
            self._log.close()


class Tab:
    """One page of the browser, with what it logged, requested and opened."""

    def __init__(self, browser: Browser) -> None:
        self.browser = browser
        target = browser.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.target = target
        attached = browser.call("Target.attachToTarget", {"targetId": target, "flatten": True})
        self.session: str = attached["sessionId"]
        for domain in ("Runtime", "Page", "Network", "Log"):
            self.call(f"{domain}.enable")
        self.call(
            "Emulation.setDeviceMetricsOverride",
            {"width": 1280, "height": 900, "deviceScaleFactor": 1, "mobile": False},
        )
        self.url = ""

    def call(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.browser.call(method, params, self.session)

    def events(self, method: str) -> list[dict[str, Any]]:
        return [
            e["params"]
            for e in self.browser.events
            if e.get("sessionId") == self.session and e["method"] == method
        ]

    def open(self, path: Path) -> float:
        """Open a file and wait for its load event; return the seconds it took."""
        self.url = path.resolve().as_uri()
        start = time.monotonic()
        self.call("Page.navigate", {"url": self.url})
        deadline = start + 60
        while not self.events("Page.loadEventFired"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.url} did not load in 60 s")
            self.browser.pump(0.05)
        self.browser.pump(0.2)
        return time.monotonic() - start

    def js(self, expression: str) -> Any:
        reply = self.call(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": True},
        )
        if "exceptionDetails" in reply:
            raise BrowserError(f"{expression}: {reply['exceptionDetails']}")
        return reply["result"].get("value")

    def hover(self, selector: str) -> None:
        """Move the mouse over the centre of the element, as a person would."""
        box = self.js(
            f"(() => {{ const e = document.querySelector({json.dumps(selector)}); "
            "e.scrollIntoView({block: 'center'}); const r = e.getBoundingClientRect(); "
            "return [r.x + r.width / 2, r.y + r.height / 2]; })()"
        )
        self.call("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": box[0], "y": box[1]})
        self.browser.pump(0.05)

    def press(self, key: str) -> None:
        codes = {"Tab": 9, "Enter": 13, "Escape": 27, "ArrowUp": 38, "ArrowDown": 40}
        down: dict[str, Any] = {
            "type": "keyDown",
            "key": key,
            "code": key,
            "windowsVirtualKeyCode": codes[key],
        }
        if key == "Enter":
            down["text"] = "\r"
        self.call("Input.dispatchKeyEvent", down)
        self.call("Input.dispatchKeyEvent", {**down, "type": "keyUp", "text": ""})
        self.browser.pump(0.05)

    def choose(self, select_id: str, value: int) -> None:
        """Pick an option of a <select>, as its change event reports it."""
        self.js(
            f"(() => {{ const s = document.getElementById({json.dumps(select_id)}); "
            f"s.value = {json.dumps(str(value))}; s.dispatchEvent(new Event('change')); }})()"
        )

    def screenshot(self, path: Path) -> bytes:
        data = base64.b64decode(self.call("Page.captureScreenshot", {"format": "png"})["data"])
        path.write_bytes(data)
        return data

    def problems(self) -> list[str]:
        """Console errors, uncaught exceptions, dialogs and requests other than the page."""
        found = [
            f"console.{e['type']}: {e['args']}"
            for e in self.events("Runtime.consoleAPICalled")
            if e["type"] in ("error", "assert", "warning")
        ]
        found += [
            f"exception: {e['exceptionDetails']}" for e in self.events("Runtime.exceptionThrown")
        ]
        found += [
            f"log {e['entry']['level']}: {e['entry']['text']}"
            for e in self.events("Log.entryAdded")
            if e["entry"]["level"] in ("error", "warning")
        ]
        found += [f"dialog: {e['message']}" for e in self.events("Page.javascriptDialogOpening")]
        found += [
            f"request: {e['request']['url']}"
            for e in self.events("Network.requestWillBeSent")
            if e["request"]["url"] != self.url
        ]
        return found

    def close(self) -> None:
        self.browser.call("Target.closeTarget", {"targetId": self.target})
