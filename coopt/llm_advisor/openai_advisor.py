"""An advisor backed by any OpenAI-compatible chat endpoint (OpenAI, vLLM, llama.cpp, Ollama ...).

The model sees the region summary and the bounded space (`prompt.py`) and answers with a JSON
ranking under a strict schema. The reply is validated with pydantic and screened against the
legal points; anything unusable raises `AdvisorUnavailable`, which `FallbackAdvisor` turns into
the heuristic's answer and a warning.

The API key is read from the environment when the client is first made and handed only to the
`openai` client: it is not an attribute of the advisor, not part of the cache identity, and
it is redacted from every message we produce.
"""

from __future__ import annotations

import json
import os
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, ValidationError

from coopt.llm_advisor import prompt
from coopt.llm_advisor.cache import AdviceCache
from coopt.llm_advisor.protocol import Advice, AdviceRequest, AdvisorUnavailable
from coopt.llm_advisor.screen import enforce_legal, screen_proposals

# Local servers ignore the key but the client insists on one.
PLACEHOLDER_KEY = "not-needed"
MAX_RATIONALE_CHARS = 1000


class _Entry(BaseModel):
    model_config = ConfigDict(extra="ignore")
    params: dict[str, Any]


class _Reply(BaseModel):
    model_config = ConfigDict(extra="ignore")
    ranked: list[Any]  # entries are checked one by one, so one bad entry rejects only itself
    rationale: str | None = None


