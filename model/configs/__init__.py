"""The Kimi K2 family's config.json files (written from the public model cards), by short name."""

from pathlib import Path

from model.config import TextConfig, load_text_config

CONFIG_DIR = Path(__file__).parent
KNOWN = sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def config_path(directory: Path, name: str, known: list[str], kind: str = "config") -> Path:
    """directory/name.json, or a ValueError that lists the `known` names."""
    if name not in known:
        raise ValueError(f"unknown {kind} '{name}' (known: {', '.join(known)})")
    return directory / f"{name}.json"


def known_config(name: str) -> TextConfig:
    return load_text_config(config_path(CONFIG_DIR, name, KNOWN))
