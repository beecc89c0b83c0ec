#!/usr/bin/env bash
# cuda-bundle.sh - packs the CUDA checks of docs/cuda.md for a GPU machine that lacks the
# build's Debian libraries (gRPC, UCX, OpenBLAS, ...) but has the CUDA runtime and cuBLAS:
# a portable Release build (-DKR_NATIVE=OFF: the CPU kernels are still chosen at run time),
# its shared libraries other than glibc's and CUDA's in one archive, and check.sh, which
# runs the tests and the smoke figures there from the repository root.
#
#   bench/cuda-bundle.sh [OUTDIR]        (default .cuda-bundle; needs nvcc here)
#   then, on the GPU machine, in a copy of the repository holding OUTDIR:
#   bash OUTDIR/check.sh [--full]        (--full adds the llama3-8b figures, about 3 minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.cuda-bundle}
bins="test_backend_ops test_cuda_fixtures kvrelay-logits kvrelay-generate kvrelay-bench-engine"
command -v nvcc >/dev/null || { echo "cuda-bundle.sh: nvcc not found" >&2; exit 1; }
cmake -S . -B build-cuda-bundle -DCMAKE_BUILD_TYPE=Release -DKR_NATIVE=OFF -DKR_WERROR=ON \
      -DCMAKE_CUDA_ARCHITECTURES=90 >/dev/null
# shellcheck disable=SC2086
cmake --build build-cuda-bundle -j"$(nproc)" --target $bins
rm -rf "${out:?}"; mkdir -p "$out/lib"
for b in $bins; do cp "build-cuda-bundle/$b" "$out/"; done
# shellcheck disable=SC2086
(cd build-cuda-bundle && ldd $bins) | awk '$3 ~ /^\// {print $3}' | sort -u |
    grep -v -E '/(libc|libm|libpthread|libdl|librt|ld-linux-x86-64|libgcc_s|libstdc\+\+)\.so|/cuda' |
    xargs -I{} cp -L {} "$out/lib/"
tar cJf "$out/lib.tar.xz" -C "$out/lib" . && rm -rf "${out:?}/lib"
cat > "$out/check.sh" <<'CHECK'
#!/usr/bin/env bash
# The CUDA checks of docs/cuda.md; run from the repository root on the GPU machine.
here=$(cd "$(dirname "$0")" && pwd); root=$PWD; lib=$(mktemp -d)
tar xJf "$here/lib.tar.xz" -C "$lib"
cublas=$(dirname "$(find / -name 'libcublas.so.13*' -not -path '/proc/*' 2>/dev/null | head -1)")
export LD_LIBRARY_PATH=$lib:$cublas:${LD_LIBRARY_PATH:-} KR_FIXTURES=$root/tests/fixtures
step() { echo; echo "=== $* ($(date +%T))"; }
cd "$here" || exit 1; M=$root/tests/fixtures/models/llama3-tiny; IDS="1 5 9 200 17 4 33 8 12 90 3 64"
step device; nvidia-smi -L
step test_backend_ops; timeout 150 ./test_backend_ops | tail -3
step test_cuda_fixtures; timeout 120 ./test_cuda_fixtures
step logits; for b in cpu cuda; do ./kvrelay-logits --model "$M" --ids "$IDS" --out "$lib/$b.bin" --backend $b; done
python3 -c "import numpy as n,sys; a=n.fromfile(sys.argv[1],'<f4'); b=n.fromfile(sys.argv[2],'<f4'); print('max abs diff', abs(a-b).max(), 'max abs', abs(a).max(), 'NaN', n.isnan(b).sum())" "$lib/cpu.bin" "$lib/cuda.bin"
for p in full streaming:sink=4,window=8 sage:budget=8 take:budget=8; do
    step "generate $p"
    for b in cpu cuda; do ./kvrelay-generate --model "$M" --ids "$IDS" --max-tokens 32 --greedy --backend $b --policy "$p"; done
done
step bench; ./kvrelay-bench-engine --model "$M" --backend cuda --batch 1,8,64 --contexts 128 --repeat 2
if [ "${1:-}" = --full ]; then
    C=$root/tools/data/llama3-8b.json   # f32 KV on CUDA: 256 KiB a token, so the batches are sized to fit
    step 8b; ./kvrelay-bench-engine --random "$C" --backend cuda --prefill 1024,8192,32768 --contexts 1024 --batch 1,8,64 --repeat 2 --decode-tokens 16
    ./kvrelay-bench-engine --random "$C" --backend cuda --prefill 1024 --contexts 8192 --batch 1,8,16 --repeat 2 --decode-tokens 16
fi
CHECK
chmod +x "$out/check.sh"
du -sh "$out"
