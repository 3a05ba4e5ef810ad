#!/usr/bin/env python3
"""Checks deploy/: every Kubernetes manifest parses as YAML and carries what
the book promises (readiness on /readyz, liveness on /healthz, preStop,
resources, a termination grace period above the drain and shutdown, a
PodDisruptionBudget, a Service), and agrees with the config its ConfigMap
gives the gateway: each probe's port is `server.listen`'s, each container
port one of the config's listeners, no startupProbe, and Prometheus'
annotations name `admin.metrics_listen`'s port (the admin listener's
/metrics needs a bearer token: a plain scrape there gets 401). With
`--facts` it prints instead, as JSON, what tests/it/deploy.rs needs to try
the same against the running binary (the ConfigMap's config, the probes,
the scraped port). docker-compose.yml: every dependency names a service
(with a health check where it waits for health, and in a profile the
dependent one is in), every named volume and mounted file exists, and
docs/src/docker.md shows each profile (`--profile NAME`). The systemd
unit has its reload,
stop and limit settings (and passes `systemd-analyze verify` where that
exists). Where `BLOOMGATE_KUBERNETES_VALIDATE` names the
`kubernetes-validate` tool (scripts/test.sh installs it from PyPI), every
manifest is also validated, strictly (no unknown field), against the
OpenAPI schemas of the oldest and newest Kubernetes versions it ships:
the field checks above only look for what the book promises, the schema
catches a misspelt or misplaced field Kubernetes would reject or ignore.
Run by tests/it/operations.rs; no cluster needed."""
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
problems = []


def need(cond, what):
    if not cond:
        problems.append(what)


