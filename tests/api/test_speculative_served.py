"""`kvserve serve` with speculative decoding: n-gram lookup and a draft model checkpoint
give the plain server's greedy text (whole and streamed, through the official openai
client), count drafts in /metrics, and a draft of another tokenizer stops start-up."""

import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from tests.factories import Server, free_port, start_server, write_llama, write_tokenizer

pytestmark = pytest.mark.slow
SPAN = [(37 * i + 11) % 290 for i in range(16)]
PROMPT = [5, 9, 14] + SPAN * 3 + SPAN[:5]  # a repeated span: what n-grams find


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    roots = {}
    for name, seed, tokens in (("target", 0, 300), ("other", 1, 300), ("foreign", 0, 280)):
        root = roots[name] = tmp_path_factory.mktemp(name)
        write_llama(root, tied=True, seed=seed, initializer_range=0.1)  # varied text that repeats
        write_tokenizer(root, tokens)
    return roots


def complete(server: Server) -> tuple[str, str]:
    """The greedy text of PROMPT, whole and as the concatenated stream."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    body = dict(
        model="target", prompt=PROMPT, max_tokens=48, temperature=0, extra_body={"ignore_eos": True}
    )
    whole = client.completions.create(**body).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **body))
    return whole, streamed


def counters(server: Server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("kvserve_spec_decode_")
    }


def test_speculative_servers_give_the_plain_text(ckpts: dict[str, Path], tmp_path: Path) -> None:
    model = ["--model", str(ckpts["target"]), "--served-model-name", "target", "--dtype", "float32"]
    always = ["--speculative-min-speedup", "0"]  # the counts below, whatever the clock
    # accepted / drafted: n-grams of a repeating output, the model itself, another model
    cases = [
        (["--speculative-method", "ngram"], lambda r: r > 0),
        (
            ["--speculative-method", "draft", "--speculative-model", str(ckpts["target"])],
            lambda r: r == 1,
        ),
        (
            ["--speculative-method", "draft", "--speculative-model", str(ckpts["other"])],
            lambda r: r < 1,
        ),
    ]
    # the plain server and the three speculative ones start side by side
    plain = start_server(str(tmp_path), *model, wait=False)
    servers = [start_server(str(tmp_path), *model, *f, *always, wait=False) for f, _ in cases]
    try:
        want, streamed = complete(plain.wait_healthy())
        assert streamed == want and want
        assert counters(plain) == {
            "kvserve_spec_decode_draft_tokens_total": 0.0,
            "kvserve_spec_decode_accepted_tokens_total": 0.0,
        }
        plain.stop()
        for server, (flags, share) in zip(servers, cases, strict=True):
            assert complete(server.wait_healthy()) == (want, want), flags
            seen = counters(server)
            drafted = seen["kvserve_spec_decode_draft_tokens_total"]
            accepted = seen["kvserve_spec_decode_accepted_tokens_total"]
            assert drafted > 0 and share(accepted / drafted), (flags, seen)
            assert server.wait_idle()["kv_cache"]["blocks_used"] == 0
            assert server.stop() == 0
    finally:
        for server in (plain, *servers):
            server.stop()


def test_a_draft_of_another_tokenizer_stops_start_up(ckpts: dict[str, Path]) -> None:
    cmd = [
        sys.executable,
        "-m",
        "service.cli",
        "serve",
        "--port",
        str(free_port()),
        "--model",
        str(ckpts["target"]),
        "--speculative-method",
        "draft",
        "--speculative-model",
        str(ckpts["foreign"]),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode != 0
    assert "speculative_model: its tokenizer" in last and "280 tokens" in last, last
