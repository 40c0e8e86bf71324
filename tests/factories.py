"""The test suite's factories: random-weight models, engines over them, Hugging Face
checkpoints written by transformers itself (with tokenizers and Hub caches), and live
`kvserve serve` processes on 127.0.0.1. Tests build what they need from these."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch

from model.config import ModelConfig
from model.demo import init_weights
from model.tokenizer import Tokenizer
from model.transformer import Transformer
from service.config import Settings
from service.engine.core.engine import LLMEngine
from service.launch import free_port

# ---- models and engines ------------------------------------------------------------


def tiny_model(seed: int = 0, **overrides: object) -> Transformer:
    fields = dict(vocab_size=97, d_model=32, n_layers=2, n_heads=4, d_ff=48, max_position=96)
    fields.update(overrides)
    model = Transformer(ModelConfig(**fields))
    init_weights(model, seed, std=0.1)
    return model.eval()


_TOKENIZER = None


def tokenizer() -> Tokenizer:
    global _TOKENIZER
    if _TOKENIZER is None:
        _TOKENIZER = Tokenizer.default()
    return _TOKENIZER


def small_model(vocab: int = 300, **overrides: object):
    fields = dict(vocab_size=vocab, n_kv_heads=2, max_position=512)
    fields.update(overrides)
    return tiny_model(**fields)


def make_engine(model=None, draft=None, **settings: object) -> LLMEngine:
    """An engine on Settings (no cap on prompt tokens in a step with decodes unless
    given); draft: a speculative draft model (with speculative_method draft)."""
    defaults = dict(
        num_kv_blocks=256,
        block_size=4,
        max_num_seqs=16,
        max_num_batched_tokens=64,
        mixed_prefill_tokens=0,
    )
    defaults.update(settings)
    config = Settings(**defaults).engine
    return LLMEngine.build(model or small_model(), tokenizer(), config, draft)


# ---- Hugging Face checkpoints -------------------------------------------------------

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


def write_llama(path: Path, *, tied: bool, seed: int = 0, **extra: object) -> object:
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(**{**TINY_LLAMA, **extra}, tie_word_embeddings=tied)
    model = tf.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path)
    return model


def write_adapter(hf_model: Any, path: Path, seed: int, **config: object) -> Any:
    """A peft LoRA adapter of `hf_model` with random A and B (peft's default B is zero:
    no delta to check), saved at `path`; returns the peft model."""
    import peft

    torch.manual_seed(seed)
    lora = peft.LoraConfig(init_lora_weights=False, **config)
    model = peft.get_peft_model(hf_model, lora).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0, 0.1)
    model.save_pretrained(path)
    return model


def write_qwen2(path: Path, seed: int = 0) -> object:
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


def _hf_model(family: str, seed: int, **config: object) -> Any:
    """transformers' `{family}ForCausalLM` of TINY_LLAMA's shape (with `config`), seeded."""
    import transformers as tf

    torch.manual_seed(seed)
    cfg = getattr(tf, f"{family}Config")(**{**TINY_LLAMA, **config})
    model = "Gemma3ForCausalLM" if family == "Gemma3Text" else f"{family}ForCausalLM"
    return getattr(tf, model)(cfg).eval()


def write_qwen3(path: Path, seed: int = 0, **config: object) -> object:
    """Qwen3: q/k norms (made to matter: not ones) and a head_dim of its own (16, not
    hidden / heads = 8)."""
    model = _hf_model("Qwen3", seed, **{"head_dim": 16, "tie_word_embeddings": True, **config})
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.normal_(1, 0.3)
            layer.self_attn.k_norm.weight.normal_(1, 0.3)
    model.save_pretrained(path)
    return model


def write_mistral(
    path: Path, seed: int = 0, sliding_window: int | None = None, **config: object
) -> object:
    model = _hf_model(
        "Mistral", seed, sliding_window=sliding_window, tie_word_embeddings=False, **config
    )
    model.save_pretrained(path)
    return model


def write_smollm3(path: Path, seed: int = 0, **config: object) -> object:
    """SmolLM3 with no RoPE in every second layer (of 3: layer 1)."""
    fields = dict(no_rope_layer_interval=2, pad_token_id=0, tie_word_embeddings=True)
    model = _hf_model("SmolLM3", seed, **{**fields, **config})
    model.save_pretrained(path)
    return model


def write_granite(path: Path, seed: int = 0) -> object:
    """Granite with every multiplier away from 1 (the 3.x models' kind of values)."""
    model = _hf_model(
        "Granite",
        seed,
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_multiplier=0.0078125,
        logits_scaling=8.0,
        tie_word_embeddings=True,
    )
    with torch.no_grad():  # scores large enough that their scale shows in the logits
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(30)
            layer.self_attn.k_proj.weight.mul_(30)
    model.save_pretrained(path)
    return model


def write_phi3(path: Path, seed: int = 0) -> object:
    """Phi-4-mini's kind: q|k|v and gate|up fused, three quarters of each head rotated
    (6 of 8 dims), LongRoPE with a pretraining length of half the context (so the
    attention factor is not 1; prompts here stay short of it: the short factors)."""
    pairs = 3
    rope = {
        "rope_type": "longrope",
        "rope_theta": 5000.0,
        "partial_rotary_factor": 0.75,
        "short_factor": [1.0 + 0.5 * i for i in range(pairs)],
        "long_factor": [2.0 + 3.0 * i for i in range(pairs)],
        "original_max_position_embeddings": 128,
        "factor": 2.0,  # the context over the pretraining length
    }
    model = _hf_model(
        "Phi3",
        seed,
        rope_parameters=rope,
        original_max_position_embeddings=128,
        pad_token_id=0,
        tie_word_embeddings=True,
    )
    model.save_pretrained(path)
    return model


def write_olmo2(path: Path, seed: int = 0, **config: object) -> object:
    """OLMo 2: norms on the sublayers' outputs and q/k norms over the whole projections
    (made to matter: not ones)."""
    model = _hf_model("Olmo2", seed, pad_token_id=0, tie_word_embeddings=False, **config)
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.normal_(1, 0.3)
            for norm in (layer.post_attention_layernorm, layer.post_feedforward_layernorm):
                norm.weight.normal_(1, 0.3)
    model.save_pretrained(path)
    return model


def write_gemma3(path: Path, seed: int = 0, sliding_window: int = 8, **config: object) -> object:
    """Gemma 3 (text) of 6 layers, the sixth global, the others windowed with their own
    RoPE base; every norm's weight away from 0 (Gemma's norms scale by 1 + w)."""
    model = _gemma3_text(seed, sliding_window, **config)
    model.save_pretrained(path)
    return model


def _gemma3_text(seed: int, sliding_window: int, **config: object) -> Any:
    model = _hf_model(
        "Gemma3Text",
        seed,
        **{
            "num_hidden_layers": 6,
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": sliding_window,
            "pad_token_id": 0,
            "tie_word_embeddings": True,
            **config,
        },
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0, 0.3)
    return model


def write_gemma3_multimodal(path: Path, seed: int = 0) -> object:
    """Gemma 3 as the 4B and larger ship: the text model of write_gemma3 inside an
    image-and-text checkpoint with a one-layer vision tower (which kvserve does not read)."""
    import transformers as tf

    text = _gemma3_text(seed, sliding_window=8)
    torch.manual_seed(seed)
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    cfg = tf.Gemma3Config(
        text_config=text.config.to_dict(),
        vision_config=vision,
        mm_tokens_per_image=4,
        image_token_index=300,
        boi_token_index=301,
        eoi_token_index=302,
    )
    model = tf.Gemma3ForConditionalGeneration(cfg).eval()
    model.model.language_model.load_state_dict(text.model.state_dict())
    model.save_pretrained(path)
    model.config.vocab_size = text.config.vocab_size  # where the parity tests look for it
    return model


def write_gemma2(path: Path, seed: int = 0, **config: object) -> object:
    """Gemma 2 of 4 layers, windows of 8 in every other, scores and logits soft-capped at
    caps the random weights reach (so the tanh bends them), norms away from 0."""
    model = _hf_model(
        "Gemma2",
        seed,
        **{
            "num_hidden_layers": 4,
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": 8,
            "attn_logit_softcapping": 0.5,
            "final_logit_softcapping": 0.3,
            "pad_token_id": 0,
            "tie_word_embeddings": True,
            **config,
        },
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0, 0.3)
            elif "q_proj" in name or "k_proj" in name:
                param.mul_(10)  # scores of a few units: past the cap
    model.save_pretrained(path)
    return model


def write_gpt2(path: Path, seed: int = 0) -> object:
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


def _moe_model(family: str, seed: int, **config: object) -> Any:
    """transformers' `{family}ForCausalLM` with its routers drawn wide (transformers
    starts them at zero, which ties every expert), so that routing matters."""
    model = _hf_model(family, seed, **config)
    with torch.no_grad():
        for layer in model.model.layers:
            moe = getattr(layer, "mlp", None) or layer.block_sparse_moe
            router = getattr(moe, "gate", None)
            if router is not None and hasattr(router, "top_k"):
                router.weight.normal_(0, 1)
    return model


def write_qwen3_moe(path: Path, seed: int = 0, **config: object) -> object:
    """Qwen3-MoE: 8 experts, top 2 renormalized, layer 1 of 3 dense (mlp_only_layers)."""
    fields = dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        head_dim=16,
        tie_word_embeddings=True,
    )
    model = _moe_model("Qwen3Moe", seed, **{**fields, **config})
    model.save_pretrained(path)
    return model


