"""modelship's own CPU kernels (`csrc/`): built once per machine, loaded on use.

- `q4_linear` (W4A8) and `q8_linear` (W8A8): `csrc/q4_cpu.cpp`, used by `quant.int4` and
  `quant.int8`; the W4A8 matmul itself is `csrc/q4_gemm.h`, compiled for AVX2 there and for
  AVX512-VNNI in `csrc/q4_vnni.cpp` (picked at run time, bit-identical results);
- `rope_paged_attention` (used by `llama.py`) and `paged_attention` (used by
  `attention.py`): `csrc/attention_cpu.cpp`;
- `dense_linear` (used by `quant.base.dense_linear`): bf16/fp16/fp32 weights widened to fp32
  in registers, each row reduced in one order whatever the batch: `csrc/dense_cpu.cpp`;
- `decoder_layers` (used by `fused_decoder.py`): every decoder layer in one call,
  `csrc/decoder_cpu.cpp`, its MLPs and mixture-of-experts dispatch in `csrc/moe_cpu.cpp`
  (`mlp_cpu.h`), on the other files' kernels (`csrc/cpu_kernels.h`, `dense_cpu.h`).

They need AVX2 + FMA + F16C; on other CPUs (and when the build fails) callers keep torch's
kernels. The build is a torch C++ extension compiled with ninja into torch's extension
cache (`TORCH_EXTENSIONS_DIR`) under a name that carries a digest of the sources, flags and
torch version, so a machine compiles each version once per checkout (`make setup` does it
ahead of time; the image's build stage too, the runtime stage has no compiler), and
checkouts sharing the cache do not rebuild over each other's library (the digest covers the
sources' folder too: torch regenerates a build file that names other source paths, and
ninja then rebuilds). A library already built under that name is loaded as it is, with
neither compiler nor ninja. Builders and loaders of one
build folder take turns under an `fcntl.flock` the kernel releases when its holder dies, so
a torch build lock found by the holder can only have been left by a killed build.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from modelship.model.kv_cache import KVCache

logger = logging.getLogger(__name__)

_NAME = "modelship_cpu_kernels"
_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [
    _CSRC / name
    for name in (
        "q4_cpu.cpp",
        "q4_vnni.cpp",
        "attention_cpu.cpp",
        "decoder_cpu.cpp",
        "moe_cpu.cpp",
        "dense_cpu.cpp",
    )
]
_HEADERS = [_CSRC / name for name in ("cpu_kernels.h", "q4_gemm.h", "dense_cpu.h", "mlp_cpu.h")]
# -ffp-contract=off: GCC would otherwise fuse a scalar `a += b * c` into an FMA in some
# template instances and not in others, and a row would round differently depending on
# which tile shape computed it (batch invariance needs one rounding per row).
_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp"]
CHUNK = 64  # columns per 32 packed bytes
BLOCK_ROWS = 8  # output rows interleaved in one block of the W4A8 layout
MAX_GROUP_SIZE = 256  # int16 partial sums of one group must not overflow


def cpu_has_avx2() -> bool:
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


@functools.cache
def load() -> bool:
    """Build (first time) and register `torch.ops.modelship.*`; False where unavailable."""
    if not cpu_has_avx2():
        return False
    try:
        from torch.utils import cpp_extension

        name = _build_name()
        build_dir = Path(cpp_extension._get_build_directory(name, False))
        if _load_prebuilt(build_dir / f"{name}.so"):
            return True
        with _one_builder(build_dir):
            cpp_extension.load(
                name=name,
                sources=[str(path) for path in _SOURCES],
                extra_cflags=_FLAGS,
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
                verbose=False,
            )
    except Exception as exc:  # no compiler or ninja: torch's kernel still works
        logger.warning("modelship CPU kernels unavailable (%s); using torch's int4 kernel", exc)
        return False
    return True


def _build_name() -> str:
    """`_NAME` plus a digest of what goes into the build (torch's own check is per process,
    and one build directory per name would be relinked by whichever version loads last)."""
    digest = hashlib.sha256(" ".join(_FLAGS).encode())
    digest.update(torch.__version__.encode())  # the library links against this libtorch
    digest.update(str(_CSRC.resolve()).encode())
    for path in [*_SOURCES, *_HEADERS]:
        digest.update(path.read_bytes())
    return f"{_NAME}_{digest.hexdigest()[:12]}"


def _load_prebuilt(library: Path) -> bool:
    """Load a library built earlier under this build's name (its digest covers everything
    that went into it); False when there is none, or a killed build left it unreadable (it
    is then built again)."""
    if not library.is_file():
        return False
    try:
        torch.ops.load_library(str(library))
    except OSError as exc:
        logger.warning("%s does not load (%s); building it again", library, exc)
        return False
    return True


@contextlib.contextmanager
def _one_builder(build_dir: Path) -> Iterator[None]:
    """Hold the build folder's flock while building or loading. torch's own lock is a file
    that waits forever once its builder was killed (every replica start would hang); under
    the flock, no live builder can hold one, so any found is removed."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "modelship.flock", "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # released by the kernel if this process dies
        baton = build_dir / "lock"
        if baton.exists():
            logger.warning("removing the build lock of a killed kernel build: %s", baton)
            baton.unlink(missing_ok=True)
        yield


