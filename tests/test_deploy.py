"""deploy/: the compose file and Dockerfiles are checked, and the hps commands run natively.

These machines have no container engine, so the compose file cannot be brought up here.
Instead:
- the file is checked: services and profiles, healthchecks, every mounted file exists,
  every hps command parses against the real CLI (the typer app), Dockerfile COPY sources
  exist, configs load without unknown keys;
- the commands of its one-shot jobs and hps services run natively, as processes of this
  machine, against what the compose file would start: a local `redis-server`, a 3-master
  Redis Cluster and moto's S3 server. The container's root is a temporary folder holding
  `configs/` (the repository's, copied), `models/`, `state/` and `app/deploy/`; the only
  substitutions are the service hostnames (redis:6379, the cluster's fixed addresses,
  http://minio:9000) by the local servers' addresses, the published port by a free one,
  and --host 0.0.0.0 by 127.0.0.1. Each service must pass its own healthcheck command and
  serve the demo model's vectors exactly.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import typer.main
import yaml

from hps.config import load_config
from hps.tools.cli import app as cli_app
from tests.support.redis_servers import RedisClusterProcs, RedisServer, free_port

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
HPS_SERVICES = ["hps", "hps-redis", "hps-cluster", "hps-s3", "hps-gpu", "hps-replica-1",
                "hps-replica-2"]
#: the images of hps itself (the others stand in for images users pull: compose.check.yml)
HPS_DOCKERFILES = [DEPLOY / "Dockerfile.cpu", DEPLOY / "Dockerfile.gpu"]
CHECK_OVERRIDE = DEPLOY / "compose.check.yml"
#: what runs natively: every hps service but the GPU one (no GPU here)
NATIVE_SERVICES = ["hps", "hps-redis", "hps-cluster", "hps-s3"]
#: container paths → folders of the native root
CONTAINER_DIRS = ("configs", "models", "state", "app")
DEMO_SCALE = "0.01"  # 10,000 keys: the demo model in miniature
_VAR = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's ${VAR:-default} substitution, recursively."""
    if isinstance(value, str):
        return _VAR.sub(lambda m: env.get(m[1]) or (m[2] or ""), value)
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    return value


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict)
    return data


def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return dict(compose["services"])


def image_entrypoint(dockerfile: Path) -> list[str]:
    (line,) = [x for x in dockerfile.read_text().splitlines() if x.startswith("ENTRYPOINT")]
    return list(json.loads(line.removeprefix("ENTRYPOINT")))


def argv_of(service: dict[str, Any]) -> list[str]:
    """entrypoint + command of a service, the image's entrypoint when it names none."""
    entry = service.get("entrypoint")
    if entry is None:
        dockerfile = service.get("build", {}).get("dockerfile")
        entry = image_entrypoint(ROOT / dockerfile) if dockerfile else []
    return [*entry, *service.get("command", [])]


# -- static checks ------------------------------------------------------------------------