def write_mixtral(path: Path, seed: int = 0, **config: object) -> object:
    """Mixtral: top 2 of 4 experts of intermediate_size features."""
    fields = dict(num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
    model = _moe_model("Mixtral", seed, **{**fields, **config})
    model.save_pretrained(path)
    return model


def write_olmoe(path: Path, seed: int = 0, **config: object) -> object:
    """OLMoE: top 3 of 8 experts, not renormalized, q/k norms over the projections."""
    fields = dict(num_experts=8, num_experts_per_tok=3, pad_token_id=0, tie_word_embeddings=False)
    model = _moe_model("Olmoe", seed, **{**fields, **config})
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.normal_(1, 0.3)
    model.save_pretrained(path)
    return model


def write_qwen2_moe(path: Path, seed: int = 0, **config: object) -> object:
    """Qwen2-MoE: top 2 of 8 experts beside a shared expert behind its sigmoid gate."""
    fields = dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        tie_word_embeddings=False,
    )
    model = _moe_model("Qwen2Moe", seed, **{**fields, **config})
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.shared_expert_gate.weight.normal_(0, 0.5)
    model.save_pretrained(path)
    return model


GPT_OSS_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
}


def gpt_oss_model(seed: int = 0, **config: object) -> Any:
    """gpt-oss: 8 experts, top 2, windowed layers (8 keys) alternating with global ones,
    YaRN past a pretraining length of 64; the router, its bias, the sinks and every
    bias drawn so that each matters."""
    fields = dict(
        num_local_experts=8,
        num_experts_per_tok=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=32,
        sliding_window=8,
        rope_parameters=GPT_OSS_ROPE,
        tie_word_embeddings=False,
    )
    model = _hf_model("GptOss", seed, **{**fields, **config})
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0, 1)
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(layer.self_attn, proj).bias.normal_(0, 0.2)
            mlp = layer.mlp
            mlp.router.weight.normal_(0, 1)
            mlp.router.bias.normal_(0, 0.5)
            for name in ("gate_up_proj", "down_proj"):
                getattr(mlp.experts, name).normal_(0, 0.1)
                getattr(mlp.experts, name + "_bias").normal_(0, 0.1)
    return model


