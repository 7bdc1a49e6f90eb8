# Sourced by the launchers (run_local.sh, run_emulated.sh, the sbatch scripts): parallel_args
# fills PARALLEL_ARGS, Megatron-LM's layout flags, from TP, EP, PP (default 1) and VPP (virtual
# pipeline stages per rank, interleaving; unset: none). Sequence parallelism whenever TP > 1.
# A size that is not a positive whole number is one line and exit status 2; whether the sizes
# fit the ranks and the model, the training script checks (one line naming the flags).
check_sizes() {  # check_sizes NAME...: each variable a positive whole number
    local name
    for name in "$@"; do
        if ! [[ "${!name}" =~ ^[1-9][0-9]*$ ]]; then
            echo "error: $name must be a positive whole number, got '${!name}'" >&2
            exit 2
        fi
    done
}

parallel_args() {
    PP="${PP:-1}"
    check_sizes TP EP PP ${VPP:+VPP}
    PARALLEL_ARGS=(--tensor-model-parallel-size "$TP" --expert-model-parallel-size "$EP"
                   --pipeline-model-parallel-size "$PP")
    if [ "$TP" -gt 1 ]; then PARALLEL_ARGS+=(--sequence-parallel); fi
    if [ -n "${VPP:-}" ]; then PARALLEL_ARGS+=(--virtual-pipeline-model-parallel-size "$VPP"); fi
}
