"""advice.json: every advisor answer of a build, and replaying it without any LLM.

Format (version 1):

    {
      "version": 1,
      "advisor": {"name": "openai", "identity": "openai:http://127.0.0.1:8000/v1|m|prompt-v1 (...)"},
      "entries": {
        "<request key (sha256)>": {
          "region": "layer0_mlp_fc1", "family": "matmul_epilogue",
          "ranked": [{"BLOCK_M": 16, ...}, ...], "source": "openai",
          "rejected": [{"params": {...}, "reason": "..."}], "rationale": "...", "warnings": [...]
        }
      }
    }

Entries are keyed by `AdviceRequest.key()`, so a replay answers exactly the questions the
recorded build asked; a question the file lacks (the model or pipeline changed) gets the
heuristic's answer and a warning.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from pydantic import BaseModel, ValidationError

from coopt.errors import InputFileError
from coopt.llm_advisor.heuristic import HeuristicAdvisor
from coopt.llm_advisor.protocol import Advice, AdviceRequest, AdvisorUnavailable, advisor_identity
from coopt.llm_advisor.screen import enforce_legal

ADVICE_FILE_VERSION = 1


class _Entry(BaseModel):
    region: str
    family: str
    ranked: list[dict]
    source: str
    rejected: list[dict] = []
    rationale: str | None = None
    warnings: list[str] = []


class _AdviceFile(BaseModel):
    version: int
    advisor: dict
    entries: dict[str, _Entry]


class AdviceLog:
    """Collects every (request, advice) of a build and writes advice.json.

        log = AdviceLog(advisor)
        advice = advisor.advise(request); log.record(request, advice)
        log.write(out / "advice.json")
    """

    def __init__(self, advisor=None):
        self.advisor = {"name": advisor.name, "identity": advisor_identity(advisor)} if advisor else {}
        self.entries: dict[str, dict] = {}

    def record(self, request: AdviceRequest, advice: Advice) -> None:
        self.entries[request.key()] = {
            "region": request.region.name,
            "family": request.family,
            **advice.to_json(),
        }

    def to_json(self) -> dict:
        return {"version": ADVICE_FILE_VERSION, "advisor": self.advisor, "entries": self.entries}

    def write(self, path: str | os.PathLike) -> None:
        """Write atomically (temp file + rename): a failed build never leaves half a file."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".advice-", suffix=".json", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(self.to_json(), f, indent=1, sort_keys=True, default=str)
                f.write("\n")
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


class ReplayAdvisor:
    """Answer from a recorded advice.json (`source == "replay"`), no network.

        advisor = ReplayAdvisor("out/advice.json")   # InputFileError when malformed
    """

    name = "replay"

    def __init__(self, path: str | os.PathLike, fallback=None, strict: bool = False):
        self.path = Path(path)
        self.fallback = fallback if fallback is not None else HeuristicAdvisor()
        self.strict = strict  # strict: a question the file cannot answer ends the build (exit 7)
        recorded = _load(self.path)
        self.entries = recorded.entries
        self.recorded_advisor = recorded.advisor  # who answered when the file was written

    @property
    def identity(self) -> str:
        return f"replay:{self.path.name}"

    def advise(self, request: AdviceRequest) -> Advice:
        entry = self.entries.get(request.key())
        if entry is None and self.strict:
            raise AdvisorUnavailable(f"{self.path} has no advice for region '{request.region.name}'")
        if entry is None:
            advice = self.fallback.advise(request)
            advice.warnings.insert(
                0,
                f"{self.path} has no advice for region '{request.region.name}' ({request.family}); "
                f"the model or pipeline changed since it was recorded? using {self.fallback.name}",
            )
            return advice
        recorded = Advice(ranked=entry.ranked, source=self.name, rationale=entry.rationale)
        # The file may have been edited by hand: it gets the same screening as a live advisor.
        advice = enforce_legal(request, recorded)
        if not advice.ranked and request.legal:
            if self.strict:
                raise AdvisorUnavailable(f"{self.path}: no legal point recorded for region '{request.region.name}'")
            fallback = self.fallback.advise(request)
            fallback.warnings.insert(
                0,
                f"{self.path}: no legal point recorded for region '{request.region.name}'; "
                f"using {self.fallback.name}",
            )
            fallback.rejected = advice.rejected
            return fallback
        if advice.rejected:
            advice.warnings.append(
                f"{self.path}: {len(advice.rejected)} recorded point(s) for region '{request.region.name}' "
                "are not legal now; discarded"
            )
        return advice


def _load(path: Path) -> _AdviceFile:
    """A parsed advice.json; a one-line InputFileError for anything malformed."""
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise InputFileError(f"cannot read advice file {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise InputFileError(f"advice file {path} is not JSON: {exc}") from None
    try:
        parsed = _AdviceFile.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "top level"
        raise InputFileError(f"advice file {path} is malformed at {where}: {first['msg']}") from None
    if parsed.version != ADVICE_FILE_VERSION:
        raise InputFileError(
            f"advice file {path} has version {parsed.version}; this coopt reads version {ADVICE_FILE_VERSION}"
        )
    return parsed
