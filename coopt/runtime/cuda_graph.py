"""Replay a built model's step as one CUDA graph (decode steps are launch-bound otherwise).

    step = GraphedStep(model, (tokens, input_pos))
    logits = step(tokens, input_pos)   # copies the inputs into the graph's buffers and replays

Shapes are fixed at capture (one graph per batch size: build one GraphedStep per bucket). The
returned tensors are the graph's own output buffers, overwritten by the next replay: clone them
to keep them. Capture runs the step a few times (warm-up), so in-place state (KV caches) is
written at the example inputs' positions, as a real step would. Without CUDA, or for inputs
not on the GPU, it simply calls the module.

A replay runs no Python, so the built model's own input checks (a position beyond the KV cache)
would not run: when the module has `check_call(*inputs)` (every coopt build does), each call
checks the new inputs with it before copying them into the graph (one device->host sync; pass
`check=False` when the caller has checked, as generate() does).
"""

from __future__ import annotations

import torch


class GraphedStep:
    def __init__(self, module, example_inputs, warmup: int = 3, check: bool = True):
        self.module = module
        self.check_call = getattr(module, "check_call", None) if check else None
        tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
        self.enabled = torch.cuda.is_available() and bool(tensors) and all(x.is_cuda for x in tensors)
        if not self.enabled:
            return
        self.static_inputs = [x.clone() if isinstance(x, torch.Tensor) else x for x in example_inputs]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.no_grad():
            for _ in range(warmup):  # compiles kernels and settles allocations outside the graph
                module(*self.static_inputs)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), torch.no_grad():
            self.static_outputs = module(*self.static_inputs)

    def __call__(self, *inputs):
        if self.check_call is not None:  # before anything is copied or replayed: a bad call changes no state
            self.check_call(*inputs)
        if not self.enabled:
            with torch.no_grad():
                return self.module(*inputs)
        if len(inputs) != len(self.static_inputs):
            raise TypeError(f"expected {len(self.static_inputs)} inputs, got {len(inputs)}")
        for static, value in zip(self.static_inputs, inputs):
            if isinstance(static, torch.Tensor) and (value.shape != static.shape or value.dtype != static.dtype):
                raise ValueError(
                    f"a captured step takes inputs of shape {tuple(static.shape)} and dtype {static.dtype}; "
                    f"got {tuple(value.shape)} {value.dtype} (capture another GraphedStep for this shape)"
                )
        for static, value in zip(self.static_inputs, inputs):
            if isinstance(static, torch.Tensor):
                static.copy_(value)
        self.graph.replay()
        return self.static_outputs
