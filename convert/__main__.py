"""python -m convert SRC DST [flags]: a HF checkpoint directory -> a jaxspec (orbax) checkpoint.

SRC holds config.json and *.safetensors (bf16 / f32, FP8 block, INT4 compressed-tensors pack-quantized,
Kimi-K2.5's `text_config` nesting, or an EAGLE-3 drafter). The kind is read from config.json.

Every flag and its default: `python -m convert --help`.

An interrupted run leaves DST.partial; rerunning the same command resumes it (a source that changed
meanwhile is refused). One conversion at a time holds DST.lock. Every error prints one line
`convert: error: ...` naming the file, tensor, key or flag and exits with status 2 (the status of
`python -m jaxspec.generate` too); DST then does not exist.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from convert.destination import check_destination, partial_dir
from convert.dst_lock import DestinationLock
from convert.errors import CheckpointError
from convert.help_format import DefaultsHelpFormatter
from model.config import ConfigError

EXIT_USAGE = 2  # every user error: bad flags, bad input files, a busy or unsafe destination


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, no usage dump
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m convert", description="HF safetensors -> jaxspec orbax checkpoint",
                epilog=__doc__.split("\n\n")[-1].strip(), formatter_class=DefaultsHelpFormatter)
    p.add_argument("src", type=Path, help="HF checkpoint directory (config.json + *.safetensors)")
    p.add_argument("dst", type=Path, help="output directory (created atomically)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"],
                   help="storage dtype of dense float weights, dequantized ones included")
    p.add_argument("--experts", default="keep", choices=["keep", "bf16"],
                   help="keep: INT4 / FP8 routed experts stay quantized; bf16: dequantize them to dense --dtype arrays")
    p.add_argument("--check", action="store_true",
                   help="verify every file of DST against the SHA-256 digests recorded when it was written (after "
                        "converting; if DST is already complete, only check it)")
    p.add_argument("--check-source", action="store_true",
                   help="with --check, also re-read SRC and compare a sample of converted tensors")
    p.add_argument("--check-samples", type=int, default=24, help="tensors sampled by --check-source (N >= 1)")
    p.add_argument("--restart", action="store_true", help="discard an unfinished DST.partial instead of resuming it")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing DST (only a jaxspec checkpoint is ever replaced)")
    p.add_argument("--allow-nonfinite", action="store_true",
                   help="convert weights holding NaN / Inf (refused by default, naming the tensor)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def parse_args(argv):
    args = build_parser().parse_args(argv)
    if args.check_samples < 1:
        raise UsageError(f"--check-samples must be >= 1, got {args.check_samples}")
    if args.check_source:
        args.check = True
    return args


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run(args, on_item_saved=None) -> int:
    dst = args.dst.absolute()
    check_destination(args.src, dst)
    with DestinationLock(dst):
        args.holds_lock = True  # from here on a DST.partial left behind is this run's (or one it resumed)
        # imported here so that `--help`, and a destination that is refused or busy, answer without loading jax
        from convert.check import check_conversion
        from convert.checkpoint import COMPLETE_MARKER
        from convert.stream import ConvertOptions, convert_checkpoint, read_config

        read_config(args.src)
        already = args.check and (dst / COMPLETE_MARKER).exists() and not args.overwrite
        if not already:
            opts = ConvertOptions(dtype=args.dtype, experts=args.experts, restart=args.restart,
                                  overwrite=args.overwrite, progress=not args.no_progress,
                                  allow_nonfinite=args.allow_nonfinite)
            convert_checkpoint(args.src, dst, opts, _log, lock=False, on_item_saved=on_item_saved)
        if args.check:
            bad = check_conversion(args.src, dst, args.check_samples if args.check_source else 0, log=_log)
            if bad:
                raise CheckpointError(f"{dst}: --check found {bad} problem{'s' * (bad > 1)} (listed above)")
    return 0


def _kept(args) -> str:
    """What a failed run leaves: a DST.partial holding converted items, which a rerun resumes."""
    if not getattr(args, "holds_lock", False):  # before the destination was checked (it may have no name)
        return ""
    work = partial_dir(args.dst.absolute())
    if work.is_dir() and not work.is_symlink() and (work / "convert_options.json").is_file():
        return f" ({work} is kept: rerun to resume it, or pass --restart to discard it)"
    return ""


def main(argv=None, on_item_saved=None) -> int:
    """The CLI; `on_item_saved` as for `convert_checkpoint` (what tests interrupt a run with)."""
    args = None
    try:
        args = parse_args(argv)
        return run(args, on_item_saved)
    except (UsageError, CheckpointError, ConfigError) as e:
        message = str(e)
    except OSError as e:  # a read-only or full disk, a permission: name the file
        message = f"{e.filename + ': ' if e.filename else ''}{e.strerror or e}"
    except KeyboardInterrupt:
        _log("convert: error: interrupted" + (_kept(args) if args is not None else ""))
        return 130
    _log(f"convert: error: {message}" + (_kept(args) if args is not None and "--restart" not in message else ""))
    return EXIT_USAGE


if __name__ == "__main__":
    code = main()
    try:
        sys.stderr.flush()
    except BrokenPipeError:  # stderr piped into a reader that left: nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stderr.fileno())
    sys.exit(code)
