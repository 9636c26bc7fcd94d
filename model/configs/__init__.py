"""The Kimi K2 family's config.json files (written from the public model cards), by short name."""

from pathlib import Path

from model.config import TextConfig, load_text_config

CONFIG_DIR = Path(__file__).parent
KNOWN = sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def known_config(name: str) -> TextConfig:
    path = CONFIG_DIR / f"{name}.json"
    if not path.exists():
        raise ValueError(f"unknown config '{name}' (known: {', '.join(KNOWN)})")
    return load_text_config(path)
