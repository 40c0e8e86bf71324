"""The prefix cache between users, end to end: with every prefix-cache key forced equal
(the worst forgery), a request still reuses only its own verified prefix; cache_salt
keeps tenants apart."""

from __future__ import annotations

import httpx
import pytest

from tests.reliability.conftest import Row, harness

pytestmark = pytest.mark.reliability  # make test-fast leaves these out

VICTIM = list(range(1000, 1040))  # 40 tokens: two full 16-token blocks
ATTACKER = list(range(2000, 2040))


def complete(client: httpx.Client, prompt: list[int], salt: str | None = None) -> tuple[str, int]:
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    if salt is not None:
        body["cache_salt"] = salt
    resp = client.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    return out["choices"][0]["text"], out["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_forged_collisions_and_salts(tmp_path, row: Row) -> None:
    """Forged prefix-cache collisions and cache_salt"""
    # the prefix cache is the engine's bookkeeping, the same in either transport
    server = harness(tmp_path, fault="collide-prefix:0")
    try:  # every key is the same: the cache holds one block, the victim's first
        with httpx.Client(base_url=server.url, timeout=60) as c:
            victim, _ = complete(c, VICTIM)
            attacker_alone, _ = complete(c, ATTACKER, salt="nobody-else")
            attacker, attacker_hit = complete(c, ATTACKER)  # lands on the victim's key
            again, victim_hit = complete(c, VICTIM)
    finally:
        server.stop()
    plain = harness(tmp_path)
    try:
        with httpx.Client(base_url=plain.url, timeout=60) as c:
            complete(c, VICTIM, salt="tenant-1")
            _, other_tenant = complete(c, VICTIM, salt="tenant-2")
            _, same_tenant = complete(c, VICTIM, salt="tenant-1")
            _, unsalted = complete(c, VICTIM)
    finally:
        plain.stop()
    row.load = (
        "every prefix-cache key forced equal, a victim's 40-token prompt cached first, then "
        "another prompt on the same key; then, with real keys, one prompt under three salts"
    )
    row.add(
        f"the other prompt: {attacker_hit} cached tokens, output "
        f"{'equal to' if attacker == attacker_alone else 'DIFFERENT from'} its own run; the "
        f"victim again: {victim_hit} cached (its own first block, verified)"
    )
    row.add(
        f"same prompt under another salt: {other_tenant} cached; the same salt: "
        f"{same_tenant}; no salt: {unsalted}"
    )
    assert attacker_hit == 0 and attacker == attacker_alone
    assert victim_hit == 16 and again == victim
    assert other_tenant == 0 and same_tenant == 32 and unsalted == 0
