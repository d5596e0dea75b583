// Validates the Kubernetes manifest set (deploy/kustomization.yaml and what it names) without a
// cluster:
//  1. the objects: the kustomization read here (its resources, and a ConfigMap per
//     configMapGenerator entry), and also `kubectl kustomize` output when kubectl is installed;
//  2. Kubernetes' JSON schemas (kubernetes-models' validators: types, required fields);
//  3. unknown fields (a misspelt key is silently ignored by the API server): each object as a
//     TypeScript literal of kubernetes-models' interface for its kind, compiled by tsc, whose
//     excess-property check names any key the schema does not have;
//  4. the set's own consistency: the StatefulSet's headless Service, selectors and labels, each
//     pod's --replica-id from its name, the gRPC port in the args, ports and native gRPC probes,
//     a GPU per pod, the image's numeric user, and the proxy's replica addresses, ports, probes
//     and ConfigMap against deploy/haproxy/haproxy.cfg;
//  5. that the check can fail: copies of deploy/ with a misspelt key, a wrong type and a fixed
//     replica id must each be refused.
// usage: node k8s_validate.mjs SOURCE_DIR WORK_DIR (WORK_DIR holds node_modules)
import { execFileSync, spawnSync } from "node:child_process";
import fs from "node:fs";
import path from "node:path";
import YAML from "yaml";

const [src, work] = process.argv.slice(2);

// apiVersion/kind -> kubernetes-models module, class and interface.
const MODELS = {
  "apps/v1/StatefulSet": ["kubernetes-models/apps/v1/StatefulSet", "StatefulSet", "IStatefulSet"],
  "apps/v1/Deployment": ["kubernetes-models/apps/v1/Deployment", "Deployment", "IDeployment"],
  "v1/Service": ["kubernetes-models/v1/Service", "Service", "IService"],
  "v1/ConfigMap": ["kubernetes-models/v1/ConfigMap", "ConfigMap", "IConfigMap"],
};
const modelKey = (o) => `${o.apiVersion}/${o.kind}`;
const label = (o) => `${o.kind} ${o.metadata?.name} (${o.source})`;

function parseAll(text, source) {
  const objects = [];
  for (const doc of YAML.parseAllDocuments(text)) {
    if (doc.errors.length) throw new Error(`${source}: ${doc.errors[0].message}`);
    const o = doc.toJS();
    if (o !== null) objects.push(Object.assign(o, { source }));
  }
  return objects;
}

// The kustomization as kubectl would build it, for the fields this repository uses (anything
// else is refused, so a new field cannot slip past this reader unnoticed).
function loadKustomization(deployDir) {
  const k = YAML.parse(fs.readFileSync(path.join(deployDir, "kustomization.yaml"), "utf8"));
  const known = ["apiVersion", "kind", "resources", "configMapGenerator"];
  for (const key of Object.keys(k)) {
    if (!known.includes(key)) throw new Error(`kustomization.yaml: ${key} is not read by this test`);
  }
  const objects = [];
  for (const r of k.resources) {
    objects.push(...parseAll(fs.readFileSync(path.join(deployDir, r), "utf8"), r));
  }
  for (const g of k.configMapGenerator ?? []) {
    const data = {};
    for (const f of g.files) {
      const [key, file] = f.includes("=") ? f.split("=") : [path.basename(f), f];
      data[key] = fs.readFileSync(path.join(deployDir, file), "utf8");
    }
    objects.push({ apiVersion: "v1", kind: "ConfigMap", metadata: { name: g.name }, data,
                   source: "configMapGenerator" });
  }
  return objects;
}

function loadWithKubectl(deployDir) {
  const out = execFileSync("kubectl", ["kustomize", deployDir], { encoding: "utf8",
                                                                   timeout: 60000 });
  return parseAll(out, "kubectl kustomize");
}

async function schemaProblems(objects) {
  const problems = [];
  for (const o of objects) {
    const m = MODELS[modelKey(o)];
    if (!m) {
      problems.push(`${label(o)}: no schema for ${modelKey(o)} in this test`);
      continue;
    }
    const Model = (await import(m[0]))[m[1]];
    const { source, ...plain } = o;
    try {
      new Model(plain).validate();
    } catch (e) {
      problems.push(`${label(o)}: schema: ${e.message}`);
    }
  }
  return problems;
}

