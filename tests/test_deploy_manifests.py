"""Deployment files, checked offline: compose.yaml against the Compose specification schema,
infra/k8s/ against the Kubernetes schemas, the KEDA ScaledObject against its CRD's shape, the
Dockerfiles' base images and pins, and every container invocation in compose and Kubernetes run
through the real CLI with `--help` (unknown options exit 2), the producer-image ones with torch made
unimportable.

Schemas come from pinned packages, nothing is fetched:
  check-jsonschema==0.39.0      ships the Compose specification schema (vendor/compose-spec.json)
  kubernetes-validate==1.37.0   ships Kubernetes JSON schemas (1.25 ... 1.37, strict variants)
"""

from __future__ import annotations

import json
import math
import re
import shlex
import subprocess
import sys
import tomllib
import urllib.parse
import urllib.request
from importlib import resources
from pathlib import Path

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "infra" / "k8s"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
# Oldest Kubernetes we claim (HPA v2 behavior, sidecar-free) and the newest the package ships.
K8S_VERSIONS = ("1.29", "1.37")
WORKER_SERVICES = ("worker-gpu0", "worker-gpu1", "worker-split")


# -- helpers ----------------------------------------------------------------------------------

def compose() -> dict:
    return yaml.safe_load((REPO / "compose.yaml").read_text())


def env_example() -> dict[str, str]:
    out = {}
    for line in (REPO / ".env.example").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")


def interpolate(node, env: dict[str, str], missing: set[str]):
    """Compose's variable interpolation (`${V}`, `${V:-default}`, `${V:?error}`, `$$`), recording
    variables used without a default that `env` lacks."""
    if isinstance(node, dict):
        return {k: interpolate(v, env, missing) for k, v in node.items()}
    if isinstance(node, list):
        return [interpolate(v, env, missing) for v in node]
    if not isinstance(node, str):
        return node

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, arg = m.group(1), m.group(2), m.group(3)
        value = env.get(name)
        if op in (":-", "-"):
            return value if value else arg
        if value is None:
            missing.add(name)
            return ""
        return value

    return _VAR.sub(sub, node)


def _need(module: str, pin: str):
    """A schema package this file relies on; its absence is a setup error, never a skip."""
    try:
        return __import__(module, fromlist=["_"])
    except ImportError:
        pytest.fail(f"{module} is missing: pip install {pin} (listed in the CI requirements)")


def compose_schema() -> dict:
    _need("check_jsonschema", "check-jsonschema==0.39.0")
    ref = resources.files("check_jsonschema") / "builtin_schemas" / "vendor" / "compose-spec.json"
    return json.loads(ref.read_text())


def k8s_validate():
    return _need("kubernetes_validate.utils", "kubernetes-validate==1.37.0")


def k8s_docs() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs.append((path.name, doc))
    return docs


def k8s_doc(kind: str, name: str) -> dict:
    found = [d for _, d in k8s_docs() if d["kind"] == kind and d.get("metadata", {}).get("name") == name]
    assert len(found) == 1, f"expected one {kind}/{name} in infra/k8s, found {len(found)}"
    return found[0]


def dockerfile(name: str) -> dict:
    """FROM (after ARG substitution), ARGs, ENTRYPOINT/CMD (exec form) and RUN lines of a Dockerfile."""
    text = (REPO / "infra" / name).read_text()
    logical = re.sub(r"\\\n", " ", text)
    args: dict[str, str] = {}
    out: dict = {"args": args, "run": []}
    for line in logical.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instr, _, rest = line.partition(" ")
        instr = instr.upper()
        if instr == "ARG":
            key, _, value = rest.partition("=")
            args[key.strip()] = value.strip()
        elif instr == "FROM":
            out["from"] = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], rest.split()[0])
        elif instr in ("ENTRYPOINT", "CMD"):
            out[instr.lower()] = json.loads(rest)
        elif instr == "RUN":
            out["run"].append(rest)
    return out


# -- compose ------------------------------------------------------------------------------------

def test_compose_matches_compose_spec_schema():
    validator = jsonschema.Draft202012Validator(compose_schema())
    raw = compose()
    errors = sorted(validator.iter_errors(raw), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)
    # After interpolation with the shipped .env.example, as `docker compose config` would see it.
    missing: set[str] = set()
    resolved = interpolate(raw, env_example(), missing)
    assert not missing, f"compose.yaml needs {sorted(missing)} but .env.example does not define them"
    errors = sorted(validator.iter_errors(resolved), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)


