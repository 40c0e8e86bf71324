"""What the benchmarks share: where they write, the model shapes they measure, a
random-weight checkpoint of a shape with a tokenizer trained here, and the engine runs
the offline numbers come from. Run the benchmarks from the repository root with
PYTHONPATH=. so that `benchmarks.common` imports."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from model.config import ModelConfig
from model.loader import load
from model.transformer import Transformer
from service.config import Settings
from service.engine.core.engine import LLMEngine
from service.engine.request import SamplingParams
from service.engine.text.processor import Texts

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "out"  # JSON results and the checkpoints written, untracked

SMOLLM2_135M = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=2048,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=0,
    eos_token_id=0,
)
LLAMA_32_1B = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=4096,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=0,
    eos_token_id=0,
)
# a shape whose forward costs little: the host's work per token dominates
SMOKE = dict(SMOLLM2_135M, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=2048)  # fmt: skip
SHAPES = {"llama-3.2-1b": LLAMA_32_1B, "smollm2-135m": SMOLLM2_135M}
# Qwen3-30B-A3B's layers (128 experts of 768 features, top 8, 32 query heads over 4 KV
# heads of 128) and vocabulary, 6 of its 48 layers: a checkpoint a benchmark can write and
# read in a minute, whose active bytes are the real model's shares
QWEN3_30B_A3B_6L = dict(
    architecture="Qwen3Moe",
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    num_hidden_layers=6,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    max_position_embeddings=4096,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=0,
)
SMOKE_MOE = dict(QWEN3_30B_A3B_6L, hidden_size=64, moe_intermediate_size=32, num_experts=8,
                 num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=2048)  # fmt: skip
MOE_SHAPES = {"qwen3-30b-a3b-6l": QWEN3_30B_A3B_6L}
# Llama-3.1-8B's shape (its context cut to what the benchmarks use): gpu_decode.py builds
# it in device memory (random_model), since its 16 GB would take minutes to write and read
LLAMA_31_8B = dict(
    LLAMA_32_1B,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    tie_word_embeddings=False,
)


def checkpoint(path: Path, shape: dict = SMOLLM2_135M, dtype: torch.dtype | None = None) -> Path:
    """Write (once) a random-weight checkpoint of `shape` (Llama, or the family its
    "architecture" names) with transformers' own save_pretrained (in `dtype`, or float32),
    and a byte-level BPE tokenizer.json trained here on Python's sources to the model's
    vocabulary size, so that `kvserve serve` can serve the directory."""
    if not (path / "config.json").exists():
        import transformers as tf

        torch.manual_seed(0)
        fields = {k: v for k, v in shape.items() if k != "architecture"}
        family = shape.get("architecture", "Llama")
        config = getattr(tf, f"{family}Config")(**fields)
        model = getattr(tf, f"{family}ForCausalLM")(config)
        (model.to(dtype) if dtype is not None else model).save_pretrained(path)
    if not (path / "tokenizer.json").exists():
        write_tokenizer(path, shape["vocab_size"])
    return path


def _utf8(path: Path) -> bool:
    try:
        path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def write_tokenizer(path: Path, vocab_size: int = SMOLLM2_135M["vocab_size"]) -> None:
    import sysconfig

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    # the whole standard library: enough text for one merge per vocabulary id, so that
    # every id the random model samples decodes to text
    files = [f for f in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")) if _utf8(f)]
    tok.train([str(f) for f in files], trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))


class _StepKinds:
    """An engine observer that notes whether each step was decodes only (one new token
    per sequence)."""

    def __init__(self) -> None:
        self.decode_only = False

    def on_step(self, seconds: float, num_tokens: int, num_seqs: int) -> None:
        self.decode_only = num_tokens == num_seqs

    def on_token_intervals(self, seconds: list[float]) -> None:
        pass

    def on_finished(self, output: object) -> None:
        pass


def run_batch(
    engine: LLMEngine,
    prompts: list[list[int]],
    out_len: int,
    extras: Callable[[int], dict] | None = None,
) -> dict[str, float]:
    """Every prompt as a greedy request of out_len tokens at once, run to the end, its
    text made as a front makes it (an offline user reads text, as a client does);
    extras(i): more SamplingParams fields for request i (none by default)."""
    texts = Texts(engine.tokenizer, engine.stop)
    for i, p in enumerate(prompts):
        more = extras(i) if extras is not None else {}
        params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True, **more)
        rid = f"b{i}-{time.monotonic_ns()}"
        engine.add_request(rid, p, params)
        texts.add(rid, params)
    decode_times: list[float] = []
    generated = 0
    kinds, observer = _StepKinds(), engine.observer
    engine.observer = kinds
    t0 = time.perf_counter()
    try:
        while engine.has_unfinished():
            s0 = time.perf_counter()
            outs = texts.process(engine.step())
            dt = time.perf_counter() - s0
            generated += sum(len(o.token_ids) for o in outs)
            if outs and kinds.decode_only:
                decode_times.append(dt)
    finally:
        engine.observer = observer
    total = time.perf_counter() - t0
    return {
        "requests": len(prompts),
        "output_tokens": generated,
        "seconds": total,
        "output_tok_s": generated / total,
        "mean_decode_step_ms": 1000 * sum(decode_times) / max(1, len(decode_times)),
    }


def run_single(engine: LLMEngine, prompt: list[int], out_len: int) -> dict[str, float]:
    params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    rid = f"single-{time.monotonic_ns()}"
    texts = Texts(engine.tokenizer, engine.stop)
    engine.add_request(rid, prompt, params)
    texts.add(rid, params)
    t0 = time.perf_counter()
    first = None
    n = 0
    while engine.has_unfinished():
        outs = texts.process(engine.step())
        n += sum(len(o.token_ids) for o in outs)
        if first is None and n:
            first = time.perf_counter()
    end = time.perf_counter()
    assert first is not None
    return {
        "ttft_ms": 1000 * (first - t0),
        "decode_ms_per_token": 1000 * (end - first) / max(1, n - 1),
    }


@torch.no_grad()
def random_model(
    shape: dict, dtype: torch.dtype, device: torch.device, seed: int = 0
) -> Transformer:
    """A model of `shape` (config.json's fields; a Llama unless its "architecture" names
    another family) with random weights made on the device: N(0, 0.02) matrices, unit
    norms, in `dtype`, with no checkpoint file in between."""
    fields = {k: v for k, v in shape.items() if k != "architecture"}
    family = shape.get("architecture", "Llama")
    cfg = ModelConfig.from_hf_config({"architectures": [f"{family}ForCausalLM"], **fields})
    with torch.device("meta"):
        model = Transformer(cfg)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in list(model.named_parameters()):
        if param.dim() >= 2:
            value = torch.randn(param.shape, generator=gen, device=device, dtype=dtype) * 0.02
        else:
            value = torch.ones(param.shape, device=device, dtype=dtype)
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, torch.nn.Parameter(value, requires_grad=False))
    model.rebuild_tables(device)
    return model.eval()


def engine_for(path: Path, device: torch.device, dtype: torch.dtype, **settings) -> LLMEngine:
    """An engine over the checkpoint at `path`, loaded the way `kvserve serve` loads it."""
    loaded = load(path, dtype, device)
    return LLMEngine.build(loaded.model, loaded.tokenizer, Settings(**settings).engine)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))
    print(f"wrote {path}")
