"""What the quantized KV cache's rotation buys: `kvserve bench quality` with K/V stored unrotated (the rotation
swapped for the identity in this process), everything else as the engine runs it (one scale per block).

    python scripts/kv_rotation_ablation.py [bench quality flags...]

e.g. `python scripts/kv_rotation_ablation.py --quantization "" --kv-cache-dtype int8,fp8_e4m3`; compare with the
same `kvserve bench quality` command (docs/features/kv-cache-quantization.md). The reference, a float32 cache, is never
rotated either way.
"""
from __future__ import annotations

import sys

import kvserve.attention.torch_ref as torch_ref
from kvserve.attention.cpu_kernels import load_paged_attention


def _unrotated(x):
    return x.contiguous()


def main(argv: list[str]) -> int:
    torch_ref.rotate = _unrotated                  # torch_ref's rotation (kv_cache/rotation.py)
    kernel = load_paged_attention()
    if kernel is not None:
        kernel.hadamard = _unrotated               # cpu_paged's (the C++ module's fast transform)
    from kvserve.cli.main import main as kvserve_main

    return kvserve_main(["bench", "quality", *argv])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
