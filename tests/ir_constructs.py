"""Hand-built kernels covering every kernel-IR construct, with numpy references: the conformance cases every
kernel target runs (tests/test_target_cuda.py in numba-cuda's simulator, test_target_opencl.py on PoCL,
test_target_hip.py compiled for AMD architectures and run through NVRTC on an NVIDIA GPU, and
scripts/cuda_selftest.py on a real GPU), so that each target is held to the same kernels and the same answers.
"""

from __future__ import annotations

import numpy as np

from polystrata.codegen.pyfamily import NUMPY_DTYPES
from polystrata.ir.expr import TABLES, Expr, Table
from polystrata.ir.kernel import (
    Assign,
    Buf,
    Call,
    Cast,
    Const,
    Decl,
    For,
    FragElem,
    Fragment,
    FragSet,
    If,
    Kernel,
    LaneFor,
    Let,
    Load,
    LocalArray,
    Reduce,
    Scalar,
    Select,
    Store,
    TileEach,
    TileMMA,
    ToF32,
    Var,
)

g0, g1, g2, n, j, k = (Var(v) for v in ("g0", "g1", "g2", "n", "j", "k"))
ROWS = Scalar("rows")
ELEMENT_BYTES = {"f32": 4, "f16": 2, "i32": 4, "u32": 4, "i16": 2, "u16": 2, "i8": 1, "u8": 1}
MATH_FUNCTIONS = 13  # outputs of `math_kernel` per value


# --- kernels ---------------------------------------------------------------------------------------------------


def reduce_kernel(lanes: int) -> Kernel:
    """Per row g0 of x[rows, n]: s = sum of x, m = max of 2x (uniform stores of Reduce results)."""
    row = g0 * n
    return Kernel(f"red{lanes}", (Buf("x", "f32"), Buf("s", "f32", True), Buf("m", "f32", True), Scalar("n"), ROWS),
                  (Var("rows"),), (
        Reduce("sum", "+", "j", n, (Let("v", Load("x", row + j)),), Var("v")),
        Reduce("mx", "max", "j", n, (), Load("x", row + j) * 2.0),
        Store("s", g0, Var("sum")),
        Store("m", g0, Var("mx")),
    ), lanes=lanes)


def shared_kernel(lanes: int) -> Kernel:
    """Rows of up to 300 values: a LaneFor fills a local array (an unrolled For inside), a Reduce reads it, a
    uniform local store is read by every lane, a LaneFor reads the array, and a last LaneFor rewrites it (each lane
    only its own values, read by no uniform code after: no barrier is needed before it)."""
    row = g0 * n
    return Kernel(f"shared{lanes}", (Buf("x", "f32"), Buf("y", "f32", True), Buf("tot", "f32", True), Scalar("n"),
                                     ROWS), (Var("rows"),), (
        LaneFor("j", n, (
            Decl("acc", "f32", Const(0.0)),
            For("k", Const(0), Const(3), (Assign("acc", Var("acc") + Load("x", row + j) * ToF32(k + 1)),), unroll=3),
            Store("t", j, Var("acc")),
        )),
        Reduce("s", "+", "j", n, (), Load("t", j)),
        Store("u", Const(0), Var("s") + 1.0),
        Let("inv", 1.0 / Load("u", 0)),
        LaneFor("j", n, (Store("y", row + j, Load("t", j) * Var("inv")),)),
        Store("tot", g0, Load("u", 0)),
        LaneFor("j", n, (Store("t", j, Const(0.0)),)),
    ), lanes=lanes, local=(LocalArray("t", "f32", 300), LocalArray("u", "f32", 1)))


def shared_ref(x: np.ndarray, rows: int, n_: int) -> tuple[np.ndarray, np.ndarray]:
    """`shared_kernel`'s y and tot (float64)."""
    t = x.reshape(rows, n_).astype(np.float64) * 6
    u = t.sum(1) + 1
    return (t / u[:, None]).reshape(-1), u


