"""python -m convert SRC DST [flags]: a HF checkpoint directory -> a jaxspec (orbax) checkpoint.

SRC holds config.json and *.safetensors (bf16 / f32, FP8 block, INT4 compressed-tensors pack-quantized,
Kimi-K2.5's `text_config` nesting, or an EAGLE-3 drafter). The kind is read from config.json.

Every flag and its default: `python -m convert --help`.

An interrupted run leaves DST.partial; rerunning the same command resumes it. Errors print one line
naming the file and tensor and exit with status 1; DST then does not exist.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from convert.help_format import DefaultsHelpFormatter
from convert.safetensors_reader import CheckpointError
from model.config import ConfigError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m convert", description="HF safetensors -> jaxspec orbax checkpoint",
                                epilog=__doc__.split("\n\n")[-1].strip(),
                                formatter_class=DefaultsHelpFormatter)
    p.add_argument("src", type=Path, help="HF checkpoint directory (config.json + *.safetensors)")
    p.add_argument("dst", type=Path, help="output directory (created atomically)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"],
                   help="storage dtype of dense float weights, dequantized ones included")
    p.add_argument("--experts", default="keep", choices=["keep", "bf16"],
                   help="keep: INT4 / FP8 routed experts stay quantized; bf16: dequantize them to dense --dtype arrays")
    p.add_argument("--check", action="store_true",
                   help="re-read SRC and compare a sample of converted tensors (after converting; if DST is already "
                        "complete, only check it)")
    p.add_argument("--check-samples", type=int, default=24, help="tensors sampled by --check")
    p.add_argument("--restart", action="store_true", help="discard an unfinished DST.partial instead of resuming it")
    p.add_argument("--overwrite", action="store_true", help="replace an existing DST")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def parse_args(argv):
    return build_parser().parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    # imported here so that `--help` answers without loading jax / orbax
    from convert.check import check_conversion
    from convert.checkpoint import COMPLETE_MARKER
    from convert.stream import ConvertOptions, convert_checkpoint

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    try:
        already = args.check and (args.dst / COMPLETE_MARKER).exists() and not args.overwrite
        if not already:
            opts = ConvertOptions(dtype=args.dtype, experts=args.experts, restart=args.restart,
                                  overwrite=args.overwrite, progress=not args.no_progress)
            convert_checkpoint(args.src, args.dst, opts, log)
        if args.check and check_conversion(args.src, args.dst, args.check_samples, log=log):
            log(f"convert: error: {args.dst}: --check found tensors that differ from {args.src}")
            return 1
    except (CheckpointError, ConfigError) as e:
        log(f"convert: error: {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
