"""SentencePiece-style tokenizer.json files (model/sentencepiece.py) in the three forms
the families write them, trained by `tokenizers` on real text with byte fallback: ids and
text equal to the `tokenizers` library's, streamed text equal to the whole."""

import json
from pathlib import Path

import pytest

from model.sentencepiece import leading_strip
from model.tokenizer import Tokenizer, TokenizerError
from tests.sentencepiece_files import BYTES, SPECIALS, TEXTS, corpus, train, write


@pytest.fixture(scope="module", params=list(SPECIALS))
def written(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    root = tmp_path_factory.mktemp(request.param)
    lib = write(root, request.param)
    return request.param, lib, Tokenizer.from_dir(root)


def test_ids_and_text_are_the_librarys(written: tuple) -> None:
    form, lib, ours = written
    checked, fallback = 0, 0
    byte_ids = {lib.token_to_id(b) for b in BYTES}
    for text in corpus("json/*.py", 10) + corpus("*.py", 8) + TEXTS:
        ids = lib.encode(text, add_special_tokens=False).ids
        assert ours.encode(text, add_bos=False) == ids
        assert ours.decode(ids) == lib.decode(ids, skip_special_tokens=False)
        assert ours.decode(ids, skip_special=True) == lib.decode(ids)
        checked += len(ids)
        fallback += sum(i in byte_ids for i in ids)
    assert checked > 20_000 and fallback > 50  # byte pieces were exercised
    assert ours.vocab_size == lib.get_vocab_size()
    assert (
        ours.encode("hi", add_bos=True)[0]
        == ours.bos_id
        == lib.token_to_id(SPECIALS[form][1 if form != "gemma" else 2])
    )


def test_special_tokens_are_recognised_or_plain_text(written: tuple) -> None:
    form, lib, ours = written
    eos = "<eos>" if form == "gemma" else "</s>"
    text = f"one{eos}two"
    assert ours.encode(text, add_bos=False) == lib.encode(text, add_special_tokens=False).ids
    assert lib.token_to_id(eos) in ours.encode(text)
    assert lib.token_to_id(eos) not in ours.encode(text, special=False)
    assert ours.eos_ids == (lib.token_to_id(eos),)
    if form == "gemma":  # the chat turns are tokens of their own
        turn = ours.encode("<start_of_turn>user\nhi<end_of_turn>", add_bos=False)
        assert turn[0] == lib.token_to_id("<start_of_turn>")
    byte = ours.encode("<0x41>", add_bos=False)  # a byte piece's name is text, not the byte
    assert ours.decode(byte) == "<0x41>"


def test_streamed_text_is_the_whole_and_never_half_a_character(written: tuple) -> None:
    """Token by token, a character split over byte pieces is held back until whole; the
    stream keeps the leading space a whole decode drops (generated text continues the
    prompt's)."""
    _, lib, ours = written
    for text in TEXTS:
        ids = ours.encode(text, add_bos=False)
        detok = ours.detokenizer()
        pieces = [detok.push([i]) for i in ids]
        assert all("\ufffd" not in p for p in pieces)
        streamed = "".join(pieces) + detok.flush()
        assert streamed == ours.decode_bytes(ids).decode("utf-8")
        assert streamed.endswith(ours.decode(ids)) and ours.decode(ids) == lib.decode(ids)


def test_a_decoder_it_does_not_know_is_named(tmp_path: Path) -> None:
    _, data = train("gemma")
    data["decoder"] = {"type": "CTC", "pad_token": "<pad>"}
    (tmp_path / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(TokenizerError, match="unsupported decoder step .*CTC"):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize(
    ("decoder", "strip"),
    [
        ({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always"}, " "),
        ({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "never"}, ""),
        ({"type": "Metaspace", "replacement": "▁", "add_prefix_space": False}, ""),
        ({"type": "Sequence", "decoders": [{"type": "Fuse"}]}, ""),
        (None, ""),
    ],
)
def test_the_leading_space_a_whole_decode_drops(decoder: dict | None, strip: str) -> None:
    assert leading_strip(decoder, Path("tokenizer.json")) == strip
