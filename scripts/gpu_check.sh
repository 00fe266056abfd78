#!/usr/bin/env bash
# Build, check and time everything on a GPU machine in one go; prints a short table at the end.
#
#   bash scripts/gpu_check.sh [section ...]     sections: env kernels bench train parity
#                                               attention (hstu bench attention grid)
#                                               tune (kernel block sizes per head dim)
#                                               e2e sim simcheck profile graphs norm pack ab tab
#                                               kab bias bwd optim mosaic recipes workers tma
#                                               attnprof order mtiles silu embed
#                                               overrides flags envs jnorm mrows tbias
#                                               host model
#                                               (bench_upstream, one GPU)
#                                               multi e2e2 scale (>= 2 GPUs; not in the default;
#                                               e2e2 at E2E_WORLD GPUs, default 2)
#                                               (default: env kernels bench train parity)
#
# The GPU image has torch, triton, jax, flax, optax and orbax but no TorchRec/fbgemm: install
# them first from the wheel parts made by ../shared/gpu/pack.sh (PARTS_DIR=... .gpu/install.sh),
# which puts them under /tmp/site. Nothing here downloads anything.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/hstu-gpu-out}
mkdir -p "$OUT"
# The repo is not pip-installed there: expose `kernels/` under its import name.
mkdir -p /tmp/hstu-path && ln -sfn "$PWD/kernels" /tmp/hstu-path/hstu_kernels \
  && ln -sfn "$PWD/configs" /tmp/hstu-path/hstu_recipes
export PYTHONPATH=/tmp/site:/tmp/hstu-path:$PWD:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
# JAX programs compiled by one run are reused by the next (same shapes): compile once per bucket
export JAX_COMPILATION_CACHE_DIR=/tmp/hstu-jax-cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
# ... and by a later call on a fresh machine (same image): a jax e2e run spends 50-110 s of
# its call compiling. $JAX_CACHE_IN: a carried tarball of an earlier call's cache, unpacked
# first; JAX_CACHE_OUT=1: the cache packed to $OUT/jax-cache.tgz at the end (what comes back
# is at most 16 MiB a file: a larger one is left out, said so), for the next call to carry
# (e.g. as .gpu/jax-cache.tgz).
mkdir -p "$JAX_COMPILATION_CACHE_DIR"
if [ -n "${JAX_CACHE_IN:-}" ]; then
  tar -xzf "$JAX_CACHE_IN" -C "$JAX_COMPILATION_CACHE_DIR" \
    && echo "gpu_check: $(ls "$JAX_COMPILATION_CACHE_DIR" | wc -l) cached programs from $JAX_CACHE_IN"
fi
sections=${*:-env kernels bench train parity}
E2E_BACKENDS=${E2E_BACKENDS:-torch,jax}  # one backend per call keeps a call inside its limit
declare -a rows

run() {  # run NAME CMD...: log to $OUT/NAME.log, record pass/fail and seconds
  local name=$1; shift
  local t0=$SECONDS
  echo "=== $name: $*"
  if "$@" 2>&1 | tee "$OUT/$name.log"; then status=ok; else status=FAIL; fi
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=FAIL
  rows+=("$(printf '%-28s %-6s %5ss' "$name" "$status" $((SECONDS - t0)))")
}

need_tree() {  # need_tree DIR SUBDIR: A/B trees are gitignored, so they travel only as carry
  if [ -z "$1" ] || [ ! -d "$1/$2" ]; then
    echo "gpu_check: the A/B tree '$1' has no $2/ on this machine (carry it with the call)" >&2
    exit 2
  fi
}
for s in $sections; do  # before anything runs: a missing tree fails the call in seconds
  case $s in
    ab|kab) need_tree "${AB_BEFORE:-}" kernels ;;
    bias) for d in ${AB_BEFORE:-}; do need_tree "$d" kernels; done ;;
    tab) for d in ${AB_TREES:-${AB_TREE:-}}; do need_tree "$d" hstu; done
         [ -n "${AB_TREES:-${AB_TREE:-}}" ] || need_tree "" hstu ;;
    host) [ -z "${AB_TREE:-}" ] || need_tree "$AB_TREE" hstu ;;
  esac
done

ab_paired_sets() {  # ab_paired_sets NAME NSETS 'BATCHES' ROUNDS: each set of runs
  # /tmp/NAME{i}_b{b}_{round} against set 0 over the same steps (scripts/ab_paired.py)
  local name=$1 nsets=$2 batches=$3 rounds=$4 b i
  for b in $batches; do
    for i in $(seq 1 $((nsets - 1))); do
      run "${name}_paired${i}_b$b" python scripts/ab_paired.py \
        --before $(for r in $(seq "$rounds"); do echo /tmp/${name}0_b${b}_$r; done) \
        --after $(for r in $(seq "$rounds"); do echo /tmp/${name}${i}_b${b}_$r; done)
    done
  done
}

