#!/usr/bin/env python3
"""Compiles kvxfer's CUDA kernels (kvxfer/src/device/kernels/*.cu) to the PTX kvxfer loads.

    python3 scripts/gen-ptx.py           regenerate the .ptx files beside the sources
    python3 scripts/gen-ptx.py --check   fail if a checked-in .ptx differs from what its
                                         source compiles to, and assemble each with ptxas
                                         for sm_80 and sm_90 (no GPU needed)

The compiler is NVRTC 12.0 and the assembler ptxas 12.0, both from PyPI wheels installed
into target/ptx-venv on first use (no CUDA toolkit, no GPU). compute_70 and NVRTC 12.0 give
PTX ISA 8.0: it loads on any driver of CUDA 12.0 or later and JIT-compiles for Volta on.
"""
import ctypes
import glob
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = os.path.join(ROOT, "kvxfer", "src", "device", "kernels")
VENV = os.path.join(ROOT, "target", "ptx-venv")
WHEELS = ["nvidia-cuda-nvrtc-cu12==12.0.76", "nvidia-cuda-nvcc-cu12==12.0.76"]
ARCH = "compute_70"
ASSEMBLE_FOR = ["sm_80", "sm_90"]


def tools():
    """The NVRTC library and ptxas, installing the wheels first if needed."""
    site = glob.glob(os.path.join(VENV, "lib", "python3*", "site-packages", "nvidia"))
    if not site or not glob.glob(os.path.join(site[0], "cuda_nvrtc", "lib", "libnvrtc.so*")):
        subprocess.run([sys.executable, "-m", "venv", VENV], check=True)
        subprocess.run([os.path.join(VENV, "bin", "pip"), "install", "-q", *WHEELS], check=True)
        site = glob.glob(os.path.join(VENV, "lib", "python3*", "site-packages", "nvidia"))
    nvrtc = sorted(glob.glob(os.path.join(site[0], "cuda_nvrtc", "lib", "libnvrtc.so*")))[0]
    ptxas = os.path.join(site[0], "cuda_nvcc", "bin", "ptxas")
    return ctypes.CDLL(nvrtc), ptxas


def compile_ptx(lib, path):
    """The PTX NVRTC makes of the source at `path`, or an exception with its log."""
    src = open(path, "rb").read()
    prog = ctypes.c_void_p()
    name = os.path.basename(path).encode()

    def ok(rc, what):
        if rc != 0:
            lib.nvrtcGetErrorString.restype = ctypes.c_char_p
            raise RuntimeError(f"{what}: {lib.nvrtcGetErrorString(rc).decode()}")

    ok(lib.nvrtcCreateProgram(ctypes.byref(prog), src, name, 0, None, None), "nvrtcCreateProgram")
    try:
        opts = [f"--gpu-architecture={ARCH}".encode(), b"--std=c++14"]
        arr = (ctypes.c_char_p * len(opts))(*opts)
        rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        if rc != 0:
            raise RuntimeError(f"{path}: compile failed:\n{log.value.decode()}")
        ok(lib.nvrtcGetPTXSize(prog, ctypes.byref(size)), "nvrtcGetPTXSize")
        ptx = ctypes.create_string_buffer(size.value)
        ok(lib.nvrtcGetPTX(prog, ptx), "nvrtcGetPTX")
        return ptx.value
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def main():
    check = "--check" in sys.argv[1:]
    lib, ptxas = tools()
    bad = 0
    for cu in sorted(glob.glob(os.path.join(KERNELS, "*.cu"))):
        out = cu[:-3] + ".ptx"
        ptx = compile_ptx(lib, cu)
        rel = os.path.relpath(out, ROOT)
        if not check:
            open(out, "wb").write(ptx)
            print(f"gen-ptx: wrote {rel} ({len(ptx)} bytes)")
            continue
        have = open(out, "rb").read() if os.path.exists(out) else b""
        if have != ptx:
            print(f"gen-ptx: {rel} differs from what its source compiles to: "
                  "run python3 scripts/gen-ptx.py and commit it")
            bad += 1
            continue
        for sm in ASSEMBLE_FOR:
            r = subprocess.run([ptxas, f"--gpu-name={sm}", "-o", os.devnull, out],
                               capture_output=True, text=True)
            if r.returncode != 0:
                print(f"gen-ptx: ptxas {sm} refused {rel}:\n{r.stderr}")
                bad += 1
        print(f"gen-ptx: {rel} matches its source and assembles for {', '.join(ASSEMBLE_FOR)}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
