"""deploy/: the Kubernetes overlays render, validate strictly and offline, and agree with the code.

- Rendering: `render()` below applies the kustomize features the overlays use (resources,
  namespace, strategic-merge patches of containers and env by name) and refuses any other, so an
  overlay cannot use a feature this renderer would get wrong. Where `kustomize` or `kubectl`
  is installed, a test checks that it renders the same objects.
- Validation: every built-in object against the Kubernetes OpenAPI schemas that
  `kubernetes-validate` ships (strict: an unknown field fails), the InferencePool and the
  ServiceMonitors against the schemas vendored in deploy/k8s/schemas/ (see their `$comment`).
  Nothing is downloaded.
- Agreement: every container's args parse with the real CLI (pilotfish's; vLLM's own parser where
  .venv-vllm exists), probes name the health services the servers register, ports, Services,
  selectors, PDBs, ServiceMonitors and RBAC fit one another, the llumlet's settings load.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate import utils as kv_utils
from packaging.requirements import Requirement
from packaging.version import Version
from referencing import Registry, Resource

from pilotfish.cli import build_parser
from pilotfish.config import struct_from_args
from pilotfish.discovery import open_discovery

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
DOCKER = ROOT / "deploy" / "docker"
OVERLAYS = ("lite", "full")
# the oldest Kubernetes minor still commonly run with gRPC probes GA, and the newest schemas shipped
K8S_VERSIONS = ("1.30", kv_utils.latest_version())
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition"}
CRD_SCHEMAS = {
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepool-v1.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-v1.json",
}
MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name"}  # strategic merge, as kustomize
OPERATOR_SECRETS = {"pilotfish-redis": False, "hf-token": True}  # name -> optional; created by the operator
SAMPLE_ENV = {"POD_NAME": "vllm-7d9f8c6b5-abcde", "POD_IP": "10.1.2.3", "REDIS_PASSWORD": "0123abcd"}


# ---- rendering ---------------------------------------------------------------------------------


def _load(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _merge(base: Any, patch: Any, field: str = "") -> Any:
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            out[key] = _merge(base[key], value, key) if key in base else copy.deepcopy(value)
        return out
    if isinstance(base, list) and isinstance(patch, list) and any(isinstance(x, dict) for x in base + patch):
        key = MERGE_KEYS.get(field)
        if key is None:
            raise NotImplementedError(f"patching the list {field!r}: keep overlays to {sorted(MERGE_KEYS)}")
        # kustomize (kyaml): the patch's items in its order, each merged with its match, then the rest
        originals = {item[key]: item for item in base}
        merged = [_merge(originals[i[key]], i, field) if i[key] in originals else copy.deepcopy(i) for i in patch]
        patched = {i[key] for i in patch}
        return merged + [copy.deepcopy(item) for item in base if item[key] not in patched]
    return copy.deepcopy(patch)


def render(path: Path) -> list[dict[str, Any]]:
    """The objects `kustomize build path` gives, for the subset of kustomize the overlays use."""
    k = yaml.safe_load((path / "kustomization.yaml").read_text())
    unknown = set(k) - {"apiVersion", "kind", "namespace", "resources", "patches"}
    assert not unknown, f"{path}: kustomization fields {unknown} are not rendered by this test"
    objects: list[dict[str, Any]] = []
    for resource in k.get("resources", []):
        target = (path / resource).resolve()
        objects += render(target) if target.is_dir() else _load(target)
    for patch in k.get("patches", []):
        assert set(patch) == {"path"}, f"{path}: only patches by path (strategic merge)"
        for doc in _load(path / patch["path"]):
            ident = (doc["apiVersion"], doc["kind"], doc["metadata"]["name"])
            hits = [i for i, o in enumerate(objects) if (o["apiVersion"], o["kind"], o["metadata"]["name"]) == ident]
            assert len(hits) == 1, f"patch {patch['path']} targets {ident}: {len(hits)} matches"
            objects[hits[0]] = _merge(objects[hits[0]], doc)
    if namespace := k.get("namespace"):
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = namespace
    return objects


RENDERED = {name: render(K8S / "overlays" / name) for name in OVERLAYS}


def find(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def one(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (obj,) = find(objects, kind, name)
    return obj


def containers(objects: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for deployment in find(objects, "Deployment"):
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            yield deployment, container


def env_of(container: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet would give it, with sample pod fields and secrets."""
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(var["value"], env)
        else:
            env[var["name"]] = SAMPLE_ENV.get(var["name"], "sample")
    return env