def kubernetes():
    docs = []
    for path in sorted(glob.glob(os.path.join(ROOT, "deploy/kubernetes/*.yaml"))):
        with open(path) as f:
            for doc in yaml.safe_load_all(f):
                if doc is None:
                    continue
                need(isinstance(doc, dict), f"{path}: not a mapping")
                for key in ("apiVersion", "kind", "metadata"):
                    need(key in doc, f"{path}: no {key}")
                need("name" in doc.get("metadata", {}), f"{path}: no metadata.name")
                docs.append((path, doc))
    kinds = {d["kind"]: (p, d) for p, d in docs}
    for kind in ("Deployment", "Service", "PodDisruptionBudget", "ConfigMap"):
        need(kind in kinds, f"no {kind} in deploy/kubernetes")
    if "Deployment" not in kinds:
        return
    _, dep = kinds["Deployment"]
    labels = dep["spec"]["selector"]["matchLabels"]
    need(dep["spec"]["template"]["metadata"]["labels"].items() >= labels.items(),
         "Deployment: the pod labels do not match its selector")
    pod = dep["spec"]["template"]["spec"]
    (c,) = [c for c in pod["containers"] if c["name"] == "bloomgate"]
    need(c.get("readinessProbe", {}).get("httpGet", {}).get("path") == "/readyz",
         "Deployment: readiness probe is not GET /readyz")
    need(c.get("livenessProbe", {}).get("httpGet", {}).get("path") == "/healthz",
         "Deployment: liveness probe is not GET /healthz")
    need("preStop" in c.get("lifecycle", {}), "Deployment: no preStop")
    res = c.get("resources", {})
    need("memory" in res.get("requests", {}) and "memory" in res.get("limits", {}),
         "Deployment: memory request and limit")
    toml = kinds["ConfigMap"][1]["data"]["bloomgate.toml"]
    seconds = lambda key: int(re.search(key + r' = "(\d+)s"', toml).group(1))
    pre = c["lifecycle"]["preStop"].get("sleep", {}).get("seconds", 0)
    need(pod.get("terminationGracePeriodSeconds", 30)
         > pre + seconds("shutdown_drain") + seconds("shutdown_timeout"),
         "Deployment: terminationGracePeriodSeconds <= preStop + drain + shutdown")
    need("migrate = false" in toml, "ConfigMap: the gateway must not migrate")
    listeners(c, dep, tomllib.loads(toml))
    ports = {p["name"] for p in c["ports"]}
    for p, d in docs:
        if d["kind"] == "Service":
            for sp in d["spec"]["ports"]:
                need(sp["targetPort"] in ports or isinstance(sp["targetPort"], int),
                     f"{p}: targetPort {sp['targetPort']} is no container port")
            need(d["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items(),
                 f"{p}: selector matches no pod")
        if d["kind"] == "PodDisruptionBudget":
            need(d["spec"]["selector"]["matchLabels"] == labels, f"{p}: selector")
            need("maxUnavailable" in d["spec"] or "minAvailable" in d["spec"], f"{p}: no budget")


def port_of(addr):
    """The port of a listen address (`0.0.0.0:8080`, `[::]:8080`)."""
    return int(str(addr).rsplit(":", 1)[1]) if addr else None


def container_port(c, port):
    """A probe's or annotation's port (a name or a number) as a number;
    None for a name no container port has."""
    by_name = {p["name"]: p["containerPort"] for p in c["ports"] if "name" in p}
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    return by_name.get(port)


def facts(c, dep, cfg, toml):
    """What the running binary is tried against (tests/it/deploy.rs)."""
    probes = []
    for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
        get = c.get(kind, {}).get("httpGet")
        if get:
            probes.append({"probe": kind, "path": get.get("path", "/"),
                           "port": container_port(c, get.get("port"))})
    ann = dep["spec"]["template"]["metadata"].get("annotations", {})
    scrape = None
    if ann.get("prometheus.io/scrape") == "true":
        scrape = {"port": int(ann.get("prometheus.io/port", 0)),
                  "path": ann.get("prometheus.io/path", "/metrics")}
    return {"config": toml, "probes": probes, "scrape": scrape}


def listeners(c, dep, cfg):
    """The Deployment against the listeners its ConfigMap's config opens."""
    listen = port_of(cfg.get("server", {}).get("listen", "127.0.0.1:8080"))
    admin = port_of(cfg.get("admin", {}).get("listen"))
    metrics = port_of(cfg.get("admin", {}).get("metrics_listen"))
    need("startupProbe" not in c,
         "Deployment: a startupProbe: on /healthz it guards nothing (200 at once), and on "
         "/readyz a database or bus outage at start-up would put every new pod in a restart "
         "loop (a failed startupProbe kills the container); readiness keeps a starting pod "
         "out of rotation already")
    for kind in ("readinessProbe", "livenessProbe"):
        port = c.get(kind, {}).get("httpGet", {}).get("port")
        need(container_port(c, port) == listen,
             f"Deployment: {kind} port {port} is not server.listen's ({listen}), where /readyz and /healthz are served")
    for p in c["ports"]:
        need(p["containerPort"] in (listen, admin, metrics),
             f"Deployment: container port {p['containerPort']} is none of the config's listeners "
             f"(server.listen {listen}, admin.listen {admin}, admin.metrics_listen {metrics})")
    need(metrics is not None,
         "ConfigMap: no admin.metrics_listen: the only /metrics is then admin.listen's, which needs "
         "the admin token (a scrape without one gets 401)")
    ann = dep["spec"]["template"]["metadata"].get("annotations", {})
    if ann.get("prometheus.io/scrape") == "true":
        port = int(ann.get("prometheus.io/port", 0))
        need(port == metrics,
             f"Deployment: prometheus.io/port {port} is not admin.metrics_listen's port ({metrics})"
             + (": it is admin.listen's, whose /metrics needs the admin token (401)" if port == admin else ""))
        need(port in [p["containerPort"] for p in c["ports"]],
             f"Deployment: prometheus.io/port {port} is no container port")
        need(ann.get("prometheus.io/path", "/metrics") == "/metrics",
             "Deployment: prometheus.io/path is not /metrics")


def print_facts():
    docs = {}
    for path in sorted(glob.glob(os.path.join(ROOT, "deploy/kubernetes/*.yaml"))):
        with open(path) as f:
            for doc in yaml.safe_load_all(f):
                if doc:
                    docs[doc["kind"]] = doc
    dep = docs["Deployment"]
    (c,) = [c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "bloomgate"]
    toml = docs["ConfigMap"]["data"]["bloomgate.toml"]
    print(json.dumps(facts(c, dep, tomllib.loads(toml), toml)))


def compose():
    path = os.path.join(ROOT, "docker-compose.yml")
    with open(path) as f:
        doc = yaml.safe_load(f)
    services = doc.get("services", {})
    volumes = set((doc.get("volumes") or {}).keys())
    profiles = set()
    for name, svc in services.items():
        mine = set(svc.get("profiles", []))
        profiles |= mine
        if "build" in svc:
            context = svc["build"] if isinstance(svc["build"], str) else svc["build"].get("context", ".")
            need(os.path.exists(os.path.join(ROOT, context, "Dockerfile")),
                 f"{path}: {name} builds {context}, which has no Dockerfile")
        deps = svc.get("depends_on", {})
        for dep, how in (deps.items() if isinstance(deps, dict) else ((d, {}) for d in deps)):
            need(dep in services, f"{path}: {name} depends on {dep}, no such service")
            if dep not in services:
                continue
            theirs = set(services[dep].get("profiles", []))
            # A service of no profile runs always; one of a profile only with it.
            need(not theirs or (mine and mine <= theirs),
                 f"{path}: {name} depends on {dep}, which runs only with --profile {sorted(theirs)}")
            if (how or {}).get("condition") == "service_healthy":
                need("healthcheck" in services[dep], f"{path}: {name} waits for {dep} to be healthy, which has no healthcheck")
        for v in svc.get("volumes", []):
            source = str(v).split(":")[0]
            if source.startswith("."):
                need(os.path.exists(os.path.join(ROOT, source)), f"{path}: {name} mounts {source}, which does not exist")
            else:
                need(source in volumes, f"{path}: {name} mounts volume {source}, not declared")
    docs = open(os.path.join(ROOT, "docs/src/docker.md")).read()
    for profile in sorted(profiles):
        need(f"--profile {profile}" in docs, f"docs/src/docker.md does not show the compose profile {profile} (--profile {profile})")


def systemd():
    path = os.path.join(ROOT, "deploy/systemd/bloomgate.service")
    text = open(path).read()
    for key in ("ExecStart=", "ExecReload=/bin/kill -HUP $MAINPID", "KillSignal=SIGTERM",
                "TimeoutStopSec=", "LimitNOFILE=", "Restart=on-failure"):
        need(key in text, f"{path}: no {key}")
    stop = int(re.search(r"TimeoutStopSec=(\d+)", text).group(1))
    need(stop > 15, f"{path}: TimeoutStopSec below shutdown_drain + shutdown_timeout (15 s)")
    analyze = shutil.which("systemd-analyze")
    binary = os.path.join(ROOT, "target/debug/bloomgate")
    if analyze and os.path.exists(binary):
        # The unit as installed, pointing at the built binary.
        with tempfile.TemporaryDirectory() as d:
            unit = os.path.join(d, "bloomgate.service")
            with open(unit, "w") as f:
                f.write(text.replace("/usr/local/bin/bloomgate", binary))
            r = subprocess.run([analyze, "verify", unit], capture_output=True, text=True)
            # Only this unit's own complaints count (the host's units may have theirs).
            own = [l for l in (r.stdout + r.stderr).splitlines() if "bloomgate.service" in l]
            need(not own, f"systemd-analyze verify: {own}")


def schemas():
    tool = os.environ.get("BLOOMGATE_KUBERNETES_VALIDATE")
    if not tool:
        print("deploy: BLOOMGATE_KUBERNETES_VALIDATE unset: schemas not checked (scripts/test.sh sets it)",
              file=sys.stderr)
        return
    manifests = sorted(glob.glob(os.path.join(ROOT, "deploy/kubernetes/*.yaml")))
    for version in SCHEMA_VERSIONS:
        r = subprocess.run([tool, "--strict", "--quiet", "-k", version, *manifests],
                           capture_output=True, text=True)
        need(r.returncode == 0, f"kubernetes-validate -k {version}: {(r.stdout + r.stderr).strip()}")


# The oldest the Deployment supports (its preStop `sleep` action, which
# needs no shell in the image, is 1.30+: 1.28's schema rejects it), and the
# newest kubernetes-validate 1.37 ships.
SCHEMA_VERSIONS = ("1.30.0", "1.37.0")

if sys.argv[1:] == ["--facts"]:
    print_facts()
    sys.exit(0)
kubernetes()
compose()
systemd()
schemas()
for p in problems:
    print("deploy:", p)
sys.exit(1 if problems else 0)
