# Mooncake (and pyzmq, msgspec) on the GPU machine, whose image has none of them and no network.
#   here, once:         bash backends/cuda/scripts/carry.sh prep    -> .whl/ and .libs/ (git-ignored)
#   device, per call:   source backends/cuda/scripts/carry.sh       (run with carry: [".whl", ".libs"])
# The device's python is 3.12, so the wheels are cp312; the Mooncake wheel links libibverbs, libcurl,
# libnuma ... which the image may lack: prep packs this machine's copies, and the device side puts
# only the missing ones on LD_LIBRARY_PATH.
MOONCAKE_WHEEL=${MOONCAKE_WHEEL:-mooncake-transfer-engine-non-cuda==0.3.13.post1}
if [[ ${1:-} == prep ]]; then
  set -euo pipefail
  py=${PYTHON:-python3}
  plat=(); for n in 17 26 27 28 31 34 35; do plat+=(--platform "manylinux_2_${n}_x86_64"); done
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${plat[@]}" --platform manylinux2014_x86_64 -d .whl "$MOONCAKE_WHEEL" pyzmq msgspec
  pkg=$("$py" -c "import importlib.util as u, os; print(os.path.dirname(u.find_spec('mooncake').origin))")
  mkdir -p .libs
  # the wheel's own libs travel inside it; libc and the toolchain's runtime are on every image
  libs=$(for f in "$pkg"/engine.so "$pkg"/store.so "$pkg"/mooncake_master; do ldd "$f"; done \
    | awk '$3 ~ /^\/(usr\/)?lib/ {print $3}' | sort -u \
    | grep -vE '/(libc|libm|libdl|libpthread|librt|libstdc\+\+|libgcc_s|libresolv|libz)\.so')
  # shellcheck disable=SC2086
  tar cJhPf .libs/libs.tar.xz --transform 's|.*/||' $libs
  du -sh .whl .libs
else
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || return 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  chmod +x /tmp/site/mooncake/mooncake_master 2>/dev/null
  mkdir -p /tmp/mlibs.all /tmp/mlibs && tar xJf .libs/libs.tar.xz -C /tmp/mlibs.all
  for f in /tmp/mlibs.all/*; do
    ldconfig -p | grep -q "/$(basename "$f")\$" || cp "$f" /tmp/mlibs/
  done
  echo "carried libs the image lacks: $(ls /tmp/mlibs | tr '\n' ' ')"
  export LD_LIBRARY_PATH=/tmp/mlibs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
