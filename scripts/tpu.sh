#!/usr/bin/env bash
# Cloud TPU VMs for tx_jax (called by ./launch.sh tpu-*; usable alone). Needs gcloud, except
# with --dry-run, which prints every gcloud command ("+ ..." one per line) and runs nothing.
#
#   tpu-create NAME [--zone Z] [--accelerator-type v4-8] [--version RUNTIME]
#                   [--project P] [--spot | --queued]
#                   RUNTIME defaults to the generation's (Cloud TPU's "TPU software versions"):
#                   v6e v2-alpha-tpuv6e, v5p v2-alpha-tpuv5, v5e (v5litepod-*)
#                   v2-alpha-tpuv5-lite, v4 and older tpu-ubuntu2204-base
#   tpu-setup NAME [--zone Z] [--project P] [--extras E]
#                   waits for a queued VM to be ACTIVE; copies the working tree to every
#                   worker (~/tx_jax) and runs scripts/tpu_worker_setup.sh there: a Python
#                   3.11 from uv whatever the image's python3 is, .venv, tx_jax with jax[tpu]
#                   and the extras E (none by default; e.g. export), each worker's devices
#   tpu-run NAME [--zone Z] [--project P] [--accelerator-type T] [--no-plan] [--wait] -- ARGS...
#                   first plans the run for the slice here (python -m tx_jax plan with ARGS'
#                   --config flags; T defaults to what gcloud says of NAME) and refuses one that
#                   does not fit; then python -m tx_jax train ARGS --config.parallel.distributed=True
#                   on every worker, in the background (nohup; log ~/tx_jax/runs/tpu-run.log),
#                   or with --wait in the foreground: the output here, the exit status the
#                   workers' (the TPU sweep's way: ./launch.sh sweep --tpu)
#   tpu-prepare NAME [--zone Z] [--project P] -- ARGS...
#                   python -m tx_jax prepare ARGS on worker 0, in the foreground: the data
#                   into a gs:// data.data_dir and the tokenizer into the gs:// workdir, once,
#                   before tpu-run (a pod's run does not wait for a long preparation)
#   tpu-logs NAME [--worker N] [--zone Z] [--project P]          follow a worker's log
#   tpu-delete NAME [--zone Z] [--project P]
#
# --workdir may be gs://bucket/path: etils/Orbax write there directly. Environment:
# TPU_ZONE, TPU_PROJECT (defaults for --zone, --project); TPU_POLL_SECONDS (how often tpu-setup
# asks a queued VM's state, default 60).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

REMOTE_DIR='~/tx_jax'  # on each worker (expanded by the worker's shell)
LOG='runs/tpu-run.log'  # relative to REMOTE_DIR
DRY_RUN=0

die() { echo "tpu.sh: $*" >&2; exit 2; }

# Shell-quote each argument the way Python's shlex.quote does (plain words stay bare, others
# go in single quotes) and join them: an argument with spaces, quotes or $ stays one word.
quote_words() {
  local out=() w sq="'" esc="'\\''"
  for w in "$@"; do
    if [[ -n "$w" && "$w" =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then
      out+=("$w")
    else
      out+=("'${w//"$sq"/"$esc"}'")
    fi
  done
  local IFS=' '
  echo "${out[*]}"
}

# Run (or with --dry-run print, "+ " then the quoted words) one command: what is printed is
# exactly what would run.
run() {
  if [ "$DRY_RUN" = 1 ]; then
    echo "+ $(quote_words "$@")"
  else
    "$@"
  fi
}

cmd="${1:-}"
[ $# -gt 0 ] && shift
[ $# -gt 0 ] && [[ "$1" != -* ]] || die "$cmd: expected a TPU name first"
name="$1"
shift

zone="${TPU_ZONE:-}" project="${TPU_PROJECT:-}" accel="" version=""
spot=0 queued=0 worker=0 plan=1 wait=0 extras=""
remote_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run|--dry_run) DRY_RUN=1 ;;
    --zone) zone="$2"; shift ;;
    --zone=*) zone="${1#*=}" ;;
    --project) project="$2"; shift ;;
    --project=*) project="${1#*=}" ;;
    --accelerator-type) accel="$2"; shift ;;
    --accelerator-type=*) accel="${1#*=}" ;;
    --version) version="$2"; shift ;;
    --version=*) version="${1#*=}" ;;
    --spot) spot=1 ;;
    --queued) queued=1 ;;
    --worker) worker="$2"; shift ;;
    --worker=*) worker="${1#*=}" ;;
    --no-plan|--no_plan) plan=0 ;;
    --wait) wait=1 ;;
    --extras) extras="$2"; shift ;;
    --extras=*) extras="${1#*=}" ;;
    --) shift; remote_args=("$@"); break ;;
    *) die "$cmd: unknown option '$1'" ;;
  esac
  shift
