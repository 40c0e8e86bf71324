"""Admission sees KV pressure: a request whose prompt + max_tokens would oversubscribe the
KV pool (and a waiting queue of the same proportion) is answered 429 with Retry-After,
even while the count of sequences in flight is below every cap."""

import asyncio

import httpx

from model.audit import kv_bytes_per_token
from model.demo import demo_config
from tests.factories import start_server


def test_kv_oversubscription_is_429_with_retry_after(tmp_path) -> None:
    per_token = kv_bytes_per_token(demo_config(), "float32")
    gib = 1024 * per_token / (1 << 30)  # a pool of about 1,024 tokens
    srv = start_server(
        str(tmp_path), "--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "8",
        "--max-queue", "0", "--kv-cache-gib", f"{gib:.9f}",
    )  # fmt: skip
    try:
        pool = httpx.get(srv.url + "/v1/models/kvserve-demo-random").json()["memory"]
        assert 900 <= pool["kv_pool_tokens"] <= 1100
        body = {"prompt": "Keep going", "max_tokens": 480, "temperature": 0, "ignore_eos": True}

        async def main() -> tuple[list[int], httpx.Response]:
            async with httpx.AsyncClient(base_url=srv.url, timeout=120) as client:
                first_tokens = []
                streams = []
                for _ in range(2):  # ~2 x 483 tokens of demand: fits the pool
                    ctx = client.stream("POST", "/v1/completions", json=body | {"stream": True})
                    resp = await ctx.__aenter__()
                    streams.append(ctx)
                    first_tokens.append(resp.status_code)
                third = await client.post("/v1/completions", json=body)
                for ctx in streams:
                    await ctx.__aexit__(None, None, None)
                return first_tokens, third

        statuses, third = asyncio.run(main())
        assert statuses == [200, 200]
        assert third.status_code == 429, third.text
        error = third.json()["error"]
        assert error["code"] == "kv_cache_full" and error["type"] == "rate_limit_error"
        assert int(third.headers["Retry-After"]) >= 1
        assert "KV cache" in error["message"]
        after = srv.wait_idle()  # the dropped streams were aborted
        assert after["kv_cache"]["blocks_used"] == 0
        small = {"prompt": "x", "max_tokens": 4}
        assert httpx.post(srv.url + "/v1/completions", json=small, timeout=60).status_code == 200
    finally:
        srv.stop()
