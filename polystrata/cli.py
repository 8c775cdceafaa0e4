"""Command-line interface. Subcommand names, options and outputs are a contract other tools rely on.

Errors print one line `error: ...` on stderr and exit 1 (2 for usage errors); `--debug` shows tracebacks.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from polystrata import interrupt, progress
from polystrata.errors import PolystrataError, writing

if TYPE_CHECKING:
    import numpy as np

# Imports stay light up here: the console script imports this module before main() can arm Ctrl-C handling.

EXIT_ERROR = 1
EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse with `error: ...` on one line and exit code 2, like the rest of the CLI."""

    def error(self, message: str):  # noqa: D102 - argparse hook
        self.print_usage(sys.stderr)
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def _output_path(arg: str) -> str:
    """argparse type of every -o: a path that is not empty (an empty one would mean the current directory)."""
    if not arg.strip():
        raise argparse.ArgumentTypeError("the output path is empty")
    return arg


def _output_file(arg: str) -> Path:
    """An -o that names a file to write: refused if it is a directory."""
    path = Path(arg)
    if path.is_dir():
        raise PolystrataError(f"{arg} is a directory; -o needs a file name")
    return path


def model_arg(p: argparse.ArgumentParser, optional: bool = False) -> None:
    """The MODEL positional argument (a GGUF path or zoo name; `optional`: run's, which has a default)."""
    help_ = "GGUF file path or zoo name (smollm2-135m, gemma3-270m)"
    if optional:
        p.add_argument("model", nargs="?", help=help_ + "; default: smollm2-135m")
    else:
        p.add_argument("model", help=help_)


def target_arg(p: argparse.ArgumentParser) -> None:
    """--target and --kv-type."""
    from polystrata.targets import TARGET_HELP

    p.add_argument("--target", default="auto", help=TARGET_HELP)
    p.add_argument("--kv-type", default="f16", help="KV cache format: f16, q8_0, q8_g64 (kernel targets)")


