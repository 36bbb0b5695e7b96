# Mooncake (and pyzmq, msgspec) on the GPU machine, whose image has none of them and no network, and
# the serving stack `hwkv serve` needs (fastapi, starlette, uvicorn, pydantic ...; the image lacks some).
#   here, once:         bash backends/cuda/scripts/carry.sh prep    -> .whl/ and .libs/ (git-ignored)
#   device, per call:   source backends/cuda/scripts/carry.sh       (run with carry: [".whl", ".libs"])
# The device's python is 3.12, so the wheels are cp312; the Mooncake wheel links libibverbs, libcurl,
# libnuma ... which the image may lack: prep packs this machine's copies (from the same wheel version
# installed here), and the device side puts only the missing ones on LD_LIBRARY_PATH.
MOONCAKE_VERSION=${MOONCAKE_VERSION:-0.3.13.post1}
# `hwkv serve` and its dependencies' closure (pure python but pydantic_core and markupsafe; ~4 MB), at
# the versions installed here. The device installs only those its image lacks or has at a version the
# others do not accept (pip resolves against the image), so the image's own copies stay in use.
SERVE_PACKAGES="fastapi starlette uvicorn h11 anyio prometheus_client httpx httpcore certifi idna pydantic
  pydantic_core annotated_types annotated_doc typing_inspection typing_extensions opentelemetry_api click
  jinja2 markupsafe"

carry_prep() (  # a subshell: its set -e stays here
  set -euo pipefail
  py=${PYTHON:-python3}
  have=$("$py" -c "import importlib.metadata as m; print(m.version('mooncake-transfer-engine-non-cuda'))")
  [[ $have == "$MOONCAKE_VERSION" ]] || { echo "installed mooncake $have, want $MOONCAKE_VERSION" >&2; exit 1; }
  plat=(); for n in 17 26 27 28 31 34 35; do plat+=(--platform "manylinux_2_${n}_x86_64"); done
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${plat[@]}" --platform manylinux2014_x86_64 -d .whl \
    "mooncake-transfer-engine-non-cuda==$MOONCAKE_VERSION" pyzmq msgspec
  local pins; pins=$("$py" -c "import importlib.metadata as m, sys
print(' '.join(f'{n}=={m.version(n)}' for n in sys.argv[1:]))" $SERVE_PACKAGES)
  rm -rf .whl/serve
  # shellcheck disable=SC2086
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${plat[@]}" --platform manylinux2014_x86_64 -d .whl/serve $pins
  pkg=$("$py" -c "import importlib.util as u, os; print(os.path.dirname(u.find_spec('mooncake').origin))")
  deps=$(for f in "$pkg"/engine.so "$pkg"/store.so "$pkg"/mooncake_master; do ldd "$f"; done)
  if grep -q "not found" <<<"$deps"; then
    echo "libraries missing here too (install them first):" >&2; grep "not found" <<<"$deps" >&2; exit 1
  fi
  mkdir -p .libs
  # the wheel's own libs travel inside it; libc and the toolchain's runtime are on every image
  libs=$(awk '$3 ~ /^\/(usr\/)?lib/ {print $3}' <<<"$deps" | sort -u \
    | grep -vE '/(libc|libm|libdl|libpthread|librt|libstdc\+\+|libgcc_s|libresolv|libz)\.so')
  # shellcheck disable=SC2086
  tar cJhPf .libs/libs.tar.xz --transform 's|.*/||' $libs
  du -sh .whl .libs
)

carry_install() {  # sourced: no set -e, no exit; every failure returns 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || return 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  chmod +x /tmp/site/mooncake/mooncake_master || return 1
  mkdir -p /tmp/mlibs.all /tmp/mlibs && tar xJf .libs/libs.tar.xz -C /tmp/mlibs.all || return 1
  local f
  for f in /tmp/mlibs.all/*; do
    ldconfig -p | grep -q "/$(basename "$f")\$" || cp "$f" /tmp/mlibs/
  done
  echo "carried libs the image lacks: $(ls /tmp/mlibs | tr '\n' ' ')"
  export LD_LIBRARY_PATH=/tmp/mlibs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  carry_install_serve
}

carry_install_serve() {  # `hwkv serve`'s stack: only what the image lacks (pip skips what it has and accepts)
  # an older prep: Mooncake works; only `hwkv serve` would lack its packages
  [[ -d .whl/serve ]] || { echo "no .whl/serve (run prep again): hwkv serve needs fastapi, uvicorn ..." >&2; return 0; }
  python3 -m pip install -q --no-index --find-links .whl/serve --no-compile --no-cache-dir --prefix /tmp/serve \
    fastapi uvicorn prometheus_client httpx pydantic jinja2 2>&1 | grep -v "Running pip as the 'root' user" >&2
  [[ ${PIPESTATUS[0]} == 0 ]] || return 1
  local sp; sp=$(echo /tmp/serve/lib/python3*/site-packages)
  if [[ -d $sp ]]; then
    export PYTHONPATH=$sp${PYTHONPATH:+:$PYTHONPATH}
    echo "carried serving packages the image lacks: $(ls "$sp" | grep -E '\.dist-info$' | sed 's/\.dist-info$//' | tr '\n' ' ')"
  fi
  python3 -c "import fastapi, uvicorn, prometheus_client, httpx" || return 1
}

if [[ ${BASH_SOURCE[0]} == "$0" ]]; then  # executed
  if [[ ${1:-} == prep ]]; then carry_prep; exit; fi
  echo "usage: bash $0 prep (here) | source $0 (on the device)" >&2
  exit 2
fi
carry_install
