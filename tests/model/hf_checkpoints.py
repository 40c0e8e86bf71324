"""Random-weight Hugging Face checkpoints written by transformers itself (test-only)."""

from pathlib import Path

import torch

TINY_LLAMA = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rope_theta=5000.0,
    bos_token_id=1,
    eos_token_id=2,
)


def write_llama(path: Path, *, tied: bool, seed: int = 0, **extra: object) -> "object":
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(**{**TINY_LLAMA, **extra}, tie_word_embeddings=tied)
    model = tf.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path)
    return model


def write_qwen2(path: Path, seed: int = 0) -> "object":
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.Qwen2Config(**TINY_LLAMA, tie_word_embeddings=True)
    model = tf.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # transformers inits biases to zero; make them matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    model.save_pretrained(path)
    return model


def write_gpt2(path: Path, seed: int = 0) -> "object":
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.GPT2Config(
        vocab_size=384,
        n_embd=64,
        n_layer=3,
        n_head=4,
        n_positions=128,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = tf.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    model.save_pretrained(path)
    return model


def write_tokenizer(path: Path, vocab_size: int = 300) -> None:
    """A byte-level BPE of vocab_size tokens (the 256 bytes, merges, two specials) trained
    by `tokenizers` on a little text, so a small checkpoint can be served."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|bos|>", "<|eos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    hf.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 50, trainer)
    hf.save(str(path / "tokenizer.json"))


HUB_COMMIT = "0123456789abcdef0123456789abcdef01234567"


def write_hub_cache(root: Path, repo: str) -> Path:
    """A tiny Llama and its tokenizer in a Hugging Face cache at `root` (the hub/ folder),
    laid out as huggingface_hub lays it out: refs/main -> snapshots/<commit>/..."""
    repo_dir = root / ("models--" + repo.replace("/", "--"))
    snapshot = repo_dir / "snapshots" / HUB_COMMIT
    snapshot.mkdir(parents=True)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(HUB_COMMIT)
    write_llama(snapshot, tied=True)
    write_tokenizer(snapshot)
    return snapshot