done

where=()  # --zone/--project, when given
[ -n "$zone" ] && where+=("--zone=$zone")
[ -n "$project" ] && where+=("--project=$project")

ssh_all() {  # ssh_all REMOTE_COMMAND: run it on every worker
  run gcloud compute tpus tpu-vm ssh "$name" "${where[@]}" --worker=all --command="$1"
}

# The runtime (software) version for an accelerator type's TPU generation.
runtime_for() {
  case "$1" in
    v6e-*) echo "v2-alpha-tpuv6e" ;;
    v5p-*) echo "v2-alpha-tpuv5" ;;
    v5litepod-*|v5e-*) echo "v2-alpha-tpuv5-lite" ;;
    *) echo "tpu-ubuntu2204-base" ;;
  esac
}

# Cloud's accelerator type -> tx_jax plan's target (v5e is 'v5litepod' in Cloud's names).
plan_target() {
  case "$1" in
    v5litepod-*) echo "tpu:v5e-${1#v5litepod-}" ;;
    v4-*|v5p-*|v5e-*|v6e-*) echo "tpu:$1" ;;
    *) die "tpu-run: cannot plan for accelerator type '$1'; pass --no-plan to skip the plan" ;;
  esac
}

# Compile the run for the slice here (tx_jax/planning) and stop if it does not fit.
plan_run() {
  local type="$accel" args=() a
  if [ -z "$type" ]; then
    if [ "$DRY_RUN" = 1 ]; then
      type="v4-8"  # what tpu-create makes by default; a real run asks gcloud
      echo "+ $(quote_words gcloud compute tpus tpu-vm describe "$name" "${where[@]}" \
        --format='value(acceleratorType)')"
    else
      type=$(gcloud compute tpus tpu-vm describe "$name" "${where[@]}" \
        --format='value(acceleratorType)') || die "tpu-run: cannot read $name's accelerator type"
    fi
  fi
  for a in "${remote_args[@]}"; do
    case "$a" in --config=*|--config.*) args+=("$a") ;; esac
  done
  local target py="${TX_JAX_PYTHON:-.venv/bin/python}"
  target=$(plan_target "$type")
  if [ "$DRY_RUN" != 1 ] && ! "$py" -c 'import importlib.util as u, sys
sys.exit(u.find_spec("libtpu") is None or u.find_spec("tx_jax") is None)' 2>/dev/null; then
    die "tpu-run: planning here needs tx_jax with the TPU compiler in $py: ./launch.sh test installs both (or .venv/bin/pip install -e '.[plan]'); or pass --no-plan"
  fi
  if ! run "$py" -m tx_jax plan --target="$target" \
      --programs=train,eval "${args[@]}"; then
    die "tpu-run: not started: the plan above says the run does not fit on $type or cannot be built (fix the config, or pass --no-plan)"
  fi
}

