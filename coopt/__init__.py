"""coopt: an ahead-of-time compiler that makes PyTorch inference fast on NVIDIA GPUs.

    import coopt
    coopt.build("examples/mlp.py", "out/mlp", target="h100")
    model = coopt.load("out/mlp")
    tokens = coopt.generate(coopt.load("out/llama"), prompt, 32)   # a built decoder

Names are imported lazily so that `coopt.load` (and the runtime of a built `out/`) needs only
torch and triton, never the compiler's xdsl / jinja2 / hypothesis.
"""

__version__ = "0.1.0"

__all__ = ["Pipeline", "build", "generate", "load"]


def __getattr__(name):
    if name in ("Pipeline", "build"):
        from coopt import api

        return getattr(api, name)
    if name == "load":
        from coopt.runtime.loader import load

        return load
    if name == "generate":
        from coopt.runtime.generate import generate

        return generate
    raise AttributeError(f"module 'coopt' has no attribute {name!r}")
