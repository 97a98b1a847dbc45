"""A headless Chromium for tests: load a local HTML page and report what a person would meet there.

No playwright or selenium: Chromium is started with ``--remote-debugging-port=0`` and driven over the
DevTools protocol (CDP) with ``websockets``' synchronous client, on ONE browser-level connection with a
flattened session for the page (``Target.attachToTarget``, ``flatten: true``): every command and event
carries the page's ``sessionId``, so no HTTP ``/json`` endpoint is needed.

``inspect_page(path)`` starts a browser, loads ``file://path``, waits for the load event (images
included) and returns a ``PageReport``: console errors and uncaught exceptions (``Runtime``), browser log
errors (``Log``: e.g. a resource that failed to load), JavaScript dialogs (accepted, and counted as
errors: an ``alert`` would otherwise block the page), every ``<img>`` (src kind, natural size,
``complete``), the verdict banner's visibility on the first screen, the page's visible text, script
elements, ``on*`` attributes and ``javascript:`` URLs in the DOM, and optionally a PNG screenshot.
``Browser`` is the context manager underneath, for several pages on one browser.

Limits: Chromium only (``$GUARDFL_BROWSER``, else ``chromium``, ``chromium-browser``, ``google-chrome``
on PATH, else /usr/bin/chromium); local files or an ``http://`` URL (a local server); a page is judged right after its load event (timers
that run later are not waited for); one fixed viewport (``VIEWPORT``, no mobile layout); what is
"visible" is the banner's box and computed style, not its colours or contrast. Every wait has a deadline
(``timeout``, seconds); the browser runs in its own process group, killed on ``close()`` / leaving the
``with`` block / interpreter exit, and (where ``setpriv --pdeathsig`` works) when the starting process
is killed outright.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import weakref
from base64 import b64decode
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: CSS pixels of the window (the "first screen")
VIEWPORT = (1280, 900)
#: executables tried in order on PATH, then the Debian path
CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FALLBACK = "/usr/bin/chromium"


def browser_path() -> str | None:
    """A Chromium-family executable, or None when there is none (tests skip then)."""
    env = os.environ.get("GUARDFL_BROWSER")
    if env:
        return env if os.access(env, os.X_OK) else None
    for name in CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    return FALLBACK if os.access(FALLBACK, os.X_OK) else None


@functools.lru_cache(maxsize=1)
def _pdeathsig() -> tuple[str, ...]:
    """``setpriv --pdeathsig KILL`` (util-linux) where it works: the browser is killed when the thread
    that started it ends, so a test process killed outright leaves no browser behind."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return ()
    try:
        ok = subprocess.run([setpriv, "--pdeathsig", "KILL", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return (setpriv, "--pdeathsig", "KILL") if ok else ()


#: browsers started and not closed yet: closed at interpreter exit whatever happened
_LIVE: "weakref.WeakSet[Browser]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for browser in list(_LIVE):
        browser.close()


class BrowserError(RuntimeError):
    """The browser could not be started, did not answer in time, or failed to load the page."""


@dataclass
class PageReport:
    """What a headless Chromium saw on one page."""

    url: str
    title: str
    #: console errors, uncaught exceptions, browser log errors and JavaScript dialogs, as one line each
    errors: list[str]
    #: every <img>: src_kind ('data' for a data: URI, else the URL scheme, or 'relative'), src (cut to 80
    #: characters), alt, complete, natural_width, natural_height
    images: list[dict[str, Any]]
    #: the banner (``banner_selector``): found, shown (non-zero box, displayed, visible, not transparent)
    #: and within the first screen
    banner_visible: bool
    banner_text: str
    #: document.body.innerText: the text a person can see (closed <details> bodies excluded)
    text: str
    #: <script> elements in the DOM
    scripts: int
    #: every ``on*`` attribute as "tag[attribute]"
    handlers: list[str]
    #: href / src / action attributes starting with "javascript:"
    javascript_urls: list[str]
    #: in-page links (href="#x") whose target id does not exist
    broken_anchors: list[str]
    #: every element's tag name, lower case, in document order
    tags: list[str] = field(repr=False)
    screenshot: Path | None = None

    @property
    def active_content(self) -> list[str]:
        """Anything in the DOM that could run code: script elements, on* handlers, javascript: URLs."""
        return (["script"] * self.scripts) + self.handlers + self.javascript_urls


#: run in the page after its load event; returns everything PageReport holds but the console
_PROBE = r"""
(() => {
  const sel = %s;
  const b = document.querySelector(sel);
  let banner = {visible: false, text: ''};
  if (b) {
    const r = b.getBoundingClientRect();
    const cs = getComputedStyle(b);
    const shown = r.width > 0 && r.height > 0 && cs.display !== 'none' && cs.visibility !== 'hidden'
      && parseFloat(cs.opacity) > 0
      && (typeof b.checkVisibility !== 'function' || b.checkVisibility({opacityProperty: true, visibilityProperty: true}));
    const onFirstScreen = r.top >= 0 && r.top < window.innerHeight && r.left < window.innerWidth && r.right > 0;
    banner = {visible: shown && onFirstScreen, text: b.innerText};
  }
  const all = Array.from(document.querySelectorAll('*'));
  const handlers = [], jsUrls = [];
  for (const el of all) {
    for (const a of Array.from(el.attributes)) {
      const name = a.name.toLowerCase();
      if (name.startsWith('on')) handlers.push(el.tagName.toLowerCase() + '[' + name + ']');
      if (['href', 'src', 'action', 'formaction', 'xlink:href'].includes(name)
          && a.value.trim().toLowerCase().startsWith('javascript:')) jsUrls.push(el.tagName.toLowerCase() + '[' + name + ']');
    }
  }
  const images = Array.from(document.images).map(img => {
    const src = img.getAttribute('src') || '';
    const m = /^([a-z][a-z0-9+.-]*):/i.exec(src);
    return {src_kind: m ? m[1].toLowerCase() : 'relative', src: src.slice(0, 80), alt: img.alt,
            complete: img.complete, natural_width: img.naturalWidth, natural_height: img.naturalHeight};
  });
  const broken = Array.from(document.querySelectorAll('a[href^="#"]'))
    .map(a => a.getAttribute('href').slice(1)).filter(id => id && !document.getElementById(id));
  return {title: document.title, text: document.body ? document.body.innerText : '',
          scripts: document.querySelectorAll('script').length, handlers, jsUrls, images, banner,
          broken, tags: all.map(el => el.tagName.toLowerCase())};
})()
"""


class Browser:
    """A headless Chromium with one DevTools connection; ``with Browser() as b: b.inspect(path)``."""

    def __init__(self, executable: str | None = None, timeout: float = 30.0) -> None:
        self.executable = executable or browser_path()
        if self.executable is None:
            raise BrowserError("no Chromium found (chromium, chromium-browser, google-chrome, /usr/bin/chromium)")
        self.timeout = timeout
        self._proc: subprocess.Popen | None = None
        self._ws = None
        self._stack = contextlib.ExitStack()
        self._ids = itertools.count(1)
        self._profile = ""
        self._log = None

    # -- lifecycle -------------------------------------------------------------------------------
    def __enter__(self) -> "Browser":
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self) -> None:
        from websockets.sync.client import connect

        self._profile = tempfile.mkdtemp(prefix="guardfl-chromium-")
        self._log = open(Path(self._profile) / "stderr.log", "wb")  # a file, not a pipe: it never fills up
        args = [self.executable, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--disable-extensions", "--no-first-run", "--no-default-browser-check", "--mute-audio",
                "--hide-scrollbars", f"--window-size={VIEWPORT[0]},{VIEWPORT[1]}", "--remote-debugging-port=0",
                f"--user-data-dir={self._profile}", "about:blank"]
        # its own process group: close() kills the wrapper script, the browser and its helpers together;
        # under setpriv --pdeathsig it dies with this process even when that is SIGKILLed (a CI timeout)
        self._proc = subprocess.Popen([*_pdeathsig(), *args], stdin=subprocess.DEVNULL, stdout=self._log,
                                      stderr=self._log, start_new_session=True)
        _LIVE.add(self)
        port_file = Path(self._profile) / "DevToolsActivePort"
        deadline = time.monotonic() + self.timeout
        while True:
            lines = port_file.read_text().splitlines() if port_file.is_file() else []
            if len(lines) >= 2:
                break
            if self._proc.poll() is not None:
                raise BrowserError(f"{self.executable} exited with {self._proc.returncode}: {self._stderr_tail()}")
            if time.monotonic() > deadline:
                raise BrowserError(f"{self.executable} gave no DevTools port in {self.timeout:.0f} s: {self._stderr_tail()}")
            time.sleep(0.05)
        url = f"ws://127.0.0.1:{int(lines[0])}{lines[1]}"
        # no proxy (a proxy variable must not catch localhost), no size limit (screenshots), no pings;
        # entered as a context manager (websockets 17 deprecates a bare connect() without legacy=True)
        self._ws = self._stack.enter_context(connect(url, proxy=None, max_size=None, open_timeout=self.timeout,
                                                     ping_interval=None, compression=None, close_timeout=2))

    def close(self) -> None:
        if self._ws is not None:
            self._ws = None
            try:
                self._stack.close()  # closes the connection
            except Exception:
                pass
        if self._proc is not None:
            for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
                try:
                    os.killpg(self._proc.pid, sig)
                except (ProcessLookupError, PermissionError):
                    break
                try:
                    self._proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
            self._proc = None
        _LIVE.discard(self)
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._profile:
            shutil.rmtree(self._profile, ignore_errors=True)
            self._profile = ""

    def _stderr_tail(self) -> str:
        try:
            lines = (Path(self._profile) / "stderr.log").read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return " | ".join(line for line in lines[-5:] if line.strip())[:600]

    # -- protocol --------------------------------------------------------------------------------
    def _recv(self, deadline: float) -> dict:
        from websockets.exceptions import ConnectionClosed

        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        try:
            return json.loads(self._ws.recv(timeout=left))
        except ConnectionClosed as err:
            raise BrowserError(f"the browser closed the DevTools connection ({err}): {self._stderr_tail()}") from None

    def _call(self, method: str, params: dict | None = None, session: str | None = None,
              events: list | None = None, timeout: float | None = None) -> dict:
        """Send one command and wait for its answer; events received meanwhile go to ``events``."""
        msg_id = next(self._ids)
        msg: dict[str, Any] = {"id": msg_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        self._ws.send(json.dumps(msg))
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            try:
                reply = self._recv(deadline)
            except TimeoutError:
                raise BrowserError(f"{method}: no answer in {timeout or self.timeout:.0f} s") from None
            if reply.get("id") == msg_id:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error'].get('message')} {reply['error'].get('data', '')}".strip())
                return reply.get("result", {})
            if "method" in reply:
                self._on_event(reply, events)

    def _on_event(self, event: dict, events: list | None) -> None:
        if events is not None:
            events.append(event)
        if event["method"] == "Page.javascriptDialogOpening":  # an alert() blocks the page until answered
            msg_id = next(self._ids)
            self._ws.send(json.dumps({"id": msg_id, "method": "Page.handleJavaScriptDialog",
                                      "params": {"accept": True}, "sessionId": event.get("sessionId")}))

    def _drain(self, events: list, seconds: float) -> None:
        """Events that arrive within ``seconds`` (late log entries)."""
        deadline = time.monotonic() + seconds
        while True:
            try:
                event = self._recv(deadline)
            except TimeoutError:
                return
            if "method" in event:
                self._on_event(event, events)

    # -- pages -----------------------------------------------------------------------------------
    def inspect(self, html_path: str | Path, screenshot: str | Path | None = None, *, full_page: bool = False,
                banner_selector: str = ".banner") -> PageReport:
        """Load ``html_path`` in a fresh tab and report on it; ``screenshot``: write a PNG there (the
        first screen, or with ``full_page`` the whole page). ``html_path`` may also be an ``http://`` URL of
        a local server (the docs site, whose search runs in a web worker that ``file://`` forbids)."""
        if isinstance(html_path, str) and html_path.startswith("http://"):
            url = html_path
        else:
            path = Path(html_path).resolve()
            if not path.is_file():
                raise BrowserError(f"no such page: {path}")
            url = path.as_uri()
        events: list[dict] = []
        target = self._call("Target.createTarget", {"url": "about:blank"})["targetId"]
        try:
            session = self._call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
            for domain in ("Page", "Runtime", "Log"):
                self._call(f"{domain}.enable", session=session, events=events)
            self._call("Emulation.setDeviceMetricsOverride", {"width": VIEWPORT[0], "height": VIEWPORT[1],
                                                              "deviceScaleFactor": 1, "mobile": False},
                       session=session, events=events)
            nav = self._call("Page.navigate", {"url": url}, session=session, events=events)
            if nav.get("errorText"):
                raise BrowserError(f"{url}: {nav['errorText']}")
            deadline = time.monotonic() + self.timeout
            while not any(e["method"] == "Page.loadEventFired" and e.get("sessionId") == session for e in events):
                try:
                    event = self._recv(deadline)
                except TimeoutError:
                    raise BrowserError(f"{url}: no load event in {self.timeout:.0f} s") from None
                if "method" in event:
                    self._on_event(event, events)
            probe = self._call("Runtime.evaluate", {"expression": _PROBE % json.dumps(banner_selector),
                                                    "returnByValue": True}, session=session, events=events)
            if "exceptionDetails" in probe:
                raise BrowserError(f"the page probe failed: {probe['exceptionDetails'].get('text')}")
            found = probe["result"]["value"]
            shot = None
            if screenshot is not None:
                params: dict[str, Any] = {"format": "png"}
                if full_page:
                    size = self._call("Page.getLayoutMetrics", session=session, events=events)["cssContentSize"]
                    params.update(captureBeyondViewport=True, clip={"x": 0, "y": 0, "width": size["width"],
                                                                    "height": size["height"], "scale": 1})
                data = self._call("Page.captureScreenshot", params, session=session, events=events)["data"]
                shot = Path(screenshot)
                shot.parent.mkdir(parents=True, exist_ok=True)
                shot.write_bytes(b64decode(data))
            self._drain(events, 0.2)
        finally:
            try:
                self._call("Target.closeTarget", {"targetId": target}, timeout=5)
            except BrowserError:
                pass
        return PageReport(
            url=url, title=found["title"], errors=_errors(events), images=found["images"],
            banner_visible=found["banner"]["visible"], banner_text=found["banner"]["text"], text=found["text"],
            scripts=found["scripts"], handlers=found["handlers"], javascript_urls=found["jsUrls"],
            broken_anchors=found["broken"], tags=found["tags"], screenshot=shot,
        )


def _errors(events: list[dict]) -> list[str]:
    """Console errors, uncaught exceptions, error log entries and dialogs, one line each."""
    out = []
    for e in events:
        method, p = e["method"], e.get("params", {})
        if method == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            args = " ".join(str(a.get("value", a.get("description", a.get("type")))) for a in p.get("args", []))
            out.append(f"console.{p['type']}: {args}")
        elif method == "Runtime.exceptionThrown":
            d = p.get("exceptionDetails", {})
            out.append(f"uncaught: {d.get('exception', {}).get('description') or d.get('text')}")
        elif method == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
            entry = p["entry"]
            out.append(f"log ({entry.get('source')}): {entry.get('text')} {entry.get('url', '')}".strip())
        elif method == "Page.javascriptDialogOpening":
            out.append(f"dialog ({p.get('type')}): {p.get('message')}")
    return out


def inspect_page(html_path: str | Path, screenshot: str | Path | None = None, *, full_page: bool = False,
                 banner_selector: str = ".banner", timeout: float = 30.0) -> PageReport:
    """Start a headless Chromium, load ``html_path`` (a local file), report on it, kill the browser."""
    with Browser(timeout=timeout) as browser:
        return browser.inspect(html_path, screenshot, full_page=full_page, banner_selector=banner_selector)
