"""SentencePiece-style tokenizer.json files as the families write them (Llama 2's legacy
normalizer, Mistral v0.3's Metaspace pre-tokenizer, Gemma's replaced spaces), trained by
`tokenizers` on real text (stdlib sources) with byte fallback."""

import json
import sysconfig
from pathlib import Path
from typing import Any

STDLIB = Path(sysconfig.get_paths()["stdlib"])
BYTES = [f"<0x{b:02X}>" for b in range(256)]
# what each family puts first in its vocabulary
SPECIALS = {
    "llama2": ["<unk>", "<s>", "</s>"],  # Llama 2, Mistral v0.1 (legacy normalizer)
    # Phi-3: Llama 2's file with its chat turns' markers added
    "phi3": [
        "<unk>",
        "<s>",
        "</s>",
        "<|endoftext|>",
        "<|system|>",
        "<|user|>",
        "<|assistant|>",
        "<|end|>",
    ],
    "metaspace": ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"],  # Mistral v0.3
    "gemma": ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"],
}
TEXTS = [
    "héllo wörld — ünïcödé 日本語のテキスト 🙂🎉 e\u0301 café",
    "  multiple   spaces\n\n\ttabs 12345678 x's they'll ",
    " a leading space, and\n a trailing newline\n",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∮ E⋅da = Q, ½ ± ∞",
]


def corpus(pattern: str, limit: int) -> list[str]:
    files = sorted(STDLIB.glob(pattern))[:limit]
    return [p.read_text(encoding="utf-8", errors="replace") for p in files]


def train(form: str, vocab_size: int = 2000) -> tuple[Any, dict]:
    """(the tokenizers library's Tokenizer, its tokenizer.json as a dict)"""
    from tokenizers import Tokenizer as Library
    from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

    specials = SPECIALS[form]
    unk = "<unk>"
    lib = Library(models.BPE(unk_token=unk, byte_fallback=True, fuse_unk=True))
    pieces = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if form in ("llama2", "phi3"):
        lib.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
        lib.decoder = decoders.Sequence([*pieces, decoders.Strip(" ", 1, 0)])
    elif form == "metaspace":  # the space put before the text by the pre-tokenizer
        lib.pre_tokenizer = pre_tokenizers.Metaspace("▁", prepend_scheme="first", split=False)
        lib.decoder = decoders.Sequence([*pieces, decoders.Strip(" ", 1, 0)])
    else:  # Gemma: spaces replaced, none prepended, none stripped
        lib.normalizer = normalizers.Replace(" ", "▁")
        lib.decoder = decoders.Sequence(pieces)
    # the byte pieces come right after the specials, as in the families' files; a small
    # alphabet leaves CJK, emoji and most accents to them
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials + BYTES, limit_alphabet=90
    )
    lib.train_from_iterator(corpus("email/*.py", 12), trainer)
    data = json.loads(lib.to_str())
    # byte pieces are vocabulary entries, not added tokens (the text "<0x41>" is text)
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] not in BYTES]
    return Library.from_str(json.dumps(data)), data


def write(path: Path, form: str, vocab_size: int = 2000, **config: object) -> Any:
    """tokenizer.json and tokenizer_config.json (BOS added, `config` on top) in `path`;
    the library's Tokenizer."""
    lib, data = train(form, vocab_size)
    (path / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    bos, eos = ("<bos>", "<eos>") if form == "gemma" else ("<s>", "</s>")
    settings = {"bos_token": bos, "eos_token": eos, "add_bos_token": True, **config}
    (path / "tokenizer_config.json").write_text(json.dumps(settings))
    return lib
