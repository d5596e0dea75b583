#!/usr/bin/env bash
# The compose files and the image's entrypoint, offline (no Docker daemon):
#  - `docker-compose config` accepts docker/docker-compose.yml and
#    docker/docker-compose.replicas.yml;
#  - with MODEL_DIR set, each treeserve service mounts it at /models and passes MODEL_DIR on,
#    and docker/entrypoint.sh then adds --model /models (unset: no --model, the tiny model);
#  - the replicas file runs 3 replicas with distinct --replica-id and distinct GPUs, and the
#    proxy mounts deploy/haproxy/haproxy.cfg and names the replicas' services.
# Exits 77 (ctest: skipped) without docker-compose, unless TREESERVE_REQUIRE_PROXY=1 (CI).
# usage: compose_test.sh SOURCE_DIR PYTHON3
set -euo pipefail
src=$1 py=$2
if ! command -v docker-compose >/dev/null; then
  echo "compose test skipped: docker-compose is not installed (Debian: apt-get install docker-compose)"
  [ "${TREESERVE_REQUIRE_PROXY:-0}" = 1 ] && { echo "TREESERVE_REQUIRE_PROXY=1: a skip is a failure"; exit 1; }
  exit 77
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for f in docker-compose.yml docker-compose.replicas.yml; do
  env -u MODEL_DIR docker-compose -f "$src/docker/$f" config >"$tmp/$f.unset"
  MODEL_DIR=/srv/models/llama docker-compose -f "$src/docker/$f" config >"$tmp/$f.set"
done

"$py" - "$tmp" "$src" <<'PY'
import os, sys, yaml
tmp, src = sys.argv[1], sys.argv[2]
def load(name):
    return yaml.safe_load(open(os.path.join(tmp, name)))["services"]
def check(cond, what):
    if not cond:
        sys.exit("compose: " + what)
for f in ("docker-compose.yml", "docker-compose.replicas.yml"):
    for mode in ("set", "unset"):
        services = load("%s.%s" % (f, mode))
        servers = {k: v for k, v in services.items() if v.get("image") == "treeserve:latest"
                   and "--listen" in (v.get("command") or [])}
        check(servers, "%s has no treeserve service" % f)
        for name, s in servers.items():
            env = s.get("environment") or {}
            mounts = s.get("volumes") or []
            if mode == "set":
                check(env.get("MODEL_DIR") == "/srv/models/llama",
                      "%s/%s does not pass MODEL_DIR on" % (f, name))
                check("/srv/models/llama:/models:ro" in mounts,
                      "%s/%s does not mount MODEL_DIR at /models: %s" % (f, name, mounts))
            else:
                check(not env.get("MODEL_DIR"), "%s/%s sets MODEL_DIR unasked" % (f, name))
            check("--model" not in s["command"], "%s/%s passes --model itself" % (f, name))
services = load("docker-compose.replicas.yml.unset")
replicas = {k: v for k, v in services.items() if "--replica-id" in (v.get("command") or [])}
ids = [v["command"][v["command"].index("--replica-id") + 1] for v in replicas.values()]
check(sorted(ids) == ["r1", "r2", "r3"], "replica ids %s" % ids)
gpus = [tuple(d["device_ids"]) for v in replicas.values()
        for d in v["deploy"]["resources"]["reservations"]["devices"]]
check(len(gpus) == 3 and len(set(gpus)) == 3 and all(len(g) == 1 for g in gpus),
      "each replica does not get a GPU of its own: %s" % gpus)
proxy = services["proxy"]
cfg = os.path.join(src, "deploy", "haproxy", "haproxy.cfg")
check(any(v.startswith(cfg + ":/usr/local/etc/haproxy/haproxy.cfg") for v in proxy["volumes"]),
      "the proxy does not mount deploy/haproxy/haproxy.cfg: %s" % proxy["volumes"])
text = open(cfg).read()
for name in replicas:
    check("-%s:50051}" % name in text, "haproxy.cfg does not default to %s:50051" % name)
print("compose files OK: %d replicas %s on GPUs %s behind %s" % (
    len(ids), sorted(ids), sorted(g[0] for g in gpus), proxy["image"]))
PY

# The entrypoint with a stand-in binary that prints its arguments.
ep=$src/docker/entrypoint.sh
out=$(env -u MODEL_DIR TREESERVE_BIN=echo sh "$ep" --listen 0.0.0.0:50051)
[ "$out" = "--listen 0.0.0.0:50051" ] || { echo "entrypoint without MODEL_DIR: $out"; exit 1; }
out=$(MODEL_DIR=/srv/m TREESERVE_BIN=echo sh "$ep" --listen 0.0.0.0:50051)
[ "$out" = "--listen 0.0.0.0:50051 --model /models" ] || { echo "entrypoint with MODEL_DIR: $out"; exit 1; }
out=$(MODEL_DIR=/srv/m TREESERVE_BIN=echo sh "$ep" --model /other)
[ "$out" = "--model /other" ] || { echo "entrypoint with MODEL_DIR and --model: $out"; exit 1; }
echo "entrypoint OK"
