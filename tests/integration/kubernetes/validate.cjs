// validate.cjs - checks the rendered Kubernetes manifests of deploy/kubernetes (kubectl kustomize
// output, one YAML file per base/overlay) against the Kubernetes API schema and against what the
// kvrelay programs accept. Run by tests/integration/kubernetes.sh, not by hand:
//   node validate.cjs --modules DIR --bin KR_BIN --src KR_SRC NAME=rendered.yaml ...
// Exit 0 when everything holds, 1 with one line per fault otherwise.
//
// Schema validation is two validators over the same generated models (kubernetes-models, built
// from the Kubernetes OpenAPI spec, and @kubernetes-models/prometheus-operator, from the
// ServiceMonitor CRD):
//  1. each model's validate() (ajv on the JSON schema): types, enums, required fields, formats.
//     Its schemas do not set additionalProperties: false, so it accepts unknown fields;
//  2. TypeScript's excess-property check: every object becomes a typed object literal
//     (`const o: IStatefulSet = {...}`) and tsc rejects unknown fields at any depth and wrong
//     types.
// Before trusting them, the self-test feeds both deliberately broken objects and fails unless
// they are rejected: the proof that this test can fail.
//
// What it does not do: talk to a cluster (no admission, no defaulting, no server-side checks such
// as immutable fields or quota), or check images exist.
"use strict";
const fs = require("fs");
const os = require("os");
const path = require("path");
const { execFileSync } = require("child_process");
const { pathToFileURL } = require("url");

const args = process.argv.slice(2);
const opt = {};
const inputs = [];
for (let i = 0; i < args.length; i++) {
  if (args[i].startsWith("--")) opt[args[i].slice(2)] = args[++i];
  else inputs.push(args[i]);
}
for (const k of ["modules", "bin", "src"]) {
  if (!opt[k]) {
    console.error(`validate.cjs: --${k} missing`);
    process.exit(2);
  }
}
const modules = opt.modules;
const YAML = require(path.join(modules, "yaml"));
const ts = require(path.join(modules, "typescript"));

const faults = [];
const fault = (where, msg) => faults.push(`${where}: ${msg}`);

// apiVersion -> [module specifier for types, file with the runtime classes]
const GROUPS = {
  v1: "kubernetes-models/v1",
  "apps/v1": "kubernetes-models/apps/v1",
  "policy/v1": "kubernetes-models/policy/v1",
  "monitoring.coreos.com/v1": "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1",
};
const loaded = {};
async function modelClass(obj) {
  const spec = GROUPS[obj.apiVersion];
  if (!spec) return null;
  if (!loaded[spec]) loaded[spec] = await import(pathToFileURL(path.join(modules, spec, "index.js")).href);
  return loaded[spec][obj.kind] || null;
}

// 1. ajv through the model's validate(): the error text, or "" when valid
async function ajvCheck(obj) {
  const Cls = await modelClass(obj);
  if (!Cls) return `no model for apiVersion ${obj.apiVersion} kind ${obj.kind}`;
  try {
    new Cls(obj).validate();
    return "";
  } catch (e) {
    return String(e.message || e).replace(/\s+/g, " ");
  }
}

// 2. tsc over all objects at once (one compiler run: ~3 s). objs: [{where, obj}]. Returns a map
// where -> [messages].
function tscCheck(objs) {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), "kvrelay-k8s-"));
  try {
    fs.symlinkSync(path.resolve(modules), path.join(dir, "node_modules"));
    const lines = [];
    const owner = []; // line number (0-based) -> index in objs
    objs.forEach((o, i) => {
      const spec = GROUPS[o.obj.apiVersion];
      const text = `export const o${i}: import("${spec}").I${o.obj.kind} = ${JSON.stringify(o.obj, null, 1)};`;
      for (const l of text.split("\n")) {
        owner.push(i);
        lines.push(l);
      }
    });
    const file = path.join(dir, "objects.ts");
    fs.writeFileSync(file, lines.join("\n") + "\n");
    const program = ts.createProgram([file], {
      strict: true,
      noEmit: true,
      module: ts.ModuleKind.NodeNext,
      moduleResolution: ts.ModuleResolutionKind.NodeNext,
      skipLibCheck: true,
      types: [],
    });
    const out = new Map();
    for (const d of ts.getPreEmitDiagnostics(program)) {
      const msg = ts.flattenDiagnosticMessageText(d.messageText, " ");
      if (!d.file || path.resolve(d.file.fileName) !== path.resolve(file)) {
        out.set("(compiler)", (out.get("(compiler)") || []).concat(msg));
        continue;
      }
      const { line } = d.file.getLineAndCharacterOfPosition(d.start);
      const where = objs[owner[line]].where;
      out.set(where, (out.get(where) || []).concat(`TS${d.code} at \`${lines[line].trim()}\`: ${msg}`));
    }
    return out;
  } finally {
    fs.rmSync(dir, { recursive: true, force: true });
  }
}

// The proof that the validators catch what they must. Each broken object has to be refused by
// the validator named; the valid one has to pass both.
function deployment(replicas, container) {
  return {
    apiVersion: "apps/v1",
    kind: "Deployment",
    metadata: { name: "selftest" },
    spec: {
      replicas,
      selector: { matchLabels: { a: "b" } },
      template: { metadata: { labels: { a: "b" } }, spec: { containers: [{ name: "c", image: "i", ...container }] } },
    },
  };
}
const SELFTEST = [
  { name: "valid Deployment", obj: deployment(2, {}), ajv: "pass", tsc: "pass" },
  { name: 'Deployment with spec.replicas: "two"', obj: deployment("two", {}), ajv: "fail", tsc: "fail" },
  { name: "Deployment whose container has an unknown field", obj: deployment(2, { bogusField: 1 }), ajv: "any", tsc: "fail" },
  { name: 'Deployment with replicas "two" and an unknown container field', obj: deployment("two", { bogusField: 1 }), ajv: "fail", tsc: "fail" },
  { name: "Deployment with an unknown field in a probe", obj: deployment(1, { livenessProbe: { httpGet: { port: "http", pathh: "/" } } }), ajv: "any", tsc: "fail" },
  { name: "Deployment with imagePullPolicy: Sometimes", obj: deployment(1, { imagePullPolicy: "Sometimes" }), ajv: "fail", tsc: "fail" },
  {
    name: "ServiceMonitor with a numeric endpoint port",
    obj: { apiVersion: "monitoring.coreos.com/v1", kind: "ServiceMonitor", metadata: { name: "s" }, spec: { selector: {}, endpoints: [{ port: 9001 }] } },
    ajv: "fail",
    tsc: "fail",
  },
  {
    name: "ServiceMonitor with an unknown endpoint field",
    obj: { apiVersion: "monitoring.coreos.com/v1", kind: "ServiceMonitor", metadata: { name: "s" }, spec: { selector: {}, endpoints: [{ port: "http", scrapeEvery: "5s" }] } },
    ajv: "any",
    tsc: "fail",
  },
];

async function selfTest() {
  const tsc = tscCheck(SELFTEST.map((t) => ({ where: t.name, obj: t.obj })));
  if (tsc.has("(compiler)")) fault("self-test", `tsc could not load the models: ${tsc.get("(compiler)").join("; ")}`);
  for (const t of SELFTEST) {
    const a = await ajvCheck(t.obj);
    const tm = (tsc.get(t.name) || []).join("; ");
    const verdict = (msg) => (msg ? `rejected (${msg.slice(0, 160)})` : "accepted");
    console.log(`self-test: ${t.name}: validate() ${verdict(a)}; tsc ${verdict(tm)}`);
    if (t.ajv === "pass" && a) fault("self-test", `${t.name}: validate() refused a valid object: ${a}`);
    if (t.ajv === "fail" && !a) fault("self-test", `${t.name}: validate() accepted it`);
    if (t.tsc === "pass" && tm) fault("self-test", `${t.name}: tsc refused a valid object: ${tm}`);
    if (t.tsc === "fail" && !tm) fault("self-test", `${t.name}: tsc accepted it`);
  }
}

// --- kvrelay-specific checks on one rendered set --------------------------------------------

const helpCache = {};
function helpOf(prog) {
  if (!(prog in helpCache)) {
    const exe = path.join(opt.bin, prog);
    if (!fs.existsSync(exe)) helpCache[prog] = null;
    else {
      try {
        helpCache[prog] = execFileSync(exe, ["--help"], { encoding: "utf8", stdio: ["ignore", "pipe", "pipe"] });
      } catch (e) {
        helpCache[prog] = (e.stdout || "") + (e.stderr || ""); // some programs exit non-zero on --help
      }
    }
  }
  return helpCache[prog];
}

const podTemplate = (o) => (["StatefulSet", "Deployment"].includes(o.kind) ? o.spec.template : null);
const matches = (selector, labels) => Object.entries(selector || {}).every(([k, v]) => (labels || {})[k] === v);
const flagValue = (argv, flag) => {
  for (const a of argv) if (a.startsWith(flag + "=")) return a.slice(flag.length + 1);
  const i = argv.indexOf(flag);
  return i >= 0 ? argv[i + 1] : undefined;
};

function checkSet(name, objs) {
  const W = (o) => `${name}: ${o.kind}/${o.metadata.name}`;
  const workloads = objs.filter(podTemplate);
  const services = objs.filter((o) => o.kind === "Service");
  const byName = (kind, n) => objs.find((o) => o.kind === kind && o.metadata.name === n);

  // no static membership any more
  for (const o of objs) {
    if (o.kind === "ConfigMap" && Object.keys(o.data || {}).some((k) => /nodes\.json/.test(k)))
      fault(W(o), "a membership file (nodes.json): membership is etcd's now");
  }

  const etcdCm = byName("ConfigMap", "kvrelay-etcd");
  if (!etcdCm) fault(name, "ConfigMap kvrelay-etcd (the etcd endpoints) is missing");

  for (const w of workloads) {
    const tpl = w.spec.template;
    const pod = tpl.spec;
    const labels = tpl.metadata.labels || {};
    if (!matches(w.spec.selector.matchLabels, labels)) fault(W(w), "selector does not match the pod template's labels");
    if (w.kind === "StatefulSet" && !byName("Service", w.spec.serviceName)) fault(W(w), `serviceName ${w.spec.serviceName}: no such Service`);
    const psc = pod.securityContext || {};
    for (const c of pod.containers) {
      const where = `${W(w)} container ${c.name}`;
      const ports = c.ports || [];
      const portNames = new Set(ports.map((p) => p.name));
      const portNums = new Set(ports.map((p) => p.containerPort));
      const declared = (p) => (typeof p === "number" ? portNums.has(p) : portNames.has(p));
      for (const probe of ["startupProbe", "readinessProbe", "livenessProbe"]) {
        const pr = c[probe];
        if (!pr) continue;
        const port = (pr.httpGet || pr.tcpSocket || pr.grpc || {}).port;
        if (port !== undefined && !declared(port)) fault(where, `${probe} port ${port} is not a declared container port`);
      }
      // securityContext: non-root, no privilege escalation, no capabilities but those added on purpose
      const sc = c.securityContext || {};
      if (!(sc.runAsNonRoot ?? psc.runAsNonRoot)) fault(where, "runAsNonRoot is not set");
      if (sc.allowPrivilegeEscalation !== false) fault(where, "allowPrivilegeEscalation is not false");
      if (!((sc.capabilities || {}).drop || []).includes("ALL")) fault(where, "capabilities do not drop ALL");
      if (sc.readOnlyRootFilesystem !== true) fault(where, "readOnlyRootFilesystem is not true");
      if (!c.resources || !c.resources.requests) fault(where, "no resource requests");

      // $(VAR) in command/args must name an env var of the container (else Kubernetes passes
      // the text through as it is)
      const argv = [...(c.command || []), ...(c.args || [])];
      const envNames = new Set((c.env || []).map((e) => e.name));
      for (const a of argv) for (const m of a.matchAll(/\$\(([A-Za-z_][A-Za-z0-9_]*)\)/g)) if (!envNames.has(m[1])) fault(where, `${a}: $(${m[1]}) is not in env`);
      for (const e of c.env || []) {
        const ref = (e.valueFrom || {}).configMapKeyRef;
        if (ref && !ref.optional) {
          const cm = byName("ConfigMap", ref.name);
          if (!cm || !(ref.key in (cm.data || {}))) fault(where, `env ${e.name}: ConfigMap ${ref.name} key ${ref.key} does not exist`);
        }
        const fr = (e.valueFrom || {}).resourceFieldRef;
        if (fr && fr.containerName !== c.name) fault(where, `env ${e.name}: resourceFieldRef names container ${fr.containerName}`);
      }

      if (!/^kvrelay(:|$|@)/.test(String(c.image).split("/").pop())) continue; // etcd's own image
      const prog = (c.command || [])[0];
      const help = prog && helpOf(prog);
      if (!prog || !/^kvrelay-/.test(prog)) {
        fault(where, `command ${JSON.stringify(c.command)} does not name a kvrelay program`);
        continue;
      }
      if (help === null) {
        fault(where, `${prog} is not in ${opt.bin}`);
        continue;
      }
      for (const a of argv.slice(1)) {
        if (!a.startsWith("--")) continue;
        const flag = a.split("=")[0];
        if (!new RegExp(`(^|\\s)${flag.replace(/[-]/g, "\\-")}(\\s|$|=)`, "m").test(help)) fault(where, `${prog} has no flag ${flag} (not in its --help)`);
      }
      if (argv.includes("--nodes") || argv.some((a) => a.startsWith("--nodes="))) fault(where, "--nodes: static membership");
      // membership from etcd, through the ConfigMap
      const etcdArg = flagValue(argv, "--etcd");
      const etcdEnv = (c.env || []).find((e) => etcdArg === `$(${e.name})`);
      const etcdRef = etcdEnv && (etcdEnv.valueFrom || {}).configMapKeyRef;
      if (!etcdRef || etcdRef.name !== "kvrelay-etcd" || etcdRef.key !== "endpoints") fault(where, `--etcd ${etcdArg}: not the endpoints of ConfigMap kvrelay-etcd`);
      const clusterArg = flagValue(argv, "--cluster");
      if (!clusterArg) fault(where, "no --cluster");
      // node ids from the pod name
      const idArg = flagValue(argv, "--id");
      const idEnv = (c.env || []).find((e) => idArg === `$(${e.name})`);
      if (!idEnv || ((idEnv.valueFrom || {}).fieldRef || {}).fieldPath !== "metadata.name") fault(where, `--id ${idArg}: not the pod name`);
      // every listening flag names a declared port
      for (const f of ["--listen", "--http", "--transfer"]) {
        const v = flagValue(argv, f);
        if (v === undefined) continue;
        const port = Number(v.split(":").pop());
        if (!portNums.has(port)) fault(where, `${f} ${v}: port ${port} is not a declared container port`);
        if (!v.startsWith("0.0.0.0:")) fault(where, `${f} ${v}: binds one address only; other pods cannot reach it`);
      }
      const ann = tpl.metadata.annotations || {};
      if (ann["prometheus.io/scrape"] !== "true" || Number(ann["prometheus.io/port"]) !== Number(flagValue(argv, "--http").split(":").pop()))
        fault(where, "prometheus.io/scrape and prometheus.io/port must name the --http port");
      if (prog === "kvrelay-prefill" || prog === "kvrelay-decode") {
        const adv = flagValue(argv, "--advertise");
        const advEnv = (c.env || []).find((e) => adv === `$(${e.name})`);
        if (!advEnv || ((advEnv.valueFrom || {}).fieldRef || {}).fieldPath !== "status.podIP") fault(where, `--advertise ${adv}: not the pod IP`);
        const drain = Number(flagValue(argv, "--drain-timeout-s") || 30);
        const grace = pod.terminationGracePeriodSeconds ?? 30;
        if (grace <= drain) fault(where, `terminationGracePeriodSeconds ${grace} does not cover --drain-timeout-s ${drain}`);
        if (w.kind !== "StatefulSet") fault(where, "nodes run in a StatefulSet (stable ids)");
        const ucx = (c.env || []).find((e) => e.name === "UCX_TLS");
        if (!ucx || !ucx.value.split(",").includes("tcp")) fault(where, "UCX_TLS must include tcp (the connection manager)");
        // what each overlay promises
        const overlay = name.split("/").pop();
        const lim = (c.resources || {}).limits || {};
        if (overlay === "gpu") {
          if (String(lim["nvidia.com/gpu"]) !== "1") fault(where, "gpu overlay: no nvidia.com/gpu limit");
          if (flagValue(argv, "--backend") !== "cuda") fault(where, "gpu overlay: no --backend=cuda");
          if (!(pod.tolerations || []).some((t) => t.key === "nvidia.com/gpu")) fault(where, "gpu overlay: no toleration for GPU nodes");
        } else if (flagValue(argv, "--backend") === "cuda") fault(where, `${overlay}: --backend=cuda outside the gpu overlay`);
        if (overlay === "rdma") {
          if (!Object.keys(lim).some((k) => k.startsWith("rdma/"))) fault(where, "rdma overlay: no RDMA device resource");
          if (!ucx || !["rc", "ud", "tcp"].every((t) => ucx.value.split(",").includes(t))) fault(where, "rdma overlay: UCX_TLS is not rc,ud,tcp");
          if (!(((c.securityContext || {}).capabilities || {}).add || []).includes("IPC_LOCK")) fault(where, "rdma overlay: no IPC_LOCK");
        }
      }
      if (prog === "kvrelay-router") {
        if (!c.readinessProbe || !c.readinessProbe.grpc) fault(where, "the router's readiness is gRPC health");
        const key = (c.env || []).find((e) => e.name === "KVRELAY_API_KEY");
        const ref = key && (key.valueFrom || {}).secretKeyRef;
        if (!ref || ref.name !== "kvrelay-api-key" || ref.optional !== true) fault(where, "KVRELAY_API_KEY from the optional Secret kvrelay-api-key");
      }
    }
  }

  // Services: the selector finds a workload, each targetPort is one of its container ports
  for (const s of services) {
    const ws = workloads.filter((w) => matches(s.spec.selector, w.spec.template.metadata.labels));
    if (ws.length === 0) {
      fault(W(s), "selector matches no workload");
      continue;
    }
    for (const p of s.spec.ports) {
      const t = p.targetPort ?? p.port;
      const ok = ws.every((w) => w.spec.template.spec.containers.some((c) => (c.ports || []).some((cp) => (typeof t === "number" ? cp.containerPort === t : cp.name === t))));
      if (!ok) fault(W(s), `port ${p.name}: targetPort ${t} is not a container port of the pods it selects`);
    }
  }
  for (const b of objs.filter((o) => o.kind === "PodDisruptionBudget")) {
    if (!workloads.some((w) => matches(b.spec.selector.matchLabels, w.spec.template.metadata.labels))) fault(W(b), "selector matches no workload");
  }
  for (const sm of objs.filter((o) => o.kind === "ServiceMonitor")) {
    const sel = sm.spec.selector.matchExpressions || [];
    const picked = services.filter((s) => sel.every((e) => e.operator === "In" && e.values.includes((s.metadata.labels || {})[e.key])));
    if (picked.length === 0) fault(W(sm), "selects no Service");
    for (const ep of sm.spec.endpoints)
      for (const s of picked) if (!s.spec.ports.some((p) => p.name === ep.port)) fault(W(sm), `Service ${s.metadata.name} has no port named ${ep.port}`);
    for (const l of sm.spec.podTargetLabels || []) if (!workloads.some((w) => l in (w.spec.template.metadata.labels || {}))) fault(W(sm), `podTargetLabels ${l}: no pod has it`);
  }

  // etcd: the endpoints are the StatefulSet's members through its headless Service
  const etcd = objs.find((o) => o.kind === "StatefulSet" && o.spec.template.spec.containers.some((c) => /etcd/.test((c.command || [c.image]).join(" "))));
  const endpoints = etcdCm ? String(etcdCm.data.endpoints || "").split(",") : [];
  if (etcd) {
    const svc = byName("Service", etcd.spec.serviceName);
    const client = svc && svc.spec.ports.find((p) => p.name === "client");
    const peer = svc && svc.spec.ports.find((p) => p.name === "peer");
    if (!svc || svc.spec.clusterIP !== "None") fault(W(etcd), `serviceName ${etcd.spec.serviceName} is not a headless Service`);
    else if (!client || !peer) fault(W(svc), "needs ports named client and peer");
    else {
      const n = etcd.spec.replicas;
      const want = [...Array(n).keys()].map((i) => `${etcd.metadata.name}-${i}.${svc.metadata.name}:${client.port}`);
      if (endpoints.join(",") !== want.join(",")) fault(`${name}: ConfigMap/kvrelay-etcd`, `endpoints ${endpoints.join(",")}, the etcd StatefulSet has ${want.join(",")}`);
      const eargs = etcd.spec.template.spec.containers[0].args || [];
      const initial = flagValue(eargs, "--initial-cluster") || "";
      const wantInitial = [...Array(n).keys()].map((i) => `${etcd.metadata.name}-${i}=http://${etcd.metadata.name}-${i}.${svc.metadata.name}:${peer.port}`);
      if (initial !== wantInitial.join(",")) fault(W(etcd), `--initial-cluster ${initial}, expected ${wantInitial.join(",")}`);
      for (const [f, port] of [["--listen-client-urls", client.port], ["--listen-peer-urls", peer.port], ["--advertise-client-urls", client.port], ["--initial-advertise-peer-urls", peer.port]]) {
        const v = flagValue(eargs, f) || "";
        if (!v.endsWith(`:${port}`)) fault(W(etcd), `${f} ${v} is not on port ${port}`);
      }
      if (!svc.spec.publishNotReadyAddresses) fault(W(svc), "members must resolve each other before they are ready: publishNotReadyAddresses");
      if (etcd.spec.podManagementPolicy !== "Parallel") fault(W(etcd), "podManagementPolicy must be Parallel (a lone first member never gets a quorum)");
      if (!(etcd.spec.volumeClaimTemplates || []).length) fault(W(etcd), "no volumeClaimTemplates");
      if (!/^[^:]+\/[^:]*etcd:v?\d+\.\d+\.\d+/.test(etcd.spec.template.spec.containers[0].image)) fault(W(etcd), "the etcd image must have a pinned version tag");
    }
  } else if (endpoints.some((e) => /kvrelay-etcd/.test(e))) {
    fault(`${name}: ConfigMap/kvrelay-etcd`, "endpoints name kvrelay-etcd, but there is no etcd StatefulSet");
  }
}

// Grafana dashboard: valid JSON, every metric it queries is one of docs/observability.md's, and
// the metrics the dashboard is there for are all on it
function checkDashboard() {
  const file = path.join(opt.src, "deploy/kubernetes/grafana/kvrelay-dashboard.json");
  let dash;
  try {
    dash = JSON.parse(fs.readFileSync(file, "utf8"));
  } catch (e) {
    fault(file, `not JSON: ${e.message}`);
    return;
  }
  const doc = fs.readFileSync(path.join(opt.src, "docs/observability.md"), "utf8");
  const known = new Set([...doc.matchAll(/^\| `(kvrelay_[a-z_]+)`/gm)].map((m) => m[1]));
  const used = new Set();
  const ids = new Set();
  for (const p of dash.panels || []) {
    if (ids.has(p.id)) fault(file, `panel id ${p.id} twice`);
    ids.add(p.id);
    for (const t of p.targets || []) {
      for (const m of String(t.expr).matchAll(/kvrelay_[a-z_]+/g)) {
        const base = m[0].replace(/_(bucket|sum|count)$/, "");
        if (!known.has(base)) fault(file, `panel "${p.title}": ${m[0]} is not a metric of docs/observability.md`);
        used.add(base);
      }
    }
  }
  for (const want of ["kvrelay_requests_total", "kvrelay_ttft_seconds", "kvrelay_tpot_seconds", "kvrelay_tokens_generated_total", "kvrelay_kv_blocks_used", "kvrelay_kv_blocks_free", "kvrelay_kv_blocks_reserved", "kvrelay_queue_depth", "kvrelay_kv_bytes_shipped_total", "kvrelay_http_responses_total", "kvrelay_batch_size"])
    if (!used.has(want)) fault(file, `no panel shows ${want}`);
  console.log(`dashboard: ${(dash.panels || []).length} panels, ${used.size} metrics, all in docs/observability.md`);
}