def test_services_profiles_and_ports(compose: dict[str, Any]) -> None:
    svc = services(compose)
    expected = {"model-init", *HPS_SERVICES, "redis", "redis-1", "redis-2", "redis-3",
                "redis-cluster-init", "minio", "s3-upload", "lb", "prometheus", "grafana"}
    assert expected <= set(svc)
    assert svc["hps"].get("profiles") is None  # the demo starts with every profile
    profiles = {p for s in svc.values() for p in s.get("profiles", [])}
    assert profiles == {"redis", "redis-cluster", "s3", "gpu", "replicas", "monitoring"}
    for name, s in svc.items():
        for port in s.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
        for dep in s.get("depends_on", {}):
            assert dep in svc, f"{name} depends on unknown service {dep}"
            # whenever the service is up, so is what it depends on
            if svc[dep].get("profiles"):
                assert s.get("profiles") and set(s["profiles"]) <= set(svc[dep]["profiles"]), \
                    f"{name} depends on {dep}, which is not in every profile {name} is in"
    assert svc["hps-gpu"]["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == \
        "nvidia"


def test_gpu_containers_share_one_mps_daemon(compose: dict[str, Any]) -> None:
    svc = services(compose)
    mps, gpu = svc["mps"], svc["hps-gpu"]
    assert mps["profiles"] == ["gpu"] and "nvidia-cuda-mps-control -f" in mps["entrypoint"][-1]
    assert mps["ipc"] == "shareable" and gpu["ipc"] == "service:mps"
    pipes = mps["environment"]["CUDA_MPS_PIPE_DIRECTORY"]
    assert gpu["environment"]["CUDA_MPS_PIPE_DIRECTORY"] == pipes
    assert "HPS_TOKEN" in gpu["environment"]
    shared = {v.split(":")[0] for v in mps["volumes"]} & {v.split(":")[0] for v in gpu["volumes"]}
    assert shared == {"mps"} and pipes.startswith("/mps/")
    assert {"../configs:/configs:ro", "models:/models", "state:/state"} <= set(gpu["volumes"])
    assert gpu["depends_on"]["mps"] == {"condition": "service_healthy"}
    assert mps["healthcheck"]["test"] == ["CMD", "hps", "mps", "status"]
    assert mps["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"
    _parse(["mps", "status"])  # the healthcheck's command is the CLI's


def test_healthchecks(compose: dict[str, Any]) -> None:
    svc = services(compose)
    for name in HPS_SERVICES:
        test = svc[name]["healthcheck"]["test"]
        assert test[0] == "CMD" and test[-1].endswith("/readyz"), name
        assert "/app/deploy/healthcheck.py" in test
        assert svc[name]["command"][svc[name]["command"].index("--port") + 1] == \
            test[-1].rsplit(":", 1)[1].split("/")[0]
    for name in ("redis", "redis-1", "redis-2", "redis-3", "minio"):
        assert svc[name]["healthcheck"]["test"][0] == "CMD", name
    for job in ("model-init", "redis-cluster-init", "s3-upload"):
        assert svc[job]["restart"] == "no"


def test_mounted_files_exist(compose: dict[str, Any]) -> None:
    named = set(compose.get("volumes", {}))
    for name, s in services(compose).items():
        for volume in interpolate(s.get("volumes", []), {}):
            source = volume.split(":", 1)[0]
            if source in named:
                continue
            assert (DEPLOY / source).exists(), f"{name} mounts {source}, which does not exist"
        build = s.get("build")
        if build:
            assert (DEPLOY / build["context"] / build["dockerfile"]).is_file(), name


def test_dockerfiles_copy_what_exists() -> None:
    for dockerfile in DEPLOY.glob("Dockerfile.*"):
        text = dockerfile.read_text()
        for line in text.splitlines():
            if line.startswith("COPY") and "--from" not in line:
                *sources, _ = line.split()[1:]
                for source in sources:
                    assert (ROOT / source).exists(), f"{dockerfile.name}: COPY {source}"
        assert text.startswith("#"), f"{dockerfile.name} starts without saying what it is"
    for dockerfile in HPS_DOCKERFILES:
        text = dockerfile.read_text()
        assert image_entrypoint(dockerfile) == ["hps"]
        assert "/readyz" in text
        # the base image is a build argument (the compose check builds on a local base);
        # the image is its last stage, or a stage on it copied whole into scratch
        assert re.search(r"^ARG BASE_IMAGE=\S+$", text, re.M), dockerfile.name
        stages = re.findall(r"^FROM (\S+)(?: AS (\S+))?$", text, re.M)
        image = stages[-1][0]
        if image == "scratch":
            (copied,) = re.findall(r"^COPY --from=(\S+) / /$", text, re.M)
            image = {name: base for base, name in stages if name}[copied]
        assert image == "${BASE_IMAGE}", dockerfile.name
        assert "USER hps" in text


class _OverrideLoader(yaml.SafeLoader):
    """YAML with the compose tag `!override` (a value that replaces the merged one)."""


_OverrideLoader.add_constructor(
    "!override", lambda loader, node: loader.construct_sequence(node)
    if isinstance(node, yaml.SequenceNode) else loader.construct_scalar(node))


def test_check_override_swaps_images_only(compose: dict[str, Any]) -> None:
    """compose.check.yml (scripts/compose_check.sh) replaces pulled images by built ones
    (and MinIO's health check by one its stand-in, moto's S3 server, can answer)."""
    override = yaml.load(CHECK_OVERRIDE.read_text(), Loader=_OverrideLoader)  # noqa: S506
    check = (ROOT / "scripts" / "compose_check.sh").read_text()
    svc = services(compose)
    for name, s in override["services"].items():
        assert name in svc, f"compose.check.yml overrides unknown service {name}"
        assert s["image"].startswith("localhost/"), name
        assert s["image"] in check, f"compose_check.sh does not build {s['image']}"
    moto = override["services"]["minio"]["healthcheck"]["test"]
    assert moto[0] == "CMD" and "mc" not in moto, moto


def _parse(argv: list[str]) -> Any:
    """Parse `hps <argv>` with the real CLI without running it; raises on a bad option.

    Returns the command's click context (its `params` are the parsed options).
    """
    group: Any = typer.main.get_command(cli_app)
    parent = group.context_class(group, info_name="hps")
    command = group.get_command(parent, argv[0])
    assert command is not None, f"hps has no command {argv[0]!r}"
    return command.make_context(argv[0], list(argv[1:]), parent=parent)


def test_commands_parse_against_the_cli(compose: dict[str, Any]) -> None:
    env = {"DEMO_SCALE": DEMO_SCALE}
    checked = 0
    for name, s in services(compose).items():
        argv = interpolate(argv_of(s), env)
        if argv and argv[0] == "hps":
            ctx = _parse(argv[1:])
            checked += 1
            if argv[1] == "serve":
                config = Path(str(ctx.params["config"]))
                assert config.parts[1] == "configs", name
                assert (ROOT / "configs" / config.name).is_file(), f"{name}: {config}"
    assert checked == 1 + len(HPS_SERVICES)
    for dockerfile in HPS_DOCKERFILES:
        (cmd,) = [x for x in dockerfile.read_text().splitlines() if x.startswith("CMD")]
        _parse(json.loads(cmd.removeprefix("CMD")))
    with pytest.raises(Exception, match="No such option"):
        _parse(["serve", "/configs/demo.json", "--no-such-option"])
    with pytest.raises(Exception, match="config"):
        _parse(["serve"])


@pytest.mark.parametrize("name", ["demo", "redis", "redis-cluster", "s3", "gpu", "gpu-workers",
                                  "replicas"])
def test_configs_load_cleanly(name: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an unknown key is a warning: none allowed
        config = load_config(ROOT / "configs" / f"{name}.json")
    (model,) = config.models
    assert model.model == "demo"
    assert model.embedding_table_names == ["user_item", "item_category"]
    assert model.embedding_vecsize_per_table == [16, 64]
    assert config.persistent_db.enabled
    assert config.volatile_db.is_redis == (name.startswith("redis") or name == "replicas")
    assert model.gpucache == name.startswith("gpu")
    # several workers share one GPU cache a device (docs/workers.md)
    assert (model.gpu_cache_scope, config.http.workers) == (
        ("host", 8) if name == "gpu-workers" else ("process", 1))
    # the replicas take online updates from the compose file's Redis Streams
    assert config.update_source.type == ("redis_stream" if name == "replicas" else "null")


# -- the commands, natively ---------------------------------------------------------------

class NativeRoot:
    """The containers' file system as a temporary folder, and the services' processes."""

    def __init__(self, root: Path, hosts: dict[str, str], base_env: dict[str, str]) -> None:
        self.root = root
        self.hosts = hosts  # hostname strings of the compose network → local addresses
        self.base_env = base_env
        self.procs: list[subprocess.Popen[bytes]] = []
        for sub in ("models", "state", "app/deploy"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        shutil.copytree(ROOT / "configs", root / "configs")
        for path in (root / "configs").glob("*.json"):
            path.write_text(self.rehost(path.read_text()))
        for script in ("healthcheck.py", "upload_model.py"):
            shutil.copy(DEPLOY / script, root / "app" / "deploy" / script)

    def rehost(self, text: str) -> str:
        for old, new in self.hosts.items():
            text = text.replace(old, new)
        return text

    def argv(self, argv: list[str], port: int | None = None) -> list[str]:
        out = []
        for arg in argv:
            first = arg.split("/")[1] if arg.startswith("/") else ""
            out.append(str(self.root / arg.lstrip("/")) if first in CONTAINER_DIRS else arg)
        if port is not None:
            out[out.index("--port") + 1] = str(port)
            out[out.index("--host") + 1] = "127.0.0.1"
        if out[0] == "hps":
            out[:1] = [sys.executable, "-m", "hps.tools.cli"]
        elif out[0] == "python":
            out[0] = sys.executable
        return out

    def env(self, service: dict[str, Any]) -> dict[str, str]:
        env = dict(self.base_env)
        for key, value in interpolate(service.get("environment", {}), self.base_env).items():
            env[key] = self.rehost(str(value))
        return env

    def run(self, service: dict[str, Any], timeout: float = 120) -> str:
        done = subprocess.run(self.argv(interpolate(argv_of(service), self.base_env)),
                              env=self.env(service), cwd=self.root / "state",
                              capture_output=True, timeout=timeout)
        output = (done.stdout + done.stderr).decode(errors="replace")
        assert done.returncode == 0, output
        return output

    def start(self, service: dict[str, Any], port: int) -> subprocess.Popen[bytes]:
        with open(self.root / f"serve-{port}.log", "wb") as log:  # the child keeps its copy
            proc = subprocess.Popen(
                self.argv(interpolate(argv_of(service), self.base_env), port),
                env=self.env(service), cwd=self.root / "state", stdout=log, stderr=log)
        self.procs.append(proc)
        return proc

    def healthy(self, service: dict[str, Any], port: int) -> bool:
        test = service["healthcheck"]["test"][1:]
        argv = self.argv(test)
        argv[-1] = argv[-1].replace(":8000/", f":{port}/")
        return subprocess.run(argv, capture_output=True, timeout=10).returncode == 0

    def log(self, port: int) -> str:
        return (self.root / f"serve-{port}.log").read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def moto_url() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    werkzeug_log = logging.getLogger("werkzeug")
    old_level = werkzeug_log.level
    werkzeug_log.setLevel(logging.WARNING)  # one access-log line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield f"http://{host}:{port}"
    finally:
        server.stop()
        werkzeug_log.setLevel(old_level)


@pytest.fixture(scope="module")
def native(tmp_path_factory: pytest.TempPathFactory, compose: dict[str, Any], moto_url: str
           ) -> Iterator[NativeRoot]:
    work = tmp_path_factory.mktemp("deploy")
    svc = services(compose)
    seeds = []
    for node in (svc["redis-1"], svc["redis-2"], svc["redis-3"]):
        port = node["command"][node["command"].index("--port") + 1]
        seeds.append(f"{node['networks']['default']['ipv4_address']}:{port}")
    cluster_seeds = ",".join(seeds)
    with RedisServer(work / "redis") as redis_server, \
            RedisClusterProcs(work / "cluster", masters=3) as cluster:
        base_env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        base_env.update(DEMO_SCALE=DEMO_SCALE, HPS_TOKEN="")
        root = NativeRoot(work / "root", {
            "redis:6379": redis_server.address,
            cluster_seeds: cluster.address,
            "http://minio:9000": moto_url,
        }, base_env)
        try:
            yield root
        finally:
            root.stop()


def test_compose_commands_run_natively(native: NativeRoot, compose: dict[str, Any]) -> None:
    svc = services(compose)
    # one-shot jobs first, as depends_on orders them
    native.run(svc["model-init"])
    demo = native.root / "models" / "demo"
    assert (demo / "user_item" / "key").is_file() and (demo / "item_category" / "key").is_file()
    uploaded = native.run(svc["s3-upload"])
    assert uploaded.count("s3://hps-models/demo/") == 2

    ports = {name: free_port() for name in NATIVE_SERVICES}
    procs = {name: native.start(svc[name], ports[name]) for name in NATIVE_SERVICES}
    deadline = time.monotonic() + 90
    pending = set(NATIVE_SERVICES)
    while pending:
        for name in sorted(pending):
            assert procs[name].poll() is None, f"{name} exited:\n{native.log(ports[name])}"
            if native.healthy(svc[name], ports[name]):
                pending.discard(name)
        assert time.monotonic() < deadline, {n: native.log(ports[n]) for n in pending}
        time.sleep(0.2)

    tables = [("user_item", 16), ("item_category", 64)]
    files = {t: (np.fromfile(demo / t / "key", "<i8"),
                 np.fromfile(demo / t / "emb_vector", "<f4").reshape(-1, d)) for t, d in tables}
    expected_tier = {"hps": "hash_map", "hps-redis": "redis", "hps-cluster": "redis",
                     "hps-s3": "hash_map"}
    for name in NATIVE_SERVICES:
        with httpx.Client(base_url=f"http://127.0.0.1:{ports[name]}", timeout=30) as client:
            info = client.get("/v1/models/demo").json()
            sources = [t["source"]["uri"] for t in info["tables"]]
            if name == "hps-s3":
                assert sources == ["s3://hps-models/demo/user_item",
                                   "s3://hps-models/demo/item_category"]
            for t in info["tables"]:
                assert t["source"]["num_keys"] == files[t["name"]][0].size
                assert any(tier.startswith(expected_tier[name]) for tier in t["tiers"]), \
                    (name, t["tiers"])
            for table, _ in tables:
                keys, vectors = files[table]
                rows = np.random.default_rng().integers(0, keys.size, 300)
                answer = client.post(f"/v1/models/demo/tables/{table}/lookup",
                                     content=keys[rows].tobytes(),
                                     headers={"Content-Type": "application/octet-stream"})
                assert answer.status_code == 200, (name, answer.text)
                got = np.frombuffer(answer.content, "<f4").reshape(rows.size, -1)
                np.testing.assert_array_equal(got, vectors[rows], err_msg=name)
