"""A mixture of experts served: a Qwen3-MoE checkpoint written by transformers, served in
bf16 on the CPU backend (routed and run by kernels/experts.c inside the one-call decoder
stack), answers the official client with the same greedy tokens whether its requests run
alone or together (each row of a mixed batch routed to its own experts), its model
card counts the experts and the parameters a token runs, and with --expert-metrics
/metrics has the tokens each layer routed to each expert."""

import re
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.factories import start_server, write_qwen3_moe, write_tokenizer

pytestmark = pytest.mark.slow

PROMPTS = [[(5 * i + 3 * j) % 290 + 3 for i in range(n)] for j, n in enumerate((9, 40, 23))]


def test_a_mixture_of_experts_serves_the_same_tokens_alone_and_together(tmp_path: Path) -> None:
    root = tmp_path / "qwen3-moe"
    # shapes the C kernels take whole: 32-wide heads, experts of 64 features (gate | up
    # in 128-row blocks), the dense layer's 128
    write_qwen3_moe(
        root,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        moe_intermediate_size=64,
        intermediate_size=128,
    )
    write_tokenizer(root)
    server = start_server(
        str(tmp_path), "--model", str(root), "--dtype", "bfloat16", "--expert-metrics"
    )
    try:
        card = httpx.get(f"{server.url}/v1/models/qwen3-moe", timeout=30).json()
        assert "experts=2/8x64" in card["features"]
        params = card["memory"]["parameters"]
        assert params["active"] < params["total"]
        assert card["memory"]["attention_backend"]["name"] == "cpu"
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)

        def complete(prompt: list[int]) -> tuple[str, list[float]]:
            r = client.completions.create(
                model="qwen3-moe",
                prompt=prompt,
                max_tokens=12,
                temperature=0,
                logprobs=0,
                extra_body={"ignore_eos": True},
            )
            choice = r.choices[0]
            return choice.text, choice.logprobs.token_logprobs

        alone = [complete(p) for p in PROMPTS]
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            together = list(pool.map(complete, PROMPTS))
        assert together == alone  # the same tokens, and their logprobs to the bit
        assert all(len(lps) == 12 for _, lps in alone) and len({t for t, _ in alone}) > 1
        assert_experts_counted(server.url)
    finally:
        server.stop()


def assert_experts_counted(url: str) -> None:
    """Each sparse layer (0 and 2; layer 1 is dense) routed every token computed to 2 of
    its 8 experts: the same total in both, read once a second by the engine."""
    line = re.compile(r"kvserve_moe_expert_tokens_total\{(.*)\} (\S+)")
    deadline = time.monotonic() + 10
    while True:
        sums: dict[int, float] = defaultdict(float)
        experts: dict[int, set[int]] = defaultdict(set)
        for m in line.finditer(httpx.get(f"{url}/metrics", timeout=30).text):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m[1]))
            sums[int(labels["layer"])] += float(m[2])
            experts[int(labels["layer"])].add(int(labels["expert"]))
        settled = sums and sums[0] == sums[2] and sums[0] > 0
        if settled or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert set(sums) == {0, 2} and experts[0] == experts[2] == set(range(8))
    assert sums[0] == sums[2] > 0 and sums[0] % 2 == 0