def test_compose_schema_catches_mistakes():
    """The schema is really applied: a misspelt key and a wrong type are rejected."""
    validator = jsonschema.Draft202012Validator(compose_schema())
    bad = compose()
    bad["services"]["redis"]["healthcheck"]["intervall"] = "10s"
    assert not validator.is_valid(bad)
    bad = compose()
    bad["services"]["worker-gpu0"]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] = 0
    assert not validator.is_valid(bad)


def test_compose_services():
    c = compose()
    services = c["services"]
    redis_cmd = " ".join(services["redis"]["command"])
    assert "--appendonly yes" in redis_cmd and "--maxmemory-policy noeviction" in redis_cmd
    assert "redis-cli ping" in " ".join(services["redis"]["healthcheck"]["test"])
    assert any(v.endswith(":/data") for v in services["redis"]["volumes"])

    s3 = services["s3"]
    assert s3["image"].startswith("chrislusf/seaweedfs:")
    config_arg = next(a for a in s3["command"] if a.startswith("-s3.config="))
    assert s3["configs"][0]["target"] == config_arg.split("=", 1)[1]
    identities = json.loads(interpolate(c["configs"][s3["configs"][0]["source"]]["content"], env_example(), set()))
    cred = identities["identities"][0]["credentials"][0]
    assert (cred["accessKey"], cred["secretKey"]) == (env_example()["AWS_ACCESS_KEY_ID"],
                                                      env_example()["AWS_SECRET_ACCESS_KEY"])

    for name, svc in services.items():
        if name != "producer":
            assert "healthcheck" in svc, f"{name} has no healthcheck"
        if name not in ("redis", "s3"):
            assert svc.get("env_file") == ".env", f"{name} must take credentials from .env"
            env = svc.get("environment", {})
            assert not any(k.startswith("AWS_SECRET") for k in env), f"{name}: secrets belong in .env"
    assert services["producer"]["profiles"] == ["tools"]

    reserved: dict[str, list[str]] = {}
    for name in WORKER_SERVICES:
        svc = services[name]
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert len(devices) == 1 and devices[0]["capabilities"] == ["gpu"]
        reserved[name] = devices[0]["device_ids"]
        mounts = [v for v in svc["volumes"] if ":/models" in v]
        assert mounts and all(v.endswith(":ro") for v in mounts), f"{name}: model dir must be read-only"
        assert _seconds(svc["stop_grace_period"]) >= 120, f"{name}: too short to finish in-flight segments"
        assert svc["environment"]["VOXBATCH_MODEL_DIR"].startswith("/models/")
    # One GPU per default worker, distinct; the split profile spans both and places the models.
    assert reserved["worker-gpu0"] == ["0"] and reserved["worker-gpu1"] == ["1"]
    assert reserved["worker-split"] == ["0", "1"]
    split = services["worker-split"]
    assert split["profiles"] == ["split2"]
    assert (split["environment"]["VOXBATCH_LLM_DEVICE"], split["environment"]["VOXBATCH_FLOW_DEVICE"],
            split["environment"]["VOXBATCH_HIFT_DEVICE"]) == ("cuda:0", "cuda:1", "cuda:1")
    assert "--gpus" not in split.get("command", []), "one process must see both GPUs"


def _seconds(duration: str) -> float:
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration))


