"""Matrix-unit instructions emulated in numba-cuda's simulator, from the vendors' fragment layouts written out element
by element (PTX ISA "Matrix fragments for mma.m16n8k16 / m16n8k32"; AMD's matrix instruction calculator for the
16x16 MFMAs; AMD's RDNA3 WMMA article for the wave32 WMMAs), independently of the `MatrixUnit` descriptions in
codegen/cuda.py and codegen/hip.py. A kernel lowered natively for a unit and rendered by the CUDA printer calls
these (the `MatrixOp` spelling of `PyPrinter`), so tests/test_target_cuda.py runs the native lowering's operand
loads, accumulator layout and tile dealing against numpy without the hardware.

Each call is warp- (wave-) collective: every lane of the subgroup deposits its registers, they meet at a barrier,
each computes the whole tile product and keeps its own accumulators.
"""

from __future__ import annotations

import threading

import numpy as np

_lock = threading.Lock()
_rooms: dict = {}


def _exchange(width: int, payload) -> list:
    """The payloads of all `width` lanes of this lane's subgroup, by lane (a collective call)."""
    tid, block = _lane()
    key = (*block, width, tid // width)
    with _lock:
        room = _rooms.setdefault(key, (threading.Barrier(width), [None] * width))
    barrier, data = room
    data[tid % width] = payload
    barrier.wait()
    out = list(data)
    barrier.wait()  # every lane has read before the next call overwrites
    return out


def _lane() -> tuple[int, tuple]:
    """(thread index, block index) of the simulator's thread running this lane."""
    t = threading.current_thread()
    return int(t.threadIdx.x), (int(t.blockIdx.x), int(t.blockIdx.y), int(t.blockIdx.z))


def _bytes(word) -> np.ndarray:
    return np.array([int(word) & 0xFFFFFFFF], np.uint32).view(np.int8).astype(np.int64)


def _halves(word) -> np.ndarray:
    return np.array([int(word) & 0xFFFFFFFF], np.uint32).view(np.float16).astype(np.float64)


def _ptx(a, b, c, k: int, floats: bool):
    """One m16n8k`k` mma.sync; a, b, c this lane's registers."""
    lanes = _exchange(32, (a, b, c))
    per = 2 if floats else 4  # elements a register
    A, B, C = np.zeros((16, k)), np.zeros((k, 8)), np.zeros((16, 8))
    for lane, (ra, rb, rc) in enumerate(lanes):
        g, t = lane // 4, lane % 4
        ea = np.concatenate([(_halves if floats else _bytes)(w) for w in ra])
        for i, v in enumerate(ea):
            # A: rows g (i in the first and third quarter of the registers' elements) or g + 8; columns
            # t * per + i % per, plus k / 2 for the second half.
            row = g + 8 * ((i // per) % 2) if len(ra) == 4 else g + 8 * (i // per)
            col = t * per + i % per + (k // 2 if len(ra) == 4 and i >= 2 * per else 0)
            A[row, col] = v
        eb = np.concatenate([(_halves if floats else _bytes)(w) for w in rb])
        for i, v in enumerate(eb):
            B[t * per + i % per + (k // 2 if i >= per else 0), g] = v
        for i, v in enumerate(rc):
            C[g + 8 * (i // 2), t * 2 + i % 2] = v
    D = C + A @ B
    lane = _lane()[0] % 32
    g, t = lane // 4, lane % 4
    vals = [D[g + 8 * (i // 2), t * 2 + i % 2] for i in range(4)]
    return tuple(np.float32(v) for v in vals) if floats else tuple(int(v) for v in vals)


def mma_s8_k32(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    return _ptx((a0, a1, a2, a3), (b0, b1), (c0, c1, c2, c3), 32, False)


def mma_s8_k16(a0, a1, b0, c0, c1, c2, c3):
    return _ptx((a0, a1), (b0,), (c0, c1, c2, c3), 16, False)


def mma_f16_k16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    return _ptx((a0, a1, a2, a3), (b0, b1), (c0, c1, c2, c3), 16, True)


def _prmt(a, b, selector: int) -> int:
    """PTX prmt.b32 (default mode): byte i of the result is byte (selector >> 4i) & 7 of b:a."""
    pool = np.array([int(a) & 0xFFFFFFFF, int(b) & 0xFFFFFFFF], np.uint32).view(np.uint8)
    return int(np.array([pool[(selector >> (4 * i)) & 7] for i in range(4)], np.uint8).view(np.uint32)[0])


def _f16x2(fn, *words) -> int:
    """fn applied to the low halves of the f16x2 words, then to their high halves (f64 arithmetic, one rounding to
    f16 as PTX's f16x2 sub and fma round)."""
    halves = [np.array([int(w) & 0xFFFFFFFF], np.uint32).view(np.float16).astype(np.float64) for w in words]
    out = np.array([fn(*(h[i] for h in halves)) for i in range(2)], np.float16)
    return int(out.view(np.uint32)[0])


def mma_u8f16_k16(a, a8, s, s8, b0, b1, c0, c1, c2, c3):
    """The u8f16 instruction as cuda_intrinsics' PTX writes it: bytes under the exponent byte 0x64 (1024 + q), less
    1024, times the row's f16 scale plus its offset, then the f16 m16n8k16 on those A registers."""
    regs = []
    for word, sm in ((a, s), (a8, s8), (a, s), (a8, s8)):
        regs.append((word, sm))
    q = [_prmt(w, 0x64646464, sel) for (w, _), sel in zip(regs, (0x5140, 0x5140, 0x5342, 0x5342))]
    q = [_f16x2(lambda h, k: h - k, x, 0x64006400) for x in q]
    v = [_f16x2(lambda h, sc, m: h * sc + m, x, _prmt(sm, sm, 0x1010), _prmt(sm, sm, 0x3232))
         for x, (_, sm) in zip(q, regs)]
    return _ptx(tuple(v), (b0, b1), (c0, c1, c2, c3), 16, True)


def _mfma(a, b, c, floats: bool):
    """One 16x16x16 MFMA on a wave64: A[i][k] at lane i + 16 (k / 4), item k % 4; B[k][j] at lane j + 16 (k / 4);
    D[i][j] at lane j + 16 (i / 4), item i % 4."""
    lanes = _exchange(64, (a, b, c))
    A, B, C = np.zeros((16, 16)), np.zeros((16, 16)), np.zeros((16, 16))
    for lane, (ra, rb, rc) in enumerate(lanes):
        ea = np.concatenate([(_halves if floats else _bytes)(w) for w in ra])
        eb = np.concatenate([(_halves if floats else _bytes)(w) for w in rb])
        for item in range(4):
            A[lane % 16, 4 * (lane // 16) + item] = ea[item]
            B[4 * (lane // 16) + item, lane % 16] = eb[item]
            C[4 * (lane // 16) + item, lane % 16] = rc[item]
    D = C + A @ B
    lane = _lane()[0] % 64
    vals = [D[4 * (lane // 16) + r, lane % 16] for r in range(4)]
    return tuple(np.float32(v) for v in vals) if floats else tuple(int(v) for v in vals)


def __builtin_amdgcn_mfma_i32_16x16x16i8(a0, b0, c0, c1, c2, c3):
    return _mfma((a0,), (b0,), (c0, c1, c2, c3), False)


def __builtin_amdgcn_mfma_f32_16x16x16f16(a0, a1, b0, b1, c0, c1, c2, c3):
    return _mfma((a0, a1), (b0, b1), (c0, c1, c2, c3), True)


def _wmma(a, b, c, floats: bool):
    """One wave32 16x16x16 WMMA: A[i][k] at lane i (and i + 16), item k; B[k][j] at lane j (and j + 16), item k;
    D[i][j] at lane j + 16 (i % 2), item i / 2."""
    lanes = _exchange(32, (a, b, c))
    A, B, C = np.zeros((16, 16)), np.zeros((16, 16)), np.zeros((16, 16))
    for lane, (ra, rb, rc) in enumerate(lanes):
        if lane < 16:
            A[lane, :] = np.concatenate([(_halves if floats else _bytes)(w) for w in ra])
            B[:, lane] = np.concatenate([(_halves if floats else _bytes)(w) for w in rb])
        for item in range(8):
            C[2 * item + lane // 16, lane % 16] = rc[item]
    D = C + A @ B
    lane = _lane()[0] % 32
    vals = [D[2 * r + lane // 16, lane % 16] for r in range(8)]
    return tuple(np.float32(v) for v in vals) if floats else tuple(int(v) for v in vals)


def __builtin_amdgcn_wmma_i32_16x16x16_iu8_w32(a0, a1, a2, a3, b0, b1, b2, b3, *c):
    return _wmma((a0, a1, a2, a3), (b0, b1, b2, b3), c, False)


def __builtin_amdgcn_wmma_f32_16x16x16_f16_w32(a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7, *c):
    return _wmma((a0, a1, a2, a3, a4, a5, a6, a7), (b0, b1, b2, b3, b4, b5, b6, b7), c, True)
