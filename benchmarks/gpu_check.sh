#!/usr/bin/env bash
# The prepared run for a machine with a GPU (issue 16): the tests that need CUDA, then decoding on
# CUDA against transformers in fp32 and bf16, eager and with CUDA graphs (compile_decode).
# From the repository root, in the project's environment:  bash benchmarks/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device here'; print(torch.cuda.get_device_name())"
python -m pytest -q -rs tests/test_engine.py tests/test_compiled_decode.py sample_plugins/int8_quant/tests -k "cuda or gpu"
cd benchmarks
for dtype in float32 bfloat16; do
    python bench_compiled.py --device cuda --dtype "$dtype" --runs 3
    python bench_compiled.py --device cuda --dtype "$dtype" --runs 3 --model llama
done
