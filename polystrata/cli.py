"""Command-line interface. Subcommand names, options and outputs are a contract other tools rely on.

Errors print one line `error: ...` on stderr and exit 1 (2 for usage errors); `--debug` shows tracebacks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from polystrata import interrupt, progress
from polystrata.errors import PolystrataError, UsageError, writing

if TYPE_CHECKING:
    import numpy as np

# Imports stay light up here: the console script imports this module before main() can arm Ctrl-C handling.

EXIT_ERROR = 1
EXIT_USAGE = 2


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Help with each option's default, where it has one to show (not None, False or empty) and the help does not
    state it already."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        default, text = action.default, action.help or ""
        if default is None or default is False or default == [] or default is argparse.SUPPRESS or "default" in text:
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """argparse with `error: ...` on one line and exit code 2, like the rest of the CLI, and defaults in the help."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

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
    """The MODEL argument, given as a positional or as llama.cpp's -m/--model (`optional`: run's and chat's, which
    have a default); `main` merges the two (`_merge_model`)."""
    from polystrata.zoo import DEFAULT_MODEL, ZOO

    help_ = f"GGUF file path or zoo name ({', '.join(ZOO)})" + (f"; default: {DEFAULT_MODEL}" if optional else "")
    p.add_argument("model", nargs="?", metavar="MODEL", help=help_)
    p.add_argument("-m", "--model", dest="model_flag", metavar="MODEL", help="the model, as llama.cpp spells it")
    p.set_defaults(model_required=not optional, command_parser=p)


def _merge_model(a) -> None:
    """MODEL from the positional or -m (not both), and present where the command needs one."""
    flag = getattr(a, "model_flag", None)
    a.model_file = None  # with an ARTIFACT: the GGUF it was compiled from, when not where the manifest says
    if flag is not None:
        from polystrata.artifact import is_artifact

        if a.model is not None and is_artifact(a.model):
            a.model_file = flag
        elif a.model is not None:
            a.command_parser.error("give the model once, as MODEL or as -m MODEL (ARTIFACT -m MODEL: its model file)")
        else:
            a.model = flag
    if getattr(a, "model_required", False) and a.model is None:
        a.command_parser.error("the following arguments are required: MODEL (or -m MODEL)")


def target_arg(p: argparse.ArgumentParser, tuning: bool = True) -> None:
    """--target and --kv-type, and (`tuning`) --no-tuning."""
    from polystrata.targets import TARGET_HELP

    p.add_argument("--target", default="auto", help=TARGET_HELP)
    p.add_argument("--kv-type", default="f16", help="KV cache format: f16, q8_0, q8_g64 (kernel targets)")
    if tuning:
        p.add_argument("--no-tuning", action="store_true",
                       help="ignore the tuning database (`polystrata tune`): every kernel with its default knobs")


def knob_arg(p: argparse.ArgumentParser) -> None:
    """--knob SPACE.NAME=VALUE (repeatable): a schedule knob for every kernel of a knob space (`parse_knobs`)."""
    p.add_argument("--knob", action="append", default=[], metavar="SPACE.NAME=VALUE",
                   help="a schedule knob for every kernel of a knob space, e.g. attention.mma=0 (repeatable; the "
                        "tuning database's choices for single kernels still apply: --no-tuning for none)")


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


def _n_predict(text: str) -> int:
    return _int_in(text, -1, 2**31 - 1, "a token count, or -1 for no limit")


def _gpu_layers(text: str) -> int:
    """-ngl's type: a layer count, or -1 (also `all`, `auto`) for every layer."""
    return -1 if text.strip() in ("all", "auto") else _int_in(text, -1, 2**31 - 1, "a layer count, or -1 for all")


def _seed(text: str) -> int | None:
    """run's --seed: 0 .. 2**64-1, or -1 for a fresh random seed (llama.cpp's convention)."""
    return None if text.strip() == "-1" else _int_in(text, 0, 2**64 - 1, "a seed from 0 to 2**64-1, or -1 for random")