def test_env_example_has_only_placeholders_and_env_is_ignored():
    env = env_example()
    for key in ("REDIS_PASSWORD", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert "change-me" in env[key], f"{key} in .env.example must be a placeholder"
    ignored = subprocess.run(["git", "check-ignore", "-q", ".env"], cwd=REPO)
    assert ignored.returncode == 0, ".env must be git-ignored"
    tracked = subprocess.run(["git", "ls-files", ".env"], cwd=REPO, capture_output=True, text=True).stdout
    assert tracked.strip() == ""
    # Settings really reads what .env.example sets (a renamed setting would be silently ignored).
    from voxbatch.settings import Settings

    fields = {f"VOXBATCH_{name.upper()}" for name in Settings.model_fields}
    for key in env:
        if key.startswith("VOXBATCH_") and not key.endswith("_HOST"):
            assert key in fields, f".env.example sets {key}, which voxbatch/settings.py does not have"


# -- Kubernetes ---------------------------------------------------------------------------------

def _k8s_params():
    return [pytest.param(doc, id=f"{name}:{doc['kind']}/{doc.get('metadata', {}).get('name', '')}")
            for name, doc in k8s_docs()]


@pytest.mark.parametrize("doc", _k8s_params())
def test_k8s_manifest_is_valid(doc):
    kind = doc["kind"]
    if kind == "ScaledObject":
        schema = json.loads((SCHEMAS / "keda-scaledobject-v1alpha1.json").read_text())
        jsonschema.Draft202012Validator(schema).validate(doc)
        return
    if kind == "Kustomization":
        listed = doc["resources"]
        assert all((K8S / r).is_file() for r in listed), listed
        expected = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml", "secret.example.yaml"}
        assert set(listed) == expected, "kustomization.yaml must list every manifest but the Secret example"
        return
    utils = k8s_validate()

    for version in K8S_VERSIONS:
        utils.validate(doc, version, strict=True)


def test_k8s_validation_catches_mistakes():
    utils = k8s_validate()

    worker = json.loads(json.dumps(k8s_doc("Deployment", "voxbatch-worker")))
    worker["spec"]["template"]["spec"]["terminationGracePeriod"] = 900  # misspelt
    with pytest.raises(utils.ValidationError):
        utils.validate(worker, K8S_VERSIONS[-1], strict=True)
    scaled = json.loads(json.dumps(k8s_doc("ScaledObject", "voxbatch-worker")))
    scaled["spec"]["triggers"][0]["metadata"]["targetValue"] = 512  # KEDA wants strings
    schema = json.loads((SCHEMAS / "keda-scaledobject-v1alpha1.json").read_text())
    assert not jsonschema.Draft202012Validator(schema).is_valid(scaled)


def _container(deployment: dict) -> dict:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def test_k8s_worker_deployment():
    dep = k8s_doc("Deployment", "voxbatch-worker")
    pod = dep["spec"]["template"]["spec"]
    c = _container(dep)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["nodeSelector"] and pod["affinity"]["nodeAffinity"]
    assert pod["terminationGracePeriodSeconds"] >= 300
    pre_stop = " ".join(c["lifecycle"]["preStop"]["exec"]["command"])
    assert "kill -TERM 1" in pre_stop and "kill -0 1" in pre_stop  # signal, then wait for the drain
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["models"]["readOnly"] is True
    models = next(v for v in pod["volumes"] if v["name"] == "models")
    assert models["persistentVolumeClaim"]["readOnly"] is True
    refs = {next(iter(e)) for e in c["envFrom"]}
    assert refs == {"configMapRef", "secretRef"}
    # The broker URL is assembled from the Secret's password, defined before it is referenced.
    names = [e["name"] for e in c["env"]]
    assert names.index("REDIS_PASSWORD") < names.index("VOXBATCH_BROKER_URL")
    port = int(k8s_doc("ConfigMap", "voxbatch-config")["data"]["VOXBATCH_METRICS_PORT"])
    assert c["ports"][0]["containerPort"] == port


def test_k8s_redis_is_durable_and_never_evicts():
    sts = k8s_doc("StatefulSet", "voxbatch-redis")
    args = _container(sts)["args"]
    pairs = dict(zip(args[::2], args[1::2]))
    assert pairs["--appendonly"] == "yes" and pairs["--maxmemory-policy"] == "noeviction"
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] in {
        m["name"] for m in _container(sts)["volumeMounts"]}
    assert k8s_doc("Service", "voxbatch-redis")["spec"]["ports"][0]["port"] == 6379


def test_k8s_selectors_match_pod_labels():
    """What the API server checks at apply time and no schema does: each workload's selector picks
    its own pods, and each Service selects the pods of some workload."""
    pods = []
    for _, doc in k8s_docs():
        if doc["kind"] in ("Deployment", "StatefulSet"):
            labels = doc["spec"]["template"]["metadata"]["labels"]
            assert doc["spec"]["selector"]["matchLabels"].items() <= labels.items(), doc["metadata"]["name"]
            pods.append(labels)
    for _, doc in k8s_docs():
        if doc["kind"] == "Service":
            assert any(doc["spec"]["selector"].items() <= p.items() for p in pods), doc["metadata"]["name"]


def test_k8s_secret_example_has_placeholders_only():
    secret = k8s_doc("Secret", "voxbatch-secrets")
    assert secret["stringData"] and all(v == "CHANGE-ME" for v in secret["stringData"].values())
    assert "data" not in secret


