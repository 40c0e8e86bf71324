"""The C paged-decode kernel against torch's attention on gathered K/V."""

import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from model.kernels import paged_decode, paged_decode_supported
from model.layers import alibi_slopes

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None or bool(os.environ.get("KVSERVE_DISABLE_KERNELS")),
    reason="no C compiler, or kernels disabled",
)


def reference(q, k_cache, v_cache, tables, lens, scale, slopes):
    b, h, d = q.shape
    kv = k_cache.shape[1]
    outs = []
    for i in range(b):
        n = int(lens[i])
        blocks = tables[i, : -(-n // k_cache.shape[-1])]
        keys = k_cache[blocks].permute(1, 0, 3, 2).reshape(kv, -1, d)[:, :n].float()
        values = v_cache[blocks].transpose(0, 1).reshape(kv, -1, d)[:, :n].float()
        keys = keys.repeat_interleave(h // kv, 0)
        values = values.repeat_interleave(h // kv, 0)
        mask = None
        if slopes is not None:
            dist = (n - 1 - torch.arange(n)).float()
            mask = (-slopes[:, None] * dist[None, :])[:, None, :]  # (H, 1, n)
        out = F.scaled_dot_product_attention(
            q[i][:, None], keys, values, attn_mask=mask, scale=scale
        )
        outs.append(out[:, 0])
    return torch.stack(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "d", "bs"), [(9, 3, 64, 16), (4, 4, 16, 8), (8, 1, 32, 16)]
)
@pytest.mark.parametrize("alibi", [False, True])
def test_kernel_matches_torch(dtype, heads, kv_heads, d, bs, alibi) -> None:
    nb = 64
    k_cache = torch.randn(nb, kv_heads, d, bs).to(dtype)
    v_cache = torch.randn(nb, kv_heads, bs, d).to(dtype)
    assert paged_decode_supported(k_cache, heads, kv_heads, d)
    lens = torch.tensor([1, bs, bs + 1, 5 * bs - 3, 7 * bs])
    tables = torch.randperm(nb)[: 5 * 7].view(5, 7)
    q = torch.randn(5, heads, d)
    slopes = alibi_slopes(heads) if alibi else None
    got = paged_decode(q, k_cache, v_cache, tables, lens, d**-0.5, slopes)
    want = reference(q, k_cache, v_cache, tables, lens, d**-0.5, slopes)
    assert (got - want).abs().max().item() < 1e-5


def test_loading_the_kernels_keeps_subnormal_floats() -> None:
    """A library linked with -ffast-math would set flush-to-zero for the whole process
    (crtfastmath.o); our kernels must not change how the rest of kvserve computes."""
    code = (
        "import torch\n"
        "from model.kernels import _fused, _library\n"
        "assert _library(64, 16, 3) is not None and _fused() is not None\n"
        "tiny = torch.tensor([1e-40], dtype=torch.float32)\n"
        "print(5e-324 * 1.0 > 0, bool((tiny * 1.0 > 0).all()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True"]