def ctx_arg(p: argparse.ArgumentParser, default_help: str) -> None:
    """-c/--ctx-size N (alias --ctx): the KV cache holds N tokens."""
    p.add_argument("-c", "--ctx-size", "--ctx", dest="ctx", type=_positive_int, default=None, metavar="N",
                   help=f"context length in tokens, the KV cache's size (default: {default_help})")


def ubatch_arg(p: argparse.ArgumentParser, default_also: str = "") -> None:
    """-ub/--ubatch-size N (llama.cpp's): the most tokens one step of a prompt computes (`Engine`'s n_ubatch);
    `default_also` follows the default in the help."""
    from polystrata.compiler import DEFAULT_UBATCH

    p.add_argument("-ub", "--ubatch-size", dest="n_ubatch", type=_positive_int, default=None, metavar="N",
                   help="step size: the most tokens one step of a prompt computes; a longer prompt runs in steps of "
                        f"N, and the scratch memory grows with N (default: {DEFAULT_UBATCH}{default_also})")


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
        p.add_argument("--expert-policy", default=None, choices=list(POLICIES),
                       help="which experts the device cache keeps when they do not all fit (default: lru)")
    p.add_argument("-ngl", "--n-gpu-layers", "--gpu-layers", dest="n_gpu_layers", type=_gpu_layers, default=None,
                   metavar="N", help="llama.cpp's layers on the GPU: 0 runs on the CPU (target auto becomes cpu); "
                                     "-1 or at least the layer count runs all of them on the device; PolyStrata does "
                                     "not split a model between GPU and CPU, so a number in between is refused")


def memory_kwargs(a) -> dict:
    """Engine keyword arguments of the memory options (`memory_args`)."""
    return {"gpu_mem": a.gpu_mem, "expert_slots": a.expert_slots, "expert_policy": a.expert_policy,
            "n_gpu_layers": a.n_gpu_layers}


