"""Write, as JSON, the facts of the machine a GPU check ran on: GPU, driver, torch, CUDA, NCCL, gloo.

    python bench/gpu_environment.py PATH

Runs anywhere; on a machine without a GPU the GPU's fields are null. Results of a benchmark or a
test run are only comparable with others taken on the same facts.
"""

import json
import os
import platform
import subprocess
import sys
from typing import Any, Optional

import torch
import torch.distributed as dist


def _command_output(*command: str) -> Optional[str]:
    """The first line a command prints, or None where it is missing or fails."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = done.stdout.strip().splitlines()
    return lines[0].strip() if lines else None


def _gpu_facts() -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"gpu": None}
    properties = torch.cuda.get_device_properties(0)
    nccl = ".".join(str(part) for part in torch.cuda.nccl.version()) if dist.is_nccl_available() else None
    return {
        "gpu": torch.cuda.get_device_name(0),
        "gpus": torch.cuda.device_count(),
        "gpu_memory_gib": round(properties.total_memory / 2**30, 1),
        "compute_capability": f"{properties.major}.{properties.minor}",
        "multiprocessors": properties.multi_processor_count,
        "driver": _command_output("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"),
        "nccl": nccl,
        "cudnn": torch.backends.cudnn.version(),
    }


def facts() -> dict[str, Any]:
    """What the run's numbers depend on, from the interpreter down to the GPU."""
    import tensorplay

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "nccl_available": dist.is_nccl_available(),
        "gloo_available": dist.is_gloo_available(),
        "tensorplay": tensorplay.__version__,
        "commit": _command_output("git", "rev-parse", "HEAD"),
        **_gpu_facts(),
    }


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    environment = facts()
    with open(sys.argv[1], "w") as written:
        json.dump(environment, written, indent=1)
    print(json.dumps(environment))


if __name__ == "__main__":
    main()