def write_gpt_oss(path: Path, seed: int = 0, **config: object) -> object:
    model = gpt_oss_model(seed, **config)
    model.save_pretrained(path)
    return model


def write_qwen_tokenizer(
    path: Path, template: str, corpus: str, thinks: bool = True, specials: tuple[str, ...] = ()
) -> None:
    """A byte-level BPE trained on `corpus` with ChatML's markers (and `specials`) as
    special tokens and Qwen's `<think>`, `</think>` (thinks: a reasoning model's),
    `<tool_call>`, `</tool_call>` as added tokens its text keeps (as Qwen3's
    tokenizer.json marks them), behind `template`."""
    import json

    from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HFTokenizer

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=340,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>", *specials],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    hf.train_from_iterator([corpus] * 50, trainer)
    kept = [*(["<think>", "</think>"] if thinks else []), "<tool_call>", "</tool_call>"]
    hf.add_tokens([AddedToken(m, special=False, normalized=False) for m in kept])
    hf.save(str(path / "tokenizer.json"))
    config = {"bos_token": None, "eos_token": "<|im_end|>", "chat_template": template}
    (path / "tokenizer_config.json").write_text(json.dumps(config))


HARMONY_SPECIALS = (
    "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
    "<|return|>", "<|call|>",
)  # fmt: skip


