"""Helpers for the advisor tests: the fake OpenAI-compatible endpoint and request builders.

(A uniquely named module, not conftest, so that test files can import it safely.)

The server is stdlib `http.server` on 127.0.0.1 (random free port) in a thread. Each test sets
`fake_llm.mode` to choose the reply:

    "ranking"   a chat.completion whose content is {"ranked": [{"params": p} for p in fake_llm.ranking]}
    "garbage"   a chat.completion whose content is not JSON
    "not_chat"  a 200 response whose body is not a chat.completion at all
    "http500"   HTTP 500 with an error body
    "echo_key"  HTTP 401 whose error message echoes the Authorization header (a hostile server)
    "slow"      waits `fake_llm.delay_s` before a valid ranking (beyond the client's timeout)

`fake_llm.requests` holds every request body received, `fake_llm.auth` the Authorization headers.
"""

from __future__ import annotations

import itertools
import json
import threading
from http.server import BaseHTTPRequestHandler

from coopt.ir.region import RegionSummary, TensorSpec
from coopt.llm_advisor import AdviceRequest
from coopt.targets import H200

FAKE_KEY = "sk-test-FAKEKEY-0123456789abcdef"


class FakeLLM:
    def __init__(self):
        self.mode = "ranking"
        self.ranking: list = []
        self.rationale = "small tiles for a GEMV"
        self.delay_s = 3.0
        self.requests: list[dict] = []
        self.auth: list[str] = []
        self.release = threading.Event()  # set at teardown so a sleeping handler ends at once
        self.lock = threading.Lock()
        self.base_url = ""

    @property
    def count(self) -> int:
        with self.lock:
            return len(self.requests)

    def reply(self, handler: BaseHTTPRequestHandler) -> None:
        length = int(handler.headers.get("Content-Length") or 0)
        body = json.loads(handler.rfile.read(length) or b"{}")
        with self.lock:
            self.requests.append(body)
            self.auth.append(handler.headers.get("Authorization", ""))
        if handler.path != "/v1/chat/completions":
            return _send(handler, 404, {"error": {"message": f"no route {handler.path}"}})
        if self.mode == "http500":
            return _send(handler, 500, {"error": {"message": "internal server error", "type": "server_error"}})
        if self.mode == "echo_key":
            message = f"invalid key: {handler.headers.get('Authorization', '')}"
            return _send(handler, 401, {"error": {"message": message, "type": "invalid_request_error"}})
        if self.mode == "not_chat":
            return _send(handler, 200, {"hello": "world"})
        if self.mode == "slow":
            self.release.wait(self.delay_s)
        if self.mode == "garbage":
            content = "Sure! I think BLOCK_M=16 is best, because GEMV."
        else:
            content = ranking_content(self)
        completion = {
            "id": "chatcmpl-test",
            "object": "chat.completion",
            "created": 0,
            "model": body.get("model", "fake"),
            "choices": [
                {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": content}}
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
        _send(handler, 200, completion)


def ranking_content(state: FakeLLM) -> str:
    """The message text of a "ranking" reply (tests may patch this to shape the text)."""
    return json.dumps({"ranked": [{"params": p} for p in state.ranking], "rationale": state.rationale})


def _send(handler: BaseHTTPRequestHandler, status: int, payload: dict) -> None:
    data = json.dumps(payload).encode()
    try:
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the client gave up (timeout test); nothing to answer


# -- requests --------------------------------------------------------------------------------
MATMUL_SPACE = {
    "BLOCK_M": [16, 32, 64, 128],
    "BLOCK_N": [32, 64, 128, 256],
    "BLOCK_K": [32, 64, 128],
    "num_warps": [4, 8],
    "num_stages": [2, 3, 4],
}


def product_points(space: dict, keep=lambda p: True) -> tuple[dict, ...]:
    """Every point of `space` (sorted knobs, like TemplateFamily.legal_points) that `keep` accepts."""
    keys = sorted(space)
    points = (dict(zip(keys, values)) for values in itertools.product(*(space[k] for k in keys)))
    return tuple(p for p in points if keep(p))


def matmul_request(m: int, n: int = 4096, k: int = 4096, dtype: str = "bfloat16", name: str = "fc1") -> AdviceRequest:
    """A linear layer [m, k] x [n, k]^T; legal excludes 128x256 tiles (as a shared-memory limit would)."""
    region = RegionSummary(
        name=name,
        family="matmul_epilogue",
        inputs=(TensorSpec((m, k), dtype), TensorSpec((n, k), dtype)),
        outputs=(TensorSpec((m, n), dtype),),
        attrs={"b_layout": "nk", "has_bias": False, "epilogue": [], "outputs": ["acc"]},
        input_names=("", f"{name}.weight"),
    )
    legal = product_points(MATMUL_SPACE, lambda p: p["BLOCK_M"] * p["BLOCK_N"] <= 128 * 128)
    return AdviceRequest(region, "matmul_epilogue", MATMUL_SPACE, legal, H200.facts())
