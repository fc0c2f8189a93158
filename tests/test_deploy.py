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

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
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
    return {d["kind"]: d for p in MANIFESTS for d in _docs(p)}


def test_deployment_gpus_probes_and_flags():
    kinds = _by_kind()
    dep, svc, ing = kinds["Deployment"], kinds["Service"], kinds["Ingress"]
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
    backend = ing["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend["name"] == svc["metadata"]["name"]
    assert ing["metadata"]["annotations"]["nginx.ingress.kubernetes.io/upstream-hash-by"] == affinity_key()
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


def affinity_key() -> str:
    """nginx's hash key for the session headers agentkv reads, in its precedence order."""
    headers = [name for name, _, _ in SOURCES if "-" in name]   # header names; body fields have none
    return "".join("$http_" + h.replace("-", "_") for h in headers)


def test_affinity_follows_the_session_precedence():
    assert affinity_key() == "$http_x_session_id$http_x_claude_code_session_id$http_session_id$http_thread_id"


def test_compose_file_follows_the_compose_spec():
    text = (DEPLOY / "docker-compose.yml").read_text()
    spec = compose_spec.PyCompose.from_yaml(text)  # strict: an unknown key is an error
    services = yaml.safe_load(text)["services"]
    assert {"agentkv", "agentkv-cpu", "postgres"} <= set(spec.services)
    gpu = services["agentkv"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]
    for name in ("agentkv", "agentkv-cpu"):
        build = services[name]["build"]
        assert (DEPLOY / build["context"] / build["dockerfile"]).is_file()
        _serve_args_parse(services[name].get("command", []))
        assert services[name]["environment"]["AGENTKV_SESSION_DB"].startswith("postgresql://")
        # the image keeps its compaction key on this volume: items outlive a recreated container
        image_env = dict(re.findall(r"(AGENTKV_[A-Z_]+)=(\S+)", (DEPLOY / build["context"] / build["dockerfile"]).read_text()))
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