def test_keda_scales_the_worker_on_outstanding_segments():
    utils = k8s_validate()

    scaled = k8s_doc("ScaledObject", "voxbatch-worker")
    spec = scaled["spec"]
    worker = k8s_doc("Deployment", "voxbatch-worker")
    assert spec["scaleTargetRef"]["name"] == worker["metadata"]["name"]
    assert spec["scaleTargetRef"].get("kind", "Deployment") == "Deployment"
    (trigger,) = spec["triggers"]
    # Not the `redis` list-length scaler: it cannot see reserved/running tasks.
    assert trigger["type"] == "metrics-api"
    assert trigger["metricType"] == "AverageValue"  # replicas = outstanding / target; fallback needs it
    meta = trigger["metadata"]
    assert meta["valueLocation"] == "segments_outstanding"
    # The URL points at the exporter's Service and port.
    url = urllib.parse.urlsplit(meta["url"])
    svc = k8s_doc("Service", "voxbatch-load-exporter")
    assert url.hostname.split(".")[:2] == [svc["metadata"]["name"], svc["metadata"]["namespace"]]
    assert url.port == svc["spec"]["ports"][0]["port"] and url.path == "/load"
    exporter = _container(k8s_doc("Deployment", "voxbatch-load-exporter"))
    assert exporter["command"] == ["python", "-m", "voxbatch.worker.metrics"]
    assert exporter["args"] == ["--port", str(exporter["ports"][0]["containerPort"])]
    # One worker holds task_concurrency x batch_size segments; a smaller target starts idle workers.
    data = k8s_doc("ConfigMap", "voxbatch-config")["data"]
    in_flight = int(data["VOXBATCH_TASK_CONCURRENCY"]) * int(data["VOXBATCH_BATCH_SIZE"])
    assert float(meta["targetValue"]) >= in_flight
    assert spec["minReplicaCount"] == 0 and spec["maxReplicaCount"] >= 1
    # The HPA behaviour KEDA passes through must be a valid autoscaling/v2 behaviour.
    hpa = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
           "metadata": {"name": "keda-hpa-voxbatch-worker"},
           "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "voxbatch-worker"},
                    "minReplicas": 1, "maxReplicas": spec["maxReplicaCount"],
                    "behavior": spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]}}
    for version in K8S_VERSIONS:
        utils.validate(hpa, version, strict=True)


def _gjson(payload: dict, path: str):
    """The subset of GJSON paths KEDA's metrics-api scaler uses here: dot-separated keys/indexes."""
    node = payload
    for part in path.split("."):
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


def test_keda_value_location_resolves_against_the_real_exporter(redis_server):
    """Start the exporter exactly as the manifest does, against real Redis, and read what KEDA reads."""
    import os

    import redis

    from voxbatch.testing_services import free_port, wait_until

    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    client.set("vb:load", 1234)
    exporter = _container(k8s_doc("Deployment", "voxbatch-load-exporter"))
    port = free_port()
    args = [a if a != exporter["args"][1] else str(port) for a in exporter["args"]]
    env = {**os.environ, "VOXBATCH_BROKER_URL": redis_server.url}
    proc = subprocess.Popen([sys.executable, *exporter["command"][1:], *args], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        def fetch() -> dict:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/load", timeout=5) as resp:
                return json.loads(resp.read())

        payload = wait_until(fetch, 30, "load exporter")
        value = _gjson(payload, k8s_doc("ScaledObject", "voxbatch-worker")["spec"]["triggers"][0]["metadata"][
            "valueLocation"])
        assert value == 1234
        replicas = math.ceil(value / float(
            k8s_doc("ScaledObject", "voxbatch-worker")["spec"]["triggers"][0]["metadata"]["targetValue"]))
        assert replicas == math.ceil(1234 / 4096)
    finally:
        proc.terminate()
        proc.wait(10)


# -- images and entrypoints ---------------------------------------------------------------------

def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.match(r"(\d+(?:\.\d+)*)", text).group(1).split("."))


def test_worker_image_targets_blackwell_hopper_ada():
    df = dockerfile("worker.Dockerfile")
    image, _, tag = df["from"].partition(":")
    assert image == "nvidia/cuda"
    assert _version(tag) >= (12, 8), "sm_120 (Blackwell) needs a CUDA 12.8+ user space"
    assert "ubuntu" in tag
    assert _version(df["args"]["TORCH_VERSION"]) >= (2, 7), "torch < 2.7 has no sm_120 kernels"
    assert _version(df["args"]["VLLM_VERSION"]) >= (0, 26), "pyproject requires vllm>=0.26"
    assert any("[engine,vllm]" in r for r in df["run"])
    assert df["entrypoint"] == ["python", "-m", "voxbatch.worker.main"]  # one process; the orchestrator restarts it


def test_producer_image_has_no_cuda_and_no_extras():
    df = dockerfile("producer.Dockerfile")
    assert re.fullmatch(r"python:3\.\d+-slim(-\w+)?", df["from"]), df["from"]
    runs = " ".join(df["run"])
    assert "cuda" not in runs.lower() and "torch" not in runs.replace("'torch' not in", "")
    assert "pip install /src" in runs and "[" not in runs.split("pip install /src")[1].split()[0]
    assert df["entrypoint"] == ["voxbatch"]
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if re.match(r"(torch|vllm)\b", d)]
    ignore = (REPO / ".dockerignore").read_text().splitlines()
    for must in (".env", ".git", ".venv"):
        assert must in ignore, f".dockerignore must exclude {must}"


