"""GGUF files (model/gguf.py) written from transformers' checkpoints as llama.cpp's
converter writes them (tests/gguf_files.py), in a mix of block types: the model's logits
are transformers' on the weights the `gguf` package's dequantization gives, its greedy
tokens the same on every backend, and the tokenizer the checkpoint's tokenizer.json."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from model.audit import audit
from model.backends.cpu import prepare_model
from model.backends.cpu.packed import held_bytes
from model.gguf import open_gguf
from model.tokenizer import Tokenizer, TokenizerError
from model.weights import CheckpointError, load_config, load_model, stored_kinds
from tests.factories import (
    write_gemma2,
    write_gemma3,
    write_gpt_oss,
    write_granite,
    write_llama,
    write_mixtral,
    write_olmo2,
    write_olmoe,
    write_phi3,
    write_qwen2,
    write_qwen2_moe,
    write_qwen3,
    write_qwen3_moe,
    write_smollm3,
    write_tokenizer,
)
from tests.gguf_files import default_types, gpt_oss_types, write_gguf
from tests.model.backends import BACKENDS, make_backend

FAMILIES = {
    "llama": lambda p: write_llama(p, tied=False),  # q/k rows permuted in the file
    "qwen2": write_qwen2,  # q/k/v biases, a tied head
    "qwen3": write_qwen3,  # q/k norms, head_dim 16 of hidden 64 / 8 heads
    "qwen3_moe": lambda p: write_qwen3_moe(p, mlp_only_layers=[]),  # stacked experts
    "mixtral": write_mixtral,  # a Llama with experts
    # norms stored as 1 + w, soft-caps, windows; no RoPE base in the file (llama.cpp's 10000)
    "gemma2": lambda p: write_gemma2(p, rope_theta=10000.0),
    "gemma3": write_gemma3,  # q/k norms, a local RoPE base, one global layer in six
    "phi3": write_phi3,  # q|k|v and gate|up fused, partial rotary, LongRoPE's factor tensors
    "olmo2": write_olmo2,  # norms after the sublayers, q/k norms over the projections
    "olmoe": write_olmoe,  # its experts stacked, top 3 not renormalized
    "granite": write_granite,  # q/k permuted; four scalings stored as *_scale
    "qwen2_moe": write_qwen2_moe,  # a shared expert behind its gate
    # q/k permuted; no RoPE in every fourth layer, which the file does not say
    "smollm3": lambda p: write_smollm3(p, no_rope_layer_interval=4, num_hidden_layers=4),
    # sinks, biases, YaRN, windows; experts in MXFP4, split into gate and up stacks
    "gpt_oss": write_gpt_oss,
}


def types_of(family: str):
    """The block types a family's file holds (gpt-oss's experts in MXFP4)."""
    return gpt_oss_types if family == "gpt_oss" else default_types


def checkpoint(family: str, tmp_path: Path) -> tuple[object, Path]:
    """transformers' model and the GGUF file written from its checkpoint."""
    hf = FAMILIES[family](tmp_path / "hf")
    write_tokenizer(tmp_path / "hf")
    (tmp_path / "gguf").mkdir()
    return hf, write_gguf(tmp_path / "hf", tmp_path / "gguf" / "model.gguf", types_of(family))


def as_the_file_holds(hf, path: Path) -> None:
    """hf's weights replaced by what the file holds, dequantized by the gguf package: each
    tensor quantized to its type in the file and back (per row, so in the checkpoint's
    layout: the file's permuted and stacked rows are the same rows; gpt-oss's experts,
    stored (in, out), turned to the file's (out, in) for it)."""
    import gguf

    f = open_gguf(path)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            source = f.source(name) or _expert_source(f, name)
            if source is None:  # a tied head, or a bias the file holds in F32
                continue
            kind = f.tensors[source[0]].tensor_type
            turned = f.arch == "gpt-oss" and name.endswith(("gate_up_proj", "down_proj"))
            w = p.detach().float().transpose(-1, -2) if turned else p.detach().float()
            back = torch.from_numpy(
                gguf.quants.dequantize(gguf.quants.quantize(w.numpy(), kind), kind)
            )
            p.copy_(back.transpose(-1, -2) if turned else back)