function unknownFieldProblems(objects, name) {
  const lines = [];
  const imports = new Set();
  objects.forEach((o, i) => {
    const m = MODELS[modelKey(o)];
    if (!m) return;
    imports.add(`import type { ${m[2]} } from "${m[0]}";`);
    const { source, ...plain } = o;
    lines.push(`// ${label(o)}`, `export const o${i}: ${m[2]} = ${JSON.stringify(plain, null, 2)};`);
  });
  const file = path.join(work, `${name}.ts`);
  fs.writeFileSync(file, [...imports, ...lines].join("\n") + "\n");
  const tsc = spawnSync(path.join(work, "node_modules", ".bin", "tsc"),
                        ["--noEmit", "--strict", "--skipLibCheck", "--target", "es2022",
                         "--module", "nodenext", "--moduleResolution", "nodenext", file],
                        { encoding: "utf8", cwd: work });
  if (tsc.status === 0) return [];
  const text = fs.readFileSync(file, "utf8").split("\n");
  const problems = [];
  for (const m of tsc.stdout.matchAll(/\.ts\((\d+),\d+\): error TS\d+: (.*)/g)) {
    // The object an error falls in: the nearest "// Kind name (file)" line above it.
    let at = Number(m[1]) - 1;
    while (at > 0 && !text[at].startsWith("// ")) at--;
    problems.push(`${text[at].slice(3)}: ${m[2]}`);
  }
  return problems.length ? problems : [`tsc failed: ${tsc.stdout}${tsc.stderr}`];
}

