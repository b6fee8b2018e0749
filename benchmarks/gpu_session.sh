#!/usr/bin/env bash
# What a session with a lent GPU runs (15 minutes of device time: one prepared call; docs/scale.md).
#
#   benchmarks/gpu_session.sh prepare   # here: the wheels the device's Python lacks, into .whl/ (git ignores it)
#   benchmarks/gpu_session.sh run       # there, through the device tool with carry [".whl"], as one call:
#                                       # install them, the GPU tests, then the collapse benchmark to a deadline
#
# The device has its own CUDA build of torch (so torch never travels) and no network; at most 64 MiB
# travels with the working tree, so no model weights: every model is built on the device. What comes
# back (under $OUT): the tests' output, the collapse table, its runs.json and each run's metrics.
# COLLAPSE_DEADLINE_S (default 400) bounds the collapse runs so the call ends inside 10 minutes.
set -u
cd "$(dirname "$0")/.."
WHEELS=(transformers==5.25.0 huggingface_hub==2.4.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5
        tomlkit==0.15.3 kernels==0.19.1 click==8.5.1 hf-xet==1.8.0 peft==0.21.2 math-verify==0.9.0
        latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 py-spy)

case "${1:-}" in
prepare)
    mkdir -p .whl .git/info
    grep -qx ".whl/" .git/info/exclude 2>/dev/null || echo ".whl/" >> .git/info/exclude
    .venv/bin/python -m pip download -q --no-deps -d .whl "${WHEELS[@]}"
    du -sh .whl
    ;;
run)
    : "${OUT:?run this on the device, where OUT is the folder that comes back}"
    t0=$(date +%s)
    work=$(mktemp -d)  # the wheels' install target, the runs, the model cache
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $work/site .whl/*.whl
    export PYTHONPATH=$work/site:$PWD PATH=$work/site/bin:$PATH HF_HUB_OFFLINE=1
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
    for m in ray vllm sglang flash_attn; do  # what the device has of its own (none of them can travel: too large)
        python3 -c "import $m; print('$m', $m.__version__)" 2>/dev/null || echo "$m: not installed"
    done
    echo "setup: $(( $(date +%s) - t0 )) s"
    (while sleep 60; do nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader; uptime; done) \
        > "$OUT/gpu_load.log" 2>&1 &
    python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$OUT/test_gpu.log" | tail -25
    echo "GPU tests done at $(( $(date +%s) - t0 )) s"
    # SAO, GRPO, DAPO, decoupled PPO at staleness 8 and GRPO at 0, 5 seeds side by side, a 32M tiny model,
    # the engine in bf16 against the fp32 trainer (docs/benchmarks.md, "SAO's claim").
    python3 benchmarks/collapse.py --seeds 0,1,2,3,4 --jobs 25 --deadline-s "${COLLAPSE_DEADLINE_S:-400}" \
        --out $work/collapse model.device=cuda model.tiny.hidden_size=512 model.tiny.num_layers=8 \
        model.warmstart.lr=1e-3 rollout.options.dtype=bfloat16 model.cache_dir=$work/cache 2>&1 \
        | grep --line-buffered -v "Warning\|warn(" > "$OUT/collapse.log"
    cp $work/collapse/runs.json "$OUT/" 2>/dev/null
    for d in $work/collapse/*/; do
        mkdir -p "$OUT/runs/$(basename "$d")" && cp "$d"/metrics.jsonl "$d"/system.json "$OUT/runs/$(basename "$d")/" 2>/dev/null
    done
    echo "all done at $(( $(date +%s) - t0 )) s"
    tail -35 "$OUT/collapse.log"
    ;;
*)
    echo "usage: $0 prepare | run" >&2
    exit 2
    ;;
esac
