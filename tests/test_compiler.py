"""Compiler passes: dropping launches that would recompute what their output buffers already hold."""

from __future__ import annotations

from dataclasses import replace

from polystrata.codegen.policy import MMA_SYNC, device_policy, matrix_kinds
from polystrata.codegen.recipes.tile_mma import MMA_OFF
from polystrata.compiler.passes import build_plan, drop_repeated_launches
from polystrata.engine import tensor_table
from polystrata.gguf import GGUFFile
from polystrata.ir.formats import FORMATS, KV_FORMATS
from polystrata.ir.graph import Graph
from polystrata.ir.kernel import Buf, Kernel, LaneFor, Launch, Load, Scalar, Store, Var
from polystrata.ir.layout import padded, sliced
from polystrata.models import build_graph
from polystrata.synth import synth_model

_N = Scalar("n")


def _copy() -> Kernel:
    """dst[i] = src[i]."""
    i = Var("i")
    return Kernel("copy", (Buf("src", "f32"), Buf("dst", "f32", True), _N), (Var("n"),),
                  (LaneFor("i", Var("n"), (Store("dst", i, Load("src", i)),)),), lanes=1)


def _bump() -> Kernel:
    """x[i] += 1 (reads what it writes)."""
    i = Var("i")
    return Kernel("bump", (Buf("x", "f32", True), _N), (Var("n"),),
                  (LaneFor("i", Var("n"), (Store("x", i, Load("x", i) + 1.0),)),), lanes=1)


def _copy_launch(src: str, dst: str) -> Launch:
    return Launch(_copy(), (("src", src), ("dst", dst)), (("n", "T"),))


def test_repeated_launch_is_dropped_while_nothing_changed_its_buffers():
    a, b, c = _copy_launch("x", "y"), _copy_launch("y", "z"), _copy_launch("x", "y")
    assert drop_repeated_launches([a, b, c]) == [a, b]  # b only reads y: y still holds what a wrote


def test_repeated_launch_runs_again_after_its_input_or_output_was_written():
    a, w_in, w_out = _copy_launch("x", "y"), _copy_launch("u", "x"), _copy_launch("u", "y")
    assert drop_repeated_launches([a, w_in, a]) == [a, w_in, a]
    assert drop_repeated_launches([a, w_out, a]) == [a, w_out, a]


def test_in_place_launch_is_never_dropped():
    bump = Launch(_bump(), (("x", "x"),), (("n", "T"),))
    assert drop_repeated_launches([bump, bump]) == [bump, bump]


def _tiny_llama(tmp_path):
    """(GGUF file, decode graph, tensor formats) of a tiny synthetic Q8_0 llama."""
    f = GGUFFile(synth_model("llama", tmp_path / "m.gguf", preset="tiny", qtype="Q8_0", seed=1))
    return f, build_graph(f.metadata, tensor_table(f), all_logits=False), {n: t.fmt for n, t in f.tensors.items()}


def test_gpu_plan_fuses_quantization_and_stacks_qkv(tmp_path):
    """GPU-shaped plans: q, k and v are one stacked matvec; the norms write the int8 activations their matmuls
    read (the quantize launches they provide are dropped), so only the attention output and the FFN activation
    product are quantized by launches of their own."""
    f, graph, formats = _tiny_llama(tmp_path)
    plan = build_plan(graph, formats, KV_FORMATS["f16"], 64, 16, 128, 32)
    n_layer = int(f.metadata["llama.block_count"])
    names = [la.kernel.name for la in plan.launches]
    quantize = [n for n in names if n.startswith("quantize_x")]
    matvec = [n for n in names if n.endswith("_q8")]
    # Per layer: q+k+v (one launch), o, gate+up, down; then the output head.
    assert len(matvec) == 4 * n_layer + 1
    assert sum(n.startswith("matmul_stack_") for n in names) == n_layer
    assert len(quantize) == 2 * n_layer
    # Each layer's two norms and the output norm write the activations of the matmuls after them.
    assert sum(n.startswith("rms_norm") and "_q8_" in n for n in names) == 2 * n_layer + 1
    for i, n in enumerate(names):
        if n.startswith("matmul_stack_") or n.startswith("glu_") or n == names[-1]:
            assert names[i - 1].startswith("rms_norm"), (i, n, names[i - 1])