ab_overrides() {  # ab_overrides NAME 'SET|SET...' 'BATCHES' ROUNDS: override sets alternating,
  # then each set against the first over the same steps
  local name=$1 sets=$2 batches=$3 rounds=$4 round b i
  local -a ovr_sets
  IFS='|' read -r -a ovr_sets <<< "$sets"
  for round in $(seq "$rounds"); do
    for b in $batches; do
      for i in "${!ovr_sets[@]}"; do
        run "${name}${i}_b${b}_$round" python -m hstu.cli bench e2e --config bench_upstream \
          --backends $E2E_BACKENDS --shufflers identity --steps ${OVR_STEPS:-30} \
          --probe-every ${OVR_PROBE_EVERY:-0} \
          --out /tmp/${name}${i}_b${b}_$round data.batch_size=$b ${ovr_sets[$i]}
      done
    done
  done
  ab_paired_sets "$name" ${#ovr_sets[@]} "$batches" "$rounds"
}

ab_envs() {  # ab_envs NAME 'SET|SET...' BACKENDS: the `envs` section's runs (its comment)
  local name=$1 backends=$3 round b i word
  local -a env_sets envs ovrs
  IFS='|' read -r -a env_sets <<< "$2"
  for round in $(seq ${AB_ROUNDS:-2}); do
    for b in ${AB_BATCHES:-32}; do
      for i in "${!env_sets[@]}"; do
        envs=(); ovrs=()
        for word in ${env_sets[$i]}; do
          if [[ ${word%%=*} =~ ^[A-Z_][A-Z0-9_]*$ ]]; then envs+=("$word"); else ovrs+=("$word"); fi
        done
        run "${name}${i}_b${b}_$round" env "${envs[@]}" python -m hstu.cli bench e2e \
          --config bench_upstream --backends $backends --shufflers identity \
          --steps ${AB_STEPS:-150} --probe-every 0 --out /tmp/${name}${i}_b${b}_$round \
          ${ENV_ARGS:-} data.batch_size=$b "${ovrs[@]}"
      done
    done
  done
  ab_paired_sets "$name" ${#env_sets[@]} "${AB_BATCHES:-32}" ${AB_ROUNDS:-2}
}

for s in $sections; do
  case $s in
    env)
      run env python -c "
import torch, triton, jax, torchrec, fbgemm_gpu
print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())
print('triton', triton.__version__, 'jax', jax.__version__, jax.devices())
print('torchrec', torchrec.__version__)" ;;
    kernels)
      run triton_gpu_tests python -m pytest -q -m gpu tests/unit/test_triton_attention.py \
        tests/unit/test_triton_layer_norm.py
      run pallas_gpu_tests python -m pytest -q -m gpu tests/unit/test_pallas_attention.py \
        tests/unit/test_pallas_silu_bwd.py tests/unit/test_pallas_layer_norm.py ;;
    model)
      # the torch model's GPU tests: fused norms and elementwise kernels, the TF32 head, the
      # bf16 linears' fp32 weight gradients, the stack and step graphs (captured), against
      # eager torch; the tables' AdamW from their looked-up rows
      run torch_model_gpu_tests python -m pytest -q -m gpu tests/unit/test_torch_model.py \
        tests/unit/test_torch_graphs.py tests/unit/test_torch_step_graphs.py \
        tests/unit/test_triton_linear_silu.py tests/unit/test_triton_layer_norm.py \
        tests/unit/test_triton_adamw_rows.py ;;
    bench)
      run triton_bench python -m hstu_kernels.triton.bench
      run triton_bias_bench python -m hstu_kernels.triton.bench_bias
      run pallas_bench python -m hstu_kernels.pallas.bench ;;
    tune)
      # block-size sweeps per head dim and kernel, each tile checked against the default's
      # output and gradients, then timed (TUNE_KERNELS, default: triton pallas); $TUNE_ARGS:
      # more options for every sweep (e.g. "--kernels dq,dkdv --repeats 10")
      for k in ${TUNE_KERNELS:-triton pallas}; do
        run "${k}_tune" python -m hstu_kernels.$k.tune --dims ${TUNE_DIMS:-256,128} ${TUNE_ARGS:-}
      done ;;
    ab)
      # A/B of two kernel trees in one call: $AB_BEFORE (a copy of kernels/ from an earlier
      # commit: git archive HEAD~N kernels | tar -x -C DIR) against kernels/, alternating,
      # torch and jax at W=1 on bench_upstream batch ${AB_BATCH:-32}, identity
      for round in 1 2; do
        for side in before after; do
          dir=$PWD/kernels; [ $side = before ] && dir=$AB_BEFORE/kernels
          ln -sfn "$dir" /tmp/hstu-path/hstu_kernels
          run "ab_${side}_$round" python -m hstu.cli bench e2e --config bench_upstream \
            --backends $E2E_BACKENDS --shufflers identity --steps 30 --probe-every 0 \
            --out /tmp/ab_${side}_$round data.batch_size=${AB_BATCH:-32}
        done
      done
      ln -sfn "$PWD/kernels" /tmp/hstu-path/hstu_kernels ;;
    tab)
      # whole-tree A/B in one call: $AB_TREE (git archive <commit> hstu kernels configs scripts |
      # tar -x -C DIR) against this tree, alternating, $E2E_BACKENDS at W=1 on bench_upstream,
      # $AB_SHUFFLERS (default identity), each batch size of $AB_BATCHES, $AB_ROUNDS rounds;
      # $AB_TREES (several such trees, space-separated) in place of $AB_TREE: each in turn, then
      # this tree (logs tab_t<i>_b<B>_<round>, this tree as tab_after_...); $AB_ARGS: overrides
      # for every tree (dist.world_size=4: that many GPUs); $AB_EXCHANGES: the balanced runs'
      # exchanges; $AB_PROBE_EVERY: steps between probes (then the device breakdown too).
      # Then each tree against this one over the same steps (scripts/ab_paired.py), the
      # figure to read: the table's medians fall on different steps
      read -r -a trees <<< "${AB_TREES:-${AB_TREE:-}}"
      for round in $(seq ${AB_ROUNDS:-2}); do
        for b in ${AB_BATCHES:-8 32}; do
          for i in $(seq 0 ${#trees[@]}); do
            if [ "$i" -lt "${#trees[@]}" ]; then
              tree=$(cd "${trees[$i]}" && pwd); side=t$i
              [ -z "${AB_TREES:-}" ] && side=before
            else
              tree=$PWD; side=after
            fi
            mkdir -p /tmp/hstu-path-$side && ln -sfn "$tree/kernels" /tmp/hstu-path-$side/hstu_kernels \
              && ln -sfn "$tree/configs" /tmp/hstu-path-$side/hstu_recipes
            run "tab_${side}_b${b}_$round" env -C "$tree" \
              PYTHONPATH=/tmp/site:/tmp/hstu-path-$side:$tree python -m hstu.cli bench e2e \
              --config bench_upstream --backends $E2E_BACKENDS \
              --shufflers ${AB_SHUFFLERS:-identity} --exchanges ${AB_EXCHANGES:-allgather,all2all} \
              --steps ${AB_STEPS:-30} --probe-every ${AB_PROBE_EVERY:-0} $([ "${AB_PROBE_EVERY:-0}" = 0 ] || echo --breakdown) \
              --out /tmp/tab_${side}_b${b}_$round data.batch_size=$b ${AB_ARGS:-}
          done
        done
      done
      # each tree against this one over the same steps, round by round (scripts/ab_paired.py)
      for b in ${AB_BATCHES:-8 32}; do
        for i in $(seq 0 $((${#trees[@]} - 1))); do
          side=t$i; [ -z "${AB_TREES:-}" ] && side=before
          run "tab_paired_${side}_b$b" python scripts/ab_paired.py \
            --before $(for r in $(seq ${AB_ROUNDS:-2}); do echo /tmp/tab_${side}_b${b}_$r; done) \
            --after $(for r in $(seq ${AB_ROUNDS:-2}); do echo /tmp/tab_after_b${b}_$r; done)
        done
      done ;;
    overrides)
      # config A/B in one call: each set of overrides in $OVR_SETS (separated by '|'; an empty
      # set is the config as shipped), alternating, $E2E_BACKENDS at W=1 on bench_upstream,
      # identity, each batch size of $AB_BATCHES, $AB_ROUNDS rounds ($OVR_PROBE_EVERY: steps
      # between probes, 0 = none; $OVR_STEPS: steps per run, default 30), then each set
      # against the first over the same steps
      ab_overrides ovr "${OVR_SETS:-}" "${AB_BATCHES:-8 32}" ${AB_ROUNDS:-2} ;;
    flags)
      # XLA_FLAGS A/B in one call: each set in $FLAG_SETS (separated by '|'; an empty set is
      # XLA's defaults), alternating, jax on bench_upstream, $AB_SHUFFLERS (default identity),
      # each batch size of $AB_BATCHES, $AB_ROUNDS rounds, overrides $AB_ARGS
      # (dist.world_size=4: that many GPUs), then each set against the first over the same steps
      IFS='|' read -r -a flag_sets <<< "${FLAG_SETS:-}"
      for round in $(seq ${AB_ROUNDS:-2}); do
        for b in ${AB_BATCHES:-8 32}; do
          for i in "${!flag_sets[@]}"; do
            run "flags${i}_b${b}_$round" env XLA_FLAGS="${flag_sets[$i]}" python -m hstu.cli \
              bench e2e --config bench_upstream --backends jax \
              --shufflers ${AB_SHUFFLERS:-identity} --steps ${AB_STEPS:-30} \
              --probe-every 0 --out /tmp/flags${i}_b${b}_$round data.batch_size=$b ${AB_ARGS:-}
          done
        done
      done
      ab_paired_sets flags ${#flag_sets[@]} "${AB_BATCHES:-8 32}" ${AB_ROUNDS:-2} ;;
    envs)
      # environment and config A/B in one call: each set in $ENV_SETS (separated by '|'; an
      # empty set is the shipped setup) holds NAME=value words, upper-case names set in the
      # environment (CUBLAS_WORKSPACE_CONFIG=:0:0, XLA_FLAGS=...), the others config
      # overrides (train.metrics_lag=3); alternating, $E2E_BACKENDS at W=1 on bench_upstream,
      # identity, each batch size of $AB_BATCHES, $AB_ROUNDS rounds of $AB_STEPS steps
      # (default 150), extra bench flags $ENV_ARGS (--breakdown), then each set against the
      # first over the same steps
      ab_envs envs "${ENV_SETS:-}" "$E2E_BACKENDS" ;;
    jnorm)
      # jax's two norms as Pallas kernels (`hstu_kernels.pallas.layer_norm`, model.fused_norm
      # on a GPU): the GPU test, the kernels against XLA's fusions in device time
      # (scripts/norm_kernels_jax.py $JNORM_ARGS, e.g. --sweep), then the step without them,
      # with them, and $JNORM_SETS (default: with their backwards only, the forwards XLA's),
      # as `envs` runs it (batch 32, $AB_ROUNDS x $AB_STEPS)
      run jnorm_gpu_test python -m pytest -q -m gpu tests/unit/test_pallas_layer_norm.py
      run jnorm_kernels python scripts/norm_kernels_jax.py ${JNORM_ARGS:-}
      ab_envs jnorm "model.fused_norm=false||${JNORM_SETS:-HSTU_PALLAS_NORM_FORWARD=xla}" jax ;;
    silu)
      # jax's Pallas SiLU-backward kernel (off in the shipped step): its tiles swept at
      # bench_upstream's layer (scripts/silu_tiles.py), then the step with the best tiling
      # (HSTU_JAX_SILU_KERNEL=compiled) against XLA's fusion, alternating, batch 32,
      # $AB_ROUNDS rounds of $OVR_STEPS steps, then over the same steps
      run silu_tiles python scripts/silu_tiles.py --rounds 3 ${SILU_ARGS:-}
      best=$(sed -n 's/^BEST_TILES=//p' "$OUT/silu_tiles.log")
      [ -n "$best" ] || echo "gpu_check: silu_tiles printed no BEST_TILES; the default tiles" >&2
      for round in $(seq ${AB_ROUNDS:-2}); do
        for i in 0 1; do
          kernel=""; [ $i = 1 ] && kernel=compiled
          run "silu${i}_b32_$round" env HSTU_JAX_SILU_KERNEL=$kernel \
            HSTU_PALLAS_SILU_TILES=$best python -m hstu.cli bench e2e --config bench_upstream \
            --backends jax --shufflers identity --steps ${OVR_STEPS:-40} --probe-every 0 \
            --out /tmp/silu${i}_b32_$round data.batch_size=32
        done
      done
      ab_paired_sets silu 2 32 ${AB_ROUNDS:-2} ;;
    workers)
      # data.workers (batches built in worker processes) against the in-process loader: the
      # overrides A/B over batch sizes $WORKERS_BATCHES, two rounds
      ab_overrides workers "data.workers=0|data.workers=2" "${WORKERS_BATCHES:-8 32}" 2 ;;
    kab)
      # kernel A/B: scripts/attention_jagged.py (bench_upstream's jagged batches, back-to-back
      # device time) on $AB_BEFORE/kernels and on kernels/, alternating, for $KAB_BACKENDS;
      # the before tree gets this tree's timers (kernels/triton/bench.py)
      rm -rf /tmp/ab-k/kab && mkdir -p /tmp/ab-k && cp -r "$AB_BEFORE/kernels" /tmp/ab-k/kab
      cp kernels/triton/bench.py /tmp/ab-k/kab/triton/
      for backend in ${KAB_BACKENDS:-torch jax}; do
        for round in 1 2; do
          for side in before after; do
            dir=$PWD/kernels; [ $side = before ] && dir=/tmp/ab-k/kab
            ln -sfn "$dir" /tmp/hstu-path/hstu_kernels
            run "kab_${backend}_${side}_$round" python scripts/attention_jagged.py \
              --backend $backend ${KAB_ARGS:-}
          done
        done
      done
      ln -sfn "$PWD/kernels" /tmp/hstu-path/hstu_kernels ;;
    tma)
      # tensor-descriptor (TMA) loads against pointer tiles, alternating in one call: each
      # HSTU_TRITON_TMA value of $TMA_SETS (default "0 1": none, the default set; or kernel
      # lists such as fwd,dq,dkdv) on scripts/attention_jagged.py, bench_upstream's jagged
      # batches (two rounds), then the tile sweep of $TMA_KERNELS (default fwd,dq) at head dim
      # 256 with each ($TMA_TUNE=0 skips it)
      read -r -a tma_sets <<< "${TMA_SETS:-0 1}"
      for round in 1 2; do
        for i in "${!tma_sets[@]}"; do
          run "tma${i}_jagged_$round" env HSTU_TRITON_TMA=${tma_sets[$i]} \
            python scripts/attention_jagged.py --backend torch ${KAB_ARGS:-}
        done
      done
      [ "${TMA_TUNE:-1}" = 1 ] && for i in "${!tma_sets[@]}"; do
        run "tma${i}_tune" env HSTU_TRITON_TMA=${tma_sets[$i]} python -m hstu_kernels.triton.tune \
          --dims 256 --kernels ${TMA_KERNELS:-fwd,dq} --repeats 10 --tiles ${TMA_TILES:-64,32,4,3 \
          64,32,4,2 64,64,4,2 128,32,8,2 128,32,8,3 128,64,8,2}
      done ;;
    bias)
      # what the attention biases cost the Triton kernel (kernels/triton/bench_bias.py): the
      # kernels of each tree in $AB_BEFORE (space-separated; each timed by this tree's
      # bench_bias) and of kernels/, alternating, two rounds; $BIAS_ARGS
      for round in 1 2; do
        i=0
        for dir in ${AB_BEFORE:-} ""; do
          if [ -n "$dir" ]; then
            side=$(basename "$dir"); i=$((i + 1))
            rm -rf "/tmp/ab-k/$i" && mkdir -p /tmp/ab-k && cp -r "$dir/kernels" "/tmp/ab-k/$i"
            cp kernels/triton/bench.py kernels/triton/bench_bias.py "/tmp/ab-k/$i/triton/"
            ln -sfn "/tmp/ab-k/$i" /tmp/hstu-path/hstu_kernels
          else
            side=after; ln -sfn "$PWD/kernels" /tmp/hstu-path/hstu_kernels
          fi
          run "bias_${side}_$round" python -m hstu_kernels.triton.bench_bias ${BIAS_ARGS:-}
        done
      done
      ln -sfn "$PWD/kernels" /tmp/hstu-path/hstu_kernels ;;
    tbias)
      # the Triton kernels' time bias per key tile (HSTU_TRITON_TIME_TILES=1, read at import):
      # the GPU tests with biases in a process with it on, then kernels/triton/bench_bias.py
      # ($BIAS_ARGS, e.g. --kernels) without and with it, alternating, two rounds
      run tbias_gpu_test env HSTU_TRITON_TIME_TILES=1 python -m pytest -q -m gpu \
        tests/unit/test_triton_attention.py -k "rab or time"
      if [ "$status" = ok ]; then
        for round in 1 2; do
          for on in 0 1; do
            run "tbias${on}_$round" env HSTU_TRITON_TIME_TILES=$on \
              python -m hstu_kernels.triton.bench_bias ${BIAS_ARGS:-}
          done
        done
      fi ;;
    bwd)
      # torch attention backward modes ($BWD_MODES: split, the dk/dv + dq kernels; fused, one
      # kernel adding dq atomically; stored, dq from the dS the dk/dv kernel stored; a mode
      # written MODE:KERNEL=m,n,warps,stages[;...] runs with those tiles), alternating in one
      # call: scripts/attention_jagged.py at $BWD_DIMS
      for dim in ${BWD_DIMS:-256 128}; do
        for round in $(seq ${BWD_ROUNDS:-2}); do
          for spec in ${BWD_MODES:-split stored}; do
            mode=${spec%%:*}; tiles=(); tag=$mode
            if [ "$spec" != "$mode" ]; then
              IFS=';' read -ra tiles <<< "${spec#*:}"; tag=$(echo "$spec" | tr ':;=,' '____')
              tiles=(--tiles "${tiles[@]}")
            fi
            run "bwd_${dim}_${tag}_$round" python scripts/attention_jagged.py --backend torch \
              --dim $dim --backward $mode "${tiles[@]}" ${BWD_ARGS:-}
          done
        done
      done ;;
    order)
      # the attention kernels' launch order (kernels/README.md, "Dispatch order"): each
      # backend's kernels (torch's Triton, jax's Mosaic) at head dim $ORDER_DIM with every
      # kernel's --lead set to each of $ORDER_LEADS in turn (the first N schedule entries with
      # their heads together, then head by head), after the kernels' own order, $ORDER_ROUNDS
      # alternating rounds
      for round in $(seq ${ORDER_ROUNDS:-1}); do
        for backend in ${ORDER_BACKENDS:-torch jax}; do
          extra=""; [ $backend = jax ] && extra="--lowering mosaic"
          for lead in default ${ORDER_LEADS:-0 16 33 66}; do
            order=(); [ $lead = default ] || order=(--lead fwd=$lead dq=$lead dkdv=$lead)
            run "order_${backend}_${lead}_$round" python scripts/attention_jagged.py \
              --backend $backend $extra --dim ${ORDER_DIM:-256} --equal 8x4096 --calls 10 \
              --rounds 3 "${order[@]}"
          done
        done
      done ;;
    mtiles)
      # the Mosaic kernels' streamed tiles (MosaicTiles block_kv, stages; the defaults and
      # their sweep: kernels/README.md, "The Mosaic tiles swept"): jax at head dim
      # $MTILES_DIM, the defaults then each of $MTILES_SETS ('|'-separated sets of
      # KERNEL=block_kv,stages), $MTILES_ROUNDS alternating rounds, on the recipe's batches
      # and 8 x 4096; a set the kernels cannot take is refused before it compiles
      IFS='|' read -r -a msets <<< "${MTILES_SETS:-fwd=32,2|fwd=32,3|fwd=32,4|dq=32,3|dkdv=32,2|dkdv=32,3|dkdv=32,4}"
      for round in $(seq ${MTILES_ROUNDS:-1}); do
        for i in $(seq 0 ${#msets[@]}); do
          mt=(); name=default
          if [ "$i" -gt 0 ]; then read -r -a mt <<< "${msets[$((i - 1))]}"; name=$i; fi
          run "mtiles_${name}_$round" python scripts/attention_jagged.py --backend jax \
            --lowering mosaic --dim ${MTILES_DIM:-256} --equal 8x4096 --calls 10 --rounds 3 \
            $([ ${#mt[@]} -eq 0 ] || echo --tiles "${mt[@]}")
        done
      done ;;
    mrows)
      # the Mosaic kernels' outputs and work table (kernels/pallas/_mosaic.py: the forward's
      # output at its rows, dq's and dk / dv's as tiles gathered back, the work table from one
      # Pallas kernel, the defaults; $HSTU_MOSAIC_OUT / $HSTU_MOSAIC_META name others): the GPU
      # test (each way against the Triton lowering at head dim $MROWS_DIM, default 256, T whole
      # tiles as in training; $MROWS_TEST_K picks other cases), the kernels in device time on
      # the recipe's batches, 8 x 4096 and 16 / 64 x 256 for each OUT:META of $MROWS_MODES
      # (default: every kernel as tiles with XLA's table, then the defaults spelled out; ~100 s
      # each, $AB_ROUNDS alternating rounds), then the step as `envs` runs it (jax, batch 32): the
      # defaults against every output as tiles with XLA's table, and $MROWS_SETS
      # ('|'-separated) as more sets (each ~60-110 s on a fresh machine: the call's 600 s
      # hold about three)
      run mrows_gpu_test python -m pytest -q -m gpu tests/unit/test_pallas_mosaic.py \
        -k "${MROWS_TEST_K:-triton_lowering and ${MROWS_DIM:-256} and T-whole}"
      if [ "$status" = ok ]; then
        for round in $(seq ${AB_ROUNDS:-2}); do
          for mode in ${MROWS_MODES:-tiles:xla fwd=rows:kernel}; do
            run "mrows_attn_${mode//[:=,]/_}_$round" env HSTU_MOSAIC_OUT=${mode%:*} \
              HSTU_MOSAIC_META=${mode#*:} python scripts/attention_jagged.py --backend jax \
              --lowering mosaic --dim ${MROWS_DIM:-256} --equal 8x4096 16x256 64x256 \
              --calls 10 --rounds 3
          done
        done
        ab_envs mrows "|HSTU_MOSAIC_OUT=tiles HSTU_MOSAIC_META=xla${MROWS_SETS:+|$MROWS_SETS}" jax
      fi ;;
    attnprof)
      # per-kernel device time of the attention call on the case $APROF_CASE (default the
      # recipe's batch of short samples) and on one 4096-token sample (scripts/attention_jagged.py
      # --profile), torch's Triton kernels and jax's Mosaic ones at head dim $APROF_DIM:
      # which kernel (or which part of the jax wrapper) sets each case's time. $APROF_EQUAL
      # (e.g. "16x256 64x256"): those equal-length batches instead, every one profiled, the
      # recipe's left out
      for backend in torch jax; do
        extra=""; [ $backend = jax ] && extra="--lowering mosaic"
        if [ -n "${APROF_EQUAL:-}" ]; then
          run "attnprof_$backend" python scripts/attention_jagged.py --backend $backend \
            --dim ${APROF_DIM:-256} --no-recipe --equal $APROF_EQUAL --calls 10 --rounds 3 \
            $extra --profile
        else
          run "attnprof_$backend" python scripts/attention_jagged.py --backend $backend \
            --dim ${APROF_DIM:-256} --equal 1x4096 --calls 10 --rounds 3 $extra \
            --profile "${APROF_CASE:-upstream seed 2}" "1 x 4096"
        fi
      done ;;
    attention)
      # hstu bench attention: checked then timed over batch x seqlen x head dim (+ Zipf batches);
      # jax in both Pallas lowerings of its kernels ($ATTN_LOWERINGS); $ATTN_BATCHES,
      # $ATTN_SEQLENS, $ATTN_DIMS: the grid (neither backend needs the TorchRec wheels here);
      # $ATTN_RESUME: a carried folder holding an earlier call's attention_<backend>.json, whose
      # points are kept and not timed again (`--resume`: a grid spread over several calls)
      mkdir -p /tmp/attention
      for backend in ${ATTN_BACKENDS:-torch jax}; do
        extra=""; [ $backend = jax ] && extra="--lowerings ${ATTN_LOWERINGS:-triton,mosaic}"
        if [ -n "${ATTN_RESUME:-}" ] && [ -f "$ATTN_RESUME/attention_$backend.json" ]; then
          cp "$ATTN_RESUME/attention_$backend.json" /tmp/attention/ && extra="$extra --resume"
        fi
        run "attention_$backend" python -m hstu.cli bench attention --backend $backend \
          --batches ${ATTN_BATCHES:-1,4,16,64} --seqlens ${ATTN_SEQLENS:-256,1024,4096,8192} \
          --dims ${ATTN_DIMS:-64,128,256} --max-tokens 65536 --out /tmp/attention $extra
        cp /tmp/attention/attention_$backend.json "$OUT/"
      done
      cp /tmp/attention/attention_*.png "$OUT/" ;;
    train)
      run torch_train_1gpu python -m hstu.cli train --backend torch --config configs/gpu.yaml \
        output_dir="$OUT/torch_train"
      run jax_train_1gpu python -m hstu.cli train --backend jax --config configs/gpu.yaml \
        output_dir="$OUT/jax_train" ;;
    parity)
      # compiled Triton vs compiled Pallas vs both references; then the demo recipe on one GPU
      # (1 rank x 32 samples = the golden file's 4 x 8 global batches) against the golden curve
      run kernel_parity_gpu python -m pytest -q -m gpu tests/parity/test_kernel_parity.py
      # fp32 and bf16, reference attention and the kernels (Triton vs Pallas); every run is
      # also held against the fp32 golden curve (bf16 at its own, wider tolerance)
      for attn in reference kernel; do
        for dtype in float32 bfloat16; do
          run "parity_${attn}_${dtype}" python -m hstu.cli parity --config configs/demo.yaml \
            train.steps=30 dist.world_size=1 data.batch_size=32 dist.device=gpu \
            model.dtype=$dtype model.attention=$attn --output-dir "$OUT/parity_${attn}_${dtype}" \
            --golden tests/parity/golden_demo_losses.json
        done
      done ;;
    e2e)
      # bench_upstream at W=1: the step against its work (batch 8 / 32 / 64 and fixed 2,000-event
      # histories); the breakdown at batch 32; $E2E_STEPS steps a run (default 30; torch's 32
      # capacities capture a graph on ~a third of 30 steps, which the medians leave out)
      E2E="python -m hstu.cli bench e2e --config bench_upstream --shufflers identity"
      E2E="$E2E --steps ${E2E_STEPS:-30}"
      E2E="$E2E --backends $E2E_BACKENDS"
      for b in 8 32 64; do
        probe=0; [ $b = 32 ] && probe="15 --breakdown"
        run "e2e_b$b" $E2E --probe-every $probe --out /tmp/e2e_b$b data.batch_size=$b
        cp /tmp/e2e_b$b/e2e.json "$OUT/e2e_b$b.json"
      done
      run e2e_fixed $E2E --probe-every 0 --out /tmp/e2e_fixed data.batch_size=8 \
        data.seqlen_dist=fixed "data.seqlen_params={}" ;;
    pack)
      # data.pack_window (issue 13's bound): $PACK_STEPS-step bench_upstream runs at batch 32,
      # unpacked and packed in windows of 4 batches, identity, W=1: programs, padding, step
      for backend in ${E2E_BACKENDS//,/ }; do
        for window in 0 128; do
          run "pack_${backend}_$window" python -m hstu.cli bench e2e --config bench_upstream \
            --backends $backend --shufflers identity --steps ${PACK_STEPS:-500} --probe-every 0 \
            --out /tmp/pack_${backend}_$window data.pack_window=$window
          cp /tmp/pack_${backend}_$window/e2e.json "$OUT/pack_${backend}_$window.json"
        done
      done ;;
    graphs)
      # train.cuda_graphs, torch at W=1 on bench_upstream: the graphs' GPU test, then eager
      # and graphed side by side at batch 8 / 32 / 64 (fixed cost = the line through them)
      run graphs_gpu_test python -m pytest -q -m gpu tests/unit/test_torch_graphs.py
      for b in 32 8 64; do
        for g in false true; do
          run "graphs_b${b}_$g" python -m hstu.cli bench e2e --config bench_upstream \
            --backends torch --shufflers identity --steps 30 --probe-every 0 \
            --out /tmp/graphs_b${b}_$g data.batch_size=$b train.cuda_graphs=$g
          cp /tmp/graphs_b${b}_$g/e2e.json "$OUT/graphs_b${b}_$g.json"
        done
      done ;;
    norm)
      # model.fused_norm (torch): eager LayerNorm + gating against the fused Triton kernels,
      # alternating, $NORM_ROUNDS rounds at batch 8 / 32 / 64 (graphs on, identity, W=1)
      run norm_gpu_tests python -m pytest -q -m gpu tests/unit/test_triton_layer_norm.py \
        tests/unit/test_torch_graphs.py
      for round in $(seq ${NORM_ROUNDS:-2}); do
        for b in 8 32 64; do
          for f in false true; do
            run "norm_b${b}_${f}_$round" python -m hstu.cli bench e2e --config bench_upstream \
              --backends torch --shufflers identity --steps 30 --probe-every 0 \
              --out /tmp/norm_b${b}_${f}_$round data.batch_size=$b model.fused_norm=$f
          done
        done
      done ;;
    mosaic)
      # the Mosaic GPU attention kernels (jax, model.pallas_lowering): compiled against the
      # reference first; only then timed against the Triton lowering on the recipe's
      # jagged batches, alternating $MOSAIC_ROUNDS rounds; MOSAIC_E2E=1 adds the bench_upstream
      # step (jax, batch 32, identity, W=1) with each forward
      run mosaic_gpu_tests python -m pytest -q -m gpu tests/unit/test_pallas_mosaic.py
      if [ "$status" = ok ]; then
        for round in $(seq ${MOSAIC_ROUNDS:-2}); do
          for f in triton mosaic; do
            run "mosaic_attn_${f}_$round" python scripts/attention_jagged.py --backend jax \
              --lowering $f --dim ${MOSAIC_DIM:-256}
          done
        done
        [ "${MOSAIC_E2E:-0}" = 1 ] && for f in triton mosaic; do
          run "mosaic_e2e_$f" python -m hstu.cli bench e2e --config bench_upstream \
            --backends jax --shufflers identity --steps 30 --probe-every 0 \
            --out /tmp/mosaic_e2e_$f model.pallas_lowering=$f
        done
      fi ;;
    recipes)
      # the shipped recipes on generated publisher-format samples (issue 15), both backends,
      # each training in its own process: $RECIPE_STEPS steps, then the test split
      run recipes python scripts/recipe_quality.py --recipes ${RECIPES:-ml1m_retrieval,kuairand_ranking,ml20m_retrieval} \
        --backends $E2E_BACKENDS --steps ${RECIPE_STEPS:-300} --work /tmp/recipes \
        --json "$OUT/recipes.json" ;;
    simcheck)
      # the simulation against a real run on this one GPU (W=1, identity, the same batches):
      # the per-rank timer must price a step as the run does
      run simcheck_w1 python -m hstu.cli bench e2e --config bench_upstream --steps 30 \
        --backends $E2E_BACKENDS --shufflers identity --probe-every 15 --simulate-ranks 1 \
        --sim-batches 6 --out /tmp/simcheck_w1
      cp /tmp/simcheck_w1/e2e.json "$OUT/simcheck_w1.json" ;;
    sim)
      # simulated W=8 and W=16 ($SIM_WORLDS) on this one GPU (per-rank forward+backward timed
      # alone), overrides $SIM_ARGS
      for w in ${SIM_WORLDS:-8 16}; do
        run "sim_w$w" python -m hstu.cli bench e2e --config bench_upstream --skip-runs \
          --backends $E2E_BACKENDS --simulate-ranks $w --sim-batches 6 --out /tmp/sim_w$w ${SIM_ARGS:-}
        cp /tmp/sim_w$w/e2e.json "$OUT/sim_w$w.json"
      done ;;
    embed)
      # the step graph's layer input in device time (the small tables' gradient sorted by id,
      # or summed over the sources' runs: scripts/embed_timing.py), then its GPU tests
      run embed_timing python scripts/embed_timing.py
      run embed_gpu_tests python -m pytest -q -p no:cacheprovider -m gpu \
        tests/unit/test_triton_embed_tokens.py tests/unit/test_torch_step_graphs.py ;;
    optim)
      # what the AdamW update costs: optax per leaf / small leaves flattened / torch fused
      run optimizer_timing python scripts/optimizer_timing.py --config bench_upstream ;;
    profile)
      # scripts/profile_step.py on bench_upstream: $PROFILE_STEPS steps, 3 traced from
      # $PROFILE_AT (past the steps that capture graphs or compile), per backend and batch size
      # ($PROFILE_BATCHES), overrides $PROFILE_ARGS; PROFILE_HLO=1: jax kernels named by their
      # fusion in the optimized HLO; PROFILE_NO_PY=1: jax without the Python tracer (whose
      # overhead shows as device idle); PROFILE_WORLD=W: W ranks (torch: rank 0 traced; jax: all);
      # PROFILE_TAG: a suffix for the logs (two profiles of one call, other $PROFILE_ARGS). The
      # traces stay on the machine (/tmp/hstu-traces); every device event of the traced steps
      # in order comes back ($OUT/seq_<backend>_b<batch>.txt)
      for backend in ${PROFILE_BACKENDS:-torch jax}; do
        for b in ${PROFILE_BATCHES:-32}; do
          run "profile_${backend}_b$b${PROFILE_TAG:+_$PROFILE_TAG}" \
            env OUT=/tmp/hstu-traces/${backend}_b$b${PROFILE_TAG:+_$PROFILE_TAG} \
            python scripts/profile_step.py --backend $backend --config bench_upstream \
            --steps ${PROFILE_STEPS:-40} --profile-at ${PROFILE_AT:-32} --profile-steps 3 \
            --top ${PROFILE_TOP:-25} ${PROFILE_HLO:+--hlo} ${PROFILE_NO_PY:+--no-python-trace} \
            --world ${PROFILE_WORLD:-1} \
            --sequence "$OUT/seq_${backend}_b$b${PROFILE_TAG:+_$PROFILE_TAG}.txt" \
            data.batch_size=$b ${PROFILE_ARGS:-}
        done
      done ;;
    host)
      # the torch step's host time by call, no profiler (scripts/host_time.py), per batch size
      # ($HOST_BATCHES), overrides $HOST_ARGS, $HOST_WORLD ranks (rank 0 timed; default 1);
      # with $AB_TREE (as in tab) that tree first, each timed by this tree's script
      sides=after; [ -n "${AB_TREE:-}" ] && sides="before after"
      for b in ${HOST_BATCHES:-8 32}; do
        for side in $sides; do
          tree=$PWD; [ $side = before ] && tree=$(cd "$AB_TREE" && pwd)
          mkdir -p /tmp/hstu-path-$side && ln -sfn "$tree/kernels" /tmp/hstu-path-$side/hstu_kernels \
            && ln -sfn "$tree/configs" /tmp/hstu-path-$side/hstu_recipes
          run "host_${side}_b$b" env -C "$tree" PYTHONPATH=/tmp/site:/tmp/hstu-path-$side:$tree \
            python "$PWD/scripts/host_time.py" --config bench_upstream --steps 70 --skip 10 \
            --world ${HOST_WORLD:-1} data.batch_size=$b ${HOST_ARGS:-}
        done
      done ;;
    e2e2)
      # W=$E2E_WORLD (default 2; as many GPUs): identity vs balanced, allgather vs all2all
      # ($E2E2_EXCHANGES), in $E2E2_REPEATS alternating rounds, with the W-rank simulation on the
      # same batches; then (E2E2_FIXED=1, the default) fixed-length data, where there is nothing
      # to balance
      # (single-controller JAX applies the plan on the host: allgather and all2all are one path)
      # (E2E2_MAIN=0: the fixed-length runs alone; E2E2_PROBE_EVERY: steps between probes;
      #  E2E2_STEPS: steps per run; E2E2_SIM_BATCHES: global batches the simulation times,
      #  by default the runs' steps 1.. (the speedups are compared over the same batches);
      #  E2E2_ARGS: overrides for both, e.g. "embedding.sharding=data_parallel embedding.optimizer=adam")
      w=${E2E_WORLD:-2}; e2e2_steps=${E2E2_STEPS:-40}
      x=${E2E2_EXCHANGES:-allgather,all2all}; [ "$E2E_BACKENDS" = jax ] && x=allgather
      [ "${E2E2_MAIN:-1}" = 1 ] && run e2e_w$w python -m hstu.cli bench e2e --config bench_upstream \
        --steps $e2e2_steps --backends $E2E_BACKENDS --exchanges $x \
        --probe-every ${E2E2_PROBE_EVERY:-15} --breakdown --repeats ${E2E2_REPEATS:-1} \
        --simulate-ranks $w --sim-batches ${E2E2_SIM_BATCHES:-$((e2e2_steps - 1))} --out /tmp/e2e_w$w \
        dist.world_size=$w ${E2E2_ARGS:-} \
        && cp /tmp/e2e_w$w/e2e.json "$OUT/e2e_w$w.json" && cp /tmp/e2e_w$w/e2e.png "$OUT/e2e_w$w.png"
      [ "${E2E2_FIXED:-1}" = 1 ] && run e2e_w${w}_fixed python -m hstu.cli bench e2e \
        --config bench_upstream --steps 30 --backends $E2E_BACKENDS --exchanges allgather \
        --probe-every 0 --out /tmp/e2e_w${w}_fixed dist.world_size=$w \
        data.batch_size=8 data.seqlen_dist=fixed "data.seqlen_params={}" ${E2E2_ARGS:-} \
        && cp /tmp/e2e_w${w}_fixed/e2e.json "$OUT/e2e_w${w}_fixed.json" ;;
    multi)
      # needs >= 2 GPUs (nvidia-h200-x2): NCCL exchange / training tests, then the balanced
      # shuffler against identity on the Zipf recipe, both backends, 2 ranks
      # one file per run, each under its own limit, verbose: a slow or hung test names itself
      # (a test still running after NCCL_TEST_LIMIT - 30 s dumps its stacks: faulthandler)
      limit=${NCCL_TEST_LIMIT:-180}
      for f in ${MULTI_TESTS:-tests/multirank/test_torch_exchange.py tests/multirank/test_torch_train.py \
               tests/multirank/test_robustness_failures.py tests/multirank/test_robustness_layout.py \
               tests/multirank/test_sharded_torch.py}; do
        run "nccl_$(basename "$f" .py)" timeout $limit python -m pytest -v -s -m gpu \
          "$f" -p no:cacheprovider --durations=0 -o faulthandler_timeout=$((limit - 30))
      done
      [ "${MULTI_TRAIN:-1}" = 1 ] && for backend in torch jax; do
        for shuffler in identity balanced; do
          run "train_2gpu_${backend}_${shuffler}" timeout 200 python -m hstu.cli train \
            --backend $backend --config configs/gpu.yaml dist.world_size=2 train.steps=100 \
            balance.shuffler=$shuffler output_dir="$OUT/train_2gpu_${backend}_${shuffler}"
        done
      done ;;
    scale)
      # embedding tables at scale (>= 2 GPUs): `hstu bench tables`, W=2, configs/gpu.yaml at width
      # 128, identity, same batch lengths in every run: step time with row-wise sharded tables of
      # each of SCALE_ROWS rows in alternating rounds (the update touches rows, not the table),
      # and peak memory replicated (AdamW on the dense table) at SCALE_REPLICATED rows (0: none).
      # 200M x 128 fp32 is 102 GB: one GPU cannot hold it with its gradient. SCALE_OVERRIDES adds
      # settings (data.batch_size=128: a step the device, not the host, bounds)
      run "scale_${SCALE_BACKENDS:-torch,jax}" timeout ${SCALE_LIMIT:-590} python -m hstu.cli \
        bench tables --config gpu --backends ${SCALE_BACKENDS:-torch,jax} \
        --rows ${SCALE_ROWS:-1000000,100000000,200000000} --replicated ${SCALE_REPLICATED:-10000000} \
        --repeats ${SCALE_REPEATS:-2} --steps ${SCALE_STEPS:-30} --out /tmp/scale \
        dist.world_size=2 model.embedding_dim=128 ${SCALE_OVERRIDES:-}
      # a failed run: the end of the newest run's log
      [ "$status" = ok ] || tail -n 40 "$(ls -t $(find /tmp/scale -name log.txt) | head -1)"
      cp /tmp/scale/tables.json "$OUT/" 2>/dev/null ;;
    *) echo "unknown section $s"; exit 2 ;;
  esac
done

if [ "${JAX_CACHE_OUT:-0}" = 1 ]; then
  tar -czf /tmp/jax-cache.tgz -C "$JAX_COMPILATION_CACHE_DIR" .
  size=$(stat -c %s /tmp/jax-cache.tgz)
  if [ "$size" -le $((16 * 1024 * 1024)) ]; then
    cp /tmp/jax-cache.tgz "$OUT/"
    rows+=("$(printf '%-28s %-6s %s' jax_cache ok "$((size / 1024)) KiB")")
  else
    rows+=("$(printf '%-28s %-6s %s' jax_cache large "$((size / 1024)) KiB, not returned")")
  fi
fi

echo
echo "summary ($(python -c 'import torch; print(torch.cuda.get_device_name())' 2>/dev/null))"
printf '%s\n' "${rows[@]}"
