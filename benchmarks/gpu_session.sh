#!/usr/bin/env bash
# The GPU measurements of docs/benchmarks.md, for a lent NVIDIA machine that has JAX (CUDA), PyTorch and
# transformers but no diffusers: run from the repository root with the pure-Python wheels it lacks in .whl/
# (diffusers, importlib_metadata; see the command in docs/benchmarks.md). Results land in $OUT (default ./out).
#   bash benchmarks/gpu_session.sh smoke sd15 sdxl      # phases, in order; each has its own time limit
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD/src
else
  export PYTHONPATH=$PWD/src
fi
export PYTHONUNBUFFERED=1
SDJAX="python3 -m sdjax.cli"

for phase in "$@"; do
  echo "=== $phase $(date -u +%H:%M:%S)"
  case $phase in
    smoke)
      nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
      python3 -c "import jax, flax, torch, diffusers, transformers; print('jax', jax.__version__, 'flax', flax.__version__, 'torch', torch.__version__, 'diffusers', diffusers.__version__, 'transformers', transformers.__version__, jax.devices())"
      timeout 120 $SDJAX bench --steps 2 --reps 1 ;;
    sd15)
      timeout 330 $SDJAX bench --arch sd15 --dtype bfloat16 --steps 50 --torch --json "$OUT/sd15-bf16-h100.json" ;;
    sd15tc)  # against diffusers with torch.compile (CUDA graphs; channels-last UNet and VAE, whole graphs)
      timeout 480 $SDJAX bench --arch sd15 --dtype bfloat16 --steps 50 --torch --torch-compile reduce-overhead \
        --json "$OUT/sd15-bf16-h100-torch-compile.json" ;;
    sdxltc)
      timeout 560 $SDJAX bench --arch sdxl --dtype bfloat16 --steps 30 --torch --torch-compile reduce-overhead \
        --json "$OUT/sdxl-bf16-h100-torch-compile.json" ;;
    unetloop)  # one UNet step alone and in a loop: sdjax, diffusers eager and torch.compile'd (3.6 device minutes)
      timeout 330 python3 benchmarks/gpu_unet_loop.py --arch sd15 --steps 50 --reps 5 --json "$OUT/unet-loop-sd15-bf16.json" ;;
    unetprofile)  # sdjax's UNet step kernel by kernel, and its optimized HLO (under a device minute)
      timeout 170 python3 benchmarks/gpu_unet_profile.py --arch sd15 --steps 5 --out "$OUT" ;;
    unetflags)  # sdjax's UNet step in a loop under XLA flags that may close the gap to torch.compile (each its own
      # process; a flag this jaxlib does not know fails only its own line). About 40 s each.
      for flags in "" "--xla_gpu_enable_cudnn_layer_norm=true" "--xla_gpu_enable_command_buffer=" \
                   "--xla_gpu_enable_latency_hiding_scheduler=true"; do
        XLA_FLAGS="$flags" timeout 150 python3 benchmarks/gpu_unet_loop.py --arch sd15 --steps 50 --reps 5 --skip-torch \
          --json "$OUT/unet-flags-$(echo "${flags:-none}" | tr -c 'a-z0-9\n' '_').json" | sed "s|^|[$flags] |"
      done ;;
    sd15fp16)
      timeout 300 $SDJAX bench --arch sd15 --dtype float16 --steps 50 --torch --json "$OUT/sd15-fp16-h100.json" ;;
    sdxl)
      timeout 400 $SDJAX bench --arch sdxl --dtype bfloat16 --steps 30 --torch --json "$OUT/sdxl-bf16-h100.json" ;;
    sdxl8)
      timeout 400 $SDJAX bench --arch sdxl --dtype bfloat16 --steps 20 --batch 8 --json "$OUT/sdxl-b8-h100.json" ;;
    compile)
      timeout 100 python3 benchmarks/make_random_model.py sdxl /tmp/sdxl-random &&
        timeout 300 python3 benchmarks/bench_compile.py --model /tmp/sdxl-random --steps 30 --json "$OUT/compile-h100.json" ;;
    split)  # the decode as a second executable against one program (Generator.split_decode), SD 1.5 bf16, 50 steps
      timeout 240 python3 benchmarks/loop_vs_alone.py --arch sd15 --dtype bfloat16 --size 512 --steps 50 --rounds 8 \
        --split-only --json "$OUT/split-sd15-bf16.json" ;;
    memory)  # a generation's device memory alone, split and one program, each in a fresh process
      timeout 200 python3 benchmarks/gpu_memory.py --arch sd15 --dtype bfloat16 --size 512 --json "$OUT/memory-sd15.json" ;;
    slicing)  # VAE slicing (one image at a time) against the whole batch: memory and time, SD 1.5 batch 8
      timeout 240 python3 benchmarks/gpu_memory.py --arch sd15 --dtype bfloat16 --size 512 --steps 20 --batch 8 \
        --modes split,sliced --json "$OUT/slicing-sd15-b8.json" ;;
    memoryxl)
      timeout 300 python3 benchmarks/gpu_memory.py --arch sdxl --dtype bfloat16 --size 1024 --json "$OUT/memory-sdxl.json" ;;
    aotcuda)  # compile in a process that sees no GPU (target config: XLA's h100_sxm.txtpb in .whl/), run on the GPU
      CUDA_VISIBLE_DEVICES= JAX_PLATFORMS=cpu XLA_FLAGS=--xla_gpu_enable_triton_gemm=false timeout 300 \
        python3 benchmarks/cuda_aot_roundtrip.py compile --target-config .whl/h100.txtpb --dir /tmp/exe &&
        timeout 200 python3 benchmarks/cuda_aot_roundtrip.py run --dir /tmp/exe | tee "$OUT/aotcuda.json" ;;
    flux)  # Flux.1 schnell (4 steps) and dev (28 steps) 1024x1024 end to end, full-size random weights, bf16: sdjax
      # against diffusers eager and torch.compile'd (schnell), each framework in its own process (about 9 minutes)
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
      F=benchmarks/flux_gpu.py
      timeout 170 python3 $F sdjax --kind schnell --steps 4 --reps 3 --json "$OUT/flux-schnell-sdjax.json"
      timeout 200 python3 $F torch --kind schnell --steps 4 --reps 2 --compile --json "$OUT/flux-schnell-torch.json"
      timeout 130 python3 $F sdjax --kind dev --steps 28 --reps 2 --json "$OUT/flux-dev-sdjax.json"
      timeout 80 python3 $F torch --kind dev --steps 28 --reps 1 --json "$OUT/flux-dev-torch.json" ;;
    redesign)  # SD 1.5 (50 steps) and SDXL (30 steps) end to end, bf16: the code before the model-family redesign
      # (bbb8cad^, unpacked in .gpu_old/src) against this tree, interleaved on one machine
      for arch in "sd15 --steps 50" "sdxl --steps 30"; do
        for v in old new; do
          if [ $v = old ]; then P=.gpu_old/src; else P=$PWD/src; fi
          PYTHONPATH=$PYTHONPATH:$P timeout $([ "${arch%% *}" = sd15 ] && echo 110 || echo 150) python3 -c "import sys; sys.path.insert(0, '$P'); from sdjax.cli import main; main()" \
            bench --arch $arch --dtype bfloat16 --reps 2 --json "$OUT/redesign-$v-${arch%% *}.json" | tail -12 | sed "s|^|[$v] |"
        done
      done ;;
    fluxdevtc)  # Flux.1 dev 28 steps with torch.compile (transformer + VAE decode)
      timeout 150 python3 benchmarks/flux_gpu.py torch --kind dev --steps 28 --reps 2 --compile --json "$OUT/flux-dev-torch-compile.json" ;;
    quant)  # SDXL's UNet step at 1024x1024: bf16 against fp8 compute (per-call and calibrated static input scales,
      # and XLA's GEMM-rewriter spelling), and int8 compute, at MLPerf's batch (8 images, CFG) and at one image
      # (about 9 minutes; issue 37; each row is printed as it finishes). Weight-only rows: add int8,fp8
      timeout 400 python3 benchmarks/quant_gpu.py --arch sdxl --batch 8 --steps 10 --reps 3 \
        --variants bf16,fp8-compute,fp8-compute-static,int8-compute,fp8-compute-qdq --json "$OUT/quant-sdxl-b8.json"
      timeout 150 python3 benchmarks/quant_gpu.py --arch sdxl --batch 1 --steps 10 --reps 3 \
        --variants bf16,fp8-compute,fp8-compute-static --json "$OUT/quant-sdxl-b1.json" ;;
    groupnorm)  # sdjax's UNet step in a loop (SD 1.5 bf16, 50 steps): GroupNorm statistics in two passes against one
      # (the default since 069520b; 850 -> 721 kernels compile-only), one pass with --split-head-dim, and one pass
      # with XLA's dot merger off (docs/benchmarks.md, "SD 1.5 UNet step kernels on a compile-only H100"). Each its
      # own process, about 40 s each: about 3 device minutes for the four, not counting the machine start.
      for v in "two-pass|--groupnorm two-pass|" "one-pass|--groupnorm one-pass|" \
               "one-pass-split-head-dim|--groupnorm one-pass --split-head-dim|" \
               "one-pass-no-dot-merger|--groupnorm one-pass|--xla_gpu_dot_merger_threshold_mb=0"; do
        IFS='|' read -r name opts flags <<< "$v"
        XLA_FLAGS="$flags" timeout 150 python3 benchmarks/gpu_unet_loop.py --arch sd15 --steps 50 --reps 5 --skip-torch \
          $opts --json "$OUT/unet-gn-$name.json" | sed "s|^|[$name] |"
      done ;;
    train)  # one LoRA training step of SD 1.5 at 512x512, batch 4, bf16: sdjax against diffusers + peft (issue 36)
      timeout 150 python3 benchmarks/finetune_step.py --arch sd15 --size 512 --batch 4 --dtype bfloat16 --steps 10 \
        --json "$OUT/train-lora-sd15-b4.json" ;;
    *) echo "unknown phase $phase"; exit 2 ;;
  esac
  echo "=== $phase rc=$? $(date -u +%H:%M:%S)"
done