def test_provided_launch_is_dropped_until_its_buffers_change():
    """A launch that `provides` another's effect stands in for it, as an earlier identical launch would."""
    q = _copy_launch("y", "yq")
    norm = Launch(_copy(), (("src", "x"), ("dst", "y")), (("n", "T"),), provides=(q,))
    assert drop_repeated_launches([norm, q]) == [norm]
    assert drop_repeated_launches([norm, _copy_launch("u", "y"), q]) == [norm, _copy_launch("u", "y"), q]


def test_runs_layout_only_on_wide_load_targets(tmp_path):
    """Q8_0 matvecs take runs of words where the target merges aligned loads (cuda), interleaved words elsewhere."""
    _, graph, formats = _tiny_llama(tmp_path)
    for wide in (False, True):
        plan = build_plan(graph, formats, KV_FORMATS["f16"], 64, 16, 128, 32, wide_loads=wide)
        runs = {r for la in plan.launches if la.kernel.name.endswith("_q8")
                for r in la.kernel.knob_dict["runs"].split(",")}  # one per weight (gate+up: two)
        assert runs == {str(int(wide))}, (wide, runs)


def test_q4_k_q5_k_rows_sliced_only_on_wide_load_targets():
    """A target with wide loads keeps Q4_K and Q5_K weights whose rows hold several blocks sliced
    (`ir.layout.sliced`, per row length) and Q6_K ones padded; any other target reads the file's layouts."""
    g = Graph(arch="t")
    tok = g.input("tokens", "i32", ("T",))
    g.input("positions", "i32", ("T",))
    x = g.op("embed", g.weight("table", "F32", (4, 512)), tok)
    shapes = {"wide": ("Q4_K", (256, 512)), "one_block": ("Q4_K", (512, 256)), "q5": ("Q5_K", (512, 512)),
              "q6": ("Q6_K", (8, 512))}
    for name, (fmt_name, shape) in shapes.items():
        x = g.op("matmul", x, g.weight(name, fmt_name, shape))
    g.outputs.append(x)
    formats = {"table": FORMATS["F32"], **{n: FORMATS[f] for n, (f, _) in shapes.items()}}
    for wide in (False, True):
        fmts = {n: build_plan(g, formats, KV_FORMATS["f16"], 16, 1, 128, 32, wide_loads=wide).buffers[n].fmt
                for n in shapes}
        if wide:
            assert fmts == {"wide": sliced(FORMATS["Q4_K"], 512), "one_block": FORMATS["Q4_K"],
                            "q5": sliced(FORMATS["Q5_K"], 512), "q6": padded(FORMATS["Q6_K"], 16)}
        else:
            assert fmts == {n: FORMATS[f] for n, (f, _) in shapes.items()}


def test_kernel_names_from_extreme_values_are_identifiers(tmp_path, monkeypatch):
    """An epsilon like 1e38 (valid metadata) once named a kernel `..._9p99e+37`, a syntax error on the cpu target."""
    from polystrata.codegen.recipes.elementwise import rms_norm_kernel
    from polystrata.ir.kernel import name_tag
    from polystrata.runtimes.cpu import CPURuntime

    assert [name_tag(v) for v in (1e-06, 0.5, -2.0)] == ["1em06", "0p5", "m2p0"]  # names of today's kernels kept
    monkeypatch.setenv("POLYSTRATA_HOME", str(tmp_path))
    k = rms_norm_kernel(f"rms_norm_8_{name_tag(1e38)}", 8, 1e38, False, 1)
    CPURuntime().compile(k)  # renders and imports: the name is a valid identifier