# Runs a console entry point the way the image would, with `torch` made unimportable when the
# invocation belongs to the producer image (which has no torch).
_RUNNER = r"""
import importlib.abc, runpy, sys
block_torch, argv = sys.argv[1] == "1", sys.argv[2:]

class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is not installed in the producer image")
        return None

if block_torch:
    sys.meta_path.insert(0, NoTorch())
if argv[0] == "voxbatch":
    sys.argv = ["voxbatch", *argv[1:]]
    from voxbatch.cli import app
    try:
        app()
    finally:
        assert "torch" not in sys.modules or not block_torch
elif argv[:2] == ["python", "-m"]:
    sys.argv = [argv[2], *argv[3:]]
    runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
else:
    raise SystemExit(f"unknown entry point {argv!r}")
"""


def _invocations() -> list[tuple[str, str, list[str]]]:
    """(where, image, argv) of every container in compose.yaml and infra/k8s."""
    entry = {"worker": dockerfile("worker.Dockerfile")["entrypoint"],
             "producer": dockerfile("producer.Dockerfile")["entrypoint"]}
    default_cmd = {"worker": dockerfile("worker.Dockerfile")["cmd"],
                   "producer": dockerfile("producer.Dockerfile")["cmd"]}
    out = []
    for name, svc in compose()["services"].items():
        image = svc.get("image", "")
        if "voxbatch-worker" in image or "voxbatch-producer" in image:
            kind = "worker" if "voxbatch-worker" in image else "producer"
            ep = svc.get("entrypoint", entry[kind])
            cmd = svc.get("command", default_cmd[kind] if "entrypoint" not in svc else [])
            out.append((f"compose:{name}", kind, [*ep, *cmd]))
    for fname, doc in k8s_docs():
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        for c in doc["spec"]["template"]["spec"]["containers"]:
            kind = next((k for k in ("worker", "producer") if f"voxbatch-{k}" in c["image"]), None)
            if kind:
                ep = c.get("command", entry[kind])
                args = c.get("args", default_cmd[kind] if "command" not in c else [])
                out.append((f"k8s:{fname}:{c['name']}", kind, [*ep, *args]))
    return out


def test_every_invocation_is_found():
    where = {w for w, _, _ in _invocations()}
    assert {"compose:worker-gpu0", "compose:worker-split", "compose:assembler", "compose:load-exporter",
            "compose:producer", "k8s:worker.yaml:worker", "k8s:assembler.yaml:assembler",
            "k8s:load-exporter.yaml:exporter"} <= where


def test_containers_run_one_worker_process_not_the_launcher():
    """Kubernetes and compose supervise the worker themselves: no container runs the multi-GPU
    launcher (`voxbatch worker`), which is for bare-metal hosts."""
    workers = [(w, argv) for w, kind, argv in _invocations() if kind == "worker"]
    assert workers
    for where, argv in workers:
        assert argv[:3] == ["python", "-m", "voxbatch.worker.main"] and "--gpus" not in argv, (where, argv)


@pytest.mark.parametrize("where,image,argv", _invocations(), ids=[w for w, _, _ in _invocations()])
def test_container_invocation_parses(where, image, argv):
    """`<entrypoint> <args> --help` exits 0 through the real CLI: every option the deployment passes
    exists (an unknown one exits 2), and producer-image commands run without torch."""
    if argv[-1] != "--help":
        argv = [*argv, "--help"]
    proc = subprocess.run([sys.executable, "-c", _RUNNER, "1" if image == "producer" else "0", *argv],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{shlex.join(argv)} ({image} image):\n{proc.stdout}\n{proc.stderr}"
    assert "usage" in proc.stdout.lower()


def test_cli_help_without_torch():
    """The brief's two checks as the producer image runs them: `voxbatch --help` and `voxbatch worker
    --help` with torch unimportable, and importing the CLI does not import torch."""
    for argv in (["voxbatch", "--help"], ["voxbatch", "worker", "--help"], ["voxbatch", "assembler", "--help"]):
        proc = subprocess.run([sys.executable, "-c", _RUNNER, "1", *argv], cwd=REPO, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
    assert "--gpus" in subprocess.run([sys.executable, "-c", _RUNNER, "1", "voxbatch", "worker", "--help"],
                                      cwd=REPO, capture_output=True, text=True, timeout=120).stdout
    code = "import sys, voxbatch.cli; assert 'torch' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)
