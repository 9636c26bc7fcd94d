"""A byte-level BPE tokenizer (HF `tokenizers`) trained on the corpus, and the corpus as token streams.

Each file becomes `<|bos|> text <|eos|>`; the ids of the three special tokens are fixed (0, 1, 2) so the
target's config.json can name them before the vocabulary exists.
"""

from __future__ import annotations

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from jaxspec.training.corpus import SourceFile

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2

# The model saw only Python sources, so it has no role tokens and no chat training: the template marks the turns
# with plain-text comment lines the tokenizer encodes like any code, which makes `generate --chat` work and shows
# a code model's continuation of a request written as a comment.
CHAT_TEMPLATE = (
    "{% for m in messages %}# {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}# assistant:\n{% endif %}"
)
# beside tokenizer.json: the special tokens by name, a BOS before each prompt (files began with one), the template
TOKENIZER_CONFIG = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "add_bos_token": True,
                    "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE}


def train_tokenizer(files: list[SourceFile], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodes: no unknown token
        show_progress=False,
    )
    tok.train_from_iterator((f.text for f in files), trainer=trainer, length=len(files))
    assert tok.token_to_id(BOS) == BOS_ID and tok.token_to_id(EOS) == EOS_ID and tok.token_to_id(PAD) == PAD_ID
    return tok


def encode_files(tok: Tokenizer, files: list[SourceFile]) -> np.ndarray:
    """All files as one int32 stream: bos, tokens, eos, bos, ... (windows may span file boundaries)."""
    encodings = tok.encode_batch([f.text for f in files], add_special_tokens=False)
    pieces = [np.concatenate([[BOS_ID], np.asarray(e.ids, np.int32), [EOS_ID]]) for e in encodings]
    return np.concatenate(pieces).astype(np.int32) if pieces else np.zeros((0,), np.int32)


def encode_file_list(tok: Tokenizer, files: list[SourceFile]) -> list[np.ndarray]:
    """Each file as its own int32 array `bos + tokens` (prompts for generation start at a file's start)."""
    encodings = tok.encode_batch([f.text for f in files], add_special_tokens=False)
    return [np.concatenate([[BOS_ID], np.asarray(e.ids, np.int32)]).astype(np.int32) for e in encodings]