function structureProblems(objects, deployDir) {
  const problems = [];
  const check = (cond, what) => { if (!cond) problems.push(what); };
  const find = (kind, name) => objects.find((o) => o.kind === kind && o.metadata?.name === name);
  const subset = (a = {}, b = {}) => Object.entries(a).every(([k, v]) => b[k] === v);
  const portOf = (address) => Number(String(address).split(":").pop());
  const env = (c, name) => (c.env ?? []).find((e) => e.name === name);
  const cfgText = fs.readFileSync(path.join(deployDir, "haproxy", "haproxy.cfg"), "utf8");
  const cfgDefault = (v) => cfgText.match(new RegExp(`"\\$\\{${v}-([^}]*)\\}"`))?.[1];

  const sts = find("StatefulSet", "treeserve");
  if (!sts) return ["no StatefulSet treeserve"];
  const pod = sts.spec.template;
  const svc = find("Service", sts.spec.serviceName);
  check(svc, `no Service ${sts.spec.serviceName} (the StatefulSet's serviceName)`);
  check(svc?.spec.clusterIP === "None", "the replicas' Service is not headless (clusterIP None)");
  check(svc?.spec.publishNotReadyAddresses === true,
        "the replicas' Service hides pods that are not ready from DNS (the proxy checks them)");
  check(subset(svc?.spec.selector, pod.metadata.labels), "the Service selects no replica pod");
  check(subset(sts.spec.selector.matchLabels, pod.metadata.labels),
        "the StatefulSet's selector does not match its pods' labels");
  const c = pod.spec.containers[0];
  const args = c.args ?? [];
  const arg = (flag) => args[args.indexOf(flag) + 1];
  check(args.includes("--replica-id") && arg("--replica-id") === "$(POD_NAME)",
        "the replica id is not the pod's name (--replica-id $(POD_NAME))");
  check(env(c, "POD_NAME")?.valueFrom?.fieldRef?.fieldPath === "metadata.name",
        "POD_NAME is not the pod's metadata.name");
  const grpc = portOf(arg("--listen"));
  const portNamed = (ctr, n) => (ctr.ports ?? []).find((p) => p.name === n)?.containerPort;
  check(portNamed(c, "grpc") === grpc, `the grpc port is not --listen's (${grpc})`);
  check(portNamed(c, "metrics") === portOf(arg("--metrics-listen")),
        "the metrics port is not --metrics-listen's");
  check(c.readinessProbe?.grpc?.port === grpc, "readiness is not the gRPC health probe on --listen");
  check(c.livenessProbe?.tcpSocket || c.livenessProbe?.grpc, "no liveness probe");
  check(String(c.resources?.limits?.["nvidia.com/gpu"]) === "1", "a replica does not ask for 1 GPU");
  const dockerfile = fs.readFileSync(path.join(src, "docker", "Dockerfile"), "utf8");
  const user = dockerfile.match(/^USER (\d+)/m)?.[1];
  check(user && pod.spec.securityContext?.runAsUser === Number(user),
        `runAsUser is not the image's user (${user})`);

  const proxy = find("Deployment", "treeserve-proxy");
  if (!proxy) return [...problems, "no Deployment treeserve-proxy"];
  const pp = proxy.spec.template;
  const h = pp.spec.containers[0];
  check(subset(proxy.spec.selector.matchLabels, pp.metadata.labels),
        "the proxy's selector does not match its pods' labels");
  const servers = [...cfgText.matchAll(/^\s*server (r\d+) "\$\{TREESERVE_REPLICA_(\d+)-/gm)];
  const hashed = servers.filter((s, i) => servers.findIndex((t) => t[1] === s[1]) === i);
  check(hashed.length === sts.spec.replicas,
        `haproxy.cfg names ${hashed.length} replicas, the StatefulSet runs ${sts.spec.replicas}`);
  check(env(h, "POD_NAMESPACE")?.valueFrom?.fieldRef?.fieldPath === "metadata.namespace",
        "POD_NAMESPACE is not the pod's namespace");
  for (let i = 1; i <= sts.spec.replicas; i++) {
    const want = `${sts.metadata.name}-${i - 1}.${svc?.metadata.name}.$(POD_NAMESPACE).svc.cluster.local:${grpc}`;
    check(env(h, `TREESERVE_REPLICA_${i}`)?.value === want,
          `TREESERVE_REPLICA_${i} is not ${want}`);
  }
  const volume = pp.spec.volumes.find((v) => v.configMap);
  const cm = objects.find((o) => o.kind === "ConfigMap" && o.metadata.name === volume?.configMap.name);
  check(cm, `the proxy mounts ConfigMap ${volume?.configMap.name}, which the set does not make`);
  check(cm?.data?.["haproxy.cfg"] === cfgText, "the ConfigMap's haproxy.cfg is not deploy/haproxy/haproxy.cfg");
  const mount = h.volumeMounts.find((m) => m.name === volume?.name);
  check(mount?.mountPath === "/usr/local/etc/haproxy",
        "the config is not mounted where the haproxy image reads it (/usr/local/etc/haproxy)");
  check(portNamed(h, "grpc") === portOf(cfgDefault("TREESERVE_PROXY_LISTEN")),
        "the proxy's grpc port is not haproxy.cfg's listener");
  check(portNamed(h, "stats") === portOf(cfgDefault("TREESERVE_PROXY_STATS")),
        "the proxy's stats port is not haproxy.cfg's stats listener");
  const monitor = cfgText.match(/^\s*monitor-uri (\S+)/m)?.[1];
  check(h.readinessProbe?.httpGet?.path === monitor && h.livenessProbe?.httpGet?.path === monitor,
        `the proxy's probes do not ask haproxy.cfg's monitor-uri (${monitor})`);
  const psvc = find("Service", "treeserve-proxy");
  check(psvc && subset(psvc.spec.selector, pp.metadata.labels), "no Service selects the proxy pods");
  check(psvc?.spec.ports.some((p) => p.targetPort === "grpc"), "the proxy Service has no grpc port");
  return problems;
}

async function validate(deployDir, name, { kubectl }) {
  const sets = [["kustomization", loadKustomization(deployDir)]];
  if (kubectl) sets.push(["kubectl", loadWithKubectl(deployDir)]);
  const problems = [];
  for (const [how, objects] of sets) {
    const prefix = (p) => `[${how}] ${p}`;
    problems.push(...(await schemaProblems(objects)).map(prefix));
    problems.push(...unknownFieldProblems(objects, `${name}-${how}`).map(prefix));
    problems.push(...structureProblems(objects, deployDir).map(prefix));
  }
  return { problems, counts: sets.map(([how, o]) => `${o.length} objects (${how})`) };
}

// A copy of deploy/ with one file changed.
function mutated(name, file, from, to) {
  const dir = path.join(work, "mutations", name);
  fs.rmSync(dir, { recursive: true, force: true });
  fs.cpSync(path.join(src, "deploy"), dir, { recursive: true });
  const text = fs.readFileSync(path.join(dir, file), "utf8");
  if (!text.includes(from)) throw new Error(`${file} no longer holds ${JSON.stringify(from)}`);
  fs.writeFileSync(path.join(dir, file), text.replace(from, to));
  return dir;
}

const hasKubectl = spawnSync("kubectl", ["version", "--client"], { timeout: 30000 }).status === 0;
const deployDir = path.join(src, "deploy");
const { problems, counts } = await validate(deployDir, "deploy", { kubectl: hasKubectl });
if (problems.length) {
  console.log(`deploy/: ${problems.length} problems:\n  ${problems.join("\n  ")}`);
  process.exit(1);
}
console.log(`deploy/ valid: ${counts.join(", ")}${hasKubectl ? "" : " (no kubectl: its build skipped)"}`);

const mutations = [
  ["misspelt-key", "k8s/treeserve.yaml", "readinessProbe:", "readinesProbe:", /readinesProbe/],
  ["wrong-type", "k8s/haproxy.yaml", "containerPort: 8404", "containerPort: stats",
   /containerPort must be integer/],
  ["fixed-replica-id", "k8s/treeserve.yaml", '"--replica-id", "$(POD_NAME)"',
   '"--replica-id", "r1"', /replica id is not the pod's name/],
];
for (const [name, file, from, to, want] of mutations) {
  const r = await validate(mutated(name, file, from, to), name, { kubectl: false });
  if (!r.problems.some((p) => want.test(p))) {
    console.log(`the ${name} copy was not refused as expected (${want}): ${r.problems.join("; ")}`);
    process.exit(1);
  }
  console.log(`${name}: refused (${r.problems.find((p) => want.test(p))})`);
}
console.log("k8s manifests OK");
