# Sourced by scripts/demo and scripts/test: the one venv both use, built in layers with stamps.
#
# The venv is $VENV, else .venv: a directory in the checkout, as the README says. Two layers,
# each with a stamp in the venv holding a hash of everything that decides what it installs:
#   base  (.consistency-base):      CPU torch, this project editable with [hf]   -- scripts/demo
#   test  (.consistency-installed): [test,report] and the test-time references  -- scripts/test
# (dependency tables of pyproject.toml, scripts/constraints.txt, scripts/install-test-references,
# this file, the Python version). The same inputs skip the installs, so `scripts/demo` then
# `scripts/test` adds the test layer to the demo's venv instead of rebuilding it; a changed
# base rebuilds the venv from scratch (`venv --clear`), so a missing install step fails here as
# on a fresh machine. The project itself is re-installed (editable, no deps) when the venv's
# editable install is not this checkout's (another path, or a pyproject.toml that changed
# since). Installs are quiet on success (no setuptools editable-install banner); a failing one
# is run again with its output shown. The upstream wheels the patch tests read are cached
# outside the venv (scripts/upstream_sources.py: ~/.cache/consistency-upstream), so a rebuilt
# venv never downloads them again.

_venv_key() {  # $1: base|test
  python3 - "$1" <<'EOF'
import hashlib, pathlib, sys
try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = None
h = hashlib.sha256(sys.version.encode())
text = pathlib.Path("pyproject.toml").read_text()
if tomllib is not None:
    proj = tomllib.loads(text).get("project", {})
    h.update(repr((proj.get("name"), proj.get("dependencies"), proj.get("optional-dependencies"))).encode())
else:
    h.update(text.encode())
files = ["scripts/constraints.txt", "scripts/venv.sh"]
if sys.argv[1] == "test":
    files.append("scripts/install-test-references")
for p in files:
    h.update(pathlib.Path(p).read_bytes())
print(sys.argv[1] + "-" + h.hexdigest()[:16])
EOF
}

_quiet() {  # run quietly; on failure run again with the output shown
  "$@" >/dev/null 2>&1 || "$@"
}

ensure_venv() {  # $1: base|test
  VENV=${VENV:-.venv}
  if [ "$VENV" = .venv ] && [ -L .venv ]; then
    rm .venv  # an older scripts/test linked .venv into a cache; the README says it is a directory here
  fi
  local base_key test_key
  base_key=$(_venv_key base)
  if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$VENV/.consistency-base" 2>/dev/null)" != "$base_key" ]; then
    echo "setting up $VENV (CPU torch, this project with [hf]) ..." >&2
    python3 -m venv --clear "$VENV"
    . "$VENV/bin/activate"
    python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
    _quiet python -m pip install -q --disable-pip-version-check torch==2.13.0  # CPU wheel; an open range pulls CUDA
    _quiet python -m pip install -q --disable-pip-version-check -c scripts/constraints.txt -e '.[hf]'
    echo "$base_key" > "$VENV/.consistency-base"
    echo "$(pwd -P) $(sha256sum pyproject.toml | cut -c1-16)" > "$VENV/.consistency-project"
  fi
  . "$VENV/bin/activate"
  if [ "$1" = test ]; then
    test_key=$(_venv_key test)
    if [ "$(cat "$VENV/.consistency-installed" 2>/dev/null)" != "$test_key" ]; then
      echo "adding the test tools to $VENV ..." >&2
      _quiet python -m pip install -q --disable-pip-version-check -c scripts/constraints.txt -e '.[test,report]'
      bash scripts/install-test-references
      echo "$test_key" > "$VENV/.consistency-installed"
      echo "$(pwd -P) $(sha256sum pyproject.toml | cut -c1-16)" > "$VENV/.consistency-project"
    fi
  fi
  local project_key
  project_key="$(pwd -P) $(sha256sum pyproject.toml | cut -c1-16)"
  if [ "$(cat "$VENV/.consistency-project" 2>/dev/null)" != "$project_key" ] \
      || ! python -I -c 'import consistency, os, sys; sys.exit(os.path.dirname(os.path.realpath(consistency.__file__)) != os.path.realpath("consistency"))' 2>/dev/null; then
    python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 \
      || _quiet python -m pip install -q --no-deps -e .
    echo "$project_key" > "$VENV/.consistency-project"
  fi
}