def _int_in(text: str, low: int, high: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not low <= value <= high:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    return _int_in(text, 1, 2**31 - 1, "a positive integer")


def seed_arg(text: str) -> int:
    """argparse type of a reproducible --seed: 0 .. 2**64-1."""
    return _int_in(text, 0, 2**64 - 1, "a seed from 0 to 2**64-1")


def _seed(text: str) -> int | None:
    """run's --seed: 0 .. 2**64-1, or -1 for a fresh random seed (llama.cpp's convention)."""
    return None if text.strip() == "-1" else _int_in(text, 0, 2**64 - 1, "a seed from 0 to 2**64-1, or -1 for random")


def ctx_arg(p: argparse.ArgumentParser, default_help: str) -> None:
    """-c/--ctx-size N (alias --ctx): the KV cache holds N tokens."""
    p.add_argument("-c", "--ctx-size", "--ctx", dest="ctx", type=_positive_int, default=None, metavar="N",
                   help=f"context length in tokens, the KV cache's size (default: {default_help})")


def threads_arg(p: argparse.ArgumentParser) -> None:
    """-t/--threads N: threads of the cpu target's kernels (applied by `main` before any command runs)."""
    p.add_argument("-t", "--threads", type=_positive_int, default=None, metavar="N",
                   help="CPU threads the cpu target computes with (default: every usable CPU)")


def memory_args(p: argparse.ArgumentParser, experts: bool = True) -> None:
    """--gpu-mem, and the expert cache's --expert-slots and (`experts`) --expert-policy."""
    from polystrata.runtimes.memory import POLICIES

    p.add_argument("--gpu-mem", default=None, metavar="SIZE",
                   help="device-memory budget: bytes with a K/M/G suffix (8G, 512M) or a percentage of free memory "
                        "(80%%); default: free memory less a margin")
    p.add_argument("--expert-slots", type=_positive_int, default=None, metavar="N",
                   help="MoE experts kept on the device per layer (default: what the budget holds)")
    if experts:
        p.add_argument("--expert-policy", default="lru", choices=list(POLICIES),
                       help="which experts the device cache keeps when they do not all fit (default: lru)")


def memory_kwargs(a) -> dict:
    """Engine keyword arguments of the memory options (`memory_args`)."""
    return {"gpu_mem": a.gpu_mem, "expert_slots": a.expert_slots, "expert_policy": a.expert_policy}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    ap = _Parser(prog="polystrata", description="Compile and run GGUF language models on any accelerator.")
    ap.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = ap.add_subparsers(dest="cmd", required=True, parser_class=_Parser)

    p = sub.add_parser("pull", help="download a zoo model into the cache and print its path")
    p.add_argument("name")
    p.add_argument("--verify", action="store_true", help="re-hash a cached model; download it again if it is damaged")

    p = sub.add_parser("info", help="architecture, hyper-parameters, tensor types and sizes")
    model_arg(p)
    p.add_argument("--tensors", action="store_true", help="list every tensor")

    p = sub.add_parser("tokenize", help="print token ids as a JSON array")
    model_arg(p)
    p.add_argument("--text", required=True)
    p.add_argument("--no-add-special", action="store_true", help="do not add BOS/EOS")
    p.add_argument("--parse-special", action="store_true", help="parse special-token text such as <|im_start|>")

    p = sub.add_parser("score", help="one forward pass; write top-k logits per position to an .npz")
    model_arg(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--text")
    src.add_argument("--file", help="text file to score")
    src.add_argument("--ids-file", help="JSON array of token ids, scored exactly")
    p.add_argument("--top-k", type=int, default=40)
    target_arg(p)
    ctx_arg(p, "the text's length, at least 4096")
    memory_args(p)
    threads_arg(p)
    p.add_argument("-o", "--output", required=True, type=_output_path)

    p = sub.add_parser("run", help="generate text; only the generated text goes to stdout")
    model_arg(p, optional=True)
    p.add_argument("-p", "--prompt", default="Tell me a short story about a robot.")
    p.add_argument("-n", "--n-predict", type=int, default=128)
    p.add_argument("--temp", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=_seed, default=None, help="random seed, 0 .. 2**64-1; -1 or unset: a fresh one")
    p.add_argument("--raw", action="store_true", help="feed the prompt as is, without the chat template")
    ctx_arg(p, "min(trained, 4096), or the artifact's")
    target_arg(p)
    threads_arg(p)
    memory_args(p)
    p.add_argument("--verbose", action="store_true", help="print the memory plan and the VRAM guard's actions")
    p.add_argument("--model", dest="model_file", default=None, metavar="PATH",
                   help="the GGUF file: with an ARTIFACT, the one it was compiled from (checked by its sha256) when "
                        "it is not where the artifact says nor in the zoo cache")

    p = sub.add_parser("parity", help="score llama.cpp's reference prompts and compare (pooled KL, top-1)")
    model_arg(p)
    p.add_argument("--fixtures", required=True, help="folder with prompts.json and one <prompt>.npz per prompt")
    target_arg(p)
    threads_arg(p)
    p.add_argument("--against-kv", default=None, metavar="KV_TYPE",
                   help="compare against this target's own run with that KV cache type (e.g. f16) instead of "
                        "llama.cpp's logits, over each prompt and its greedy continuation")

    p = sub.add_parser("compile", help="plan the model for a target and write an artifact")
    model_arg(p)
    target_arg(p)
    p.add_argument("--arch", default=None, help="GPU architecture to compile for (hip: gfx1030, gfx90a, ...)")
    ctx_arg(p, "min(trained, 4096)")
    threads_arg(p)
    memory_args(p, experts=False)
    p.add_argument("-o", "--output", required=True, type=_output_path)

    from polystrata.bench import add_bench_parser

    add_bench_parser(sub)

    p = sub.add_parser("synth", help="write a random-weight model at a real shape")
    p.add_argument("--arch", required=True, choices=["llama", "qwen2", "qwen3", "qwen3moe", "qwen2moe", "gemma3"])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--type", default="Q8_0", help="weight format, e.g. Q4_K, Q8_0, F16, or the mix Q4_K_M")
    p.add_argument("--seed", type=seed_arg, default=0)
    p.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    p.add_argument("--router-skew", type=float, default=0.0,
                   help="MoE routing locality: router rows scaled by exp(-S*r) over a random expert order (0: none)")
    p.add_argument("-o", "--output", required=True, type=_output_path)
    return ap


# --- commands ------------------------------------------------------------------------------------------------


def _resolve(arg: str | None) -> Path:
    from polystrata import zoo

    return zoo.resolve_model(arg or zoo.DEFAULT_MODEL)


def cmd_pull(a) -> int:
    from polystrata import zoo

    print(zoo.pull(a.name, verify=a.verify))
    return 0


def cmd_info(a) -> int:
    from polystrata.engine import tensor_table
    from polystrata.gguf import GGUFFile
    from polystrata.models import model_hparams

    path = _resolve(a.model)
    with GGUFFile(path) as f:
        md = f.metadata
        print(f"file: {path} ({path.stat().st_size / 2**20:.1f} MiB, GGUF v{f.version})")
        print(f"name: {md.get('general.name', '?')}")
        hp = model_hparams(md, tensor_table(f))
        print(f"architecture: {hp.arch}")
        for k, v in vars(hp).items():
            if k not in ("arch", "extra") and v not in (0, 0.0):
                print(f"  {k}: {v}")
        print(f"tokenizer: {md.get('tokenizer.ggml.model', '?')} (pre: {md.get('tokenizer.ggml.pre', '-')})")
        by_type: dict[str, list[int]] = {}
        for t in f.tensors.values():
            n, b = by_type.setdefault(t.fmt.name, [0, 0])
            by_type[t.fmt.name] = [n + 1, b + t.nbytes]
        total = sum(b for _, b in by_type.values())
        n_params = sum(t.n_elements for t in f.tensors.values())
        print(f"tensors: {len(f.tensors)}, {n_params / 1e6:.1f} M parameters, {total / 2**20:.1f} MiB")
        for name, (n, b) in sorted(by_type.items(), key=lambda kv: -kv[1][1]):
            print(f"  {name:8s} {n:5d} tensors {b / 2**20:10.1f} MiB")
        if a.tensors:
            for t in f.tensors.values():
                print(f"  {t.name:40s} {t.fmt.name:7s} {str(t.shape):22s} {t.nbytes:>12d} B")
    return 0


def _load_tokenizer(path: Path):
    from polystrata.gguf import GGUFFile
    from polystrata.tokenizer import Tokenizer

    with GGUFFile(path) as f:
        return Tokenizer.from_metadata(f.metadata)


def cmd_tokenize(a) -> int:
    tok = _load_tokenizer(_resolve(a.model))
    ids = tok.encode(a.text, add_special=not a.no_add_special, parse_special=a.parse_special)
    print(json.dumps(ids))
    return 0


def _read_ids_file(path: str) -> list[int]:
    try:
        ids = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise PolystrataError(f"cannot read token ids from {path}: {e}") from None
    except RecursionError:
        raise PolystrataError(f"{path}: expected a non-empty JSON array of integer token ids") from None
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise PolystrataError(f"{path}: expected a non-empty JSON array of integer token ids")
    # Ids travel as int32: anything outside is no token of any vocabulary.
    bad = next((i for i in ids if not 0 <= i < 2**31), None)
    if bad is not None:
        raise PolystrataError(f"{path}: token id {bad} is out of range")
    return ids


def top_k_scores(logits: np.ndarray, k: int) -> dict[str, np.ndarray]:
    """The fixtures' schema: top-k ids and logits per position (largest first) and the log-sum-exp."""
    import numpy as np

    l64 = logits.astype(np.float64)
    k = min(k, logits.shape[1])
    top = np.argpartition(-logits, k - 1, axis=1)[:, :k]
    order = np.argsort(-np.take_along_axis(logits, top, 1), axis=1, kind="stable")
    top = np.take_along_axis(top, order, 1)
    m = l64.max(axis=1, keepdims=True)
    lse = (np.log(np.exp(l64 - m).sum(axis=1)) + m[:, 0]).astype(np.float32)
    return {
        "top_ids": top.astype(np.int32),
        "top_logits": np.take_along_axis(logits, top, 1).astype(np.float32),
        "logsumexp": lse,
    }


def _save_npz(path: str, **arrays: np.ndarray) -> None:
    """Write an .npz atomically: a failed run leaves no half-written file."""
    import os
    import tempfile

    import numpy as np

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            np.savez_compressed(fh, **arrays)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def cmd_score(a) -> int:
    import numpy as np

    from polystrata.engine import DEFAULT_CTX, Engine

    if a.top_k < 1:
        raise PolystrataError("--top-k must be at least 1")
    _output_file(a.output)
    path = _resolve(a.model)
    if a.ids_file:
        ids = _read_ids_file(a.ids_file)
    else:
        try:
            text = a.text if a.text is not None else Path(a.file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise PolystrataError(f"cannot read {a.file}: {e}") from None
        ids = None
    tok = _load_tokenizer(path)
    if ids is None:
        ids = tok.encode(text)
    if a.ctx is not None and a.ctx < len(ids):
        raise PolystrataError(f"the text has {len(ids)} tokens, more than the context (-c {a.ctx})")
    # One pass over the whole text: the context must hold all of it, however long.
    eng = Engine(path, target=a.target, n_ctx=a.ctx or max(len(ids), DEFAULT_CTX), kv_type=a.kv_type,
                 **memory_kwargs(a))
    t0 = time.perf_counter()
    logits = eng.score(ids)
    dt = time.perf_counter() - t0
    with writing(a.output):
        _save_npz(a.output, ids=np.asarray(ids, np.int32), **top_k_scores(logits, a.top_k))
    print(f"scored {len(ids)} tokens in {dt:.2f} s -> {a.output}", file=sys.stderr)
    return 0


def cmd_parity(a) -> int:
    import numpy as np

    from polystrata.engine import Engine
    from polystrata.parity import Parity

    fixtures = Path(a.fixtures)
    prompts = fixtures / "prompts.json"
    if not prompts.is_file():
        prompts = fixtures.parent / "prompts.json"
    try:
        names = list(json.loads(prompts.read_text()))
    except (OSError, ValueError) as e:
        raise PolystrataError(f"cannot read the fixtures' prompts.json near {fixtures}: {e}") from None
    path = _resolve(a.model)
    eng = Engine(path, target=a.target, kv_type=a.kv_type)
    if a.against_kv and eng.target == "reference":
        raise PolystrataError("--against-kv compares KV cache types of a kernel target; the reference keeps f32 K, V")
    base = Engine(path, target=eng.target, kv_type=a.against_kv) if a.against_kv else None
    par = Parity()
    need = ("ids", "top_ids", "top_logits") + (("greedy",) if base is not None else ())
    for name in names:
        try:
            ref = np.load(fixtures / f"{name}.npz")
            missing = [k for k in need if k not in ref.files]
        except (OSError, ValueError) as e:
            raise PolystrataError(f"cannot read the fixture {name}.npz in {fixtures}: {e}") from None
        if missing:
            raise PolystrataError(f"the fixture {name}.npz in {fixtures} has no {', '.join(missing)}")
        if base is None:
            par.add(ref["top_ids"], ref["top_logits"], eng.score([int(i) for i in ref["ids"]]))
        else:  # the continuation makes the context longer: more of it read back from the cache
            ids = [int(i) for i in np.concatenate([ref["ids"], ref["greedy"]])]
            top = top_k_scores(base.score(ids), ref["top_ids"].shape[1])
            par.add(top["top_ids"], top["top_logits"], eng.score(ids))
    versus = f" {a.kv_type} KV vs {a.against_kv} KV" if base else ""
    print(f"parity {path.name} {eng.target}{versus}: {par}")
    return 0 if par.ok() else EXIT_ERROR


def cmd_run(a) -> int:
    from polystrata.artifact import is_artifact, kernel_store, load_artifact
    from polystrata.engine import Engine, GenerationStats
    from polystrata.sampling import Sampler, SamplerConfig

    target, kv_type, n_ctx, store = a.target, a.kv_type, a.ctx, None
    if a.model_file is not None and not (a.model and is_artifact(a.model)):
        if a.model:
            raise PolystrataError(f"give the model once: {a.model} or --model {a.model_file}")
        a.model, a.model_file = a.model_file, None
    if a.model and is_artifact(a.model):
        manifest = load_artifact(a.model, a.model_file)
        store = kernel_store(a.model)
        path, target = Path(manifest["model"]["path"]), manifest["target"]["name"]
        kv_type = manifest["memory"]["kv_type"] if target != "reference" else kv_type
        n_ctx = n_ctx or manifest["memory"]["n_ctx"]
        slots = manifest["memory"].get("expert_slots_per_layer")
        if a.expert_slots is None and manifest["memory"].get("experts_streamed") and isinstance(slots, int):
            a.expert_slots = slots  # the compiled plan's expert cache, unless --expert-slots says otherwise
    else:
        path = _resolve(a.model)
    if a.n_predict < 0:
        raise PolystrataError("-n must be >= 0")
    eng = Engine(path, target=target, n_ctx=n_ctx, kv_type=kv_type, verbose=a.verbose, kernel_store=store,
                 **memory_kwargs(a))
    tok = eng.tokenizer
    template = eng.metadata.get("tokenizer.chat_template")
    if template and not a.raw:
        from polystrata.chat import render_chat

        text = render_chat(
            template,
            [{"role": "user", "content": a.prompt}],
            add_generation_prompt=True,
            bos_token=tok.id_to_token(tok.bos_id) if tok.bos_id is not None else "",
            eos_token=tok.id_to_token(tok.eos_id) if tok.eos_id is not None else "",
        )
        # The template already holds BOS where the model wants it; special-token text is meant literally.
        ids = tok.encode(text, add_special=False, parse_special=True)
        if tok.add_bos and tok.bos_id is not None and (not ids or ids[0] != tok.bos_id):
            ids = [tok.bos_id] + ids
    else:
        ids = tok.encode(a.prompt)
    sampler = Sampler(
        SamplerConfig(
            temperature=a.temp, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p,
            repeat_penalty=a.repeat_penalty, seed=a.seed,
        )
    )
    stats = GenerationStats()
    stream = tok.stream()
    out = sys.stdout
    for t in eng.generate(ids, a.n_predict, sampler, stats):
        piece = stream.feed(t)
        if piece:
            out.write(piece)
            out.flush()
    out.write(stream.flush())
    out.write("\n")
    out.flush()
    print(stats.summary(), file=sys.stderr)
    return 0


def cmd_compile(a) -> int:
    from polystrata.artifact import write_artifact

    out, report = write_artifact(_resolve(a.model), a.target, a.output, kv_type=a.kv_type, arch=a.arch, n_ctx=a.ctx,
                                 gpu_mem=a.gpu_mem, expert_slots=a.expert_slots)
    print(f"wrote {out}: {report}", file=sys.stderr)
    return 0


def cmd_synth(a) -> int:
    from polystrata.synth import synth_model

    with writing(a.output):
        out = synth_model(a.arch, _output_file(a.output), preset=a.preset, qtype=a.type, seed=a.seed,
                          n_layer=a.layers, router_skew=a.router_skew)
    print(out)
    return 0


def cmd_bench(a) -> int:
    from polystrata.bench import cmd_bench as run

    return run(a)


COMMANDS = {
    "bench": cmd_bench,
    "pull": cmd_pull,
    "info": cmd_info,
    "tokenize": cmd_tokenize,
    "score": cmd_score,
    "run": cmd_run,
    "compile": cmd_compile,
    "parity": cmd_parity,
    "synth": cmd_synth,
}


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """`warnings.showwarning` for the console: one line `warning: ...`, without the file, line and source."""
    print(f"warning: {' '.join(str(message).split())}", file=file or sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `polystrata` command.

    Run as the command (no `argv`), Ctrl-C ends it within a second, whatever it is doing, with
    `error: interrupted` and exit code 130 (see polystrata.interrupt).
    """
    warnings.showwarning = _show_warning
    try:  # a Ctrl-C can land while the watchdog thread is starting
        if argv is None:
            interrupt.arm()
        args = build_parser().parse_args(argv)
    except KeyboardInterrupt:
        return interrupt.report()
    try:
        # Progress bars on stderr, except where the output is for a program (--json, bench -o json|csv).
        progress.enabled = not (getattr(args, "json", False) or getattr(args, "output_format", "md") != "md")
        if getattr(args, "threads", None) is not None:
            from polystrata import threads

            threads.configure(args.threads)  # before anything starts Numba's thread pool
        return COMMANDS[args.cmd](args)
    except PolystrataError as e:
        if args.debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return interrupt.report()
    except BrokenPipeError:
        return EXIT_ERROR
    except MemoryError:
        if args.debug:
            raise
        print("error: out of memory", file=sys.stderr)
        return EXIT_ERROR
    except OSError as e:
        if args.debug:
            raise
        print(f"error: {e.strerror or e}: {e.filename or ''}".rstrip(": "), file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
