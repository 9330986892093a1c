# Sourced by quickstart and test: install what tierfs needs on a fresh Debian machine, idempotently.
# System packages through apt (only when one is missing), Python packages into REPO/.venv (only when
# setup.cfg changed since the last install).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$REPO/.venv"
PY="$VENV/bin/python"

log() { printf '\033[1m[tierfs]\033[0m %s\n' "$*"; }

apt_install() {
  local missing=()
  for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  local SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  log "installing system packages: ${missing[*]}"
  $SUDO apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
}

install_system() {
  local pkgs=(fuse3 libfuse3-dev pkg-config gcc python3-venv "$@")
  command -v java >/dev/null 2>&1 || pkgs+=(default-jre-headless)
  # python3-venv is only needed when the interpreter lacks a working venv module
  python3 -c 'import venv, ensurepip' 2>/dev/null && pkgs=("${pkgs[@]/python3-venv}")
  local clean=(); for p in "${pkgs[@]}"; do [ -n "$p" ] && clean+=("$p"); done
  apt_install "${clean[@]}"
  [ -e /dev/fuse ] || { log "error: /dev/fuse is missing; FUSE cannot work here (modprobe fuse?)"; exit 1; }
}

# The stamp holds the hash of setup.cfg + pyproject.toml and the extras installed with it ("<hash>[test]").
# An install with extras also satisfies a plain one, so alternating `quickstart` and `test` installs once.
install_python() {
  local extras="${1:-}"
  local stamp="$VENV/.tierfs-installed"
  local hash; hash="$(cat "$REPO/setup.cfg" "$REPO/pyproject.toml" | sha256sum | cut -c1-16)"
  if [ ! -x "$PY" ]; then
    log "creating $VENV"
    python3 -m venv "$VENV"
  fi
  local have; have="$(cat "$stamp" 2>/dev/null || true)"
  if [ "$have" != "$hash$extras" ] && { [ -n "$extras" ] || [ "${have:0:16}" != "$hash" ]; }; then
    log "installing tierfs and its Python dependencies into .venv"
    "$PY" -m pip install -q --upgrade pip >/dev/null
    "$PY" -m pip install -q -e "$REPO$extras"
    echo "$hash$extras" > "$stamp"
  fi
  export PYSPARK_PYTHON="$PY" PYSPARK_DRIVER_PYTHON="$PY"
}

# Apache RocketMQ for the broker tests and bench/broker.py: Maven (and a JDK for javac) from apt when absent, then
# each version's artifacts from Maven Central into ~/.m2 and its runtime classpath into
# ~/.cache/tierfs/rocketmq/<version>/classpath (tests/brokerutil.py reads it). A version that does not resolve
# stops the install: the broker tests must fail, never skip.
install_rocketmq() {
  command -v javac >/dev/null 2>&1 || apt_install default-jdk-headless
  command -v mvn >/dev/null 2>&1 || apt_install maven
  local cache="${TIERFS_ROCKETMQ_CACHE:-$HOME/.cache/tierfs/rocketmq}" v profile out
  for v in $("$PY" -c 'import sys; sys.path.insert(0, "tests"); import brokerutil; print(*brokerutil.VERSIONS)'); do
    out="$cache/$v/classpath"
    [ -s "$out" ] && [ "$out" -nt "$REPO/tests/broker/pom.xml" ] && continue
    log "resolving Apache RocketMQ $v with Maven (cached in ~/.m2)"
    mkdir -p "$cache/$v"
    profile=""; case "$v" in 5.*) profile="-Ptiered-store" ;; esac
    mvn -q -B -f "$REPO/tests/broker/pom.xml" $profile "-Drocketmq.version=$v" dependency:build-classpath \
      "-Dmdep.outputFile=$out.tmp" || { log "error: Apache RocketMQ $v did not resolve from Maven Central"; exit 1; }
    mv "$out.tmp" "$out"
  done
}

# Delta Lake's Spark runtime (and hadoop-aws, for S3A on Ceph RGW) for the tests that read the archive table with
# Spark SQL: Delta's own jars and S3A's from Maven Central into ~/.m2, their classpath into
# ~/.cache/tierfs/delta-spark/<delta>-spark<x.y>-hadoop<v>/classpath (tests/deltaspark.py names it and the versions,
# from the installed pyspark). Spark's own jars (Scala, Hadoop's client, Parquet) are left out. A failure stops the
# install: those tests must fail, never skip.
install_delta_spark() {
  command -v mvn >/dev/null 2>&1 || apt_install maven
  local line args out
  line="$("$PY" -c 'import sys; sys.path.insert(0, sys.argv[1]); import deltaspark
print(*deltaspark.resolve_args())' "$REPO/tests")" || { log "error: cannot tell which Delta runtime pyspark needs"; exit 1; }
  read -r -a args <<< "$line"
  out="${args[-1]}"; unset 'args[-1]'
  [ -s "$out" ] && [ "$out" -nt "$REPO/tests/delta/pom.xml" ] && return 0
  log "resolving Delta Lake's Spark runtime and hadoop-aws with Maven (${args[*]})"
  mkdir -p "$(dirname "$out")"
  mvn -q -B -f "$REPO/tests/delta/pom.xml" "${args[@]}" dependency:build-classpath -DincludeScope=runtime \
    -DincludeGroupIds=io.delta,org.apache.hadoop,software.amazon.awssdk,software.amazon.s3.analyticsaccelerator,org.wildfly.openssl \
    -DexcludeArtifactIds=hadoop-client-api,hadoop-client-runtime "-Dmdep.outputFile=$out.tmp" \
    || { log "error: Delta Lake's Spark runtime did not resolve from Maven Central (${args[*]})"; exit 1; }
  mv "$out.tmp" "$out"
}

# A Hive Metastore server (3.1, standalone, with Hadoop's and Derby's jars) for the tests of archive.catalog = hive:
# its jars from Maven Central into ~/.m2, their classpath into ~/.cache/tierfs/hive-metastore/<version>/classpath
# (tests/hivemetastore.py names the version and starts the server). A failure stops the install: those tests must
# fail, never skip.
install_hive_metastore() {
  command -v mvn >/dev/null 2>&1 || apt_install maven
  local v out
  v="$("$PY" -c 'import sys; sys.path.insert(0, sys.argv[1]); import hivemetastore; print(hivemetastore.HIVE_VERSION)' \
    "$REPO/tests")" || { log "error: cannot tell which Hive Metastore the tests need"; exit 1; }
  out="${TIERFS_HIVE_CACHE:-$HOME/.cache/tierfs/hive-metastore}/$v/classpath"
  [ -s "$out" ] && [ "$out" -nt "$REPO/tests/hive/pom.xml" ] && return 0
  log "resolving the Hive Metastore $v with Maven"
  mkdir -p "$(dirname "$out")"
  mvn -q -B -f "$REPO/tests/hive/pom.xml" "-Dhive.version=$v" dependency:build-classpath -DincludeScope=runtime \
    "-Dmdep.outputFile=$out.tmp" || { log "error: the Hive Metastore $v did not resolve from Maven Central"; exit 1; }
  mv "$out.tmp" "$out"
}
