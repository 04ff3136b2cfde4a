"""What every kernel family shares: whether Triton runs here, block sizes, rows, launch grids.

* **interpreted** — Triton's ``@triton.jit`` returns an interpreter function (kernels run on the
  CPU, block by block in NumPy) when ``TRITON_INTERPRET=1`` is in the environment at the moment
  the kernel is defined, i.e. before this package is first imported. ``INTERPRETED`` records what
  the jit decorator actually did to a kernel defined here, at the same time as the families'
  kernels, so it cannot disagree with them.
* **rows** — a tensor ``[..., n]`` is read as ``rows × n``: the leading dimensions flattened, the
  last one contiguous. Row kernels run one program per row (forward) or per chunk of consecutive
  rows (backward, see ``row_chunks``).
* **block** — the columns one program holds at once: the next power of two of ``n``, capped; a
  row wider than its block is walked in blocks (the looped path). ``forced`` blocks (the
  ``block_size`` keyword of every public function) exist so the interpreter tests can exercise
  the looped path on small rows.

Only long-stable Triton APIs are used by the families (``tl.load``/``store``/``program_id``/
``arange``/``where``/``max``/``sum``/``exp``/``log``/``sqrt``/``rsqrt``/``erf``/``sigmoid``), so
the kernels compile on Triton 3.x as shipped with torch 2.11 to 2.13.
"""

# No ``from __future__ import annotations`` in the kernel files: ``triton.jit`` reads the
# ``tl.constexpr`` annotations of kernel parameters, which must stay objects, not strings.
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the eager reference compositions run instead (``backend``)
    triton = None
    tl = None

__all__ = [
    "CROSS_ENTROPY_MAX_BLOCK",
    "ELEMENTWISE_BLOCK",
    "HAS_TRITON",
    "INTERPRETED",
    "ROW_MAX_BLOCK",
    "ROW_MAX_BLOCK_BACKWARD",
    "available",
    "backend",
    "elementwise_block",
    "num_warps",
    "num_warps_backward",
    "row_block",
    "row_chunks",
    "rows_of",
]

HAS_TRITON = triton is not None

if HAS_TRITON:

    @triton.jit
    def _jit_mode_probe(x):
        """Never launched: the type ``@triton.jit`` gives it says whether kernels are interpreted."""
        tl.store(x, 0)

    INTERPRETED = type(_jit_mode_probe).__name__ == "InterpretedFunction"

else:
    INTERPRETED = False

ROW_MAX_BLOCK = 16384
"""Widest row a norm's forward program holds in registers at once (hidden 16384 at one block, 16
warps, no register spills on sm_90); wider rows take the looped path."""
ROW_MAX_BLOCK_BACKWARD = 8192
"""The same for the norms' backward, which also holds its weight-gradient partial sums: at 8192
columns and 16 warps ptxas (sm_90) spills a few hundred bytes per thread, at 16384 several KB;
wider rows take the looped path."""
CROSS_ENTROPY_MAX_BLOCK = 32768
"""Classes one cross-entropy program reads per block (Liger-Kernel's ``MAX_FUSED_SIZE // 2``);
a 128256-class vocabulary is walked in four blocks."""
ELEMENTWISE_BLOCK = 1024
"""Elements per program of the pointwise kernels (bias + GeLU, SwiGLU)."""


def available(device: torch.device | str) -> bool:
    """Whether the Triton kernels run for tensors on ``device`` (see ``backend``)."""
    dev = torch.device(device)
    if not HAS_TRITON:
        return False
    if dev.type == "cuda":
        return True
    return dev.type == "cpu" and INTERPRETED


def backend(t: torch.Tensor) -> str:
    """``"triton"`` when a fused op runs its Triton kernels for ``t`` (a CUDA tensor with Triton
    importable, or a CPU tensor under the interpreter), else ``"eager"``: the family's reference
    composition of torch ops."""
    return "triton" if available(t.device) else "eager"


def rows_of(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a contiguous ``[rows, n]`` tensor (a view when it already is contiguous)."""
    return x.contiguous().view(-1, x.shape[-1]) if x.dim() > 0 else x.reshape(1, 1)


def row_block(n: int, forced: int, cap: int = ROW_MAX_BLOCK) -> tuple[int, bool]:
    """``(block, one_block)``: the columns a row program holds at once and whether that is the
    whole row. ``forced`` > 0 overrides (a power of two, for tests of the looped path)."""
    if forced > 0:
        if forced & (forced - 1):
            raise ValueError(f"block_size must be a power of two, got {forced}")
        block = forced
    else:
        block = min(triton.next_power_of_2(max(n, 1)), cap)
    return block, block >= n


def elementwise_block(forced: int) -> int:
    if forced > 0:
        if forced & (forced - 1):
            raise ValueError(f"block_size must be a power of two, got {forced}")
        return forced
    return ELEMENTWISE_BLOCK


def num_warps(block: int) -> int:
    """Warps for a row program of ``block`` columns (Liger-Kernel's ``calculate_settings``)."""
    if block >= 32768:
        return 32
    if block >= 8192:
        return 16
    if block >= 2048:
        return 8
    return 4


def num_warps_backward(block: int) -> int:
    """Warps for a norm's backward row program: more than forward's, since each thread holds
    more live values (ptxas on sm_90: 4096 columns at 8 warps take 197 registers per thread, at
    16 warps 128, no spills)."""
    if block >= 4096:
        return 16
    if block >= 1024:
        return 8
    return 4


def row_chunks(rows: int, device: torch.device) -> tuple[int, int]:
    """``(programs, rows_per_program)`` of a backward row kernel that also reduces weight
    gradients: each program walks consecutive rows and keeps its own fp32 partial sums, one row
    of a ``[programs, n]`` buffer that torch sums afterwards. Two programs per multiprocessor on
    a GPU (enough to fill it while the partial buffer stays small: 264 × 4096 × 4 bytes = 4.3 MB
    on an H100); four under the interpreter, so odd row counts leave a short last chunk."""
    if device.type == "cuda":
        target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        target = 4
    per = max(1, -(-rows // max(1, target)))
    return max(1, -(-rows // per)), per