def generation_args(p: argparse.ArgumentParser, chat: bool) -> None:
    """The options of `run` and (`chat`) `chat`: model, prompt, sampling, stop strings, context, target, memory."""
    model_arg(p, optional=True)
    src = p.add_mutually_exclusive_group()
    first = "the first message, answered before stdin's" if chat else "the prompt"
    src.add_argument("-p", "--prompt", default=None,
                     help=f"{first}" + ("" if chat else "; without -p and -f it is read from stdin"))
    src.add_argument("-f", "--file", default=None, help=f"a UTF-8 file that holds {first}")
    p.add_argument("-sys", "--system-prompt", default=None, metavar="TEXT",
                   help="a system message, put first through the chat template")
    p.add_argument("-n", "--n-predict", type=_n_predict, default=None, metavar="N",
                   help="tokens to generate (a reply) at most; -1: until the model ends it or the context is full "
                        "(default: 128 for run, -1 for chat)")
    p.add_argument("--temp", type=float, default=0.8, help="temperature; 0: greedy, the most likely token")
    p.add_argument("--top-k", type=int, default=40, help="keep the K most likely tokens; 0: all")
    p.add_argument("--top-p", type=float, default=0.95, help="keep the most likely tokens that hold this much "
                                                             "probability; 1.0: all")
    p.add_argument("--min-p", type=float, default=0.05, help="drop tokens less likely than this times the most "
                                                             "likely one; 0: none")
    p.add_argument("--repeat-penalty", type=float, default=1.0, help="penalty of recent tokens; 1.0: off")
    p.add_argument("--repeat-last-n", type=int, default=64, metavar="N",
                   help="how many of the last tokens the repeat penalty looks at; 0: none, -1: all")
    p.add_argument("-s", "--seed", type=_seed, default=None, help="random seed, 0 .. 2**64-1; -1 or unset: a fresh one")
    p.add_argument("--stop", action="append", default=[], metavar="STR",
                   help="end the reply where this text appears (not printed); repeatable")
    if not chat:
        p.add_argument("--raw", action="store_true", help="feed the prompt as is, without the chat template")
        p.add_argument("-i", "--interactive", "-cnv", "--conversation", dest="interactive", action="store_true",
                       help="talk: the same as `polystrata chat`")
    ctx_arg(p, "the model's, reduced to what the memory budget holds; or the artifact's")
    ubatch_arg(p, ", or the artifact's")
    target_arg(p)
    threads_arg(p)
    memory_args(p)
    p.add_argument("--verbose", action="store_true", help="print the memory plan and the VRAM guard's actions")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    from polystrata import __version__
    from polystrata.synth import PRESETS
    from polystrata.zoo import ZOO

    zoo = "; ".join(f"{m.name}: {m.description}" for m in ZOO.values())
    presets = "; ".join(f"{arch}: {', '.join(names)}" for arch, names in PRESETS.items())
    ap = _Parser(prog="polystrata", description="Compile and run GGUF language models on any accelerator.",
                 epilog=f"zoo models (MODEL by name): {zoo}. synth presets (--preset): {presets}.")
    ap.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    ap.add_argument("--version", action="version", version=f"polystrata {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True, parser_class=_Parser)

    p = sub.add_parser("pull", help="download a zoo model into the cache and print its path")
    p.add_argument("name", help=f"zoo model: {', '.join(ZOO)}")
    p.add_argument("--verify", action="store_true", help="re-hash a cached model; download it again if it is damaged")

    sub.add_parser("list", help="the zoo models pulled into the cache: name, size, path")

    p = sub.add_parser("rm", help="remove a pulled zoo model from the cache")
    p.add_argument("name", help=f"zoo model: {', '.join(ZOO)}")

    p = sub.add_parser("info", help="architecture, hyper-parameters, tensor types and sizes")
    model_arg(p)
    p.add_argument("--tensors", action="store_true", help="list every tensor")
    p.add_argument("--json", action="store_true", help="print one JSON object")

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
    p.add_argument("--top-k", type=int, default=40, help="logits kept per position, the largest")
    target_arg(p)
    ctx_arg(p, "the text's length, at least 4096")
    ubatch_arg(p)
    memory_args(p)
    threads_arg(p)
    p.add_argument("-o", "--output", required=True, type=_output_path)

    p = sub.add_parser("run", help="generate text; only the generated text goes to stdout")
    generation_args(p, chat=False)

    p = sub.add_parser("chat", help="talk with the model: a conversation on stdin, replies streamed to stdout")
    generation_args(p, chat=True)

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions, "
                                     "/v1/models, /health)")
    model_arg(p, optional=True)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=lambda s: _int_in(s, 0, 65535, "a port from 0 to 65535"), default=8080,
                   help="port to listen on (0: any free one)")
    p.add_argument("-np", "--parallel", type=_positive_int, default=1, metavar="N",
                   help="requests decoded at once, sharing each decode step; each holds the context / N tokens")
    p.add_argument("--api-key", default=os.environ.get("POLYSTRATA_API_KEY") or None, metavar="KEY",
                   help="key clients must send (Authorization: Bearer KEY); default: $POLYSTRATA_API_KEY, else none")
    ctx_arg(p, "the model's, reduced to what the memory budget holds, or the artifact's; shared by the --parallel "
               "sequences")
    ubatch_arg(p, ", or the artifact's; at least --parallel")
    target_arg(p)
    knob_arg(p)
    threads_arg(p)
    memory_args(p)
    p.add_argument("--verbose", action="store_true", help="print the memory plan and the VRAM guard's actions")

    p = sub.add_parser("parity", help="score llama.cpp's reference prompts and compare (pooled KL, top-1)")
    model_arg(p)
    p.add_argument("--fixtures", required=True, help="folder with prompts.json and one <prompt>.npz per prompt")
    target_arg(p)
    ubatch_arg(p)
    threads_arg(p)
    p.add_argument("--against-kv", default=None, metavar="KV_TYPE",
                   help="compare against this target's own run with that KV cache type (e.g. f16) instead of "
                        "llama.cpp's logits, over each prompt and its greedy continuation")
    knob_arg(p)

    p = sub.add_parser("compile", help="plan the model for a target and write an artifact")
    model_arg(p)
    target_arg(p)
    p.add_argument("--arch", default=None,
                   help="GPU architecture to compile for (hip: gfx1030, gfx90a, ...; cuda: sm_80, sm_90, ...)")
    knob_arg(p)
    ctx_arg(p, "the model's, reduced to what the memory budget holds")
    ubatch_arg(p)
    p.add_argument("-np", "--parallel", type=_positive_int, default=1, metavar="N",
                   help="plan for `serve -np N` too: the steps of N sequences decoded at once, so that serving the "
                        "artifact with that -np compiles nothing")
    threads_arg(p)
    memory_args(p, experts=False)
    p.add_argument("-o", "--output", required=True, type=_output_path)

    from polystrata.bench import add_bench_parser
    from polystrata.tuning.command import add_tune_parser

    add_bench_parser(sub)
    add_tune_parser(sub)

    p = sub.add_parser("synth", help="write a random-weight model at a real shape")
    p.add_argument("--arch", required=True, choices=["llama", "qwen2", "qwen3", "qwen3moe", "qwen2moe", "gemma3",
                                                     "qwen35", "qwen35moe", "qwen3next"])
    p.add_argument("--preset", default="tiny", help=f"the shape; per architecture: {presets}")
    p.add_argument("--type", default="Q8_0", help="weight format, e.g. Q4_K, Q8_0, F16, or the mix Q4_K_M")
    p.add_argument("--seed", type=seed_arg, default=0, help="seed of the random weights")
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


