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
- Security: every listener beyond loopback serves TLS or checks a token (pilotfish/security.py's own
  rule, on the args as parsed), the TLS files come read-only from the Secret deploy/k8s/README.md
  says how to make, the ServiceMonitors scrape over HTTPS with what the servers require. The
  integration test at the end starts the picker and the scheduler from the manifests' own args with
  certificates made by the README's openssl commands, and runs the manifests' own probes.
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
# strategic merge, as kustomize
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
}
# name -> optional; created by the operator (deploy/k8s/README.md)
OPERATOR_SECRETS = {
    "pilotfish-redis": False,
    "hf-token": True,
    "pilotfish-tls": False,
    "pilotfish-metrics-client": False,
}
K8S_README = K8S / "README.md"
TLS_SECRET, TLS_KEYS = "pilotfish-tls", {"tls.crt", "tls.key", "ca.crt"}
MOUNT_ROOT = "/etc/pilotfish/"  # where the pods mount their Secrets (tls/, redis/)
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


def parsed_args(container: dict[str, Any], files: Path | None = None) -> Any:
    """The container's args through the real CLI; `files`: a folder standing in for /etc/pilotfish/."""
    env = env_of(container)
    argv = [expand(a, env) for a in container["args"]]
    if files is not None:
        argv = [a.replace(MOUNT_ROOT, f"{files}/") for a in argv]
    args, unknown = build_parser().parse_known_args(argv)
    assert not unknown, f"{container['name']}: unknown flags {unknown}"
    return args


def config_of(container: dict[str, Any], files: Path | None = None) -> Any:
    from pilotfish.ext_proc.config import ExtProcConfig
    from pilotfish.scheduler.config import SchedulerConfig

    args = parsed_args(container, files)
    struct = {"ext-proc": ExtProcConfig, "scheduler": SchedulerConfig}[container["args"][0]]
    return struct_from_args(struct, args, getattr(args, "config", None) or getattr(args, "config_path", None))


def secret_file(deployment: dict[str, Any], container: dict[str, Any], path: str) -> tuple[str, str]:
    """(Secret, key) that `path` reads inside the container; the mount must be read-only."""
    folder, _, key = path.rpartition("/")
    (mount,) = [m for m in container.get("volumeMounts", []) if m["mountPath"].rstrip("/") == folder]
    assert mount.get("readOnly") is True, f"{deployment['metadata']['name']}: {folder} is mounted read-only"
    (volume,) = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    assert "items" not in volume["secret"], "every key of the Secret, under its own name"
    return volume["secret"]["secretName"], key


def readme_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", K8S_README.read_text(), re.S)


def cert_manager_objects() -> list[dict[str, Any]]:
    (block,) = [b for b in readme_blocks("yaml") if "cert-manager.io/v1" in b]
    return [d for d in yaml.safe_load_all(block) if d]


def documented_certificate(secret: str) -> dict[str, Any]:
    (cert,) = [o for o in cert_manager_objects() if o["kind"] == "Certificate" and o["spec"]["secretName"] == secret]
    return cert


def documented_names() -> set[str]:
    """The names deploy/k8s/README.md puts in pilotfish-tls's certificate (its cert-manager Certificate)."""
    return set(documented_certificate(TLS_SECRET)["spec"]["dnsNames"])


def openssl_script() -> str:
    """The README's openssl commands, without the kubectl ones (nothing here talks to a cluster)."""
    (block,) = [b for b in readme_blocks("bash") if "openssl req" in b]
    lines, skipping = [], False
    for line in block.splitlines():
        skipping = skipping or line.startswith("kubectl")
        if not skipping:
            lines.append(line)
        elif not line.endswith("\\"):
            skipping = False
    return "set -eu\n" + "\n".join(lines) + "\n"


def fake_mounts(root: Path, cert: Path, key: Path, ca: Path) -> Path:
    """A folder laid out as the pods' /etc/pilotfish: tls/ (the TLS Secret's keys), redis/password."""
    (root / "tls").mkdir(parents=True)
    for name, source in (("tls.crt", cert), ("tls.key", key), ("ca.crt", ca)):
        shutil.copy(source, root / "tls" / name)
    (root / "redis").mkdir()
    (root / "redis" / "password").write_text(SAMPLE_ENV["REDIS_PASSWORD"] + "\n")
    return root