def _expert_source(f, name: str) -> tuple[str, int | None] | None:
    """The file's tensor of a parameter transformers keeps fused over the experts
    (`experts.gate_up_proj` (E, 2F, d), `experts.down_proj` (E, d, F): rows along the
    input, as the file's), by its first expert's checkpoint name."""
    prefix, _, proj = name.rpartition(".")
    moe = prefix.removesuffix(".experts")
    names = {"gate_up_proj": ("gate_proj", "w1"), "down_proj": ("down_proj", "w2")}.get(proj, ())
    for block in (moe, moe.replace(".mlp", ".block_sparse_moe")):
        for n in names:
            if found := f.source(f"{block}.experts.0.{n}.weight"):
                return found
    return None


@pytest.mark.parametrize("family", list(FAMILIES))
@torch.no_grad()
def test_logits_are_transformers_on_the_gguf_packages_dequantization(
    family: str, tmp_path: Path
) -> None:
    hf, path = checkpoint(family, tmp_path)
    ours = load_model(path)
    assert (
        ours.cfg.architecture
        == json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"][0]
    )
    as_the_file_holds(hf, path)
    n = 160 if family == "phi3" else 48  # Phi-3's past its pretraining length: long factors
    tokens = torch.randint(3, hf.config.vocab_size, (n,))
    ref = hf(tokens[None]).logits[0]
    assert (ref - ours(tokens)).abs().max().item() <= 1e-4
    quantized = hf(tokens[None]).logits[0]
    assert quantized.sub(ref).abs().max() == 0  # the reference is the quantized model


ROPES = {
    # 4 frequencies, one of them blended: 200 tokens run past the pretraining length
    "tiny": dict(factor=8.0, original=64, theta=5000.0, heads=8),
    # Llama 3.2's scaling over a 64-wide head: several blended frequencies, fitted
    "llama-3.2": dict(factor=32.0, original=8192, theta=500000.0, heads=1),
}