def public_url(url: str) -> str:
    """`url` without user info, query or fragment: what may appear in logs and advice.json."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))


class OpenAIAdvisor:
    """Ask an OpenAI-compatible endpoint to rank the legal points.

        advisor = OpenAIAdvisor("http://127.0.0.1:8000/v1", "qwen2.5-coder-7b",
                                cache=AdviceCache())
        advice = advisor.advise(request)   # raises AdvisorUnavailable when it cannot answer
    """

    name = "openai"

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key_env: str = "OPENAI_API_KEY",
        timeout_s: float = 30,
        max_retries: int = 2,
        cache: AdviceCache | None = None,
    ):
        self.base_url = base_url
        self.model = model
        self.api_key_env = api_key_env
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.cache = cache
        self._client = None

    @property
    def identity(self) -> str:
        """Endpoint, model and prompt version: what makes two answers comparable. No secrets."""
        return f"openai:{public_url(self.base_url)}|{self.model}|{prompt.PROMPT_VERSION}"

    def __repr__(self) -> str:
        return f"OpenAIAdvisor({public_url(self.base_url)!r}, {self.model!r})"

    def advise(self, request: AdviceRequest) -> Advice:
        if len(request.legal) <= 1:
            # Nothing to rank: do not spend a request (or a cache entry) on it.
            return Advice(list(request.legal), source="heuristic", rationale="at most one legal point; model not asked")
        if self.cache is not None:
            hit = self.cache.get(self.identity, request)
            if hit is not None:
                hit.warnings.extend(self.cache.take_problems())
                return enforce_legal(request, hit)
        advice = self._redacted(self._parse(request, self._ask(request)))
        if self.cache is not None:
            self.cache.put(self.identity, request, advice)
            advice.warnings.extend(self.cache.take_problems())
        return advice

    # -- transport ---------------------------------------------------------------------
    def _api_key(self) -> str:
        return os.environ.get(self.api_key_env) or PLACEHOLDER_KEY

    def _client_or_raise(self):
        if self._client is None:
            try:
                import openai  # lazily: `import coopt.llm_advisor` must work without it
            except ImportError as exc:
                raise AdvisorUnavailable(f"the 'openai' package is not installed ({exc})") from None
            self._client = openai.OpenAI(
                base_url=self.base_url, api_key=self._api_key(), timeout=self.timeout_s, max_retries=self.max_retries
            )
        return self._client

    def _ask(self, request: AdviceRequest) -> str:
        """The reply's message text; every transport problem becomes AdvisorUnavailable."""
        client = self._client_or_raise()
        import openai  # present: the client exists
        try:
            completion = client.chat.completions.create(
                model=self.model,
                messages=prompt.messages(request),
                response_format=prompt.response_format(request),
                # No `temperature`: reasoning models reject it. Repeatability comes from the
                # cache and advice.json instead.
            )
        except openai.APITimeoutError:
            raise self._unavailable(f"timed out after {self.timeout_s:g} s") from None
        except openai.APIConnectionError as exc:
            raise self._unavailable(f"cannot connect ({exc})") from None
        except openai.APIStatusError as exc:
            unset = exc.status_code in (401, 403) and not os.environ.get(self.api_key_env)
            hint = f" (${self.api_key_env} is not set)" if unset else ""
            raise self._unavailable(f"HTTP {exc.status_code}{hint}: {exc.message}") from None
        except openai.OpenAIError as exc:
            raise self._unavailable(f"{type(exc).__name__}: {exc}") from None
        try:
            message = completion.choices[0].message
        except (AttributeError, IndexError, TypeError):
            raise self._unavailable("response is not a chat.completion") from None
        content = getattr(message, "content", None)
        if not isinstance(content, str) or not content.strip():
            refusal = getattr(message, "refusal", None)
            raise self._unavailable(f"empty reply{f' (refusal: {refusal})' if refusal else ''}")
        return content

    # -- reply -------------------------------------------------------------------------
    def _parse(self, request: AdviceRequest, content: str) -> Advice:
        text = _strip_code_fence(content)
        try:
            reply = _Reply.model_validate(json.loads(text))
        except ValueError as exc:  # json.JSONDecodeError and pydantic.ValidationError
            what = "reply does not match the schema" if isinstance(exc, ValidationError) else "reply is not JSON"
            raise self._unavailable(f"{what}: {text[:80]!r}") from None
        proposals, rejected = [], []
        for entry in reply.ranked:
            if isinstance(entry, dict) and "params" not in entry:
                proposals.append(entry)  # a bare point, as schema-less servers often write
                continue
            try:
                proposals.append(_Entry.model_validate(entry).params)
            except ValidationError:
                rejected.append({"params": entry, "reason": "entry has no 'params' object"})
        ranked, screened_out = screen_proposals(request, proposals)
        rejected.extend(screened_out)
        if not ranked:
            first = rejected[0]["reason"] if rejected else "empty ranking"
            raise self._unavailable(f"no legal point in the reply ({len(rejected)} rejected; first: {first})")
        warnings = []
        if rejected:
            warnings.append(
                f"advisor 'openai' proposed {len(rejected)} point(s) outside the legal set for region "
                f"'{request.region.name}'; discarded"
            )
        rationale = (reply.rationale or "").strip()[:MAX_RATIONALE_CHARS] or None
        return Advice(ranked=ranked, source=self.name, rejected=rejected, warnings=warnings, rationale=rationale)

    def _unavailable(self, reason: str) -> AdvisorUnavailable:
        """One line, with the key redacted: messages end up in reports and logs."""
        line = " ".join(f"{reason} [{public_url(self.base_url)}, model {self.model}]".split())
        return AdvisorUnavailable(self._redact(line))

    def _redact(self, text: str) -> str:
        key = os.environ.get(self.api_key_env)
        return text.replace(key, "***") if key and len(key) >= 4 else text

    def _redacted(self, advice: Advice) -> Advice:
        """A server that echoes the key into its reply must not get it into the cache or
        advice.json: redact it anywhere in the advice."""
        text = json.dumps(advice.to_json(), default=str)
        redacted = self._redact(text)
        return advice if redacted == text else Advice.from_json(json.loads(redacted))


def _strip_code_fence(text: str) -> str:
    """Servers without schema support often wrap JSON in ```json fences; look inside them."""
    stripped = text.strip()
    if stripped.startswith("```"):
        stripped = stripped.split("\n", 1)[1] if "\n" in stripped else ""
        stripped = stripped.rsplit("```", 1)[0]
    return stripped.strip()
