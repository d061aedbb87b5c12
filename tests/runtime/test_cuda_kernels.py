"""runtime/cuda_kernels: the launch configuration handed to the driver's cuLaunchKernelEx must
have cuda.h's layout byte for byte (a wrong offset launches with garbage, not an error)."""

from __future__ import annotations

import ctypes

from coopt.runtime.cuda_kernels import LaunchAttribute, LaunchConfig, launch_config


def test_the_launch_structs_have_cuda_h_layout():
    # CUlaunchAttribute: id, pad to 8, a 64-byte union; CUlaunchConfig: 7 uints, stream, attrs, count
    assert (ctypes.sizeof(LaunchAttribute), LaunchAttribute.value.offset) == (72, 8)
    assert ctypes.sizeof(LaunchConfig) == 56
    assert (LaunchConfig.hStream.offset, LaunchConfig.attrs.offset, LaunchConfig.numAttrs.offset) == (32, 40, 48)


def test_pdl_is_one_programmatic_serialization_attribute_and_off_is_none():
    on = launch_config((16, 8, 1), (256, 1, 1), 70000, 0x1234, pdl=True)
    assert (on.gridDimX, on.gridDimY, on.blockDimX, on.sharedMemBytes, on.hStream) == (16, 8, 256, 70000, 0x1234)
    assert on.numAttrs == 1 and on.attrs[0].id == 6 and on.attrs[0].value.flag == 1  # PROGRAMMATIC_STREAM_SERIALIZATION
    assert launch_config((1, 1, 1), (32, 1, 1), 0, 0, pdl=False).numAttrs == 0
