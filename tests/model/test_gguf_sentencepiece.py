"""A GGUF file whose tokenizer is SentencePiece's (tokenizer.ggml.model 'llama': each
piece with its score and type, as llama.cpp's converter writes the tokenizer.model of
Llama 2, Mistral or Gemma): kvserve rebuilds the BPE merges from the scores and encodes
as the `sentencepiece` library encodes with the model the file was written from, with a
space put before the text (Llama's) and without (Gemma's)."""

from pathlib import Path

import pytest

from model.sentencepiece import gguf_merges
from model.tokenizer import Tokenizer
from tests.factories import write_llama
from tests.gguf_files import write_gguf
from tests.sentencepiece_files import TEXTS, corpus


def train(out: Path, dummy_prefix: bool) -> Path:
    """A SentencePiece BPE model trained by the library on stdlib sources: byte fallback,
    no normalization (Llama's and Gemma's settings), `dummy_prefix` a space before text."""
    import sentencepiece as spm

    text = out / "corpus.txt"
    text.write_text("\n".join(corpus("email/*.py", 12)), encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(text), model_prefix=str(out / "tokenizer"), model_type="bpe",
        vocab_size=1500, byte_fallback=True, character_coverage=0.9995,
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=dummy_prefix, split_digits=True, max_sentence_length=1 << 16,
        allow_whitespace_only_pieces=True, minloglevel=2,
    )  # fmt: skip
    return out / "tokenizer.model"


@pytest.fixture(scope="module", params=[True, False], ids=["llama", "gemma"])
def written(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    from sentencepiece import SentencePieceProcessor

    root = tmp_path_factory.mktemp("spm")
    model = train(root, request.param)
    sp = SentencePieceProcessor(model_file=str(model))
    write_llama(root / "hf", tied=False, vocab_size=sp.vocab_size() + 3)  # [PADn] past it
    path = write_gguf(root / "hf", root / "spm.gguf", sentencepiece=model)
    return sp, Tokenizer.from_dir(path)


def test_ids_and_text_are_sentencepieces(written: tuple) -> None:
    """Real text (code, prose, CJK, emoji, digits, runs of spaces and newlines): the same
    ids as SentencePiece's own encoder, the same text back; byte pieces exercised."""
    sp, ours = written
    checked, fallback = 0, 0
    for text in corpus("json/*.py", 6) + corpus("*.py", 6) + TEXTS:
        ids = sp.encode(text)
        assert ours.encode(text, add_bos=False) == ids, text[:80]
        assert ours.decode(ids) == sp.decode(ids)
        checked += len(ids)
        fallback += sum(sp.is_byte(i) for i in ids)
    assert checked > 10_000 and fallback > 50


def test_bos_eos_and_the_padding_pieces(written: tuple) -> None:
    sp, ours = written
    assert ours.encode("hi", add_bos=True)[0] == ours.bos_id == sp.bos_id()
    assert ours.eos_ids == (sp.eos_id(),)
    assert ours.vocab_size == sp.vocab_size() + 3
    assert ours.encode("</s>", add_bos=False) == [sp.eos_id()]  # a control piece's text


def test_merges_rank_a_pieces_splits_by_its_score() -> None:
    """Every split of a normal piece into two normal pieces, the higher-scored piece's
    first; control and byte pieces are never parts."""
    tokens = ["<unk>", "<s>", "a", "b", "c", "ab", "bc", "abc", "<0x61>"]
    scores = [0.0, 0.0, -1.0, -2.0, -3.0, -5.0, -4.0, -6.0, 0.0]
    types = [2, 3, 1, 1, 1, 1, 1, 1, 6]
    merges = gguf_merges(tokens, scores, types)
    assert merges == [["b", "c"], ["a", "b"], ["a", "bc"], ["ab", "c"]]