@pytest.fixture(scope="module")
def mounts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """/etc/pilotfish as the pods see it, with a certificate for the documented names (cryptography)."""
    pytest.importorskip("cryptography", reason="the test extra's cryptography package makes the certificates")
    from pilotfish.security_testing import issue, make_ca

    pki = tmp_path_factory.mktemp("pki")
    ca_key, ca_cert, ca = make_ca(pki)
    cert, key = issue(ca_key, ca_cert, pki, "pilotfish", hosts=tuple(sorted(documented_names())))
    return fake_mounts(tmp_path_factory.mktemp("etc-pilotfish"), cert, key, ca)


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


def tls_probe(probe: dict[str, Any]) -> tuple[str, int, str, str]:
    """An exec probe's (code, port, certificate name, health service): gRPC health over TLS in the pod
    (the kubelet's own gRPC probe speaks no TLS)."""
    assert set(probe) >= {"exec"} and "grpc" not in probe
    python, flag, code, address, name, service = probe["exec"]["command"]
    assert (python, flag) == ("python", "-c")
    host, _, port = address.rpartition(":")
    assert host == "127.0.0.1", "the pod asks itself"
    assert probe["timeoutSeconds"] >= 3, "python and grpc start in well under a second, not in the 1 s default"
    return code, int(port), name, service


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_name_the_health_services_the_servers_register(overlay: str) -> None:
    from pilotfish.ext_proc.server import LIVE_SERVICES, READY_SERVICES
    from pilotfish.scheduler.service import SERVICE_NAME

    objects = RENDERED[overlay]
    codes = set()
    names = documented_names()
    ext = one(objects, "Deployment", "pilotfish-epp")["spec"]["template"]["spec"]["containers"][0]
    port = config_of(ext).port
    code, probe_port, name, service = tls_probe(ext["readinessProbe"])
    assert (probe_port, service) == (port, "readiness") and name in names
    assert "readiness" in READY_SERVICES  # answered only after the first discovery sync
    codes.add(code)
    code, probe_port, name, service = tls_probe(ext["livenessProbe"])
    assert (probe_port, service) == (port, "liveness") and name in names
    assert "liveness" in LIVE_SERVICES  # answered at once
    codes.add(code)
    sched = one(objects, "Deployment", "pilotfish-scheduler")["spec"]["template"]["spec"]["containers"][0]
    port = config_of(sched).port
    code, probe_port, name, service = tls_probe(sched["readinessProbe"])
    assert (probe_port, service) == (port, SERVICE_NAME) and name in names
    codes.add(code)
    code, probe_port, name, service = tls_probe(sched["livenessProbe"])
    assert (probe_port, service) == (port, "") and name in names
    codes.add(code)
    (code,) = codes  # one probe, run by test_the_manifests_serve_tls_as_documented
    compile(code, "probe", "exec")
    assert set(re.findall(r'"/etc/pilotfish/tls/"', code)) and {"ca.crt", "tls.crt", "tls.key"} <= set(
        re.findall(r'"([a-z]+\.[a-z]+)"', code)
    )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_pool_the_picker_and_the_scheduler_are_wired_together(overlay: str) -> None:
    objects = RENDERED[overlay]
    pool = one(objects, "InferencePool", "vllm-pool")
    ref = pool["spec"]["endpointPickerRef"]
    assert ref["failureMode"] == "FailClose"  # the protocol's default; see the manifest's comment
    epp_service = one(objects, "Service", ref["name"])
    (svc_port,) = [p for p in epp_service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    # gRPC over TLS, as GIE's pickers serve it and gateways dial them (not kubernetes.io/h2c: cleartext)
    assert svc_port["appProtocol"] == "http2"
    epp = one(objects, "Deployment", ref["name"])
    ext = epp["spec"]["template"]["spec"]["containers"][0]
    assert svc_port["targetPort"] in {p["name"] for p in ext["ports"]}
    config = config_of(ext)
    assert config.discovery in (f"k8s-pool:{pool['metadata']['name']}", f"k8s-pool:{pool['metadata']['namespace']}/"
                                f"{pool['metadata']['name']}")  # fmt: skip
    host, _, port = config.scheduler_address.rpartition(":")
    sched_service = one(objects, "Service", host)
    assert int(port) in [p["port"] for p in sched_service["spec"]["ports"]]
    assert config.tls_server_name == host, "the name the picker expects in the scheduler's certificate"
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
    sched_container = sched["spec"]["template"]["spec"]["containers"][0]
    config = config_of(sched_container)
    assert config.enable_full_mode_scheduling
    redis_service = one(objects, "Service", "pilotfish-redis")
    expected = f"redis://pilotfish-redis:{redis_service['spec']['ports'][0]['port']}/0"
    assert config.redis_url == expected, "no password in the URL: it would sit in the process's arguments"
    assert secret_file(sched, sched_container, config.redis_password_file) == ("pilotfish-redis", "password")
    vllm_deployment = one(objects, "Deployment", "vllm")
    vllm = vllm_deployment["spec"]["template"]["spec"]["containers"][0]
    llumlet = config_from_env(env_of(vllm))
    assert llumlet.enabled and llumlet.cms_url == expected
    assert secret_file(vllm_deployment, vllm, llumlet.redis_password_file) == ("pilotfish-redis", "password")
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


def secret_refs(objects: list[dict[str, Any]]) -> Iterator[tuple[str, str, bool]]:
    """(where, secret name, optional) for every Secret an object reads: env, volumes, ServiceMonitors."""
    for deployment in find(objects, "Deployment"):
        where = f"Deployment/{deployment['metadata']['name']}"
        spec = deployment["spec"]["template"]["spec"]
        for container in spec["containers"]:
            for var in container.get("env", []):
                if (ref := var.get("valueFrom", {}).get("secretKeyRef")) is not None:
                    yield where, ref["name"], ref.get("optional", False)
        for volume in spec.get("volumes", []):
            if (secret := volume.get("secret")) is not None:
                yield where, secret["secretName"], secret.get("optional", False)
    for monitor in find(objects, "ServiceMonitor"):
        for endpoint in monitor["spec"]["endpoints"]:
            tls = endpoint.get("tlsConfig", {})
            for ref in [tls.get(k, {}).get("secret") for k in ("ca", "cert")] + [tls.get("keySecret")]:
                if ref is not None:
                    yield f"ServiceMonitor/{monitor['metadata']['name']}", ref["name"], ref.get("optional", False)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_the_documented_secrets_are_referenced(overlay: str) -> None:
    docs = (ROOT / "README.md").read_text() + K8S_README.read_text() + _yaml_comments()
    refs = list(secret_refs(RENDERED[overlay]))
    for where, name, optional in refs:
        assert name in OPERATOR_SECRETS, f"{where}: secret {name}"
        assert optional == OPERATOR_SECRETS[name], f"{where}: {name} optional={optional}"
        assert f"secret generic {name}" in docs, f"how to create {name}"
        assert f"`{name}`" in K8S_README.read_text(), f"deploy/k8s/README.md lists {name}"
    assert {"pilotfish-tls", "pilotfish-metrics-client"} <= {name for _, name, _ in refs}
    assert not find(RENDERED[overlay], "Secret"), "no credential is committed: the operator creates the Secret"
    assert not [p for p in K8S.rglob("*") if re.search(r"\.(key|pem|crt|p12)$", p.name)], "no key or certificate file"
    for path in K8S.rglob("*.yaml"):
        assert "PRIVATE KEY" not in path.read_text(), path


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


# ---- security -----------------------------------------------------------------------------------

COMPONENT_DEPLOYMENTS = {"ext-proc": "pilotfish-epp", "scheduler": "pilotfish-scheduler"}


def pilotfish_containers(objects: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for deployment, container in containers(objects):
        if container["image"].split(":")[0] == "pilotfish":
            yield deployment, container


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_listener_beyond_loopback_serves_tls_or_checks_a_token(overlay: str, mounts: Path) -> None:
    """pilotfish/security.py's own start-up rule on every container's args as the CLI parses them, so no
    manifest can ship a listener that refuses to start, or one that --insecure lets start open."""
    from pilotfish.security import Security, is_loopback
    from pilotfish.vllm_plugin.config import config_from_env, llumlet_security

    for deployment, container in containers(RENDERED[overlay]):
        where = f"{deployment['metadata']['name']}/{container['name']}"
        image = container["image"].split(":")[0]
        if image == "pilotfish":
            config = config_of(container, mounts)
            assert not config.insecure, f"{where}: --insecure"
            security = Security.from_config(config, environ={})
            security.check_listener(config.host)  # what the server runs first; /metrics binds the same host
            if not is_loopback(config.host):
                assert security.tls or security.token, where
        elif image == "pilotfish-vllm":
            # the llumlet's gRPC server (Migrate, Abort) inside the engine: loopback unless told, and the
            # same rule beyond. vLLM's own OpenAI port (--host=0.0.0.0) is the data plane the gateway
            # routes to through the pool, not a Pilotfish listener.
            env = {k: v.replace(MOUNT_ROOT, f"{mounts}/") for k, v in env_of(container).items()}
            llumlet = config_from_env(env)
            assert not llumlet.insecure, f"{where}: PILOTFISH_INSECURE"
            if llumlet.enabled and llumlet.serve_grpc:
                llumlet_security(llumlet).check_listener(llumlet.llumlet_host, "PILOTFISH_LLUMLET_HOST")
        elif image == "redis":
            assert container["args"][:2] == ["--requirepass", "$(REDIS_PASSWORD)"], f"{where}: Redis needs AUTH"
        else:
            pytest.fail(f"{where}: {image} is not classified here: say what guards its listeners")


@pytest.mark.parametrize("component", sorted(COMPONENT_DEPLOYMENTS))
def test_the_listener_rule_refuses_a_manifest_without_tls_or_a_token(component: str, mounts: Path) -> None:
    """The test above has teeth: the same container without its TLS flags fails it."""
    from pilotfish.config import ConfigError
    from pilotfish.security import Security

    deployment = one(RENDERED["lite"], "Deployment", COMPONENT_DEPLOYMENTS[component])
    container = copy.deepcopy(deployment["spec"]["template"]["spec"]["containers"][0])
    container["args"] = [a for a in container["args"] if not a.startswith(("--tls-", "--auth-token-file"))]
    config = config_of(container, mounts)
    with pytest.raises(ConfigError, match="beyond loopback"):
        Security.from_config(config, environ={}).check_listener(config.host)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_tls_comes_read_only_from_the_secret_and_each_link_gets_what_it_needs(overlay: str, mounts: Path) -> None:
    from pilotfish.security import Security

    objects = RENDERED[overlay]
    seen = set()
    for deployment, container in pilotfish_containers(objects):
        component = container["args"][0]
        seen.add(component)
        config = config_of(container)
        files = {"tls_cert_file": "tls.crt", "tls_key_file": "tls.key", "tls_ca_file": "ca.crt"}
        for field, key in files.items():
            assert secret_file(deployment, container, getattr(config, field)) == (TLS_SECRET, key), field
        pod = deployment["spec"]["template"]["spec"]
        (volume,) = [v for v in pod["volumes"] if v.get("secret", {}).get("secretName") == TLS_SECRET]
        mode = volume["secret"]["defaultMode"]
        assert mode & 0o040 and not mode & 0o007, "readable by the pod's group (fsGroup), by no one else"
        assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]
        security = Security.from_config(config_of(container, mounts), environ={})
        assert security.tls
        if component == "ext-proc":
            # the gateway presents no client certificate; the scheduler is dialled with TLS, verified
            # by the CA, and given the picker's certificate
            assert config.tls_no_client_auth and not security.mutual
            assert security.client_tls and security.cert and security.ca
        else:
            assert not config.tls_no_client_auth and security.mutual, "only clients with the CA's certificate"
    assert seen == {"ext-proc", "scheduler"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_service_monitors_scrape_over_https_with_what_the_servers_require(overlay: str, mounts: Path) -> None:
    from pilotfish.security import Security

    objects = RENDERED[overlay]
    by_app = {d["metadata"]["name"]: c for d, c in pilotfish_containers(objects)}
    names = documented_names()
    scraped = set()
    for monitor in find(objects, "ServiceMonitor"):
        apps = set(monitor["spec"]["selector"].get("matchLabels", {}).values())
        for e in monitor["spec"]["selector"].get("matchExpressions", []):
            apps |= set(e["values"])
        for app in apps & set(by_app):
            scraped.add(app)
            security = Security.from_config(config_of(by_app[app], mounts), environ={})
            (endpoint,) = monitor["spec"]["endpoints"]
            tls = endpoint["tlsConfig"]
            assert endpoint["scheme"] == "https" and security.tls
            assert tls["ca"] == {"secret": {"name": TLS_SECRET, "key": "ca.crt"}}
            assert tls["serverName"] in names and "insecureSkipVerify" not in tls
            assert not security.token, "a token on /metrics needs bearerTokenSecret here"
            if security.mutual:
                assert tls["cert"] == {"secret": {"name": "pilotfish-metrics-client", "key": "tls.crt"}}
                assert tls["keySecret"] == {"name": "pilotfish-metrics-client", "key": "tls.key"}
    assert scraped == set(by_app)


def test_the_readmes_certificates_fit_the_manifests() -> None:
    """deploy/k8s/README.md's cert-manager objects and openssl commands make what the manifests use."""
    namespace = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())["namespace"]
    objects = cert_manager_objects()
    assert {o["metadata"]["namespace"] for o in objects} == {namespace}
    tls, client = documented_certificate(TLS_SECRET), documented_certificate("pilotfish-metrics-client")
    assert {"server auth", "client auth"} <= set(tls["spec"]["usages"])
    assert "client auth" in client["spec"]["usages"] and "server auth" not in client["spec"]["usages"]
    assert tls["spec"]["issuerRef"] == client["spec"]["issuerRef"], "one CA: the ca.crt in each Secret"
    (ca_issuer,) = [
        o for o in objects if o["kind"] == "Issuer" and o["metadata"]["name"] == tls["spec"]["issuerRef"]["name"]
    ]
    (ca_cert,) = [o for o in objects if o["kind"] == "Certificate" and o["spec"].get("isCA")]
    assert ca_issuer["spec"]["ca"]["secretName"] == ca_cert["spec"]["secretName"]
    services = {s["metadata"]["name"] for s in find(RENDERED["lite"], "Service")} & set(COMPONENT_DEPLOYMENTS.values())
    expected = {
        f"{s}{suffix}" for s in services for suffix in ("", f".{namespace}.svc", f".{namespace}.svc.cluster.local")
    }
    assert set(tls["spec"]["dnsNames"]) == expected
    assert set(re.findall(r"DNS:([a-z0-9.-]+)", openssl_script())) == expected, "openssl makes the same names"
    listed = next(b for b in re.findall(r"```\n(.*?)```", K8S_README.read_text(), re.S))
    assert set(listed.split()) == expected, "the README's list of names"


@pytest.mark.integration
async def test_the_manifests_serve_tls_as_documented(tmp_path: Path) -> None:
    """The picker and the scheduler started from the lite manifests' own args (ports, discovery and the
    scheduler's address swapped for loopback ones), with certificates the README's openssl commands
    make: the manifests' probes pass; a gateway without a client certificate reaches the picker but
    not the scheduler; the picker schedules through the scheduler over mutual TLS; /metrics answers
    Prometheus as the ServiceMonitors configure it, and refuses a scraper without the client certificate."""
    import asyncio
    import ssl
    import sys

    import grpc
    import msgspec
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from pilotfish.ext_proc.routing import SCHEDULER
    from pilotfish.ext_proc.server import ExtProcServer
    from pilotfish.procs import free_port
    from pilotfish.protos import scheduler_pb2
    from pilotfish.scheduler.service import SchedulerServer

    if shutil.which("openssl") is None:
        pytest.skip("no openssl binary: the README's commands cannot run")
    pki = tmp_path / "pki"
    pki.mkdir()
    made = subprocess.run(["bash", "-c", openssl_script()], cwd=pki, capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr[-2000:]
    files = fake_mounts(tmp_path / "etc-pilotfish", pki / "tls.crt", pki / "tls.key", pki / "ca.crt")
    objects = RENDERED["lite"]
    epp = one(objects, "Deployment", "pilotfish-epp")["spec"]["template"]["spec"]["containers"][0]
    sched = one(objects, "Deployment", "pilotfish-scheduler")["spec"]["template"]["spec"]["containers"][0]
    engines = ["e0=127.0.0.1:8001", "e1=127.0.0.1:8002"]
    sched_config = msgspec.structs.replace(config_of(sched, files), port=free_port(), metrics_port=free_port(),
                                           discovery="", instances=engines)  # fmt: skip
    scheduler = SchedulerServer(sched_config)
    await scheduler.start()
    epp_config = msgspec.structs.replace(config_of(epp, files), port=free_port(), metrics_port=free_port(),
                                         discovery="", instances=engines,
                                         scheduler_address=f"127.0.0.1:{scheduler.port}")  # fmt: skip
    picker = ExtProcServer(epp_config)
    await picker.start()
    try:
        # the manifests' probes, as the kubelet runs them (with the ports swapped)
        for container, port in ((epp, picker.port), (sched, scheduler.port)):
            for kind in ("readinessProbe", "livenessProbe"):
                code, _, name, service = tls_probe(container[kind])
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-c", code.replace(MOUNT_ROOT, f"{files}/"), f"127.0.0.1:{port}", name, service,
                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                )  # fmt: skip
                out, _ = await asyncio.wait_for(proc.communicate(), 30)
                assert proc.returncode == 0, f"{container['name']} {kind}: {out.decode()[-2000:]}"

        # a gateway: TLS, verifies with the CA, presents no client certificate
        gateway = grpc.ssl_channel_credentials((pki / "ca.crt").read_bytes())

        async def health(port: int, name: str) -> int:
            options = [("grpc.ssl_target_name_override", name)]
            async with grpc.aio.secure_channel(f"127.0.0.1:{port}", gateway, options) as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
                return int(reply.status)

        assert await health(picker.port, "pilotfish-epp") == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError):  # the scheduler asks for a client certificate
            await health(scheduler.port, "pilotfish-scheduler")

        # the picker's own link: mutual TLS to the scheduler, which decides
        request = scheduler_pb2.ScheduleRequest(request_id="r1", model=epp_config.model[0], prompt_tokens=10)
        decision = await picker.router.choose(request)
        assert decision.source == SCHEDULER and decision.address in ("127.0.0.1:8001", "127.0.0.1:8002")

        # /metrics as the ServiceMonitors scrape it
        monitors = {
            m["metadata"]["name"]: m["spec"]["endpoints"][0].get("tlsConfig") for m in find(objects, "ServiceMonitor")
        }

        async def scrape(port: int, server_name: str, client: bool) -> bytes:
            context = ssl.create_default_context(cafile=str(pki / "ca.crt"))
            if client:
                context.load_cert_chain(pki / "client.crt", pki / "client.key")
            reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context, server_hostname=server_name)
            writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            status = await asyncio.wait_for(reader.readline(), 10)
            writer.close()
            return status

        assert b" 200 " in await scrape(sched_config.metrics_port, monitors["pilotfish-scheduler"]["serverName"], True)
        assert b" 200 " in await scrape(epp_config.metrics_port, monitors["pilotfish-epp"]["serverName"], True)
        assert b" 200 " in await scrape(epp_config.metrics_port, monitors["pilotfish-epp"]["serverName"], False)
        try:  # TLS 1.3: the refusal of a missing client certificate comes on the first read
            status = await scrape(sched_config.metrics_port, "pilotfish-scheduler", False)
        except (ssl.SSLError, ConnectionError, asyncio.IncompleteReadError):
            status = b""
        assert status == b"", "no answer to a scraper without the client certificate"
    finally:
        await picker.stop(0)
        await scheduler.stop(grace=0)


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
