# Mooncake (and pyzmq, msgspec) on the GPU machine, whose image has none of them and no network.
#   here, once:         bash backends/cuda/scripts/carry.sh prep    -> .whl/ and .libs/ (git-ignored)
#   device, per call:   source backends/cuda/scripts/carry.sh       (run with carry: [".whl", ".libs"])
# The device's python is 3.12, so the wheels are cp312; the Mooncake wheel links libibverbs, libcurl,
# libnuma ... which the image may lack: prep packs this machine's copies (from the same wheel version
# installed here), and the device side puts only the missing ones on LD_LIBRARY_PATH.
MOONCAKE_VERSION=${MOONCAKE_VERSION:-0.3.13.post1}

carry_prep() (  # a subshell: its set -e stays here
  set -euo pipefail
  py=${PYTHON:-python3}
  have=$("$py" -c "import importlib.metadata as m; print(m.version('mooncake-transfer-engine-non-cuda'))")
  [[ $have == "$MOONCAKE_VERSION" ]] || { echo "installed mooncake $have, want $MOONCAKE_VERSION" >&2; exit 1; }
  plat=(); for n in 17 26 27 28 31 34 35; do plat+=(--platform "manylinux_2_${n}_x86_64"); done
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${plat[@]}" --platform manylinux2014_x86_64 -d .whl \
    "mooncake-transfer-engine-non-cuda==$MOONCAKE_VERSION" pyzmq msgspec
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
}

if [[ ${BASH_SOURCE[0]} == "$0" ]]; then  # executed
  if [[ ${1:-} == prep ]]; then carry_prep; exit; fi
  echo "usage: bash $0 prep (here) | source $0 (on the device)" >&2
  exit 2
fi
carry_install
