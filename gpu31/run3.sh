. .gpu/b/install.sh; ln -sfn ../kernels qwen38_backend/kernels
export PYTHONUNBUFFERED=1 MLX_PTX_CACHE_DIR=/tmp/ptx; mkdir -p /tmp/ptx
[ -d /tmp/ptx/ ] && [ "$(ls /tmp/ptx | wc -l)" -gt 0 ] || tar xzf .gpu/ptx.tgz -C /tmp
timeout 570 python benchmarks/bench_flash_full.py --dims flash --layers 48 --experts 512 --experts-bits 4 --depth 4096 --decode 32 --runs 5 --prefill 4096 --step-kernels route+stream+expert,route+stream+expert+select --out $OUT/flash_full_select_s31.json 2>&1 | tail -30
