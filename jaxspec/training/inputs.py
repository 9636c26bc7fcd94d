"""What the training entry points refuse before any work: flags out of range, a corpus with nothing to train on,
a tokenizer or target that is not one, an output path that already holds something. Each refusal is a UsageError
naming the flag; `cli` prints it as one line `error: ...` with exit status 2 (Ctrl-C: status 130, no traceback)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

from jaxspec.cli_common import UsageError, flag_name, run_with_exit_codes


def require_finite(args, *names: str, low: float = 0.0, high: float = math.inf, low_open: bool = False) -> None:
    """Float flags (None: not given) that must be finite numbers in [low, high] ((low, high] with `low_open`)."""
    for name in names:
        v = getattr(args, name)
        if v is None:
            continue
        if not math.isfinite(v) or v > high or v < low or (low_open and v == low):
            where = f"{'(' if low_open else '['}{low:g}, {high:g}]" if math.isfinite(high) else \
                f"{'>' if low_open else '>='} {low:g}"
            within = "in " if math.isfinite(high) else ""
            raise UsageError(f"{flag_name(name)} must be a finite number {within}{where}, got {v}")


def require_splits(args) -> None:
    """Held-out and validation percents: each in [0, 100], and some files left to train on."""
    require_finite(args, "held_out_percent", "val_percent", high=100.0)
    if args.held_out_percent + args.val_percent >= 100.0:
        raise UsageError(f"--held-out-percent {args.held_out_percent:g} + --val-percent {args.val_percent:g} leave no "
                         f"training files (their sum must be below 100)")


def require_new_output(flag: str, path: Path) -> None:
    """Training writes into a new or empty directory only: it never overwrites what a user (or an earlier run)
    put there, and files of an earlier run beside new ones would pass for one finished run."""
    if path.exists() and not path.is_dir():
        raise UsageError(f"{flag} {path}: exists and is not a directory")
    if path.is_dir() and any(path.iterdir()):
        raise UsageError(f"{flag} {path}: already exists and is not empty (training does not overwrite; "
                         f"remove it or choose another)")


def load_tokenizer(flag: str, path: str | Path):
    from tokenizers import Tokenizer

    if not Path(path).is_file():
        raise UsageError(f"{flag} {path}: {'not a file' if Path(path).exists() else 'no such file'}")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for unreadable or malformed JSON
        raise UsageError(f"{flag} {path}: not a tokenizer.json ({e})") from None


def read_corpus(root: str | None, max_files: int | None):
    """The corpus files, or a UsageError naming --corpus-root when there is nothing to train on."""
    from jaxspec.training.corpus import read_sources

    if root is not None and not Path(root).is_dir():
        raise UsageError(f"--corpus-root {root}: {'not a directory' if Path(root).exists() else 'no such directory'}")
    files = read_sources(root, max_files=max_files)
    if not files:
        raise UsageError(f"--corpus-root {root}: no non-empty UTF-8 *.py file under it")
    return files


def load_target(flag: str, path: str | Path):
    """(TextConfig, weights) of a train_target output directory, or a UsageError naming `flag`."""
    from jaxspec.training.artifacts import WEIGHTS, load_target_dir

    path = Path(path)
    if not path.is_dir():
        raise UsageError(f"{flag} {path}: {'not a directory' if path.exists() else 'no such directory'}")
    missing = [n for n in ("config.json", f"{WEIGHTS}.dtypes.json") if not (path / n).is_file()]
    if missing:
        raise UsageError(f"{flag} {path}: not a train_target output directory ({', '.join(missing)} missing)")
    try:
        return load_target_dir(path)
    except (ValueError, KeyError, OSError) as e:  # ConfigError, a JSON error, a shard of other shapes or keys
        raise UsageError(f"{flag} {path}: not a train_target output directory ({e})") from None


def cli(main: Callable[[list[str] | None], object], argv: list[str] | None) -> int:
    """`main(argv)` as a command: 0 when it finishes, 2 with one line for a refused input, 130 on Ctrl-C."""
    def run() -> int:
        main(argv)
        return 0

    return run_with_exit_codes(run, ())
