"""Serving benchmark over HTTP; the same as `kvserve bench` (see service/bench_cli.py).

    python benchmarks/serve_bench.py --spawn "--model benchmarks/out/smollm2-135m-random --dtype bfloat16" \
        --concurrency 1 4 16 64 --plot benchmarks/serve_sweep.png
"""

import sys

from service.bench_cli import main

if __name__ == "__main__":
    sys.exit(main())
