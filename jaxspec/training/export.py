"""Turn a training run's output (flat .npz + config.json) into the engine's checkpoint format.

    python -m jaxspec.training.export RUN_DIR DEST     # DEST/target, DEST/draft, DEST/tokenizer*.json

RUN_DIR is what `train_target` / `train_draft` wrote (RUN_DIR/target, RUN_DIR/draft, RUN_DIR/tokenizer.json).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from convert.checkpoint import save_draft, save_target
from jaxspec.training.artifacts import load_draft_dir, load_target_dir, read_config
from jaxspec.training.tokenizer import TOKENIZER_CONFIG


def export_pair(run_dir: str | Path, dest: str | Path, overwrite: bool = True) -> Path:
    run_dir, dest = Path(run_dir), Path(dest).absolute()  # orbax refuses relative paths
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy2(run_dir / "tokenizer.json", dest / "tokenizer.json")
    (dest / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=1) + "\n")
    _, target_w = load_target_dir(run_dir / "target")
    save_target(dest / "target", target_w, read_config(run_dir / "target"), tokenizer_dir=dest,
                source=f"jaxspec.train_target ({run_dir.name})", overwrite=overwrite)
    _, draft_w = load_draft_dir(run_dir / "draft")
    save_draft(dest / "draft", draft_w, read_config(run_dir / "draft"), source=f"jaxspec.train_draft ({run_dir.name})",
               overwrite=overwrite)
    return dest


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir")
    p.add_argument("dest")
    args = p.parse_args(argv)
    print(export_pair(args.run_dir, args.dest))


if __name__ == "__main__":
    main()