def int_kernel(lanes: int = 16) -> Kernel:
    """Integer ops on every narrow load type, If (on a Call) / Select / Cast, int abs / max / min, an unrolled For
    with a run-time trip count; 4 outputs a value."""
    a, b, c, h, s, w = (Load(name, j) for name in ("a", "b", "c", "h", "s", "w"))
    body = (
        Let("q", a // 7 + (a % 7) * 100),
        Let("bits", ((b >> 3) & 0xF) | (c << 2)),
        Decl("r", "i32", Const(0)),
        If(a < 50, (Assign("r", Var("q")),), (Assign("r", Var("bits") - s),)),
        Store("o", j * 4, Var("r")),
        Store("o", j * 4 + 1, Select(h.eq(7), -1, h * 3 + b)),
        Store("o", j * 4 + 2, Cast("i32", ToF32(s) * 0.5) + Call("abs", s) + Call("max", a, c) - Call("min", b, s)),
        Store("u", j, ((w >> 4) & 0xFFFFFFF) | (w << 28)),
        If(Call("min", b, 3).ne(3), (Store("o", j * 4 + 3, Const(1)),), (Store("o", j * 4 + 3, Const(2)),)),
        # An unrolled loop whose trip count (0..8) is rarely a multiple of the unroll, a Let re-bound each trip.
        Decl("acc", "i32", Const(0)),
        For("k", Const(0), b % 9, (Let("kc", Var("k") * 3 + c), Assign("acc", Var("acc") + Var("kc"))), unroll=4),
        Store("t", j, Var("acc")),
    )
    params = (Buf("a", "i32"), Buf("b", "u8"), Buf("c", "i8"), Buf("h", "u16"), Buf("s", "i16"), Buf("w", "u32"),
              Buf("o", "i32", True), Buf("u", "u32", True), Buf("t", "i32", True), Scalar("n"))
    return Kernel("ints", params, (1,), (LaneFor("j", n, body),), lanes=lanes)


def math_kernel(lanes: int = 32) -> Kernel:
    """Every math function, float division, an f32 scalar, and inf / NaN constants."""
    x = Load("x", j) * Var("scale")
    fns = [Call("exp", x), Call("tanh", x), Call("sqrt", Call("abs", x)), Call("rsqrt", Call("abs", x) + 1.0),
           Call("cos", x), Call("sin", x), Call("log", Call("abs", x) + 0.5), Call("pow", Call("abs", x), 1.5),
           Call("max", x, 0.25), Call("min", x, 0.25), x / 3.0, Const(float("inf")) * x, Const(float("nan"))]
    assert len(fns) == MATH_FUNCTIONS
    body = tuple(Store("y", j * MATH_FUNCTIONS + i, f) for i, f in enumerate(fns))
    return Kernel("mathf", (Buf("x", "f32"), Buf("y", "f32", True), Scalar("n"), Scalar("scale", "f32")), (1,),
                  (LaneFor("j", n, body),), lanes=lanes)


GRID = (3, 4, 5)


def grid_kernel(lanes: int = 8) -> Kernel:
    """A three-dimensional grid (`GRID`), 10 values a group."""
    idx = (g2 * GRID[1] + g1) * GRID[0] + g0
    return Kernel("grid3", (Buf("y", "i32", True),), tuple(Const(d) for d in GRID), (
        LaneFor("j", Const(10), (Store("y", idx * 10 + j, g0 * 10000 + g1 * 1000 + g2 * 100 + j),)),
    ), lanes=lanes)


def table_kernel(lanes: int = 16) -> Kernel:
    """A Table lookup (iq4nl)."""
    return Kernel("table", (Buf("q", "u8"), Buf("y", "f32", True), Scalar("n")), (1,), (
        LaneFor("j", n, (Store("y", j, ToF32(Table("iq4nl", Load("q", j) & 15)) * 0.5),)),
    ), lanes=lanes)


def f16_kernel(lanes: int = 64) -> Kernel:
    """f16 buffer loads and stores, the f16 bit intrinsics, and a uniform store into an f16 local array read back."""
    return Kernel("f16io", (Buf("h", "f16"), Buf("x", "f32"), Buf("y", "f32", True), Buf("o", "f16", True),
                            Buf("p", "u32", True), Buf("z", "f32", True), Scalar("n")), (1,), (
        LaneFor("j", n, (
            Store("y", j, Load("h", j)),
            Store("o", j, Load("x", j)),
            Store("p", j, Call("f32_to_f16_bits", Call("f16_bits_to_f32", Call("f32_to_f16_bits", Load("x", j))))),
        )),
        Store("hl", Const(0), Const(1.0) / 3.0),
        Store("z", Const(0), Load("hl", Const(0))),
    ), lanes=lanes, local=(LocalArray("hl", "f16", 2),))


def f16_local_kernel(lanes: int = 64) -> Kernel:
    """An f16 local array of up to 256 values written by the lanes and read by others, a Table lookup, and a
    uniform f16 store into a buffer after a LaneFor wrote it."""
    return Kernel("f16local", (Buf("h", "f16"), Buf("q", "u8"), Buf("y", "f32", True), Buf("o", "f16", True),
                               Scalar("n")), (1,), (
        LaneFor("j", n, (Store("t", j, Load("h", j) * 2.0),)),
        LaneFor("j", n, (
            Store("y", j, Load("t", n - 1 - j) + ToF32(Table("iq4nl", Load("q", j) & 15))),
            Store("o", j, Load("h", j) * 0.5),
        )),
        Store("o", Const(0), Load("t", 1)),
    ), lanes=lanes, local=(LocalArray("t", "f16", 256),))


def intrinsics_kernel(lanes: int = 32) -> Kernel:
    """Each intrinsic: dot4_i8, load_u32 at offsets aligned to 1, 2 and 4 bytes, the f16 bit conversions, and an
    iq4nl Table lookup."""
    x = Load("x", j)
    return Kernel("intr", (Buf("x", "f32"), Buf("a", "i32"), Buf("b", "u32"), Buf("q", "u8"), Buf("o", "i32", True),
                           Buf("w", "u32", True), Buf("t", "f32", True), Buf("u", "u32", True),
                           Buf("y", "f32", True), Scalar("n")), (1,), (
        LaneFor("j", n, (
            Store("o", j, Call("dot4_i8", Load("a", j), Load("b", j), j - 50)),
            *(Store("w", j * 3 + s, Call("load_u32", Var("q"), j * al, al)) for s, al in enumerate((1, 2, 4))),
            Store("t", j, ToF32(Table("iq4nl", Load("q", j) & 15)) * 0.5),
            Store("u", j, Call("f32_to_f16_bits", x)),
            Store("y", j, Call("f16_bits_to_f32", Call("f32_to_f16_bits", x))),
        )),
    ), lanes=lanes)


# Tile products: (kind, fragment rows, cols, lanes, words of K a step, steps). Hardware tiles of 16 x 8 (CUDA
# mma.sync) and 16 x 16 (MFMA) both fit: the i8 tile is 3 x 2 (CUDA, 3 a warp: odd) or 3 x 1 (MFMA) of them, 4
# words a step (CUDA's k16 form); the f16 tile 1 x 4 or 1 x 2, over two warps on CUDA. Small: the numba-cuda
# simulator runs every lane as a Python thread.
TILES = {"i8": ("i8", 48, 16, 64, 4, 2), "f16": ("f16", 16, 32, 64, 8, 2), "u8f16": ("u8f16", 32, 16, 64, 8, 2)}
U8F16_GROUP = 2  # words of A a scale word covers in the u8f16 case (8 bytes: 4 groups a step)
TILE_SCALES = (0.5, 2.0)  # the i8 kernel's per-step scales (exact in f32 at these sums)


def tile_kernel(kind: str) -> Kernel:
    """y[r, c] = the tile product of rows of a and b (m x K and n x K packed words, m and n not multiples of the
    tile: partial tiles, zero-padded, stores guarded), K in `steps` steps of `words` words staged in local arrays at
    a padded stride. i8: each step's i32 product scaled by `TILE_SCALES[step]` into an f32 fragment and added to an
    exact i32 total (`yi`), the step's fragment cleared by FragSet; f16: f32 sums across steps; u8f16: A's bytes
    made f16 by the scale words of `s` (a row's groups of U8F16_GROUP words), B two words of f16 pairs for each
    word of A."""
    _, rows, cols, lanes, words, steps = TILES[kind]
    kw, st = words * steps, words + 4
    bw, stb = (2, 2 * words + 4) if kind == "u8f16" else (1, st)  # B's words for each of A's; its row stride
    r0, c0, e, w = Var("g0") * rows, Var("g1") * cols, Var("e"), Var("step")
    m, n_ = Var("m"), Var("n")
    i, jj = Var("i"), Var("jj")

    def stage(local: str, src: str, count: int, first: Expr, limit: Expr, per: int = 1, stride: int = st) -> LaneFor:
        row, word = e // (words * per), e % (words * per)
        return LaneFor("e", Const(count * words * per), (
            Store(local, row * stride + word, Select(first + row < limit, Load(
                src, (first + row) * kw * per + w * words * per + word), Const(0))),))

    acc = "acc"
    clear = (FragSet("f", Const(0.0)), FragSet("tot", Const(0))) if kind == "i8" else ()
    body: list = [TileEach("i", "jj", (FragSet(acc, Const(0) if kind == "i8" else Const(0.0)), *clear))]
    step = [stage("ta", "a", rows, r0, m), stage("tb", "b", cols, c0, n_, bw, stb)]
    if kind == "u8f16":
        ng = words // U8F16_GROUP
        step += [LaneFor("e", Const(rows * ng), (Store("ts", e, Select(r0 + e // ng < m, Load(
                     "s", (r0 + e // ng) * (steps * ng) + w * ng + e % ng), Const(0))),)),
                 TileMMA(acc, kind, "ta", Const(0), st, "tb", Const(0), stb, words, scales="ts", scale_stride=ng,
                         group_words=U8F16_GROUP)]
    else:
        step.append(TileMMA(acc, kind, "ta", Const(0), st, "tb", Const(0), st, words))
    if kind == "i8":
        step.append(TileEach("i", "jj", (
            FragSet("f", FragElem("f") + ToF32(FragElem(acc)) * Load("s", w)),
            FragSet("tot", FragElem("tot") + FragElem(acc)),
            FragSet(acc, Const(0)),
        )))
    body.append(For("step", Const(0), Const(steps), tuple(step)))
    guard = (r0 + i < m) & (c0 + jj < n_)
    at = (r0 + i) * n_ + c0 + jj
    if kind == "i8":
        out = (Store("y", at, FragElem("f")), Store("yi", at, FragElem("tot")))
    else:
        out = (Store("y", at, FragElem(acc)),)
    body.append(TileEach("i", "jj", (If(guard, out),)))
    frags = (Fragment(acc, "i32" if kind == "i8" else "f32", rows, cols),)
    params = [Buf("a", "u32"), Buf("b", "u32"), Buf("y", "f32", True)]
    if kind == "i8":
        frags += (Fragment("f", "f32", rows, cols), Fragment("tot", "i32", rows, cols))
        params += [Buf("yi", "i32", True), Buf("s", "f32")]
    local = (LocalArray("ta", "u32", rows * st), LocalArray("tb", "u32", cols * stb))
    if kind == "u8f16":
        params.append(Buf("s", "u32"))
        local += (LocalArray("ts", "u32", rows * (words // U8F16_GROUP)),)
    grid = ((m + rows - 1) // rows, (n_ + cols - 1) // cols)
    return Kernel(f"tile_{kind}", (*params, Scalar("m"), Scalar("n")), grid, tuple(body), lanes=lanes,
                  local=local, fragments=frags)


def tile_case(kind: str, m: int, n_: int, seed: int = 3) -> tuple:
    """`tile_kernel(kind)` on an m x n output: inputs and numpy references (a conformance case)."""
    _, rows, cols, lanes, words, steps = TILES[kind]
    rng = np.random.default_rng(seed)
    kw = words * steps
    if kind == "i8":
        a8 = rng.integers(-64, 64, (m, kw * 4)).astype(np.int8)
        b8 = rng.integers(-64, 64, (n_, kw * 4)).astype(np.int8)
        per = [a8[:, s * words * 4:(s + 1) * words * 4].astype(np.int64)
               @ b8[:, s * words * 4:(s + 1) * words * 4].astype(np.int64).T for s in range(steps)]
        scales = np.array(TILE_SCALES, np.float32)
        ins = {"a": a8.view(np.uint32).reshape(-1), "b": b8.view(np.uint32).reshape(-1), "s": scales}
        want = {"y": sum(p * float(sc) for p, sc in zip(per, scales)).reshape(-1), "yi": sum(per).reshape(-1)}
        outs = {"y": (m * n_, "f32"), "yi": (m * n_, "i32")}
    elif kind == "u8f16":
        # Bytes with positive scales and offsets (no cancellation), each value rounded to f16 once, as the kernel's.
        q = rng.integers(0, 256, (m, kw * 4)).astype(np.uint8)
        groups = kw // U8F16_GROUP
        sc = rng.uniform(0.002, 0.01, (m, groups)).astype(np.float16)
        off = rng.uniform(0.0, 0.5, (m, groups)).astype(np.float16)
        per = np.repeat(np.arange(groups), U8F16_GROUP * 4)
        a16 = (sc[:, per].astype(np.float64) * q + off[:, per].astype(np.float64)).astype(np.float16)
        b16 = rng.uniform(0.05, 2, (n_, kw * 4)).astype(np.float16)
        sm = sc.view(np.uint16).astype(np.uint32) | (off.view(np.uint16).astype(np.uint32) << 16)
        # B's words in u8f16's order: of each 8, the pairs 0, 2, 4, 6 first, then 1, 3, 5, 7.
        bw = b16.view(np.uint32).reshape(n_, -1, 4, 2).transpose(0, 1, 3, 2)
        ins = {"a": q.view(np.uint32).reshape(-1), "b": bw.reshape(-1), "s": sm.reshape(-1)}
        want = {"y": (a16.astype(np.float64) @ b16.astype(np.float64).T).reshape(-1)}
        outs = {"y": (m * n_, "f32")}
    else:
        # Positive values: no cancellation, so f32 sums in any order stay within the relative tolerance.
        a16 = rng.uniform(0.05, 2, (m, kw * 2)).astype(np.float16)
        b16 = rng.uniform(0.05, 2, (n_, kw * 2)).astype(np.float16)
        ins = {"a": a16.view(np.uint32).reshape(-1), "b": b16.view(np.uint32).reshape(-1)}
        want = {"y": (a16.astype(np.float64) @ b16.astype(np.float64).T).reshape(-1)}
        outs = {"y": (m * n_, "f32")}
    grid = (-(-m // rows), -(-n_ // cols))
    return (f"tile product {kind} {m}x{n_}", tile_kernel(kind), ins, outs, {"m": m, "n": n_}, grid, want)


# --- cases: kernels with inputs and numpy references -------------------------------------------------------------


def f16_values(count: int = 300) -> np.ndarray:
    """Edge cases of f32 -> f16 rounding, random bit patterns and values near f16 ties (no NaNs)."""
    edge = [0.0, -0.0, 1.0, 65504.0, 65519.99, 65520.0, 1e6, -1e6, np.inf, -np.inf, 6.1e-5, 5.96e-8, 2.98e-8,
            2.9802322e-08, 2.9802326e-08, 8.9406967e-08, 1e-10, -3e-6, 0.1, 1 / 3, 6.103515625e-05, 6.1e-05]
    rng = np.random.default_rng(6)
    rand = rng.integers(0, 2**32, count, dtype=np.uint64).astype(np.uint32).view(np.float32)
    near = (rng.integers(0, 2**16, count).astype(np.uint16).view(np.float16).astype(np.float32).view(np.uint32)
            + rng.integers(-4096, 4097, count).astype(np.uint32)).view(np.float32)
    x = np.concatenate([np.array(edge, np.float32), rand, near]).astype(np.float32)
    return x[~np.isnan(x)]


def _f16_bits(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return x.astype(np.float16).view(np.uint16)


def cases(scale: int = 1) -> list[tuple]:
    """(label, kernel, inputs, outputs {name: (size, dtype)}, scalars, grid, reference {name: array}).

    f16 outputs are compared as raw bits; `scale` grows the sizes (the GPU selftest)."""
    rng = np.random.default_rng(0)
    out = []
    for lanes in (1, 16, 32, 64, 128, 24):
        for n_ in sorted({0, 1, 5, max(lanes - 1, 1), lanes, lanes + 3, 3 * lanes + 7}):
            x = rng.standard_normal(3 * n_ * scale).astype(np.float32)
            xr = x.reshape(3, -1)
            mx = (2 * xr).max(1) if xr.size else np.full(3, -np.inf, np.float32)
            out.append((f"reduce lanes={lanes} n={n_ * scale}", reduce_kernel(lanes), {"x": x},
                        {"s": (3, "f32"), "m": (3, "f32")}, {"n": n_ * scale, "rows": 3}, (3,),
                        {"s": xr.sum(1), "m": mx}))
    for lanes, n_ in ((1, 50), (16, 150), (64, 50), (96, 300)):
        x = rng.random(3 * n_).astype(np.float32)
        y, u = shared_ref(x, 3, n_)
        out.append((f"local+lanefor lanes={lanes} n={n_}", shared_kernel(lanes), {"x": x},
                    {"y": (3 * n_, "f32"), "tot": (3, "f32")}, {"n": n_, "rows": 3}, (3,), {"y": y, "tot": u}))
    m = 100 * scale
    ins = {"a": rng.integers(0, 100, m, dtype=np.int32), "b": rng.integers(0, 256, m).astype(np.uint8),
           "c": rng.integers(-128, 128, m).astype(np.int8), "h": rng.integers(0, 12, m).astype(np.uint16),
           "s": rng.integers(-30000, 30000, m).astype(np.int16),
           "w": rng.integers(0, 2**32, m, dtype=np.uint64).astype(np.uint32)}
    A, B, C, S = (ins[v].astype(np.int64) for v in "abcs")  # a >= 0: `//` and `%` of negatives differ (C, Python)
    o = np.zeros((m, 4), np.int64)
    o[:, 0] = np.where(A < 50, A // 7 + (A % 7) * 100, (((B >> 3) & 0xF) | (C << 2)) - S)
    o[:, 1] = np.where(ins["h"] == 7, -1, ins["h"].astype(np.int64) * 3 + B)
    o[:, 2] = (S * 0.5).astype(np.int64) + np.abs(S) + np.maximum(A, C) - np.minimum(B, S)
    o[:, 3] = np.where(B < 3, 1, 2)
    w = ins["w"]
    trips = B % 9
    out.append(("ints/select/if/unroll", int_kernel(), ins, {"o": (4 * m, "i32"), "u": (m, "u32"), "t": (m, "i32")},
                {"n": m}, (1,), {"o": o.reshape(-1), "u": ((w >> 4) & 0xFFFFFFF) | (w << 28),
                                 "t": 3 * trips * (trips - 1) // 2 + trips * C}))
    x = rng.uniform(-4, 4, m).astype(np.float32)
    xs = (x * np.float32(0.75)).astype(np.float64)
    ax = np.abs(xs)
    with np.errstate(invalid="ignore"):
        ref = np.stack([np.exp(xs), np.tanh(xs), np.sqrt(ax), 1 / np.sqrt(ax + 1), np.cos(xs), np.sin(xs),
                        np.log(ax + 0.5), ax ** 1.5, np.maximum(xs, 0.25), np.minimum(xs, 0.25), xs / 3,
                        np.inf * xs, np.full_like(xs, np.nan)], 1)
    out.append(("math", math_kernel(), {"x": x}, {"y": (MATH_FUNCTIONS * m, "f32")}, {"n": m, "scale": 0.75},
                (1,), {"y": ref.reshape(-1)}))
    G0, G1, G2, J = np.meshgrid(*(range(d) for d in GRID), range(10), indexing="ij")
    want = np.zeros(10 * np.prod(GRID), np.int64)
    want[((G2 * GRID[1] + G1) * GRID[0] + G0) * 10 + J] = G0 * 10000 + G1 * 1000 + G2 * 100 + J
    out.append(("grid 3x4x5", grid_kernel(), {}, {"y": (want.size, "i32")}, {}, GRID, {"y": want}))
    q = rng.integers(0, 256, m).astype(np.uint8)
    iq4nl = np.array(TABLES["iq4nl"], np.float32)
    out.append(("table", table_kernel(), {"q": q}, {"y": (m, "f32")}, {"n": m}, (1,), {"y": iq4nl[q & 15] * 0.5}))
    xv = f16_values(300 * scale)
    hb = rng.integers(0, 2**16, xv.size).astype(np.uint16)
    want16 = _f16_bits(xv)
    out.append(("f16 load/store/intrinsics", f16_kernel(), {"h": hb, "x": xv},
                {"y": (xv.size, "f32"), "o": (xv.size, "f16"), "p": (xv.size, "u32"), "z": (1, "f32")},
                {"n": xv.size}, (1,), {"y": hb.view(np.float16).astype(np.float32), "o": want16, "p": want16,
                                       "z": np.float32(np.float16(1 / 3))}))
    n_ = 200
    h16 = (rng.standard_normal(n_) * 4).astype(np.float16)
    t16 = (h16.astype(np.float32) * 2).astype(np.float16)
    o16 = (h16.astype(np.float32) * 0.5).astype(np.float16)
    o16[0] = t16[1]
    q = rng.integers(0, 256, n_).astype(np.uint8)
    out.append(("f16 local array/table", f16_local_kernel(), {"h": h16.view(np.uint16), "q": q},
                {"y": (n_, "f32"), "o": (n_, "f16")}, {"n": n_}, (1,),
                {"y": t16[::-1].astype(np.float32) + iq4nl[q & 15], "o": o16.view(np.uint16)}))
    a = rng.integers(-(2**31), 2**31, m, dtype=np.int64).astype(np.int32)
    b = rng.integers(0, 2**32, m, dtype=np.uint64).astype(np.uint32)
    q = rng.integers(0, 256, 4 * m + 4).astype(np.uint8)
    x = (rng.standard_normal(m) * 3).astype(np.float32)
    dot = (a.view(np.int8).reshape(-1, 4).astype(np.int64) * b.view(np.int8).reshape(-1, 4)).sum(1)
    out.append(("dot4/load_u32/table/f16 bits", intrinsics_kernel(), {"x": x, "a": a, "b": b, "q": q},
                {"o": (m, "i32"), "w": (3 * m, "u32"), "t": (m, "f32"), "u": (m, "u32"), "y": (m, "f32")},
                {"n": m}, (1,),
                {"o": dot + np.arange(m) - 50,
                 "w": np.array([q[i * al:i * al + 4].view("<u4")[0] for i in range(m) for al in (1, 2, 4)]),
                 "t": iq4nl[q[:m] & 15] * 0.5, "u": _f16_bits(x), "y": x.astype(np.float16).astype(np.float32)}))
    out += [tile_case("i8", 50, 10), tile_case("f16", 20, 20), tile_case("u8f16", 40, 20)]
    return out


# --- running and comparing ---------------------------------------------------------------------------------------


def run(r, kernel, inputs, outputs, scalars=None, grid=(1,), **compile_kw) -> dict[str, np.ndarray]:
    """Launch `kernel` on runtime `r` with poisoned outputs (NaN floats, all-ones bytes otherwise, in the storage
    dtype); returns their contents (f16 as raw u16 bits). `compile_kw` goes to `r.compile`."""
    ck = r.compile(kernel, **compile_kw)
    bufs = {name: r.upload(np.ascontiguousarray(a)) for name, a in inputs.items()}
    for name, (size, dt) in outputs.items():
        fill = np.full(size, np.nan, np.float32) if dt == "f32" else \
            np.full(size * ELEMENT_BYTES[dt], 0xFF, np.uint8).view(NUMPY_DTYPES[dt])
        bufs[name] = r.upload(fill)
    r.launch(ck, r.args_for(kernel, bufs, scalars or {}), grid)
    r.sync()
    return {name: r.download(bufs[name], (size,), "u16" if dt == "f16" else dt) for name, (size, dt) in outputs.items()}


def max_error(got: np.ndarray, want, dtype: str) -> float:
    """Largest relative error (floats; NaN where exactly one is NaN) or count of differing values (ints)."""
    got, want = np.asarray(got), np.asarray(want).reshape(np.shape(got))
    if dtype != "f32":
        return float((got.astype(np.int64) != want.astype(np.int64)).sum())
    with np.errstate(invalid="ignore"):  # signalling NaNs (random f16 bit patterns) raise the flag
        g, w = got.astype(np.float64), want.astype(np.float64)
    if (np.isnan(g) != np.isnan(w)).any():
        return float("nan")
    inf = np.isinf(w)
    if (g[inf] != w[inf]).any():  # infinities must match exactly
        return float("inf")
    ok = np.isfinite(w)
    return float((np.abs(g[ok] - w[ok]) / np.maximum(np.abs(w[ok]), 1e-6)).max(initial=0.0))


def check_case(got: dict, want: dict, outputs: dict, label: str, tol: float = 1e-5) -> None:
    """Assert every output of a case is within `tol` (relative, f32) or exact (integers, f16 bits) of `want`."""
    for name, (_, dt) in outputs.items():
        err = max_error(got[name], want[name], dt)
        assert err <= (tol if dt == "f32" else 0), (label, name, err)


def copy_region_check(r) -> bool:
    """The memory manager's runtime mechanisms (`Runtime.alloc_host`, `copy_async`, `wait_for`, `wait_host`,
    `write_region`): bytes copied into the middle of a device buffer on the copy queue are seen by a kernel queued
    after `wait_for`, and nothing around them changes."""
    x, s, m = r.alloc((300,), "f32"), r.alloc((1,), "f32"), r.alloc((1,), "f32")
    stage = r.alloc_host(400)
    stage[:] = np.arange(100, dtype=np.float32).view(np.uint8)
    ev = r.copy_async(x, 400, stage)  # floats 100..199
    r.wait_for(ev)
    kern = reduce_kernel(r.lanes)
    r.launch(r.compile(kern), r.args_for(kern, {"x": x, "s": s, "m": m}, {"n": 300, "rows": 1}), (1,))
    r.wait_host(ev)
    r.write_region(x, 4 * 299, np.float32([5.0]))
    out = r.download(x, (300,), "f32")
    return (r.download(s, (1,), "f32")[0] == 4950 and np.array_equal(out[100:200], np.arange(100))
            and not out[:100].any() and not out[200:299].any() and out[299] == 5)


def expert_cache_resize_check(r) -> bool:
    """The memory manager's expert cache on a runtime (`Runtime.alloc`, `free`, `copy_async`, `write`): two MoE
    layers with caches of 3 slots over 6 experts of two weights (64 and 32 bytes an expert, staged from their
    sources), shrunk to 2 slots and grown to 4, free all 4 old slot buffers before the first new one is
    allocated, and after each change the slot the table names for a resident expert holds that expert's bytes."""
    from polystrata.codegen.recipes import ExpertStream
    from polystrata.runtimes.memory import ExpertSource, ExpertStreamer

    sizes = {"g": 64, "d": 32}
    data = {f"{w}{li}": ((np.arange(6 * n) * (3 + li) + n) % 251).astype(np.uint8).reshape(6, n)
            for li in (0, 1) for w, n in sizes.items()}
    streams = [ExpertStream((f"g{li}", f"d{li}"), f"t{li}", "r", "l", "x", 6, 2, 4, 1) for li in (0, 1)]
    st = ExpertStreamer(r, lambda w: ExpertSource(data[w].shape[1], "u8", True, data[w].__getitem__), streams, 3,
                        pin=False)

    def holds() -> bool:
        ok = True
        for layer in st.layers:
            table = r.download(layer.table_handle, (6,), "i32")
            n = layer.cache.slots
            slots = [r.download(dev, (n * data[w].shape[1],), "u8").reshape(n, -1)
                     for w, dev in zip(layer.stream.weights, layer.device)]
            resident = [e for e in range(6) if layer.cache.resident(e)]
            ok &= bool(resident) and all(np.array_equal(s[table[e]], data[w][e])
                                         for e in resident for w, s in zip(layer.stream.weights, slots))
        return ok

    for li in (0, 1):
        st.load(li, [1, 4])
        st.load(li, [5, 0])  # evicts 1 (least recently used) for 0
    ok = holds()
    moves: list[str] = []
    alloc, free = r.alloc, r.free
    r.alloc = lambda *a: moves.append("alloc") or alloc(*a)
    r.free = lambda buf: moves.append("free") or free(buf)
    try:
        for slots in (2, 4):
            moves.clear()
            st.resize(slots)
            ok &= moves == ["free"] * 4 + ["alloc"] * 4 and st.slots == slots and holds()
    finally:
        del r.alloc, r.free
    return ok
