"""Tokenizers in the checkpoint formats (Kimi tiktoken.model, HF tokenizer.json), chat templates, streaming."""

import json

import pytest

from jaxspec.tokenizer import StreamDecoder, TokenizerError, load_tokenizer
from tests.kimi_tokenizer_fixture import write_kimi_tokenizer

TEXT = "def the thing(é, 中文): return 'ok'  # ünïcödé ✓"


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    d = tmp_path_factory.mktemp("kimi_tok")
    write_kimi_tokenizer(d)
    return load_tokenizer(d)


def test_kimi_round_trip_and_specials(kimi):
    ids = kimi.encode(TEXT + "<|im_end|>")
    assert kimi.decode(ids) == TEXT + "<|im_end|>"
    assert ids[-1] == kimi.special_tokens["<|im_end|>"]
    assert kimi.token_id("eos_token") == kimi.special_tokens["[EOS]"]
    # unnamed reserved ids get placeholder names, 258 specials in all
    assert len(kimi.special_tokens) == 258


def test_chat_template(kimi):
    text = kimi.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}])
    assert text == "<|im_system|>system<|im_middle|>S<|im_end|><|im_user|>user<|im_middle|>U<|im_end|>" \
                   "<|im_assistant|>assistant<|im_middle|>"


def test_stream_decoder_never_splits_a_character(kimi):
    ids = kimi.encode(TEXT)
    assert any(kimi.decode([i]).endswith("\ufffd") for i in ids)  # multi-byte chars span several tokens
    dec = StreamDecoder(kimi)
    pieces = [dec.push([i]) for i in ids] + [dec.flush()]
    assert "".join(pieces) == TEXT
    assert not any("\ufffd" in p for p in pieces)


def test_hf_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT] * 10, trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    t = load_tokenizer(tmp_path)
    ids = t.encode(TEXT)
    assert t.decode(ids) == TEXT and t.token_id("eos_token") == t.special_tokens["<eos>"]
    dec = StreamDecoder(t)
    assert "".join([dec.push([i]) for i in ids] + [dec.flush()]) == TEXT
    with pytest.raises(TokenizerError, match="no chat template") as e:
        t.apply_chat_template([{"role": "user", "content": "x"}])
    for looked_for in ("chat_template.jinja", "chat_template.json", "tokenizer_config.json", str(tmp_path)):
        assert looked_for in str(e.value)


def test_missing_and_broken_tokenizers(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer"):
        load_tokenizer(tmp_path / "a" / "b")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        load_tokenizer(tmp_path)


class _CountingTokenizer:
    """A tokenizer of fixed pieces that counts the tokens it decodes; like sentencepiece, a decode drops the leading
    space of its first piece."""

    def __init__(self, pieces):
        self.pieces, self.decoded = pieces, 0

    def decode(self, ids):
        self.decoded += len(ids)
        text = "".join(self.pieces[i] for i in ids)
        return text[1:] if text.startswith(" ") else text


def test_stream_decoder_decodes_each_token_a_bounded_number_of_times():
    """A server streams answers of thousands of tokens: decoding the whole list at every push cost each answer
    O(n^2) token decodes (seconds of the event loop at 16k tokens); each push now decodes the new tokens and the
    last piece's. The text is the whole decode's, the space a sentencepiece decode drops at its start included."""
    pieces = [" the", " cat", " sat", ".", "\n"]
    ids = [i % len(pieces) for i in range(3000)]
    tok = _CountingTokenizer(pieces)
    dec = StreamDecoder(tok)
    text = "".join([dec.push([i]) for i in ids] + [dec.flush()])
    assert text == _CountingTokenizer(pieces).decode(ids)
    assert tok.decoded <= 6 * len(ids)  # the whole list at every push: ~n^2 / 2 = 4.5 million


def test_stream_decoder_rewinds_to_a_mark():
    pieces = [" a", " b", " c", " d"]
    dec = StreamDecoder(_CountingTokenizer(pieces))
    assert dec.push([0, 1]) == "a b"
    mark = dec.mark()
    assert dec.push([2, 3]) == " c d"
    dec.rewind(mark)
    assert [dec.push([2]), dec.push([3]), dec.flush()] == [" c", " d", ""]
