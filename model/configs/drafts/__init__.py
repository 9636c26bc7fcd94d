"""EAGLE-3 draft configs (the drafters' config.json) for the Kimi targets, by short name.

kimi-k2.5-eagle3: the K2.5 drafter's shape (REFERENCE.md section 5; TorchSpec's K2.5 recipe, intermediate
12288) with a 32000-token draft vocabulary; aux layers default to the target's (1, 29, 57).
kimi-k2.5-eagle3-mla, kimi-k2.6-eagle3.1-mla, kimi-k2.7-coder-eagle3.1-mla: the MLA drafters
(Eagle3DeepseekV2ForCausalLM), the last two in the EAGLE-3.1 form; docs/drafters.md says which values are
published and which assumed.
"""

from pathlib import Path

from model.configs import config_path
from model.eagle3 import DraftConfig, load_draft_config

DRAFT_DIR = Path(__file__).parent
KNOWN_DRAFTS = sorted(p.stem for p in DRAFT_DIR.glob("*.json"))


def known_draft_config(name: str) -> DraftConfig:
    return load_draft_config(config_path(DRAFT_DIR, name, KNOWN_DRAFTS, "draft config"))