def expand(text: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), text)


def parsed_args(container: dict[str, Any]) -> Any:
    env = env_of(container)
    args, unknown = build_parser().parse_known_args([expand(a, env) for a in container["args"]])
    assert not unknown, f"{container['name']}: unknown flags {unknown}"
    return args


def config_of(container: dict[str, Any]) -> Any:
    from pilotfish.ext_proc.config import ExtProcConfig
    from pilotfish.scheduler.config import SchedulerConfig

    args = parsed_args(container)
    struct = {"ext-proc": ExtProcConfig, "scheduler": SchedulerConfig}[container["args"][0]]
    return struct_from_args(struct, args, getattr(args, "config", None) or getattr(args, "config_path", None))


# ---- validation --------------------------------------------------------------------------------


def _crd_validator(filename: str, version: str) -> jsonschema.Draft202012Validator:
    schema_dir = next(
        f"v{v}-local-strict" for v in reversed(kv_utils.all_versions()) if kv_utils.major_minor(v) <= version
    )
    definitions = kv_utils.schema_contents(f"kubernetes-json-schema/{schema_dir}/_definitions.json", version)
    registry: Registry = Resource.from_contents(definitions) @ Registry()
    schema = json.loads((K8S / "schemas" / filename).read_text())
    return jsonschema.Draft202012Validator(schema, registry=registry)


def validate(obj: dict[str, Any], version: str) -> None:
    """Raises jsonschema.ValidationError (kubernetes-validate's is one) on any schema error."""
    crd = CRD_SCHEMAS.get((obj["apiVersion"], obj["kind"]))
    if crd is None:
        kubernetes_validate.validate(obj, version, strict=True)
        return
    _crd_validator(crd, version).validate(obj)
    if obj["kind"] == "InferencePool":  # the CRD's x-kubernetes-validations (CEL), by hand
        ref = obj["spec"].get("endpointPickerRef")
        if ref is not None and ref.get("kind", "Service") == "Service" and "port" not in ref:
            raise jsonschema.ValidationError("endpointPickerRef: port is required when kind is Service or unset")
        numbers = [p["number"] for p in obj["spec"]["targetPorts"]]
        if len(numbers) != len(set(numbers)):
            raise jsonschema.ValidationError("targetPorts: port number must be unique")


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_rendered_object_validates_strictly(overlay: str, version: str) -> None:
    objects = RENDERED[overlay]
    assert objects
    for obj in objects:
        try:
            validate(obj, version)
        except jsonschema.ValidationError as exc:
            pytest.fail(f"{overlay}: {obj['kind']}/{obj['metadata']['name']} (k8s {version}): {exc.message}")


def _unknown_field_variants(obj: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    top = copy.deepcopy(obj)
    top["unknownField"] = 1
    yield "top level", top
    meta = copy.deepcopy(obj)
    meta["metadata"]["unknownField"] = 1
    yield "metadata", meta
    if isinstance(obj.get("spec"), dict):
        spec = copy.deepcopy(obj)
        spec["spec"]["unknownField"] = 1
        yield "spec", spec
    if obj["kind"] == "Deployment":
        deep = copy.deepcopy(obj)
        deep["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["unknownField"] = 1
        yield "a container's probe", deep
    if obj["kind"] == "InferencePool":
        deep = copy.deepcopy(obj)
        deep["spec"]["endpointPickerRef"]["port"]["unknownField"] = 1
        yield "endpointPickerRef.port", deep
    if obj["kind"] == "ServiceMonitor":
        deep = copy.deepcopy(obj)
        deep["spec"]["endpoints"][0]["unknownField"] = 1
        yield "an endpoint", deep


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_an_unknown_field_anywhere_fails_validation(overlay: str) -> None:
    for obj in RENDERED[overlay]:
        for where, variant in _unknown_field_variants(obj):
            with pytest.raises(jsonschema.ValidationError):
                validate(variant, K8S_VERSIONS[-1])
                pytest.fail(f"{obj['kind']}/{obj['metadata']['name']}: an unknown field at {where} passed")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda s: s["endpointPickerRef"].pop("port"), "port is required"),
        (lambda s: s["targetPorts"].append({"number": 8000}), "unique"),
        (lambda s: s["endpointPickerRef"].update(failureMode="FailSometimes"), "FailSometimes"),
        (lambda s: s["selector"].update(matchLabels={}), "non-empty|should be non-empty|minProperties|does not have"),
        (lambda s: s.update(targetPorts=[{"number": p} for p in range(8000, 8009)]), "too long|maxItems"),
    ],
)
def test_inferencepool_schema_refuses_what_the_crd_refuses(change: Any, message: str) -> None:
    pool = copy.deepcopy(one(RENDERED["lite"], "InferencePool", "vllm-pool"))
    change(pool["spec"])
    with pytest.raises(jsonschema.ValidationError, match=message):
        validate(pool, K8S_VERSIONS[-1])