@pytest.mark.parametrize("rope", list(ROPES))
@torch.no_grad()
def test_llama31_rope_scaling_is_read_from_rope_freqs(rope: str, tmp_path: Path) -> None:
    """Llama 3.1's scaling reaches a GGUF file only as the rope_freqs divisors; the
    scaling read back from them turns 200 tokens as transformers does with the
    checkpoint's rope_scaling."""
    r = ROPES[rope]
    scaling = {"rope_type": "llama3", "factor": r["factor"], "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": r["original"],
               "rope_theta": r["theta"]}  # fmt: skip
    hf = write_llama(tmp_path / "hf", tied=True, rope_scaling=scaling, rope_theta=r["theta"],
                     max_position_embeddings=512, num_attention_heads=r["heads"],
                     num_key_value_heads=1)  # fmt: skip
    write_tokenizer(tmp_path / "hf")
    (tmp_path / "gguf").mkdir()
    path = write_gguf(tmp_path / "hf", tmp_path / "gguf" / "model.gguf")
    assert "rope_freqs.weight" in open_gguf(path).tensors
    ours = load_model(path)
    assert ours.cfg.rope_scaling is not None and ours.cfg.rope_scaling.factor == r["factor"]
    as_the_file_holds(hf, path)
    tokens = torch.randint(3, hf.config.vocab_size, (200,))
    assert (hf(tokens[None]).logits[0] - ours(tokens)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@torch.no_grad()
def test_transformers_own_gguf_reader_gives_the_same_logits(family: str, tmp_path: Path) -> None:
    """An independent reader of the same file (transformers' GGUF loader, which undoes
    the Llama permutation its own way) gives our logits."""
    import transformers as tf

    _, path = checkpoint(family, tmp_path)
    ours = load_model(path)
    theirs = tf.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    tokens = torch.randint(3, ours.cfg.vocab_size, (40,))
    assert (theirs(tokens[None]).logits[0] - ours(tokens)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("name", BACKENDS)
def test_greedy_tokens_are_the_same_on_every_backend(name: str, tmp_path: Path) -> None:
    from model.generate import generate

    hf, path = checkpoint("qwen3_moe", tmp_path)
    ours = load_model(path)
    as_the_file_holds(hf, path)
    prompt = torch.randint(3, hf.config.vocab_size, (12,))
    hf.generation_config.eos_token_id = None
    want = hf.generate(prompt[None], max_new_tokens=16, do_sample=False,
                       attention_mask=torch.ones(1, 12, dtype=torch.long), pad_token_id=0)  # fmt: skip
    backend = make_backend(name, ours.cfg)
    got = list(generate(ours, prompt.tolist(), 16, backend=backend))
    assert got == want[0, 12:].tolist()


@torch.no_grad()
def test_auto_keeps_each_tensor_in_the_kind_that_holds_it(tmp_path: Path) -> None:
    """--quantization auto (the server's default) on a GGUF in bf16 on the cpu backend:
    Q4_0 and Q4_1 tensors packed int4 (their groups of 32 are int4's), Q5_0 int5 (its
    blocks of 32 are int5's groups), the tied head as its Q8_0 embedding table, int8g
    (tests/model/test_stack.py runs such mixed layers as the one decoder call); its
    logits nearer the file's values in bf16 (none) than int4 gives, which rounds the
    Q5_0 down projections of layers 0 and 1 to 4 bits (the model 256 wide: rows of
    whole K-quant blocks, which int4 holds in 4 bits)."""
    hf = tmp_path / "hf"
    write_qwen3_moe(hf, mlp_only_layers=[], hidden_size=256, head_dim=64, moe_intermediate_size=256)
    write_tokenizer(hf)
    (tmp_path / "gguf").mkdir()
    path = write_gguf(hf, tmp_path / "gguf" / "model.gguf", default_types)
    models = {}
    for quantization in ("none", "auto", "int4"):
        models[quantization] = model = load_model(path, torch.bfloat16)
        prepare_model(model, quantization)
    auto = models["auto"]
    for block in auto.layers:
        assert (block.attn.wqkv.quant, block.attn.wo.quant) == ("int4", "int4")  # Q4_0
        assert block.ffn.router.quant == "int4"  # Q4_1
        experts = {(f.w_in.quant, f.w_out.quant) for f in block.ffn.experts.ffns}
        assert experts == {("int4", "int5")}  # Q4_1 (gate | up), Q5_0 down
    assert auto.cfg.tie_embeddings and auto.lm_head.quant == "int8g"  # a copy of Q8_0's table
    int4 = models["int4"]  # layer 2 of 3 takes more bits (model/int4_mix.py)
    downs = [{f.w_out.quant for f in b.ffn.experts.ffns} for b in int4.layers]
    assert downs == [{"int4"}, {"int4"}, {"int8g"}]
    assert int4.lm_head.quant == "int8g"
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, auto.cfg.vocab_size, (48,), generator=g)
    logits = {q: m(tokens).float() for q, m in models.items()}
    error = {q: (logits[q] - logits["none"]).abs().mean().item() for q in ("auto", "int4")}
    assert 0 < error["auto"] < error["int4"], error


@torch.no_grad()
def test_mxfp4_experts_are_held_exactly_in_int8g(tmp_path: Path) -> None:
    """gpt-oss's MXFP4 experts under --quantization auto on the cpu backend: int8g, whose
    float16 step a group and int8 codes hold each block's power-of-two scale and 4-bit
    float values exactly (every expert's gate, up and down, every layer)."""
    from model.backends.cpu.kernels.linear import int8g_quantize
    from model.grouped import int8g_dequantize

    _, path = checkpoint("gpt_oss", tmp_path)
    assert {k for _, k in stored_kinds(path).values()} >= {"int8"}
    model = load_model(path, torch.bfloat16)
    stacks = [(b.ffn.experts.w_in, b.ffn.experts.w_out) for b in model.layers]
    prepare_model(model, "auto")
    for block in model.layers:
        assert {(f.w_in.quant, f.w_out.quant) for f in block.ffn.experts.ffns} == {
            ("int8g", "int8g")
        }
    for stack in (w for pair in stacks for w in pair):
        assert stack.shape[0] == 8 and stack[0].abs().sum() > 0
        for expert in stack.float():
            assert torch.equal(int8g_dequantize(*int8g_quantize(expert)), expert)


@torch.no_grad()
def test_mxfp4_experts_are_held_exactly_in_int5_under_int4(tmp_path: Path) -> None:
    """gpt-oss's MXFP4 experts under --quantization int4 on the cpu backend, rows not
    whole K-quant blocks: int5 (the down projections of the layers Q4_K_M gives more
    bits int8g), whose float16 step and minimum a group and 5-bit codes hold each block's
    4-bit float values (-6..6 in halves, times its power-of-two scale) exactly."""
    from model.grouped import int4_dequantize, int5_quantize_reference
    from model.int4_mix import more_bits

    _, path = checkpoint("gpt_oss", tmp_path)
    model = load_model(path, torch.bfloat16)
    assert model.cfg.d_model % 256 and model.cfg.experts.d_ff % 256  # not whole K-blocks
    stacks = [(b.ffn.experts.w_in, b.ffn.experts.w_out) for b in model.layers]
    prepare_model(model, "int4")
    n = model.cfg.n_layers
    for i, block in enumerate(model.layers):
        down = "int8g" if more_bits(i, n) else "int5"
        assert {(f.w_in.quant, f.w_out.quant) for f in block.ffn.experts.ffns} == {("int5", down)}
    for stack in (w for pair in stacks for w in pair):
        assert stack.shape[0] == 8 and stack[0].abs().sum() > 0
        for expert in stack.float():
            assert torch.equal(int4_dequantize(*int5_quantize_reference(expert)), expert)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_the_plan_counts_what_auto_holds(
    family: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvserve plan` on a GGUF (--quantization auto, from the file's headers: no tensor
    read), and `kvserve audit`, name the parameters auto packs as integers and count
    their bytes within 4% of what the loaded, packed model holds (the plan leaves out
    the packed layouts' padding to whole 64-row blocks: a few percent of this tiny
    shape, noise on a real one; bf16 in place of a 4-bit kind would be 2x)."""
    from service.cli import main

    _, path = checkpoint(family, tmp_path)
    model = load_model(path, torch.bfloat16)
    prepare_model(model, "auto")
    held = held_bytes(model)
    stored = stored_kinds(path)
    assert stored and {kind for _, kind in stored.values()} == {"int4", "int5", "int8"}
    args = ["plan", "--model", str(path), "--no-measure", "--device", "cpu", "--json"]
    assert main([*args, "--dtype", "bfloat16", "--memory-gib", "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["quantization"] == "auto"
    assert abs(report["weight_bytes"] - held) <= 0.04 * held, (report["weight_bytes"], held)
    assert report["weight_bytes"] < audit(model.cfg, "bfloat16").weight_bytes
    if family == "llama":  # a step reads the head, and of the lookup table a row
        cfg = model.cfg
        own_head = not cfg.tie_embeddings or "embed.weight" in stored
        table = cfg.vocab_size * cfg.d_model * 2 if own_head else 0
        assert report["decode_read_bytes_per_device"] == report["weight_bytes"] - table > 0
    assert main([*args, "--dtype", "float32", "--memory-gib", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["quantization"] == "none"
    # `kvserve audit` loads the file and counts the same bytes
    assert main(["audit", "--model", str(path), "--device", "cpu", "--dtype", "bfloat16"]) == 0
    audited = json.loads(capsys.readouterr().out)
    assert (audited["quantization"], audited["weight_bytes"]) == ("auto", report["weight_bytes"])


def test_the_tokenizer_is_the_checkpoints(tmp_path: Path) -> None:
    _, path = checkpoint("llama", tmp_path)
    ours, ref = Tokenizer.from_dir(path), Tokenizer.from_dir(tmp_path / "hf")
    for text in ("the quick brown fox", "  jumps\nover 12345 lazy dogs!", "<|bos|>the<|eos|>"):
        assert ours.encode(text) == ref.encode(text)
    assert ours.decode(ours.encode("the lazy dog")) == "the lazy dog"
    assert ours.special_ids == {"<|bos|>": 0, "<|eos|>": 1}
    assert (ours.bos_id, ours.eos_ids) == (0, (1,))
    assert load_config(path).eos_token_ids == (1,)
    assert load_config(path).name == "model"


def test_gpt_4o_pre_tokenizer_is_o200ks_split(tmp_path: Path) -> None:
    """A byte-level BPE behind o200k's split (gpt-oss's tokenizer.json), written with the
    pre-tokenizer name llama.cpp's converter gives it ("gpt-4o"), encodes as the
    `tokenizers` library runs the tokenizer.json, on text where o200k's split is not
    GPT-2's (capitals inside words, contractions, digits in threes, slashes)."""
    from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HFTokenizer

    from model.tokenizer import O200K_PATTERN

    write_gpt_oss(tmp_path / "hf", vocab_size=400)
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(O200K_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|bos|>", "<|eos|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    corpus = "HelloWorld it's JSONParser don't 1234567 and/or\n\n  CamelCase I'LL"
    hf.train_from_iterator([corpus] * 50, trainer)
    hf.save(str(tmp_path / "hf" / "tokenizer.json"))
    (tmp_path / "gguf").mkdir()
    path = write_gguf(tmp_path / "hf", tmp_path / "gguf" / "model.gguf", pre="gpt-4o")
    ours = Tokenizer.from_dir(path)
    for text in (corpus, "XMLHttpRequest's 98765 a/b/c\r\n\tWe'RE", " ünïcödé ÀB"):
        assert ours.encode(text) == hf.encode(text).ids, text


def test_each_tensor_is_read_in_the_type_it_is_stored(tmp_path: Path) -> None:
    """Every type the writer used is in the file, and a loaded weight is the gguf
    package's dequantization of its tensor, exactly (float32 holds every block's
    values)."""
    import gguf

    _, path = checkpoint("qwen2", tmp_path)
    f = open_gguf(path)
    assert {t.tensor_type.name for t in f.tensors.values()} == {
        "F32",
        "Q8_0",
        "Q4_0",
        "Q4_1",
        "Q5_0",
    }
    ours = load_model(path)
    embed = f.tensors["token_embd.weight"]
    want = gguf.quants.dequantize(embed.data, embed.tensor_type)
    assert torch.equal(ours.embed.weight, torch.from_numpy(np.asarray(want, dtype=np.float32)))
    assert default_types("blk.0.ffn_down.weight") == "Q5_0"


@torch.no_grad()
def test_a_split_file_is_read_from_its_first_shard(tmp_path: Path) -> None:
    """A GGUF file split into shards (NAME-00001-of-0000N.gguf, as the gguf package's
    writer and llama.cpp's gguf-split write them) loads from its first shard: the
    metadata there, the tensors from every shard, served under NAME; the same logits as
    the file whole. A later shard, or a missing one, is refused naming the file to use
    or the one missing."""
    import shutil

    import gguf

    from model.hub import resolve

    hf, whole = checkpoint("qwen3_moe", tmp_path)
    split = tmp_path / "split"
    split.mkdir()
    first = write_gguf(tmp_path / "hf", split / "qwen.gguf", split_max_tensors=10)
    files = sorted(split.iterdir())
    assert first.name == f"qwen-00001-of-{len(files):05d}.gguf" and len(files) >= 3
    assert len(gguf.GGUFReader(str(first)).tensors) < len(open_gguf(first).tensors)
    tokens = torch.randint(3, hf.config.vocab_size, (24,))
    assert torch.equal(load_model(first)(tokens), load_model(whole)(tokens))
    assert load_config(first).name == "qwen" and resolve(str(first)).model_id == "qwen"
    assert Tokenizer.from_dir(first).encode("the quick fox") == Tokenizer.from_dir(whole).encode(
        "the quick fox"
    )
    with pytest.raises(CheckpointError, match=f"shard 2 of {len(files)}.*{first.name}"):
        load_config(files[1])
    short = tmp_path / "short"  # a copy lacking the last shard
    short.mkdir()
    for f in files[:-1]:
        shutil.copy(f, short / f.name)
    with pytest.raises(CheckpointError, match=f"missing {files[-1].name}"):
        load_model(short / first.name)


def test_a_file_kvserve_cannot_serve_is_refused_naming_it(tmp_path: Path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(CheckpointError, match="junk.gguf"):
        load_config(junk)
    _, path = checkpoint("llama", tmp_path)
    data = path.read_bytes()
    other = tmp_path / "other.gguf"
    other.write_bytes(data.replace(b"llama", b"xllam", 1))
    with pytest.raises(CheckpointError, match="architecture 'xllam' is not served"):
        load_model(other)
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    hf["intermediate_size"] *= 2  # metadata that disagrees with the tensors' shapes
    (tmp_path / "hf" / "config.json").write_text(json.dumps(hf))
    wrong = write_gguf(tmp_path / "hf", tmp_path / "wrong.gguf")
    with pytest.raises(
        CheckpointError, match=r"wrong.gguf: tensor .*gate_proj.* has shape .* expected"
    ):
        load_model(wrong)
    bad_pre = tmp_path / "pre.gguf"
    bad_pre.write_bytes(data.replace(b"gpt-2", b"gpt-9", 1))
    with pytest.raises(TokenizerError, match="pre-tokenizer 'gpt-9'"):
        Tokenizer.from_dir(bad_pre)
