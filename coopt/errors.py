"""User-facing errors: each carries the one line the CLI prints and a documented exit code.

Exit codes (also in README.md and `coopt --help`):
  0  success
  2  bad command-line usage (typer's own)
  3  model file: missing, unparseable, no `Model`, or `get_inputs()`/`get_init_inputs()` failed
  4  torch.export could not capture the model
  5  bad configuration: unknown target, unknown pass or knob, malformed pipeline string, a
     pass that cannot apply (fp8-kv-cache / --kv-cache fp8 on a model without a KV cache,
     chunked-prefill / --prefill-chunk on one without a dynamic prompt length)
  6  output directory: exists and is not empty (use --force), or cannot be written (too little
     disk space for the weights, checked before the build starts and before they are written)
  7  advisor failed and fallback to the heuristic was disabled (--no-advisor-fallback)
  8  the built model does not match the original model end to end
  9  bad input file for `coopt opt` / `coopt tune` (unparseable IR, not a build directory)
 10  plugin clash or broken plugin
 11  the GPU's memory: the build ran out of it (the model, its build and the end-to-end
     check's copies did not fit together), or the check cannot fit at all (the build's weights
     beside the model), refused before the tuning
 70  internal error (a bug in coopt: please report it with the message)
"""

from __future__ import annotations


class CooptError(Exception):
    """An error with a one-line message meant for the user and an exit code."""

    exit_code: int = 70

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class ModelFileError(CooptError):
    exit_code = 3


class CaptureError(CooptError):
    exit_code = 4


class ConfigError(CooptError):
    exit_code = 5


class OutputDirError(CooptError):
    exit_code = 6


class AdvisorError(CooptError):
    exit_code = 7


class EndToEndMismatch(CooptError):
    exit_code = 8


class InputFileError(CooptError):
    exit_code = 9


class PluginError(CooptError):
    exit_code = 10


class DeviceMemoryError(CooptError):
    exit_code = 11
