"""The GPU check's probe of a python3's torch: one JSON object on stdout, nothing else.

Run as `python3 tools/gpu/probe_torch.py`; whatever torch, CUDA or a plugin prints while
importing goes to stderr (the step's log), never into the JSON. Without torch it prints
{"torch": null, "error": ...} and exits 0: the caller tries the next python3.
"""
import contextlib
import glob
import os
import sys

sys.dont_write_bytecode = True  # no __pycache__ left in the tree that travels
import json_stdout  # noqa: E402  (tools/gpu/json_stdout.py, beside this file)


def probe():
    info = {"python": sys.executable, "python_version": sys.version.split()[0]}
    # Anything written to stdout while importing (warnings printed by a plugin, say)
    # goes to stderr: stdout carries the JSON alone.
    with contextlib.redirect_stdout(sys.stderr):
        try:
            import torch
        except Exception as e:  # noqa: BLE001 - any failure to import is "no torch here"
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            info.update({"torch": None, "error": first})
            return info
        torch_dir = os.path.dirname(torch.__file__)
        info.update({
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "cxx11_abi": bool(torch.compiled_with_cxx11_abi()),
            "cmake_prefix": torch.utils.cmake_prefix_path,
            "torch_dir": torch_dir,
            "debian": torch_dir.startswith("/usr/lib/python3/"),
        })
        available = bool(info["cuda"]) and torch.cuda.is_available()
        info["available"] = available
        info["devices"] = torch.cuda.device_count() if available else 0
        if available:
            info["capability"] = "%d.%d" % torch.cuda.get_device_capability(0)
            info["device_name"] = torch.cuda.get_device_name(0)
            props = torch.cuda.get_device_properties(0)
            info["multiprocessors"] = props.multi_processor_count
            info["memory_bytes"] = props.total_memory
            try:
                info["nccl_version"] = ".".join(map(str, torch.cuda.nccl.version()))
            except Exception:  # noqa: BLE001 - a torch without NCCL
                info["nccl_version"] = None
        try:
            import torch.distributed as dist
            info["gloo_available"] = bool(dist.is_available() and dist.is_gloo_available())
        except Exception:  # noqa: BLE001
            info["gloo_available"] = False
    # Debian's python3-torch has no CMake package of its own: libtorch-dev's is LibTorch's.
    if not os.path.exists(os.path.join(info["cmake_prefix"], "Torch", "TorchConfig.cmake")):
        debian_cmake = "/usr/lib/x86_64-linux-gnu/cmake"
        if info["debian"] and os.path.exists(os.path.join(debian_cmake, "Torch", "TorchConfig.cmake")):
            info["cmake_prefix"] = debian_cmake
        else:
            info["cmake_prefix_missing"] = True
    site = os.path.dirname(torch_dir)
    # The NCCL this torch loads (a wheel's nvidia-nccl-cu*): tetra's nccl backend links
    # the same library, with the headers beside it.
    nccl_lib = ""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1]
                if "libnccl.so" in path:
                    nccl_lib = path
                    break
    except OSError:
        pass
    if not nccl_lib:
        found = sorted(glob.glob(os.path.join(site, "nvidia", "**", "libnccl.so*"), recursive=True))
        nccl_lib = found[0] if found else ""
    info["nccl_lib"] = nccl_lib
    include = ""
    if nccl_lib:
        for up in (os.path.dirname(os.path.dirname(nccl_lib)), os.path.dirname(nccl_lib)):
            if os.path.exists(os.path.join(up, "include", "nccl.h")):
                include = os.path.join(up, "include")
                break
    info["nccl_include"] = include
    # Gloo's headers of the Gloo this torch was built with: a wheel ships them in its own
    # include folder; Debian's torch is built against Debian's libgloo-dev.
    own = os.path.join(torch_dir, "include")
    if os.path.exists(os.path.join(own, "gloo", "algorithm.h")):
        info["gloo_headers"] = own
    elif info["debian"] and os.path.exists("/usr/include/gloo/algorithm.h"):
        info["gloo_headers"] = "/usr/include"
    else:
        info["gloo_headers"] = ""
    # nvcc of a pip CUDA toolkit beside torch, where there is one.
    info["pip_nvcc"] = sorted(glob.glob(os.path.join(site, "nvidia", "**", "bin", "nvcc"), recursive=True))
    return info


if __name__ == "__main__":
    # Whatever the import writes to file descriptor 1 from C (CUDA, a plugin's printf)
    # lands on stderr too: stdout carries the JSON alone.
    sys.exit(json_stdout.run(lambda: (probe(), 0)))
