"""The deployment files, checked by the real tools."""

import re
import subprocess
from pathlib import Path

from tests.deploy.tools import compose, hadolint, promtool

ROOT = Path(__file__).resolve().parents[2]


def run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)


def test_compose_config_gpu_and_cpu() -> None:
    binary = compose()
    gpu = run(binary, "-f", "docker-compose.yml", "config", "-q")
    assert gpu.returncode == 0, gpu.stderr
    cpu = run(binary, "-f", "docker-compose.yml", "-f", "docker-compose.cpu.yml", "config", "-q")
    assert cpu.returncode == 0, cpu.stderr
    gpu_full = run(binary, "-f", "docker-compose.yml", "config").stdout
    cpu_full = run(
        binary, "-f", "docker-compose.yml", "-f", "docker-compose.cpu.yml", "config"
    ).stdout
    assert "driver: nvidia" in gpu_full and "driver: nvidia" not in cpu_full
    assert "VARIANT: cpu" in cpu_full and "/models" in cpu_full and "read_only: true" in cpu_full


def test_hadolint_dockerfile() -> None:
    result = run(hadolint(), "Dockerfile")
    assert result.returncode == 0, result.stdout + result.stderr


def test_both_variants_install_the_pinned_torch_and_check_its_build() -> None:
    """One runtime stage installs either variant's torch at constraints.txt's pin (the
    CPU one by its +cpu local version, from TORCH_INDEX_URL or the variant's own index)
    and fails the build unless torch's CUDA matches the variant; kvserve goes in as its
    built wheel under the same constraints; every path the Dockerfile copies exists."""
    text = (ROOT / "Dockerfile").read_text()
    assert "torch==2.13.0" in (ROOT / "constraints.txt").read_text()
    runtime = text.split("\nFROM base AS runtime\n")[1]
    assert "gpu) spec=torch==2.13.0;" in runtime and "cpu) spec=torch==2.13.0+cpu;" in runtime
    assert "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}" in runtime
    assert "${TORCH_INDEX_URL:-https://pypi.org/simple}" in runtime
    assert 'pip install --no-cache-dir -c constraints.txt "$spec" --index-url "$index"' in runtime
    assert "torch.version.cuda" in runtime and "bool(cuda) == want" in runtime
    assert "pytorch/pytorch" not in text  # no base image with a torch of its own
    # the runtime installs the built wheel (what users install), not the source tree
    assert "pip wheel --no-cache-dir --no-deps -w /wheels ." in text
    assert "pip install --no-cache-dir -c constraints.txt /wheels/kvserve-*.whl" in text
    assert "gcc" in text  # the C kernels and Triton's launcher compile at run time
    for line in text.splitlines():
        if line.startswith("COPY ") and "--from=" not in line:
            for src in line.split()[1:-1]:
                assert (ROOT / src).exists(), f"Dockerfile copies {src}, which is missing"


def test_every_stage_is_one_the_image_needs() -> None:
    """The legacy builder builds every stage before the target, BuildKit only those the
    target uses: with no stage the image does not use, both build the same."""
    text = (ROOT / "Dockerfile").read_text()
    stages = re.findall(r"^FROM \S+ AS (\S+)$", text, flags=re.M)
    assert stages[-1] == "runtime"
    for name in stages[:-1]:
        after = text.split(f" AS {name}\n", 1)[1]
        assert re.search(rf"^(FROM {name} |COPY --from={name} )", after, flags=re.M), (
            f"stage {name} is not used by a later one"
        )
    assert "${VARIANT}" not in text  # no stage picked by a build argument


def test_promtool_check_config() -> None:
    result = run(promtool(), "check", "config", "deploy/prometheus/prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr
