#!/usr/bin/env bash
# kubernetes.sh - renders deploy/kubernetes (the kustomize base and every overlay) with
# `kubectl kustomize` and validates every rendered object: against the Kubernetes API schema
# (and the ServiceMonitor CRD's), after proving on deliberately broken objects that the
# validators reject a wrong type and an unknown field; and against kvrelay itself: each
# container runs a program of $KR_BIN with flags its --help lists, ports and probes name declared
# ports, the etcd endpoints are the etcd StatefulSet's members, no static membership, and what
# each overlay promises (tests/integration/kubernetes/validate.cjs). Also the Grafana dashboard's
# metric names against docs/observability.md. No cluster is involved: rendering and schemas only.
# Skips (77) without kubectl >= 1.21 (kustomize v4+), node, or the npm packages in
# $KR_BIN/npm-kubernetes/node_modules (`./kvrelay test` installs them from
# tests/integration/kubernetes/package-lock.json).
# Env (set by ctest): KR_BIN, KR_SRC.
set -euo pipefail
modules=$KR_BIN/npm-kubernetes/node_modules
if ! command -v kubectl >/dev/null 2>&1; then
  echo "SKIP: kubectl missing: install a kubectl >= 1.21 (Debian 12's kubernetes-client is 1.20, too old)"
  exit 77
fi
# The manifests use kustomize's `labels`, `patches` and components (kustomize >= 4.1, in kubectl
# >= 1.21). Debian 12's kubernetes-client is kubectl 1.20, whose kustomize 2.0.3 cannot build them.
kz=$(kubectl version --client 2>/dev/null | sed -n 's/^Kustomize Version: v\([0-9]*\)\..*/\1/p')
if [ -z "$kz" ] || [ "$kz" -lt 4 ]; then
  echo "SKIP: $(command -v kubectl) embeds kustomize ${kz:+v$kz.x }older than v4 (kubectl before 1.21): it cannot build deploy/kubernetes; install a kubectl >= 1.21"
  exit 77
fi
if ! command -v node >/dev/null 2>&1 || [ ! -d "$modules/kubernetes-models" ] || [ ! -d "$modules/typescript" ]; then
  echo "SKIP: node or the npm packages of tests/integration/kubernetes/package.json ($modules) are missing: ./kvrelay test installs them"
  exit 77
fi

out=$(mktemp -d -t kvrelay-k8s.XXXXXX)
trap 'rm -rf "$out"' EXIT
k=$KR_SRC/deploy/kubernetes
sets=(base)
for d in "$k"/overlays/*/; do sets+=("overlays/$(basename "$d")"); done
args=()
for s in "${sets[@]}"; do
  f=$out/$(echo "$s" | tr / _).yaml
  if ! kubectl kustomize "$k/$s" >"$f" 2>"$out/err"; then
    echo "FAIL: kubectl kustomize $s:"
    cat "$out/err"
    exit 1
  fi
  args+=("$s=$f")
done
for want in overlays/cpu overlays/gpu overlays/rdma overlays/external-etcd overlays/monitoring; do
  [[ " ${sets[*]} " == *" $want "* ]] || { echo "FAIL: $want is missing"; exit 1; }
done
# the old single manifest and its static membership are gone
if [ -e "$k/kvrelay.yaml" ]; then echo "FAIL: deploy/kubernetes/kvrelay.yaml still exists"; exit 1; fi

node "$KR_SRC/tests/integration/kubernetes/validate.cjs" --modules "$modules" --bin "$KR_BIN" --src "$KR_SRC" "${args[@]}"