def cmd_list(a) -> int:
    """`polystrata list`: the pulled zoo models, one a line (nothing on stdout when there are none)."""
    from polystrata import zoo

    models = zoo.pulled()
    if not models:
        print(f"no zoo models in {zoo.models_dir()}; `polystrata pull NAME` fetches one of: {', '.join(zoo.ZOO)}",
              file=sys.stderr)
    width = max((len(m.name) for m, _ in models), default=0)
    for model, path in models:
        print(f"{model.name:{width}s}  {path.stat().st_size / 2**20:8.1f} MiB  {path}")
    return 0


def cmd_rm(a) -> int:
    from polystrata import zoo

    print(f"removed {zoo.remove(a.name)}", file=sys.stderr)
    return 0


def model_info(path: Path, tensors: bool = False) -> dict:
    """What `info` shows: file, architecture, hyper-parameters, tokenizer, tensor counts and sizes by type (and
    with `tensors` every tensor's name, type, shape and size)."""
    from polystrata.engine import tensor_table
    from polystrata.gguf import GGUFFile
    from polystrata.models import model_hparams, qwen35

    with GGUFFile(path) as f:
        md = f.metadata
        hp = model_hparams(md, tensor_table(f))
        by_type: dict[str, dict[str, int]] = {}
        for t in f.tensors.values():
            entry = by_type.setdefault(t.fmt.name, {"tensors": 0, "bytes": 0})
            entry["tensors"] += 1
            entry["bytes"] += t.nbytes
        info = {
            "file": str(path), "file_bytes": path.stat().st_size, "gguf_version": f.version,
            "name": md.get("general.name"), "architecture": hp.arch,
            "hparams": {k: v for k, v in vars(hp).items() if k not in ("arch", "extra")},
            "tokenizer": {"model": md.get("tokenizer.ggml.model"), "pre": md.get("tokenizer.ggml.pre")},
            "notes": qwen35.describe(hp) if hp.arch in qwen35.ARCHES else [],
            "n_tensors": len(f.tensors), "n_params": sum(t.n_elements for t in f.tensors.values()),
            "tensor_bytes": sum(e["bytes"] for e in by_type.values()),
            "types": dict(sorted(by_type.items(), key=lambda kv: -kv[1]["bytes"])),
        }
        if tensors:
            info["tensors"] = [{"name": t.name, "type": t.fmt.name, "shape": list(t.shape), "bytes": t.nbytes}
                               for t in f.tensors.values()]
    return info