def _kustomize_command() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_real_kustomize_renders_the_same_objects(overlay: str) -> None:
    command = _kustomize_command()
    if command is None:
        pytest.skip("neither kustomize nor kubectl is installed; the Python renderer above was used alone")
    out = subprocess.run(
        [*command, str(K8S / "overlays" / overlay)], capture_output=True, text=True, check=True, timeout=60
    )

    def key(o: dict[str, Any]) -> tuple[str, str, str]:
        return (o["apiVersion"], o["kind"], o["metadata"]["name"])

    theirs = sorted(_load_text(out.stdout), key=key)
    ours = sorted(RENDERED[overlay], key=key)
    assert [key(o) for o in theirs] == [key(o) for o in ours]
    for a, b in zip(theirs, ours, strict=True):
        assert a == b, f"{key(a)} differs between kustomize and render()"


def _load_text(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


# ---- agreement with the code --------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pilotfish_container_args_parse_with_the_real_cli(overlay: str) -> None:
    seen = set()
    for deployment, container in containers(RENDERED[overlay]):
        if container["image"].split(":")[0] != "pilotfish":
            continue
        assert container["command"] == ["pilotfish"]
        config = config_of(container)
        seen.add(container["args"][0])
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert config.port == ports["grpc"], deployment["metadata"]["name"]
        assert config.metrics_port == ports["metrics"], "the metrics port is served and named for the ServiceMonitor"
        assert config.host == "0.0.0.0"
        open_discovery(config.discovery)  # the URL is one discovery takes (no I/O)
        assert config.discovery.startswith("k8s-pool:")
    assert seen == {"ext-proc", "scheduler"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_name_the_health_services_the_servers_register(overlay: str) -> None:
    from pilotfish.ext_proc.server import LIVE_SERVICES, READY_SERVICES
    from pilotfish.scheduler.service import SERVICE_NAME

    objects = RENDERED[overlay]
    ext = one(objects, "Deployment", "pilotfish-epp")["spec"]["template"]["spec"]["containers"][0]
    port = config_of(ext).port
    assert ext["readinessProbe"]["grpc"] == {"port": port, "service": "readiness"}
    assert "readiness" in READY_SERVICES  # answered only after the first discovery sync
    assert ext["livenessProbe"]["grpc"] == {"port": port, "service": "liveness"}
    assert "liveness" in LIVE_SERVICES  # answered at once
    sched = one(objects, "Deployment", "pilotfish-scheduler")["spec"]["template"]["spec"]["containers"][0]
    port = config_of(sched).port
    assert sched["readinessProbe"]["grpc"] == {"port": port, "service": SERVICE_NAME}
    assert sched["livenessProbe"]["grpc"] == {"port": port}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_pool_the_picker_and_the_scheduler_are_wired_together(overlay: str) -> None:
    objects = RENDERED[overlay]
    pool = one(objects, "InferencePool", "vllm-pool")
    ref = pool["spec"]["endpointPickerRef"]
    assert ref["failureMode"] == "FailClose"  # the protocol's default; see the manifest's comment
    epp_service = one(objects, "Service", ref["name"])
    (svc_port,) = [p for p in epp_service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    assert svc_port["appProtocol"] == "kubernetes.io/h2c"
    epp = one(objects, "Deployment", ref["name"])
    ext = epp["spec"]["template"]["spec"]["containers"][0]
    assert svc_port["targetPort"] in {p["name"] for p in ext["ports"]}
    config = config_of(ext)
    assert config.discovery in (f"k8s-pool:{pool['metadata']['name']}", f"k8s-pool:{pool['metadata']['namespace']}/"
                                f"{pool['metadata']['name']}")  # fmt: skip
    host, _, port = config.scheduler_address.rpartition(":")
    sched_service = one(objects, "Service", host)
    assert int(port) in [p["port"] for p in sched_service["spec"]["ports"]]
    sched = one(objects, "Deployment", "pilotfish-scheduler")["spec"]["template"]["spec"]["containers"][0]
    assert config_of(sched).discovery == config.discovery  # one pool, read the same way by both
    vllm = one(objects, "Deployment", "vllm")
    labels = vllm["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in pool["spec"]["selector"]["matchLabels"].items())
    engine_ports = {p["containerPort"] for p in vllm["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert {p["number"] for p in pool["spec"]["targetPorts"]} <= engine_ports


def test_full_mode_connects_scheduler_engines_and_redis() -> None:
    from pilotfish.vllm_plugin.config import config_from_env

    objects = RENDERED["full"]
    sched = one(objects, "Deployment", "pilotfish-scheduler")
    assert sched["spec"]["replicas"] >= 2
    config = config_of(sched["spec"]["template"]["spec"]["containers"][0])
    assert config.enable_full_mode_scheduling
    redis_service = one(objects, "Service", "pilotfish-redis")
    expected = f"redis://:{SAMPLE_ENV['REDIS_PASSWORD']}@pilotfish-redis:{redis_service['spec']['ports'][0]['port']}/0"
    assert config.redis_url == expected
    vllm = one(objects, "Deployment", "vllm")["spec"]["template"]["spec"]["containers"][0]
    llumlet = config_from_env(env_of(vllm))
    assert llumlet.enabled and llumlet.cms_url == expected
    assert llumlet.cluster == config.cms_cluster
    assert (llumlet.instance_id, llumlet.advertise_host) == (SAMPLE_ENV["POD_NAME"], SAMPLE_ENV["POD_IP"])
    redis = one(objects, "Deployment", "pilotfish-redis")["spec"]["template"]["spec"]["containers"][0]
    assert redis["args"][:2] == ["--requirepass", "$(REDIS_PASSWORD)"]
    assert {"REDIS_PASSWORD"} <= {v["name"] for v in redis["env"]}
    assert not find(RENDERED["lite"], "Deployment", "pilotfish-redis")


def test_lite_mode_llumlet_is_inert_and_selected() -> None:
    from pilotfish.vllm_plugin import llumlet_selected
    from pilotfish.vllm_plugin.config import config_from_env

    vllm = one(RENDERED["lite"], "Deployment", "vllm")["spec"]["template"]["spec"]["containers"][0]
    assert not config_from_env(env_of(vllm)).enabled
    for overlay in OVERLAYS:
        vllm = one(RENDERED[overlay], "Deployment", "vllm")["spec"]["template"]["spec"]["containers"][0]
        assert llumlet_selected(vllm["command"] + vllm["args"]), "--scheduler-cls names the llumlet"
        names = [v["name"] for v in vllm["env"] if v["name"].startswith("PILOTFISH_")]
        config_from_env({n: env_of(vllm)[n] for n in names})  # every variable is a setting, every value valid


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_env_references_are_defined_before_use(overlay: str) -> None:
    for deployment, container in containers(RENDERED[overlay]):
        defined: set[str] = set()
        for var in container.get("env", []):
            for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", var.get("value", "")):
                assert ref in defined, f"{deployment['metadata']['name']}: {var['name']} uses $({ref}) before it is set"
            defined.add(var["name"])
        for arg in container.get("args", []) + container.get("command", []):
            for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", arg):
                assert ref in defined, f"{deployment['metadata']['name']}: an arg uses $({ref}), not in env"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_the_documented_secrets_are_referenced(overlay: str) -> None:
    readme = (ROOT / "README.md").read_text()
    for deployment, container in containers(RENDERED[overlay]):
        for var in container.get("env", []):
            ref = var.get("valueFrom", {}).get("secretKeyRef")
            if ref is None:
                continue
            assert ref["name"] in OPERATOR_SECRETS, f"{deployment['metadata']['name']}: secret {ref['name']}"
            assert ref.get("optional", False) == OPERATOR_SECRETS[ref["name"]]
            assert f"secret generic {ref['name']}" in readme + _yaml_comments(), f"how to create {ref['name']}"
    assert not find(RENDERED[overlay], "Secret"), "no credential is committed: the operator creates the Secret"


def _yaml_comments() -> str:
    return "\n".join(p.read_text() for p in K8S.rglob("*.yaml"))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rbac_grants_only_list_and_watch_on_the_pool_and_its_pods(overlay: str) -> None:
    objects = RENDERED[overlay]
    assert not find(objects, "ClusterRole") and not find(objects, "ClusterRoleBinding")
    (role,) = find(objects, "Role")
    grants = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
              for v in rule["verbs"]}  # fmt: skip
    assert grants == {(g, r, v) for g, r in (("", "pods"), ("inference.networking.k8s.io", "inferencepools"))
                      for v in ("list", "watch")}  # fmt: skip
    (binding,) = find(objects, "RoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    bound = {s["name"] for s in binding["subjects"]}
    assert all(s["namespace"] == role["metadata"]["namespace"] for s in binding["subjects"])
    for deployment in find(objects, "Deployment"):
        spec = deployment["spec"]["template"]["spec"]
        uses_api = any(config_of(c).discovery.startswith("k8s") for c in spec["containers"]
                       if c["image"].startswith("pilotfish:"))  # fmt: skip
        if uses_api:
            assert spec["serviceAccountName"] in bound
        else:
            assert spec.get("serviceAccountName") not in bound
            assert spec.get("automountServiceAccountToken") is False, f"{deployment['metadata']['name']} needs no token"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_pdbs_and_monitors_select_what_exists(overlay: str) -> None:
    objects = RENDERED[overlay]
    pods = {d["metadata"]["name"]: d["spec"]["template"] for d in find(objects, "Deployment")}

    def selected(match: dict[str, str]) -> list[str]:
        return [n for n, t in pods.items() if all(t["metadata"]["labels"].get(k) == v for k, v in match.items())]

    for deployment in find(objects, "Deployment"):
        assert deployment["spec"]["selector"]["matchLabels"].items() <= deployment["spec"]["template"]["metadata"][
            "labels"
        ].items()
    for service in find(objects, "Service"):
        (name,) = selected(service["spec"]["selector"])
        port_names = {p["name"] for c in pods[name]["spec"]["containers"] for p in c["ports"]}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in port_names, f"Service {service['metadata']['name']}: {port['targetPort']}"
    for pdb in find(objects, "PodDisruptionBudget"):
        (name,) = selected(pdb["spec"]["selector"]["matchLabels"])
        replicas = one(objects, "Deployment", name)["spec"]["replicas"]
        assert pdb["spec"].get("minAvailable", 0) < replicas, f"PDB {pdb['metadata']['name']} would block every drain"
    services = find(objects, "Service")
    for monitor in find(objects, "ServiceMonitor"):
        sel = monitor["spec"]["selector"]

        def matches(labels: dict[str, str], sel: dict[str, Any] = sel) -> bool:
            return all(labels.get(k) == v for k, v in sel.get("matchLabels", {}).items()) and all(
                labels.get(e["key"]) in e["values"] for e in sel.get("matchExpressions", [])
            )

        hits = [s for s in services if matches(s["metadata"]["labels"])]
        assert hits, f"ServiceMonitor {monitor['metadata']['name']} selects no Service"
        for endpoint in monitor["spec"]["endpoints"]:
            for service in hits:
                assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert {p for d in pods.values() for p in [d["metadata"]["labels"]["app"]]} >= {"pilotfish-epp", "vllm"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pilotfish_containers_run_unprivileged_on_pinned_images(overlay: str) -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    for deployment, container in containers(RENDERED[overlay]):
        image = container["image"]
        name, _, tag = image.rpartition(":")
        assert name and tag and tag != "latest", f"{image}: pin a tag"
        if name in ("pilotfish", "pilotfish-vllm"):
            assert tag == version, f"{image}: the images are tagged with the package version"
        if name in ("pilotfish", "redis"):
            pod = deployment["spec"]["template"]["spec"]["securityContext"]
            assert pod["runAsNonRoot"] is True and pod["runAsUser"] != 0
            sec = container["securityContext"]
            assert sec["allowPrivilegeEscalation"] is False and sec["capabilities"]["drop"] == ["ALL"]
            assert sec["readOnlyRootFilesystem"] is True


def test_vllm_args_parse_with_vllms_own_parser() -> None:
    python = ROOT / ".venv-vllm" / "bin" / "python"
    if not python.exists():
        pytest.skip("no .venv-vllm (scripts/install-vllm.sh makes it; CI has it)")
    containers_by_overlay = {o: one(RENDERED[o], "Deployment", "vllm")["spec"]["template"]["spec"]["containers"][0]
                             for o in OVERLAYS}  # fmt: skip
    code = r"""
import json, sys
import vllm.entrypoints.cli.serve as serve
from vllm.utils.argparse_utils import FlexibleArgumentParser
out = {}
for name, argv in json.loads(sys.argv[1]).items():
    parser = FlexibleArgumentParser()
    sub = parser.add_subparsers(dest="subparser")
    for cmd in serve.cmd_init():
        cmd.subparser_init(sub)
    a = parser.parse_args(argv)
    import importlib
    module, _, cls = a.scheduler_cls.rpartition(".")
    resolved = getattr(importlib.import_module(module), cls)
    out[name] = {"model": a.model_tag, "port": a.port, "host": a.host, "scheduler": resolved.__name__}
print(json.dumps(out))
"""
    argv = {}
    for overlay, container in containers_by_overlay.items():
        assert container["command"] == ["vllm", "serve"]
        argv[overlay] = ["serve", *container["args"]]
    result = subprocess.run(
        [str(python), "-c", code, json.dumps(argv)],
        capture_output=True, text=True, timeout=300, check=False,
        env={k: v for k, v in os.environ.items() if not k.startswith("PILOTFISH_")},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    parsed = json.loads(result.stdout.strip().splitlines()[-1])
    for overlay in OVERLAYS:
        assert parsed[overlay]["port"] == 8000 and parsed[overlay]["host"] == "0.0.0.0"
        assert parsed[overlay]["scheduler"] == "LlumletScheduler"


# ---- images ------------------------------------------------------------------------------------


def _dockerfile(name: str) -> str:
    return (DOCKER / name).read_text()


def _default_arg(text: str, name: str) -> str:
    match = re.search(rf"^ARG {name}=(\S+)$", text, re.M)
    assert match, f"ARG {name}=... with a default"
    return match.group(1)


def test_pilotfish_image_is_pinned_small_and_unprivileged() -> None:
    text = _dockerfile("Dockerfile")
    base = _default_arg(text, "PYTHON_IMAGE")
    assert re.fullmatch(r"python:3\.1[1-9]\.\d+-slim-\w+(@sha256:[0-9a-f]{64})?", base), f"{base}: pin a patch release"
    assert re.search(r"^USER 10001:10001$", text, re.M), "runs as a numeric non-root user (runAsNonRoot can check it)"
    assert text.count("FROM ${PYTHON_IMAGE}") == 2, "builds in one stage, ships only the virtualenv"
    assert re.search(r'^ENTRYPOINT \["pilotfish"\]$', text, re.M)
    assert "pip install ." in text, "installs the package definition the tests install"


def setup_components() -> list[str]:
    """setup.py's COMPONENTS: the folders installed as pilotfish subpackages."""
    components = re.search(r"COMPONENTS = \[(.*?)\]", (ROOT / "setup.py").read_text(), re.S)
    assert components
    return re.findall(r'"([a-z_]+)"', components.group(1))


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.vllm"])
def test_each_image_copies_every_folder_setup_py_packages(dockerfile: str) -> None:
    text = _dockerfile(dockerfile)
    copied = set(re.findall(r"^COPY ([a-z_]+)/ ", text, re.M))
    assert copied == {*setup_components(), "pilotfish", "envoy"}
    ignore = (DOCKER / f"{dockerfile}.dockerignore").read_text()
    for folder in copied:
        assert f"!{folder}/" in ignore, f"{dockerfile}.dockerignore keeps {folder}/ out of the build context"


def test_vllm_image_is_a_release_the_vllm_extra_allows() -> None:
    text = _dockerfile("Dockerfile.vllm")
    image = _default_arg(text, "VLLM_IMAGE")
    match = re.fullmatch(r"vllm/vllm-openai:v(\d+\.\d+\.\d+)(@sha256:[0-9a-f]{64})?", image)
    assert match, f"{image}: pin a vLLM release"
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (requirement,) = [Requirement(r) for r in extras["vllm"]]
    assert Version(match.group(1)) in requirement.specifier
    assert '"/tmp/pilotfish[vllm]"' in text, "installs pilotfish[vllm]"
    assert "pilotfish.vllm_plugin:register" in text, "the build checks that vLLM finds the entry point"
