"""What the command-line entry points (`jaxspec.generate`, `jaxspec.serve`) share: where the embedded pair lives,
finding a target's drafter, the EOS ids a checkpoint names, the --mesh flag, the user-error type and how errors
end a run."""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path
from typing import Callable

from convert.json_input import parse_json

DEFAULT_MODEL_DIR = Path(__file__).parent / "default_model"
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class UsageError(Exception):
    """A user error: the entry points print it as one line `error: ...` and exit with status 2."""


def run_with_exit_codes(run: Callable[[], int], input_errors: tuple[type[BaseException], ...]) -> int:
    """`run()`, with a bad input (a UsageError or one of `input_errors`: a checkpoint, config, tokenizer or prompt
    that is refused) or an unreadable file printed as one line `error: ...` and status 2, and Ctrl-C as status 130."""
    try:
        return run()
    except (UsageError, *input_errors) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:  # a file that cannot be read, a port that cannot be bound
        print(f"error: {e.filename + ': ' if e.filename else ''}{e.strerror or e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are a UsageError (one line, exit 2), not a usage dump."""

    def error(self, message):
        raise UsageError(message)


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """--model, --draft and --moe-kernel, as every entry point that loads a pair takes them."""
    from model.config import KERNEL_CHOICES

    p.add_argument("--model", type=Path, default=None, help="converted target checkpoint (default: the embedded model)")
    p.add_argument("--draft", type=Path, default=None,
                   help="converted EAGLE-3 drafter (default: MODEL/draft, then a sibling directory named draft)")
    p.add_argument("--moe-kernel", choices=KERNEL_CHOICES["moe"], default="auto",
                   help="routed experts (model.config.Kernels.moe): auto (the measured default), wgmma, grouped "
                        "(verify converts an expert several tokens chose once: faster where tokens share experts, "
                        "a few percent slower where they do not; Hopper), triton, off (plain XLA)")


def with_moe_kernel(cfg, choice: str):
    """The target config with its routed-experts kernel set to the --moe-kernel choice."""
    return cfg.replace(kernels=dataclasses.replace(cfg.kernels, moe=choice))


def parse_mesh(spec: str | None):
    if spec is None:
        return None
    from model.sharding import make_mesh, parse_mesh_spec

    try:
        dims = parse_mesh_spec(spec)
    except ValueError:
        raise UsageError(f"--mesh {spec!r}: expected a device count like 8 or a shape like 2x4") from None
    import jax

    n = math.prod(dims)
    if n > jax.device_count():
        raise UsageError(f"--mesh {spec}: needs {n} devices, {jax.device_count()} available")
    return make_mesh(dims)


def flag_name(dest: str) -> str:
    """The command-line flag of an argparse destination (`max_context` -> `--max-context`)."""
    return "--" + dest.replace("_", "-")


def require_at_least(args, minimum: int, *names: str) -> None:
    """A UsageError naming the first of the flags `names` (argparse dests; None: not given) below `minimum`."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value < minimum:
            raise UsageError(f"{flag_name(name)} must be >= {minimum}, got {value}")


def require_checkpoint_dir(flag: str, path: Path) -> None:
    """A UsageError naming `flag` unless `path` is a directory (one that exists but is not says so)."""
    if not path.is_dir():
        why = "not a directory (a checkpoint is one)" if path.exists() else "no such checkpoint directory"
        raise UsageError(f"{flag} {path}: {why}")


def find_draft(model_dir: Path, draft: Path | None) -> Path | None:
    if draft is not None:
        return draft
    for candidate in (model_dir / "draft", model_dir.parent / "draft"):
        if candidate.is_dir() and candidate.resolve() != model_dir.resolve():
            return candidate
    return None


def eos_ids(model_dir: Path, cfg, tokenizer) -> tuple[int, ...]:
    ids = set(cfg.eos_token_id)
    gen = model_dir / "generation_config.json"
    if gen.exists():
        try:
            doc = parse_json(gen.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise UsageError(f"{gen}: not valid JSON ({e})") from None
        eos = doc.get("eos_token_id") if isinstance(doc, dict) else None
        eos = eos if isinstance(eos, list) else [] if eos is None else [eos]
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in eos):
            raise UsageError(f"{gen}: eos_token_id must be a token id or a list of them, got {doc.get('eos_token_id')!r}")
        ids.update(eos)
    tok_eos = tokenizer.token_id("eos_token")
    if tok_eos is not None:
        ids.add(tok_eos)
    return tuple(sorted(int(i) for i in ids))
