"""What the serving benchmark's requests come to: each request's measurements (Result),
a run's summary (throughput; TTFT, inter-token latency, time per output token and
end-to-end latency as mean, p50, p90, p99; errors), its table and plot (matplotlib,
optional), the JSON report and the CPU it ran on."""

from __future__ import annotations

import json
import platform
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Result:
    ok: bool
    prompt_tokens: int
    output_tokens: int = 0
    ttft: float | None = None
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def _stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    ordered = sorted(values)

    def pct(p: float) -> float:
        return 1000 * ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]

    return {
        "mean": 1000 * statistics.fmean(ordered),
        "p50": pct(50),
        "p90": pct(90),
        "p99": pct(99),
        "max": 1000 * ordered[-1],
    }


def summarize(results: list[Result], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "requests": len(results),
        "completed": len(ok),
        "errors": len(results) - len(ok),
        "error_examples": [r.error for r in results if not r.ok][:3],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_tok_s": out_tokens / duration,
        "total_tok_s": (out_tokens + sum(r.prompt_tokens for r in ok)) / duration,
        "ttft_ms": _stats([r.ttft for r in ok if r.ttft is not None]),
        "itl_ms": _stats([x for r in ok for x in r.itl]),
        "tpot_ms": _stats([r.tpot for r in ok if r.tpot is not None]),
        "e2e_ms": _stats([r.e2e for r in ok]),
    }


def print_table(runs: list[dict[str, Any]]) -> None:
    head = (
        f"{'conc':>5} {'rate':>6} {'ok/err':>8} {'req/s':>7} {'out tok/s':>10} {'tot tok/s':>10} "
        f"{'TTFT p50':>9} {'p99':>8} {'ITL p50':>8} {'p99':>7} {'TPOT p50':>9} {'e2e p50':>9} {'p99':>9}"
    )
    print(head)
    print("-" * len(head))

    def f(v: float | None, w: int) -> str:
        return f"{v:{w}.1f}" if v is not None else " " * (w - 1) + "-"

    for r in runs:
        print(
            f"{r['concurrency'] or '-':>5} {r['request_rate'] or '-':>6} {r['completed']:>4}/{r['errors']:<3} "
            f"{r['request_throughput']:7.2f} {r['output_tok_s']:10.1f} {r['total_tok_s']:10.1f} "
            f"{f(r['ttft_ms']['p50'], 9)} {f(r['ttft_ms']['p99'], 8)} {f(r['itl_ms']['p50'], 8)} {f(r['itl_ms']['p99'], 7)} "
            f"{f(r['tpot_ms']['p50'], 9)} {f(r['e2e_ms']['p50'], 9)} {f(r['e2e_ms']['p99'], 9)}"
        )
    if runs:
        cpu = ", ".join(f"{r['client_cpu_s']:.2f}" for r in runs)
        print(f"client: {runs[0]['client_transport']} transport, CPU seconds per run: {cpu}")


def plot(runs: list[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "matplotlib is not installed (pip install 'kvserve[bench]'): no plot", file=sys.stderr
        )
        return False
    conc = [r["concurrency"] for r in runs]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(conc, [r["output_tok_s"] for r in runs], "o-", label="output tokens/s")
    a.set_xscale("log", base=2)
    a.set_xlabel("concurrency")
    a.set_ylabel("tokens/s")
    a.set_title("throughput")
    a.grid(alpha=0.3)
    for key, label in (("ttft_ms", "TTFT"), ("itl_ms", "inter-token"), ("e2e_ms", "end-to-end")):
        b.plot(conc, [r[key]["p50"] for r in runs], "o-", label=f"{label} p50")
        b.plot(conc, [r[key]["p99"] for r in runs], "x--", label=f"{label} p99")
    b.set_xscale("log", base=2)
    b.set_yscale("log")
    b.set_xlabel("concurrency")
    b.set_ylabel("ms")
    b.set_title("latency")
    b.grid(alpha=0.3)
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def write_report(path: str | Path, report: dict[str, Any]) -> None:
    """A benchmark's JSON report (its folder made), and say where it went."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


def cpu_model() -> str:
    """The CPU's model name, as /proc/cpuinfo gives it (what the results name), with its
    family and model numbers: a virtual machine's CPU is often only "Intel(R) Xeon(R)
    Processor", which Sapphire and Emerald Rapids both are."""
    info: dict[str, str] = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if not line.strip():
            break  # the first CPU's block
        key, _, value = line.partition(":")
        info.setdefault(key.strip(), value.strip())
    name = info.get("model name") or platform.processor() or "unknown"
    if "cpu family" in info and "model" in info:
        name += f" (family {info['cpu family']}, model {info['model']})"
    return name
