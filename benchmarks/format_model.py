"""A small checkpoint that follows structured_throughput.py's formats: the demo model's
shape (cl100k, 4 layers, d_model 256), trained for a few minutes on this CPU to write
the benchmark's documents after its prompt. The random demo model breaks the grammar at
almost every token (structured outputs' worst case); this one shows what constraints
cost with a model that writes the format, as a trained model does.

The documents: the prompt, then (tokenized apart, as the server reads a prompt) a
compact JSON array of short strings (3-8 lowercase letters) or of records
(benchmarks/structured_throughput.py's two schemas), each validated against its schema.
The model is trained over the tokens the documents use alone (3,760 of 100,277); in the
checkpoint every other row of the tied embedding is zero, so each of their logits is
exactly 0, and the training loss (the used tokens' logits and one column of log(number
unused)) is the whole vocabulary's: checked on the saved checkpoint. 800 steps: ~15
minutes on 2 cores, to a loss of about the documents' own entropy (~2.3 nats a token).

    PYTHONPATH=. .venv/bin/python benchmarks/format_model.py OUT_DIR
    PYTHONPATH=. .venv/bin/python benchmarks/structured_throughput.py \\
        --server-args "--model OUT_DIR" --schema strings
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path
from typing import Any

import torch
from structured_throughput import PROMPT, schema

from model.demo import CL100K_EOS, demo_config
from model.tokenizer import Tokenizer

SEQ = 160  # tokens a training window (the benchmark generates 128 after a 4-token prompt)


def words(tok: Tokenizer, n: int, rng: random.Random) -> list[str]:
    """n of cl100k's tokens that are 3-8 lowercase letters (one token each)."""
    found = []
    for i in range(tok.vocab_size):
        if tok.valid_id(i) and i not in tok.special_ids.values():
            b = tok.token_bytes(i)
            if 3 <= len(b) <= 8 and b.isalpha() and b.islower() and b.isascii():
                found.append(b.decode())
    return rng.sample(sorted(found), n)


def document(kind: str, vocab: list[str], rng: random.Random) -> str:
    """A compact array long enough to fill a window (after the prompt)."""
    if kind == "strings":
        items: list[Any] = [rng.choice(vocab) for _ in range(120)]
    else:
        letters = "abcdefghijklmnopqrstuvwxyz"
        items = [
            {
                "id": "".join(rng.choices(letters, k=2)) + f"{rng.randrange(1000):03d}",
                "qty": rng.randint(1, 99),
                "size": rng.choice("SML"),
                "ok": rng.random() < 0.5,
            }
            for _ in range(16)
        ]
    return json.dumps(items, separators=(",", ":"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="the checkpoint's directory")
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    import jsonschema
    from transformers import LlamaConfig, LlamaForCausalLM

    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    tok = Tokenizer.default()
    vocab = words(tok, 2000, rng)
    c = demo_config()
    prompt = tok.encode(PROMPT)
    windows = []
    for k in range(4000):
        kind = ("strings", "records")[k % 2]
        text = document(kind, vocab, rng)
        doc = json.loads(text)  # the schema's, with the document's own item count
        jsonschema.validate(doc, schema(len(doc), kind))
        windows.append((prompt + tok.encode(text))[:SEQ])
    if any(len(w) < SEQ for w in windows):
        raise SystemExit("a document is shorter than a window")
    used = sorted({t for w in windows for t in w})
    data = torch.tensor(windows)
    where = torch.full((c.vocab_size,), -1, dtype=torch.long)
    where[used] = torch.arange(len(used))
    small = where[data]  # the windows in the used tokens' own numbering

    def config(vocab_size: int, eos: int | None = None) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=vocab_size, hidden_size=c.d_model, num_hidden_layers=c.n_layers,
            num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads,
            intermediate_size=c.d_ff, max_position_embeddings=c.max_position,
            rope_theta=c.rope_theta, rms_norm_eps=c.norm_eps, tie_word_embeddings=True,
            eos_token_id=eos, bos_token_id=None, torch_dtype="float32",
        )  # fmt: skip

    # trained over the used tokens alone; in the checkpoint every other embedding row is
    # zero, so each of their logits is 0 and their log-sum-exp one constant column
    model = LlamaForCausalLM(config(len(used)))
    rest = math.log(c.vocab_size - len(used))
    ce = torch.nn.functional.cross_entropy

    def loss_of(pick: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=small[pick, :-1]).logits  # (B, T, used)
        logits = torch.cat([logits, logits.new_full((*logits.shape[:2], 1), rest)], -1)
        return ce(logits.flatten(0, 1), small[pick, 1:].flatten())

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, args.lr, total_steps=args.steps)
    t0 = time.perf_counter()
    for step in range(args.steps):
        loss = loss_of(torch.randint(len(data), (args.batch,)))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 100 == 0 or step == args.steps - 1:
            print(f"step {step:5d}  loss {loss.item():.3f}  {time.perf_counter() - t0:.0f} s")

    full = LlamaForCausalLM(config(c.vocab_size, CL100K_EOS))
    state = model.state_dict()
    emb = state.pop("model.embed_tokens.weight")
    state.pop("lm_head.weight", None)
    with torch.no_grad():
        full.load_state_dict(state, strict=False)
        full.model.embed_tokens.weight.zero_()[torch.tensor(used)] = emb
        pick = torch.arange(4)  # the checkpoint's loss over the whole vocabulary is the same
        whole = ce(full(input_ids=data[pick, :-1]).logits.flatten(0, 1), data[pick, 1:].flatten())
        if not torch.allclose(loss_of(pick), whole, atol=1e-4):
            raise SystemExit(f"trained loss {loss_of(pick).item()} != checkpoint's {whole.item()}")
    out = Path(args.out)
    full.save_pretrained(out, safe_serialization=True)
    print(f"wrote {out} ({len(used)} tokens trained, {len(windows)} windows, loss {whole:.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
