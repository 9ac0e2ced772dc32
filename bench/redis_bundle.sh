#!/usr/bin/env bash
# Package this machine's Debian redis-server (and redis-py as a wheel) for a machine that
# has neither and no network, e.g. a GPU host that runs bench/async_grpo.py.
#
#   bash bench/redis_bundle.sh [DIR]          # default: outputs/redis-bundle
#
# DIR/bin/redis-server runs the copied binary with the shared libraries it links (except
# the C library's own, which the target must have: glibc >= 2.34); DIR/wheels holds the
# redis-py wheel. On the target:
#
#   export PATH="$PWD/DIR/bin:$PATH"
#   python -m pip install --no-index --no-deps DIR/wheels/redis-*.whl
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-outputs/redis-bundle}"
binary="$(command -v redis-server || true)"
if [ -z "$binary" ]; then
  echo "redis-server is not on PATH here: apt-get install redis-server first" >&2
  exit 2
fi
binary="$(readlink -f "$binary")"
rm -rf "$out"
mkdir -p "$out/bin" "$out/lib" "$out/wheels"
cp "$binary" "$out/lib/redis-server.bin"
# every linked library except glibc's core (the target's own must be used)
ldd "$binary" | awk '/=> \// {print $3}' | while read -r lib; do
  case "$(basename "$lib")" in
    libc.so.*|libm.so.*|libpthread.so.*|libdl.so.*|librt.so.*|ld-linux*) ;;
    *) cp -L "$lib" "$out/lib/" ;;
  esac
done
cat > "$out/bin/redis-server" <<'EOF'
#!/usr/bin/env bash
here="$(cd "$(dirname "$(readlink -f "$0")")/.." && pwd)"
LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/lib/redis-server.bin" "$@"
EOF
chmod +x "$out/bin/redis-server" "$out/lib/redis-server.bin"
version="$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("redis"))')"
.venv/bin/python -m pip download -q --no-deps --only-binary :all: -d "$out/wheels" "redis==$version"
"$out/bin/redis-server" --version
du -sh "$out"
