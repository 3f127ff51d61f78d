# Sourced by install.sh and test_v034.sh: `pip_install PYTHON ARGS...` installs
# into PYTHON's virtual environment with uv, which resolves the same pins as pip
# in a fraction of its time, reading pip's own index settings (its configuration
# and PIP_* variables: uv reads neither); with pip where uv cannot be had or
# fails, or with PIP_ONLY=1.
pip_setting() {  # $1 the python, $2 the pip setting; its variable wins
  local variable=PIP_$(echo "$2" | tr 'a-z-' 'A-Z_')
  if [ -n "${!variable:-}" ]; then echo "${!variable}"; else "$1" -m pip config get "global.$2" 2>/dev/null || true; fi
}

pip_install() {
  local py
  py=$(command -v "$1")
  shift
  if [ -z "${PIP_ONLY:-}" ] && { "$py" -m uv --version >/dev/null 2>&1 || "$py" -m pip install -q uv >/dev/null 2>&1; }; then
    local indexes=() url
    url=$(pip_setting "$py" index-url)
    [ -z "$url" ] || indexes+=(--index-url "$url")
    for url in $(pip_setting "$py" extra-index-url); do indexes+=(--extra-index-url "$url"); done
    for url in $(pip_setting "$py" find-links); do indexes+=(--find-links "$url"); done
    # pip's choice among several indexes: the best version found on any of them;
    # compiled as pip does, for processes that may not write bytecode (every spawned
    # engine process would otherwise compile vLLM and torch again)
    "$py" -m uv pip install -q --python "$py" --compile-bytecode --index-strategy unsafe-best-match "${indexes[@]}" "$@" ||
      { echo "uv could not install this; pip will" >&2; "$py" -m pip install -q "$@"; }
  else
    "$py" -m pip install -q "$@"
  fi
}

pip_uninstall() {
  local py
  py=$(command -v "$1")
  shift
  if "$py" -m uv --version >/dev/null 2>&1; then
    "$py" -m uv pip uninstall -q --python "$py" "$@" 2>/dev/null || true
  else
    "$py" -m pip uninstall -y -q "$@" || true
  fi
}