def test_matmul_knob_space_reaches_every_matmul_of_a_prompt_plan(tmp_path):
    """`bench --knob matmul.mma_min=N` (a space-wide knob) sets the path of every matmul of a prompt plan: q/k/v, o,
    gate+up and down alike. The GLU once read a space of its own, so that knob left it on the tile products while
    every other matmul ran the int8 matvecs: the H200's "matvec" prefill measured 0.6x what it was. (On tile
    products q, k and v launch one by one, not stacked.)"""
    _, graph, formats = _tiny_llama(tmp_path)
    cuda = replace(device_policy(lanes=128, subgroup=32, wide_loads=True, int8_dot=True),
                   matrix_kinds=matrix_kinds(MMA_SYNC))

    def matmuls(knobs: dict | None) -> list[str]:
        plan = build_plan(graph, formats, KV_FORMATS["f16"], 128, 128, knobs=knobs, policy=cuda)
        return [la.kernel.name for la in plan.launches if la.kernel.name.startswith(("matmul", "glu_"))]

    # (Split K, the GPUs' default for steps of 6-64 rows, off here: its own test_recipes_tile_mma cases.)
    on, off = matmuls({"matmul": {"mma_min": 32, "mma_split": 0}}), matmuls({"matmul": {"mma_min": MMA_OFF}})
    assert any(n.startswith("glu_") for n in on) and any(n.startswith("glu_") for n in off), (on, off)
    # Each matmul: its tile products for steps of more than 64 tokens, its int8 matvecs for the others.
    assert [n for n in on if n.endswith("_gt64_mma")] == [n.replace("_le64_q8", "_gt64_mma") for n in on
                                                          if n.endswith("_le64_q8")] != [], on
    assert not any("_mma" in n for n in off), off
    assert matmuls(None) == off  # the tiny model's matrices are under the GPUs' default mma_min (512)


def test_kernel_builders_build_each_kernel_once_and_tell_apart_what_renders_differently():
    """A model's layers ask for the same kernels: the builders keep them (`kernel_builder`), and only arguments
    that render alike may share one, with functions (epilogues) told apart by what they close over."""
    from polystrata.codegen.recipes import _arg_key
    from polystrata.codegen.recipes.elementwise import rms_norm_kernel
    from polystrata.codegen.recipes.tile_matmul import tile_matmul_kernel
    from polystrata.ir.kernel import Call, buffers_read

    q4_0, q4_1 = FORMATS["Q4_0"], FORMATS["Q4_1"]

    def tile(fmt, act):
        return tile_matmul_kernel("glu", [fmt, fmt], 8, 64, rows=2, tokens=4,
                                  epilogue=lambda v: Call(act, v[0]) * v[1])

    assert tile(q4_0, "exp") is tile(q4_0, "exp")
    assert len({id(tile(q4_0, "exp")), id(tile(q4_0, "tanh")), id(tile(q4_1, "exp"))}) == 3
    assert tile(q4_0, "exp") != tile(q4_0, "tanh")  # the closure's value, not only its code
    assert rms_norm_kernel("n", 64, 1e-6, False, 1) is rms_norm_kernel("n", 64, 1e-6, False, 1)
    assert rms_norm_kernel("n", 64, 1e-6, False, 1) != rms_norm_kernel("n", 64, 1e-5, False, 1)
    # Equal and alike hashed in Python, rendered differently (Const(1) prints 1, Const(1.0) prints 1.0).
    assert len({_arg_key(1), _arg_key(1.0), _arg_key(True), _arg_key(0.0), _arg_key(-0.0)}) == 5
    assert _arg_key((Var("a") + 1,)) != _arg_key((Var("a") + 1.0,))
    # A plan's analysis of a shared kernel is its own too: the buffers it reads, walked once.
    k = tile(q4_0, "exp")
    assert buffers_read(k) is buffers_read(tile(q4_0, "exp")) and {"x", "w0", "w1"} <= buffers_read(k)


def test_a_kernel_crosses_processes_without_its_memos():
    """`Kernel.once` keeps a hash and a fingerprint; a pickled kernel (to a compile worker) leaves them behind: a
    string's hash is salted per process."""
    import pickle

    from polystrata.codegen.recipes.elementwise import rms_norm_kernel

    k = rms_norm_kernel("n", 64, 1e-6, False, 1)
    hash(k), k.fingerprint()
    again = pickle.loads(pickle.dumps(k))
    assert "_once" not in again.__dict__ and again == k and again.fingerprint() == k.fingerprint()


def test_vnni_is_read_from_the_cpu_numba_compiles_for(monkeypatch):
    """`NUMBA_CPU_NAME` (a portable cache's `generic`) names the CPU: its `NUMBA_CPU_FEATURES`, not the host's."""
    from numba.core import config

    from polystrata.codegen.policy import host_vnni

    monkeypatch.setattr(config, "CPU_NAME", "generic")
    monkeypatch.setattr(config, "CPU_FEATURES", "")
    assert not host_vnni()
    monkeypatch.setattr(config, "CPU_FEATURES", "+avx2,+avxvnni")
    assert host_vnni()