async function main() {
  await selfTest();
  if (faults.length) {
    for (const f of faults) console.log(`FAULT ${f}`);
    console.log("the validators did not reject the broken objects: nothing below could be trusted");
    process.exit(1);
  }
  const all = [];
  for (const arg of inputs) {
    const eq = arg.indexOf("=");
    const name = arg.slice(0, eq);
    const docs = YAML.parseAllDocuments(fs.readFileSync(arg.slice(eq + 1), "utf8"));
    const objs = [];
    for (const d of docs) {
      if (d.errors.length) fault(name, `YAML: ${d.errors[0].message}`);
      const o = d.toJS();
      if (o) objs.push(o);
    }
    for (const o of objs) {
      const where = `${name}: ${o.kind}/${o.metadata && o.metadata.name}`;
      const a = await ajvCheck(o);
      if (a) fault(where, `schema: ${a}`);
      all.push({ where, obj: o });
    }
    checkSet(name, objs);
    console.log(`${name}: ${objs.length} objects (${[...new Set(objs.map((o) => o.kind))].join(", ")})`);
  }
  for (const [where, msgs] of tscCheck(all)) for (const m of msgs) fault(where, `schema: ${m}`);
  checkDashboard();
  for (const f of faults) console.log(`FAULT ${f}`);
  console.log(faults.length ? `${faults.length} faults` : `all ${all.length} rendered objects valid`);
  process.exit(faults.length ? 1 : 0);
}
main().catch((e) => {
  console.log(`validate.cjs: ${e.stack || e}`);
  process.exit(1);
});