def write_harmony_tokenizer(path: Path, template: str, corpus: str) -> None:
    """A byte-level BPE trained on `corpus` with harmony's markers as special tokens
    (gpt-oss's), behind `template`; generation stops at <|return|> and <|call|>."""
    import json

    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=340,
        special_tokens=list(HARMONY_SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    hf.train_from_iterator([corpus] * 50, trainer)
    hf.save(str(path / "tokenizer.json"))
    config = {"bos_token": None, "eos_token": "<|return|>", "chat_template": template}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    ends = [hf.token_to_id("<|return|>"), hf.token_to_id("<|call|>")]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": ends}))


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


# ---- live servers -------------------------------------------------------------------

# the two ways a server runs its engine (--engine-process): tests that serve run in both
ENGINE_MODES = {"engine-thread": "off", "engine-process": "on"}


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log_path: str
    mode: str = "engine-thread"  # a key of ENGINE_MODES, where a fixture says

    def client(self, **kw: object) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, **kw)

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def wait_idle(self, timeout: float = 10.0) -> dict:
        """Wait until no request runs or waits and no KV block is in use."""
        deadline = time.monotonic() + timeout
        while True:
            h = self.health()
            if (h["running"], h["waiting"], h["kv_cache"]["blocks_used"]) == (
                0,
                0,
                0,
            ) or time.monotonic() > deadline:
                return h
            time.sleep(0.05)

    def wait_healthy(self, timeout: float = 120.0) -> Server:
        """Wait until /health answers 200 (servers started with wait=False start side by
        side: their imports overlap)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {_tail(self.log_path)}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"server did not become healthy: {_tail(self.log_path)}")

    def wait_fronts(self, n: int, timeout: float = 120.0) -> Server:
        """Wait until each of `n` fronts answers /health: the first healthy answer says
        only that one front listens (the others may still be importing, and until they
        listen the kernel gives every connection to the first)."""
        seen: set[int] = set()
        deadline = time.monotonic() + timeout
        while len(seen) < n:
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"only fronts {sorted(seen)} answered: {_tail(self.log_path)}")
            with contextlib.suppress(httpx.HTTPError):
                resp = httpx.get(self.url + "/health", timeout=2)  # a fresh connection
                if resp.status_code == 200:
                    seen.add(resp.json()["front"])
            time.sleep(0.02)
        return self

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def _tail(path: str) -> str:
    with open(path) as f:
        return f.read()[-2000:]


def start_server(
    tmp_dir: str,
    *args: str,
    wait: bool = True,
    module: str = "service.cli",
    env: dict[str, str] | None = None,
) -> Server:
    """`python -m <module> serve --port <free> ...`; `module` may be a launcher that wraps
    the real CLI (tests.reliability.harness), `env` adds environment variables."""
    port = free_port()
    log_path = os.path.join(tmp_dir, f"server-{port}.log")
    cmd = [
        sys.executable,
        "-m",
        module,
        "serve",
        "--port",
        str(port),
        "--kv-cache-gib",
        "0.25",
        *args,
    ]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env)
    server = Server(proc, f"http://127.0.0.1:{port}", log_path)
    return server.wait_healthy() if wait else server