def supports(out_features: int, in_features: int, group_size: int) -> bool:
    return (
        group_size % CHUNK == 0 and group_size <= MAX_GROUP_SIZE and in_features % group_size == 0
    )


def pack_q4(
    u: torch.Tensor,  # [out, in] int32 in [0, 15]
    scale: torch.Tensor,  # [out, in / group_size]
    zero_point: torch.Tensor,  # [out, in / group_size] signed
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (qweight uint8 [blocks, 4 in], scales fp16 [blocks, in / group_size, 8], mins the
    same) in `q4_linear`'s row-interleaved layout (`csrc/q4_gemm.h`), blocks = ceil(out / 8),
    the last block padded with zero rows.

    W = (u - 8 - zero_point) * scale = u * scale + min with min = -(8 + zero_point) * scale.
    Per row, chunk of 64 columns, byte j holds column j (low nibble) and j + 32 (high); the
    block's 8 rows then take turns every 4 bytes (lane i: bytes 4i .. 4i + 3 of each row).
    """
    out_features, in_features = u.shape
    num_blocks = -(-out_features // BLOCK_ROWS)
    padded = num_blocks * BLOCK_ROWS
    scale = scale.float()
    mins = -(8 + zero_point.float()) * scale
    if padded != out_features:  # zero rows: u = 0 and scale = min = 0 give outputs of 0
        pad = (0, 0, 0, padded - out_features)
        u, scale, mins = F.pad(u, pad), F.pad(scale, pad), F.pad(mins, pad)
    num_chunks = in_features // CHUNK
    halves = u.to(torch.uint8).view(padded, num_chunks, 2, CHUNK // 2)
    rows = halves[:, :, 0] | (halves[:, :, 1] << 4)  # [padded, chunks, 32]
    lanes = rows.view(num_blocks, BLOCK_ROWS, num_chunks, 8, 4)  # [block, row, chunk, lane, 4]
    qweight = lanes.permute(0, 2, 3, 1, 4).reshape(num_blocks, 4 * in_features)

    def interleave(t: torch.Tensor) -> torch.Tensor:  # [padded, groups] -> [blocks, groups, 8]
        return t.half().view(num_blocks, BLOCK_ROWS, -1).transpose(1, 2).contiguous()

    return qweight.contiguous(), interleave(scale), interleave(mins)


def dequantize_q4_rows(
    qweight: torch.Tensor,  # [blocks, 4 in] uint8, `pack_q4`'s layout
    scales: torch.Tensor,  # [blocks, in / group_size, 8] fp16
    mins: torch.Tensor,  # [blocks, in / group_size, 8] fp16
    rows: torch.Tensor,  # [n] int64 output-row ids
) -> torch.Tensor:  # [n, in] fp32: u * scale + min of those rows only
    """The inverse of `pack_q4` for some rows (an embedding lookup in a 4-bit table): reads
    the n rows' bytes, scales and mins, and nothing else of the weight."""
    blocks, lane = rows // BLOCK_ROWS, rows % BLOCK_ROWS
    n, in_features = rows.shape[0], qweight.shape[1] // 4
    num_chunks = in_features // CHUNK
    packed = qweight[blocks].view(n, num_chunks, 8, BLOCK_ROWS, 4)  # [n, chunk, lane, row, 4]
    index = lane.view(n, 1, 1, 1, 1).expand(n, num_chunks, 8, 1, 4)
    mine = packed.gather(3, index).view(n, num_chunks, CHUNK // 2)  # [n, chunk, 32] bytes
    u = torch.cat([mine & 0xF, mine >> 4], dim=2).view(n, in_features).float()
    group_size = in_features // scales.shape[1]
    scale = scales[blocks, :, lane].float().repeat_interleave(group_size, dim=1)  # [n, in]
    low = mins[blocks, :, lane].float().repeat_interleave(group_size, dim=1)
    return u.mul_(scale).add_(low)


def q4_linear(
    x: torch.Tensor,  # [n, in] bf16 or fp32, contiguous
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    group_size: int,
    isa: str = "auto",  # "avx2" or "vnni" force one (the same bits either way)
) -> torch.Tensor:  # [n, 8 ceil(out / 8)] in x's dtype: the padding rows' outputs are 0
    return torch.ops.modelship.q4_linear(x, qweight, scales, mins, group_size, isa)


def q4_kernel_isa() -> str:
    """The instruction set `q4_linear` runs here: "vnni" (AVX512-VNNI) or "avx2"."""
    return torch.ops.modelship.q4_isa()


def pack_q8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (int8 [out, in], fp32 scales [out]): symmetric per output row."""
    weight = weight.float()
    scales = weight.abs().amax(dim=1) / 127
    inv = torch.where(scales > 0, 1 / scales, torch.zeros_like(scales))
    qweight = (weight * inv[:, None]).round().clamp_(-127, 127).to(torch.int8)
    return qweight.contiguous(), scales.contiguous()


def q8_linear(
    x: torch.Tensor,  # [n, in] bf16 or fp32, contiguous
    qweight: torch.Tensor,  # [out, in] int8
    scales: torch.Tensor,  # [out] fp32
    group_size: int,  # activation quantization group
) -> torch.Tensor:  # [n, out] fp32
    return torch.ops.modelship.q8_linear(x, qweight, scales, group_size)


def dense_linear(
    x: torch.Tensor,  # [n, in] float
    weight: torch.Tensor,  # [out, in] bf16, fp16 or fp32, contiguous
    bias: torch.Tensor | None,  # [out]
    isa: str = "auto",  # "avx2" keeps to the AVX2 tiles (the same bits as AVX-512's)
) -> torch.Tensor:  # [n, out] fp32
    return torch.ops.modelship.dense_linear(x, weight, bias, isa)


def paged_attention(
    q: torch.Tensor,  # [num_tokens, heads, head_dim] fp32, contiguous
    kv: torch.Tensor,  # [num_slots, 2, kv_heads, head_dim] fp32 or int8
    kv_scales: torch.Tensor | None,  # [num_slots, 2, kv_heads] fp32 with an int8 kv, else None
    block_table: torch.Tensor,  # [num_requests, width] int32
    token_request: torch.Tensor,  # [num_tokens] int32
    token_position: torch.Tensor,  # [num_tokens] int32
    block_size: int,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:  # [num_tokens, heads, head_dim] fp32
    """Each query over its request's positions 0 .. its own; with `window`, over the last
    `window` of them only (its own included)."""
    return torch.ops.modelship.paged_attention(
        q, kv, kv_scales, block_table, token_request, token_position, block_size, scale,
        window or 0,
    )  # fmt: skip


def rope_paged_attention(
    qkv: torch.Tensor,  # [num_tokens, (heads + 2 * kv_heads) * head_dim], before RoPE
    cache: KVCache,  # fp32 or int8: this step's K/V land here
    cos: torch.Tensor,  # [max_positions, head_dim] fp32
    sin: torch.Tensor,  # [max_positions, head_dim] fp32, rotate-half sign folded in
    meta,  # AttentionMetadata built for the "cpu" backend
    scale: float,
    num_heads: int,
    window: int | None = None,
) -> torch.Tensor:  # [num_tokens, heads * head_dim] in qkv's dtype
    """RoPE on q and k, the cache write (int8: quantized per head vector, as
    `kv_cache.quantize_kv`) and paged attention in one call (one layer); `window` as in
    `paged_attention`."""
    return torch.ops.modelship.rope_paged_attention(
        qkv.contiguous(),
        cache.kv,
        cache.scales,
        cos,
        sin,
        meta.slot_mapping,
        meta.block_table,
        meta.token_request,
        meta.token_position,
        meta.block_size,
        scale,
        num_heads,
        window or 0,
    )


def main() -> None:
    """Build now (`make setup` runs this)."""
    logging.basicConfig(level=logging.INFO)  # build errors are logged, then False
    print("modelship CPU kernels:", "ready" if load() else "unavailable on this machine")
