"""Fixtures for the advisor tests: a running fake endpoint, a fake API key, request builders."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from advisor_support import FAKE_KEY, FakeLLM, matmul_request


@pytest.fixture
def fake_llm(monkeypatch):
    """A running fake endpoint; `fake_llm.base_url` is ".../v1". Stopped after the test."""
    # The client must reach 127.0.0.1 directly, whatever proxies the environment sets.
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    state = FakeLLM()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            state.reply(self)

        def log_message(self, *args):  # keep pytest output clean
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    state.base_url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    yield state
    state.release.set()
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


@pytest.fixture
def api_key(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", FAKE_KEY)
    return FAKE_KEY


@pytest.fixture
def make_matmul_request():
    return matmul_request