# A VM made by `tpu-create --queued` exists once its queued resource is ACTIVE: wait for that,
# one line a poll. A name that is no queued resource (a plain tpu-create) goes on at once.
wait_until_active() {
  local describe=(gcloud alpha compute tpus queued-resources describe "$name" "${where[@]}"
    --format='value(state.state)')
  if [ "$DRY_RUN" = 1 ]; then
    run "${describe[@]}"  # a real run asks again each TPU_POLL_SECONDS until ACTIVE
    return 0
  fi
  local state start=$SECONDS
  while state=$("${describe[@]}" 2>/dev/null) && [ -n "$state" ]; do
    case "$state" in
      ACTIVE) return 0 ;;
      FAILED|SUSPENDING|SUSPENDED|DELETING)
        die "$cmd: queued resource $name is $state: delete it (tpu-delete $name --queued) and create it again" ;;
    esac
    echo "$cmd: $name is queued ($state, $(( (SECONDS - start) / 60 )) min): waiting until it is ACTIVE"
    sleep "${TPU_POLL_SECONDS:-60}"
  done
}

case "$cmd" in
  tpu-create)
    [ "$spot" = 1 ] && [ "$queued" = 1 ] && die "tpu-create: --spot or --queued, not both"
    [ -n "$version" ] || version=$(runtime_for "${accel:-v4-8}")
    if [ "$queued" = 1 ]; then
      run gcloud alpha compute tpus queued-resources create "$name" "${where[@]}" \
        --node-id="$name" --accelerator-type="${accel:-v4-8}" --runtime-version="$version"
    else
      extra=()
      [ "$spot" = 1 ] && extra+=(--spot)
      run gcloud compute tpus tpu-vm create "$name" "${where[@]}" \
        --accelerator-type="${accel:-v4-8}" --version="$version" "${extra[@]}"
    fi
    ;;
  tpu-setup)
    wait_until_active
    # The working tree as it is (tracked and untracked files, not .venv/runs/.git).
    archive="/tmp/tx_jax-$name.tar.gz"
    run tar czf "$archive" --exclude=.venv --exclude=runs --exclude=.git --exclude=.jax_cache \
      --exclude=__pycache__ --exclude='*.egg-info' --exclude=.pytest_cache --exclude=.ruff_cache .
    run gcloud compute tpus tpu-vm scp "$archive" "$name:tx_jax-setup.tar.gz" "${where[@]}" \
      --worker=all
    ssh_all "mkdir -p $REMOTE_DIR && tar xzf ~/tx_jax-setup.tar.gz -C $REMOTE_DIR \
&& rm ~/tx_jax-setup.tar.gz && cd $REMOTE_DIR && bash scripts/tpu_worker_setup.sh${extras:+ $(
      quote_words "$extras")}"
    ;;
  tpu-run)
    [ ${#remote_args[@]} -gt 0 ] || die "tpu-run: expected -- ARGS... (e.g. -- --config=...)"
    [ "$plan" = 1 ] && plan_run
    args="$(quote_words "${remote_args[@]}" --config.parallel.distributed=True)"
    if [ "$wait" = 1 ]; then
      ssh_all "cd $REMOTE_DIR && .venv/bin/python -m tx_jax train $args"
    else
      ssh_all "cd $REMOTE_DIR && mkdir -p runs && nohup .venv/bin/python -m tx_jax train \
$args > $LOG 2>&1 < /dev/null &"
    fi
    ;;
  tpu-prepare)
    [ ${#remote_args[@]} -gt 0 ] || die "tpu-prepare: expected -- ARGS... (--config=... --workdir=gs://...)"
    run gcloud compute tpus tpu-vm ssh "$name" "${where[@]}" --worker=0 \
      --command="cd $REMOTE_DIR && .venv/bin/python -m tx_jax prepare $(quote_words "${remote_args[@]}")"
    ;;
  tpu-logs)
    run gcloud compute tpus tpu-vm ssh "$name" "${where[@]}" --worker="$worker" \
      --command="tail -n 100 -f $REMOTE_DIR/$LOG"
    ;;
  tpu-delete)
    if [ "$queued" = 1 ]; then
      run gcloud alpha compute tpus queued-resources delete "$name" "${where[@]}" --force --quiet
    else
      run gcloud compute tpus tpu-vm delete "$name" "${where[@]}" --quiet
    fi
    ;;
  *)
    die "unknown command '$cmd' (tpu-create, tpu-setup, tpu-prepare, tpu-run, tpu-logs, tpu-delete)"
    ;;
esac