def test_each_kernel_family_of_a_prompt_plan_is_an_instance_of_its_own(tmp_path):
    """A prompt plan on matrix units shares its steps out among kernel families by row count: tile products for
    long steps, split-K tile products for batched decoding, int8 matvecs for a few rows. Each family reads the
    knobs of an instance of its own (`Site`), timed by the tuner at steps it serves, so a choice that wins for
    prompt chunks (mma_unroll=1 on the H100) is not forced on the serving steps' kernels, where it loses."""
    _, graph, formats = _tiny_llama(tmp_path)
    cuda = replace(device_policy(lanes=128, subgroup=32, wide_loads=True, int8_dot=True),
                   matrix_kinds=matrix_kinds(MMA_SYNC))
    space = {"matmul": {"mma_min": 32, "mma_chunk": 64}}  # the tiny model's matrices on the tile products

    def glu(extra: dict | None = None):
        plan = build_plan(graph, formats, KV_FORMATS["f16"], 128, 128, knobs={**space, **(extra or {})}, policy=cuda)
        m = next(i for i, ss in enumerate(plan.group_sites) if any(":glu_" in s.signature for s in ss))
        kernels = {la.kernel.name: dict(la.kernel.knobs) for la, g in zip(plan.launches, plan.groups) if g == m}
        return {s.signature: s.rows for s in plan.group_sites[m]}, kernels

    sites, kernels = glu()
    main = next(s for s in sites if s.endswith(":t128"))
    assert main.startswith("matmul.v6:glu_") and sites == {main: 5, main + ":long": None, main + ":split": 16}
    matvec, long = "glu_swiglu_q8_0_q8_0_256x128_le5_q8", "glu_swiglu_q8_0_q8_0_256x128_gt64_mma"
    splits = {n for n in kernels if "_mma_k" in n}
    assert {matvec, long} <= set(kernels) and len(splits) == 2  # the gate's and the up's parts

    def changed(extra: dict) -> set[str]:
        return {n for n, kn in glu(extra)[1].items() if kernels.get(n) != kn}

    assert changed({main + ":long": {"mma_unroll": 1}}) == {long}
    assert changed({main + ":split": {"mma_unroll": 1}}) == splits
    assert changed({main: {"tokens": 2}}) == {matvec}


def test_moe_experts_tile_products_are_a_kernel_family_of_their_own(tmp_path):
    """The MoE experts' tile products (prompt chunks) read the knobs of a family of their own (`:long`), the
    experts' int8 matvecs (steps of up to 64 rows) the instance's, timed at 16 rows."""
    f = GGUFFile(synth_model("qwen3moe", tmp_path / "moe.gguf", preset="tiny", qtype="Q8_0", seed=1))
    graph = build_graph(f.metadata, tensor_table(f), all_logits=False)
    formats = {n: t.fmt for n, t in f.tensors.items()}
    cuda = replace(device_policy(lanes=128, subgroup=32, wide_loads=True, int8_dot=True),
                   matrix_kinds=matrix_kinds(MMA_SYNC))
    space = {"moe_ffn": {"mma_min": 32, "mma_chunk": 64}}

    def experts(extra: dict | None = None):
        plan = build_plan(graph, formats, KV_FORMATS["f16"], 128, 128, knobs={**space, **(extra or {})}, policy=cuda)
        sites = {s.signature: s.rows for ss in plan.group_sites for s in ss if s.signature.startswith("moe_ffn")}
        kernels = {la.kernel.name: dict(la.kernel.knobs) for la in plan.launches
                   if la.kernel.name.startswith(("moe_gateup", "moe_down"))}
        return sites, kernels

    sites, kernels = experts()
    main = next(s for s in sites if s.endswith(":t128"))
    assert main.startswith("moe_ffn.v4:") and sites == {main: 16, main + ":long": None}
    tiles = {n for n in kernels if n.endswith("_gt64_mma")}
    assert len(tiles) == 2 and len(kernels) == 4  # gate+up and down: tile products and matvecs

    def changed(extra: dict) -> set[str]:
        return {n for n, kn in experts(extra)[1].items() if kernels.get(n) != kn}

    assert changed({main + ":long": {"mma_unroll": 1}}) == tiles
    assert changed({main: {"sub": 1}}) == set(kernels) - tiles