def cmd_info(a) -> int:
    info = model_info(_resolve(a.model), a.tensors)
    if a.json:
        # Hyper-parameters may be tuples (per-layer values) or numpy scalars: lists and plain numbers in JSON.
        print(json.dumps(info, default=lambda v: v.tolist() if hasattr(v, "tolist") else str(v)))
        return 0
    print(f"file: {info['file']} ({info['file_bytes'] / 2**20:.1f} MiB, GGUF v{info['gguf_version']})")
    print(f"name: {info['name'] or '?'}")
    print(f"architecture: {info['architecture']}")
    for k, v in info["hparams"].items():
        if v not in (0, 0.0):
            print(f"  {k}: {v}")
    for line in info["notes"]:
        print(line)
    print(f"tokenizer: {info['tokenizer']['model'] or '?'} (pre: {info['tokenizer']['pre'] or '-'})")
    print(f"tensors: {info['n_tensors']}, {info['n_params'] / 1e6:.1f} M parameters, "
          f"{info['tensor_bytes'] / 2**20:.1f} MiB")
    for name, e in info["types"].items():
        print(f"  {name:8s} {e['tensors']:5d} tensors {e['bytes'] / 2**20:10.1f} MiB")
    for t in info.get("tensors", []):
        print(f"  {t['name']:40s} {t['type']:7s} {str(tuple(t['shape'])):22s} {t['bytes']:>12d} B")
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

    from polystrata.artifact import is_artifact
    from polystrata.chat_cli import open_engine
    from polystrata.engine import DEFAULT_CTX, Engine

    if a.top_k < 1:
        raise PolystrataError("--top-k must be at least 1")
    _output_file(a.output)
    if a.ids_file:
        ids = _read_ids_file(a.ids_file)
    else:
        try:
            text = a.text if a.text is not None else Path(a.file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise PolystrataError(f"cannot read {a.file}: {e}") from None
        ids = None
    eng = None
    if a.model is not None and is_artifact(a.model):  # its target, KV type, context (-c: another) and kernels
        eng = open_engine(a, all_logits=True)
        tok, n_ctx = eng.tokenizer, eng.n_ctx
    else:
        path = _resolve(a.model)
        tok, n_ctx = _load_tokenizer(path), a.ctx
    if ids is None:
        ids = tok.encode(text)
    if n_ctx is not None and n_ctx < len(ids):
        raise PolystrataError(f"the text has {len(ids)} tokens, more than the context (-c {n_ctx})")
    if eng is None:  # one pass over the whole text: the context must hold all of it, however long
        eng = Engine(path, target=a.target, n_ctx=a.ctx or max(len(ids), DEFAULT_CTX), kv_type=a.kv_type,
                     tuning=not a.no_tuning, n_ubatch=a.n_ubatch, all_logits=True, **memory_kwargs(a))
    t0 = time.perf_counter()
    logits = eng.score(ids)
    dt = time.perf_counter() - t0
    with writing(a.output):
        _save_npz(a.output, ids=np.asarray(ids, np.int32), **top_k_scores(logits, a.top_k))
    print(f"scored {len(ids)} tokens in {dt:.2f} s -> {a.output}", file=sys.stderr)
    return 0


def _read_fixtures(fixtures: Path, path: Path, need: tuple[str, ...]) -> list:
    """llama.cpp's reference outputs in `fixtures`, one npz per prompt of prompts.json (there or one folder up), with
    the arrays `need` names; refused if they were made with another model than `path`'s: its tokenizer must turn
    each prompt into the fixture's ids, and every id must be in its vocabulary."""
    import numpy as np

    prompts = fixtures / "prompts.json"
    if not prompts.is_file():
        prompts = fixtures.parent / "prompts.json"
    try:
        texts = json.loads(prompts.read_text())
    except (OSError, ValueError) as e:
        raise PolystrataError(f"cannot read the fixtures' prompts.json near {fixtures}: {e}") from None
    if not isinstance(texts, dict):
        texts = dict.fromkeys(texts)
    tok = _load_tokenizer(path)
    refs = []
    for name, text in texts.items():
        try:
            ref = np.load(fixtures / f"{name}.npz")
            missing = [k for k in need if k not in ref.files]
        except (OSError, ValueError) as e:
            raise PolystrataError(f"cannot read the fixture {name}.npz in {fixtures}: {e}") from None
        if missing:
            raise PolystrataError(f"the fixture {name}.npz in {fixtures} has no {', '.join(missing)}")
        ids = [int(i) for i in ref["ids"]]
        foreign = max(ids + [int(ref["top_ids"].max(initial=0))]) >= tok.vocab_size or (
            isinstance(text, str) and tok.encode(text) != ids)
        if foreign:
            raise PolystrataError(f"the fixtures in {fixtures} were not made with {path.name}: the prompt {name!r} "
                                  "is not tokenized as this model tokenizes it")
        refs.append(ref)
    return refs


def cmd_parity(a) -> int:
    import numpy as np

    from polystrata.bench import parse_knobs
    from polystrata.engine import Engine
    from polystrata.parity import Parity
    from polystrata.targets import resolve_target

    if a.against_kv and resolve_target(a.target) == "reference":
        raise PolystrataError("--against-kv compares KV cache types of a kernel target; the reference keeps f32 K, V")
    path = _resolve(a.model)
    refs = _read_fixtures(Path(a.fixtures), path, ("ids", "top_ids", "top_logits") + (("greedy",) * bool(a.against_kv)))
    knobs = parse_knobs(a.knob)
    eng = Engine(path, target=a.target, kv_type=a.kv_type, tuning=not a.no_tuning, n_ubatch=a.n_ubatch, knobs=knobs,
                 all_logits=True)
    base = (Engine(path, target=eng.target, kv_type=a.against_kv, tuning=not a.no_tuning, n_ubatch=a.n_ubatch,
                   knobs=knobs, all_logits=True) if a.against_kv else None)
    par = Parity()
    for ref in refs:
        if base is None:
            par.add(ref["top_ids"], ref["top_logits"], eng.score([int(i) for i in ref["ids"]]))
        else:  # the continuation makes the context longer: more of it read back from the cache
            ids = [int(i) for i in np.concatenate([ref["ids"], ref["greedy"]])]
            top = top_k_scores(base.score(ids), ref["top_ids"].shape[1])
            par.add(top["top_ids"], top["top_logits"], eng.score(ids))
    versus = f" {a.kv_type} KV vs {a.against_kv} KV" if base else ""
    print(f"parity {path.name} {eng.target}{versus}: {par}")
    return 0 if par.ok() else EXIT_ERROR


def cmd_serve(a) -> int:
    from polystrata import zoo
    from polystrata.chat_cli import open_engine
    from polystrata.server import listen, serve

    # The port is taken once the options pass their checks and before the model loads: an address in use is refused
    # at once, not after the compile.
    socks = []
    try:
        eng = open_engine(a, checked=lambda: socks.append(listen(a.host, a.port)))
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    sock = socks[0]
    model_id = Path(a.model).name if a.model else zoo.DEFAULT_MODEL

    def ready(url: str) -> None:
        seqs = f"{a.parallel} parallel sequences" if a.parallel > 1 else "1 sequence"
        print(f"serving {model_id} at {url}/v1 on {eng.target} ({eng.device}): {seqs} of {eng.n_ctx // a.parallel} "
              f"tokens{', API key required' if a.api_key else ''}; Ctrl-C stops",
              file=sys.stderr, flush=True)

    serve(eng, a.parallel, sock, model_id, a.api_key, ready)
    return 0


def cmd_compile(a) -> int:
    from polystrata.artifact import write_artifact
    from polystrata.bench import parse_knobs
    from polystrata.compiler import DEFAULT_UBATCH
    from polystrata.engine import check_parallel, gpu_layers_target, tensor_table
    from polystrata.gguf import GGUFFile
    from polystrata.models import model_hparams
    from polystrata.targets import resolve_target

    check_parallel(a.parallel, a.n_ubatch or DEFAULT_UBATCH, a.ctx)  # before a zoo model downloads
    path, target = _resolve(a.model), a.target
    if a.n_gpu_layers is not None:
        with GGUFFile(path) as f:
            n_layer = model_hparams(f.metadata, tensor_table(f)).n_layer
        target = gpu_layers_target(target, resolve_target(target), a.n_gpu_layers, n_layer)
    out, report = write_artifact(path, target, a.output, kv_type=a.kv_type, arch=a.arch, n_ctx=a.ctx,
                                 gpu_mem=a.gpu_mem, expert_slots=a.expert_slots, tuning=not a.no_tuning,
                                 n_ubatch=a.n_ubatch, n_seq=a.parallel, knobs=parse_knobs(a.knob))
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


def cmd_tune(a) -> int:
    from polystrata.tuning.command import cmd_tune as tune

    return tune(a)


def cmd_run(a) -> int:
    from polystrata.chat_cli import cmd_run as run

    return run(a)


def cmd_chat(a) -> int:
    from polystrata.chat_cli import cmd_chat as chat

    return chat(a)


COMMANDS = {
    "bench": cmd_bench,
    "pull": cmd_pull,
    "list": cmd_list,
    "rm": cmd_rm,
    "info": cmd_info,
    "tokenize": cmd_tokenize,
    "score": cmd_score,
    "run": cmd_run,
    "chat": cmd_chat,
    "serve": cmd_serve,
    "compile": cmd_compile,
    "parity": cmd_parity,
    "synth": cmd_synth,
    "tune": cmd_tune,
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
    args = None
    try:  # a Ctrl-C can land while the watchdog thread is starting
        if argv is None:
            interrupt.arm()
        args = build_parser().parse_args(argv)
        _merge_model(args)
        # Progress bars on stderr, except where the output is for a program (--json, bench -o json|csv), unless
        # POLYSTRATA_PROGRESS=1 asks for them anyway (a log of a long run then shows how far it got).
        machine_output = getattr(args, "json", False) or getattr(args, "output_format", "md") != "md"
        progress.enabled = not machine_output or os.environ.get("POLYSTRATA_PROGRESS") == "1"
        if getattr(args, "threads", None) is not None:
            from polystrata import threads

            threads.configure(args.threads)  # before anything starts Numba's thread pool
        status = COMMANDS[args.cmd](args)
        # A Ctrl-C that a library swallowed (or Python dropped in a callback) while the command finished: still
        # the interrupt's exit.
        return interrupt.report() if interrupt.received() else status
    except KeyboardInterrupt:
        return interrupt.report()
    except Exception as e:
        if interrupt.received():  # an error after a Ctrl-C is the interrupt's (see polystrata.interrupt)
            return interrupt.report()
        return _failed(e, getattr(args, "debug", False))


def _failed(e: Exception, debug: bool) -> int:
    """`main`'s one line and exit status for error `e` of a command; anything but our errors and the system's is
    re-raised (a traceback: a bug), as is everything with --debug. Call inside the `except` that caught `e`."""
    if isinstance(e, BrokenPipeError):  # the reader went away (`| head`): nothing to say
        return EXIT_ERROR
    if debug or not isinstance(e, (PolystrataError, MemoryError, OSError)):
        raise e
    if isinstance(e, PolystrataError):
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE if isinstance(e, UsageError) else EXIT_ERROR
    if isinstance(e, MemoryError):
        print("error: out of memory", file=sys.stderr)
        return EXIT_ERROR
    print(f"error: {e.strerror or e}: {e.filename or ''}".rstrip(": "), file=sys.stderr)
    return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
