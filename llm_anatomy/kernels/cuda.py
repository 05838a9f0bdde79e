"""CUDA C++ kernels, compiled at run time by NVRTC (PyTorch's torch.cuda._compile_kernel, which its CUDA wheels
carry: no nvcc needed) and launched through the driver's cuLaunchKernelEx, so that they can take part in
programmatic dependent launch (PDL) like the Triton kernels (see pdl.py) and be captured in CUDA graphs.

PyTorch's own launcher has no launch attributes; the structures below mirror the driver's CUlaunchConfig and
CUlaunchAttribute (cuda.h, CUDA 12 and 13).
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID


class LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class LaunchConfig(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


def available(device: torch.device) -> bool:
    """Whether CUDA C++ kernels can be compiled and run here: a Hopper or later GPU, and PyTorch's NVRTC path."""
    return (device.type == "cuda" and hasattr(torch.cuda, "_compile_kernel")
            and os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.get_device_capability(device)[0] >= 9)


@functools.cache
def compile_kernel(source: str, name: str, device_index: int, shared_bytes: int):
    """The kernel `name` of `source`, built for the GPU at device_index (sm_XY), allowed shared_bytes of dynamic
    shared memory. Built once per process (NVRTC takes a fraction of a second)."""
    major, minor = torch.cuda.get_device_capability(device_index)
    with torch.cuda.device(device_index):
        kernel = torch.cuda._compile_kernel(source, name, compute_capability=f"{major}{minor}")
        kernel.set_shared_memory_config(shared_bytes)
    return kernel


def launch(kernel, grid: int, block: int, args: list, shared_bytes: int = 0, pdl: bool = False) -> None:
    """cuLaunchKernelEx on the current stream; with `pdl`, it may start while the kernel before finishes (the
    kernel must then wait with griddepcontrol.wait before reading that kernel's outputs). args: tensors (their
    data pointers), ints (C int), floats (C float)."""
    libcuda = torch.cuda._utils._get_gpu_runtime_library()
    attr = LaunchAttribute(id=PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value[0] = 1
    config = LaunchConfig((grid, 1, 1), (block, 1, 1), shared_bytes, torch.cuda.current_stream().cuda_stream,
                          ctypes.pointer(attr) if pdl else None, 1 if pdl else 0)
    held = [ctypes.c_void_p(a.data_ptr()) if isinstance(a, torch.Tensor)
            else ctypes.c_float(a) if isinstance(a, float) else ctypes.c_int(a) for a in args]
    params = (ctypes.c_void_p * len(held))(*[ctypes.cast(ctypes.byref(h), ctypes.c_void_p) for h in held])
    result = libcuda.cuLaunchKernelEx(ctypes.byref(config), kernel.func, params, None)
    if result != 0:
        raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {result}")
