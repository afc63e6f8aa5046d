. .gpu/b/install.sh; ln -sfn ../kernels qwen38_backend/kernels
export PYTHONUNBUFFERED=1 MLX_PTX_CACHE_DIR=/tmp/ptx; mkdir -p /tmp/ptx
[ -f .gpu/ptx.tgz ] && tar xzf .gpu/ptx.tgz -C /tmp
t0=$(date +%s)
timeout 200 python -m pytest -q --run-gpu tests/test_gpu.py -k "qsa_select" > $OUT/gpu_tests_select.log 2>&1
echo "tests rc=$? $(( $(date +%s)-t0 )) s"; tail -3 $OUT/gpu_tests_select.log
timeout 300 ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum --csv --log-file $OUT/flash4b.csv python benchmarks/probe_verify_kernels_gpu.py --model flash --layers 4 --rows 1 --window > $OUT/ncu.log 2>&1
echo "ncu rc=$? $(( $(date +%s)-t0 )) s"
python benchmarks/probe_verify_kernels_gpu.py --model flash --layers 4 --context 4096 --rows 1 --parse $OUT/flash4b.csv --out $OUT/flash_step_kernels_4l_s31b.json 2>&1 | tail -1
tar czf $OUT/ptx.tgz -C /tmp ptx
echo "total $(( $(date +%s)-t0 )) s"
