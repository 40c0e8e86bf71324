"""A Gemma-3-shaped server at a 32k context: with the windowed layers' KV in a pool of
their own, the same KV budget holds at least 3x the sequences of max_model_len that
global KV in every layer would, and `kvserve plan` says the same; a prompt well past
the window is served."""

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from model.audit import kv_bytes_per_token
from model.config import ModelConfig
from tests.factories import start_server, write_gemma3, write_tokenizer

pytestmark = pytest.mark.slow

CONTEXT, WINDOW, GIB = 32768, 512, 0.25


def test_a_32k_context_holds_3x_the_sequences(tmp_path: Path) -> None:
    hf = write_gemma3(tmp_path, sliding_window=WINDOW, max_position_embeddings=CONTEXT)
    write_tokenizer(tmp_path)
    cfg = ModelConfig.from_hf_config(hf.config.to_dict())
    assert len(cfg.windowed_layers) == 5 and cfg.mixed_windows
    global_kv = int(GIB * (1 << 30)) // (CONTEXT * kv_bytes_per_token(cfg, "float32"))
    server = start_server(str(tmp_path), "--model", str(tmp_path), "--dtype", "float32")
    try:
        card = httpx.get(f"{server.url}/v1/models/{tmp_path.name}", timeout=30).json()["memory"]
        assert card["kv_window_blocks"] > 0
        held = card["kv_pool_sequences_of_max_len"]
        assert held >= 3 * global_kv > 0, (held, global_kv)
        prompt = [(7 * i + 3) % 290 for i in range(3 * WINDOW)]
        body = {"model": tmp_path.name, "prompt": prompt, "max_tokens": 8, "temperature": 0}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
    finally:
        server.stop()
    plan = subprocess.run(
        [sys.executable, "-m", "service.cli", "plan", "--model", str(tmp_path), "--dtype",
         "float32", "--memory-gib", "1", "--seq-len", str(CONTEXT), "--no-measure", "--json"],
        capture_output=True, text=True, check=True, timeout=300,
    )  # fmt: skip
    report = json.loads(plan.stdout)
    assert report["sequences_of_seq_len"] >= 3 * report["sequences_of_seq_len_global_kv"] > 0
