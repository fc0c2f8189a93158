"""deploy/: the Kubernetes manifests validate against the Kubernetes API schema (strict), the
compose file against the Compose specification, the Dockerfiles pass hadolint; and every agentkv
command line in them parses with agentkv's own CLI, every probe path is one the server answers."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import compose_spec
import kubernetes_validate
import pytest
import yaml

from agentkv.server.app import create_app
from agentkv.server.cli import build_parser
from agentkv.server.config import ServeConfig
from agentkv.server.pipeline.sessions import SOURCES

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
REPO = DEPLOY.parent
MANIFESTS = sorted((DEPLOY / "k8s").glob("*.yaml"))
DOCKERFILES = [DEPLOY / "Dockerfile", DEPLOY / "Dockerfile.cpu"]


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _serve_args_parse(args: list[str]) -> ServeConfig:
    """Flags as agentkv serve reads them (compose's ${VAR:-default} replaced by the default)."""
    args = [re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", a) for a in args]
    ns = build_parser().parse_args(["serve", *args])
    return ServeConfig(**{k: v for k, v in vars(ns).items() if k in ServeConfig.model_fields})


def _routes() -> set[str]:
    return {r.path for r in create_app(ServeConfig(session_db=":memory:")).routes}


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
@pytest.mark.parametrize("version", ["1.30.0", kubernetes_validate.latest_version()])
def test_manifest_is_valid_kubernetes(path, version):
    for doc in _docs(path):
        kubernetes_validate.validate(doc, version, strict=True)


def _by_kind() -> dict[str, dict]:
    """Each kind's object named `agentkv`, or its only object."""
    out: dict[str, dict] = {}
    for d in (d for p in MANIFESTS for d in _docs(p)):
        if d["kind"] not in out or d["metadata"]["name"] == "agentkv":
            out[d["kind"]] = d
    return out


def _named(kind: str, name: str) -> dict:
    return next(d for p in MANIFESTS for d in _docs(p) if d["kind"] == kind and d["metadata"]["name"] == name)


def test_deployment_gpus_probes_and_flags():
    kinds = _by_kind()
    dep, svc = kinds["Deployment"], _named("Service", "agentkv-replicas")
    pod = dep["spec"]["template"]
    container = pod["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] >= 1
    routes = _routes()
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert container[probe]["httpGet"]["path"] in routes
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    cfg = _serve_args_parse(container["args"])
    assert container["resources"]["limits"]["nvidia.com/gpu"] == cfg.tensor_parallel_size * cfg.pipeline_parallel_size
    env = {e["name"] for e in container["env"]}
    assert {"AGENTKV_API_KEY", "AGENTKV_SESSION_DB"} <= env and all(n[8:].lower() in ServeConfig.model_fields
                                                                   for n in env if n.startswith("AGENTKV_"))
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert container["ports"][0]["containerPort"] == 8000
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["ports"][0]["port"] == 8000   # the router resolves it
    secret = kinds["Secret"]["stringData"]
    refs = {e["valueFrom"]["secretKeyRef"]["key"] for e in container["env"] if "valueFrom" in e}
    assert refs <= secret.keys()
    # every replica reads the one compaction key from the Secret, mounted as a file
    key_file = next(e["value"] for e in container["env"] if e["name"] == "AGENTKV_COMPACTION_KEY_FILE")
    volume = next(v for v in pod["spec"]["volumes"] if v.get("secret"))
    mount = next(m for m in container["volumeMounts"] if m["name"] == volume["name"])
    (item,) = volume["secret"]["items"]
    assert volume["secret"]["secretName"] == kinds["Secret"]["metadata"]["name"] and item["key"] in secret
    assert key_file == f"{mount['mountPath']}/{item['path']}"


ROUTER_CFG = DEPLOY / "router" / "haproxy.cfg"


def router_sources() -> list[str]:
    """The session ids the router keys on, in its order, named as agentkv's ``SOURCES`` name them."""
    names = []
    for expr in re.findall(r"^\s*http-request set-var\(txn\.sid\) (\S+)", ROUTER_CFG.read_text(), re.M):
        header = re.fullmatch(r"req\.fhdr\(([\w-]+),1\)", expr)
        body = re.findall(r"json_query\('\$\.([\w.]+)'\)", expr)
        name = (header.group(1) if header
                else ".".join(body[:1]) if body[0] != "metadata.user_id" else "metadata.user_id")
        if name not in names:
            names.append(name)
    return names


def test_router_follows_the_session_precedence():
    """The router reads every session id agentkv reads, in agentkv's order (a conversation's turns
    then share a routing key whenever they share a session)."""
    assert router_sources() == [name for name, _, _ in SOURCES]


def test_router_config_is_valid_haproxy(haproxy):
    run = subprocess.run([haproxy, "-c", "-f", str(ROUTER_CFG)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_router_manifest_matches_its_config_and_the_services():
    router, svc = _named("Deployment", "agentkv-router"), _named("Service", "agentkv")
    ing, replicas = _by_kind()["Ingress"], _named("Service", "agentkv-replicas")
    pod = router["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    cfg = ROUTER_CFG.read_text()
    assert container["image"].startswith("haproxy:")
    assert container["readinessProbe"]["httpGet"]["path"] == re.search(r"monitor-uri (\S+)", cfg).group(1)
    assert {p["containerPort"] for p in container["ports"]} == {8000, 8404}   # the config's default binds
    assert re.search(r"AGENTKV_ROUTER_BIND-:8000\}", cfg) and re.search(r"AGENTKV_ROUTER_STATS_BIND-:8404\}", cfg)
    env = {e["name"]: e.get("value") for e in container["env"]}
    # HAProxy's resolver uses no search domains: the Service by its full name, in the router's namespace
    assert env["AGENTKV_REPLICA_HOST"] == f"{replicas['metadata']['name']}.$(POD_NAMESPACE).svc.cluster.local"
    namespace = next(e for e in container["env"] if e["name"] == "POD_NAMESPACE")
    assert namespace["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    (volume,) = pod["spec"]["volumes"]
    (mount,) = container["volumeMounts"]
    assert volume["configMap"]["items"] == [{"key": "haproxy.cfg", "path": "haproxy.cfg"}]
    assert mount["mountPath"] == "/usr/local/etc/haproxy"   # the haproxy image's configuration path
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    backend = ing["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend["name"] == svc["metadata"]["name"]


def test_compose_file_follows_the_compose_spec():
    text = (DEPLOY / "docker-compose.yml").read_text()
    spec = compose_spec.PyCompose.from_yaml(text)  # strict: an unknown key is an error
    services = yaml.safe_load(text)["services"]
    assert {"agentkv", "agentkv-cpu", "postgres", "router"} <= set(spec.services)
    router = services["router"]
    assert router["image"].startswith("haproxy:") and "8000:8000" in router["ports"]
    src = router["volumes"][0].split(":")[0]
    assert (DEPLOY / src).resolve() == ROUTER_CFG
    assert re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", router["environment"]["AGENTKV_REPLICA_HOST"]) in services
    gpu = services["agentkv"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]
    for name in ("agentkv", "agentkv-cpu"):
        build = services[name]["build"]
        assert (DEPLOY / build["context"] / build["dockerfile"]).is_file()
        _serve_args_parse(services[name].get("command", []))
        assert services[name]["environment"]["AGENTKV_SESSION_DB"].startswith("postgresql://")
        # the image keeps its compaction key on this volume: items outlive a recreated container
        image_env = dict(re.findall(r"(AGENTKV_[A-Z_]+)=(\S+)",
                                    (DEPLOY / build["context"] / build["dockerfile"]).read_text()))
        key_dir = image_env["AGENTKV_COMPACTION_KEY_FILE"].rsplit("/", 1)[0]
        assert any(v.split(":")[1] == key_dir for v in services[name]["volumes"]), services[name]["volumes"]


def test_compose_file_is_rejected_with_a_typo():
    with pytest.raises(Exception, match="imagee"):
        compose_spec.PyCompose.from_yaml("services:\n  a:\n    imagee: x\n")


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_lints_clean_and_runs_agentkv(path):
    hadolint = Path(sys.executable).with_name("hadolint")
    run = subprocess.run([str(hadolint), "--no-color", str(path)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    text = path.read_text()
    for src in re.findall(r"^COPY (.+) \S+$", text, re.M):
        for item in shlex.split(src):
            assert (REPO / item).exists(), f"{path.name} copies missing {item}"
    entry = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M).group(1))
    assert entry[:2] == ["agentkv", "serve"]
    _serve_args_parse(entry[2:])
    assert "EXPOSE 8000" in text and "/health" in text
    key_file = re.search(r"AGENTKV_COMPACTION_KEY_FILE=(\S+)", text).group(1)
    volume = json.loads(re.search(r"^VOLUME (\[.*\])$", text, re.M).group(1))
    assert any(key_file.startswith(v + "/") for v in volume), (key_file, volume)   # the key is kept
