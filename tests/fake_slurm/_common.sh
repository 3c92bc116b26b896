# Shared by the stand-in SLURM commands in this folder (sourced, not run).
# FAKE_SLURM_LOG: file that receives one line per call, "<command> <argv...>",
#   each argument shell-quoted so a --wrap payload stays on its line.
# FAKE_SLURM_STATE: folder with one "<jobid>.state" file per job holding
#   "<job-name>|<STATE>|<pid>", the accounting the real slurmdbd would keep.
: "${FAKE_SLURM_LOG:?FAKE_SLURM_LOG must name the call log file}"
: "${FAKE_SLURM_STATE:?FAKE_SLURM_STATE must name the job state folder}"
mkdir -p "$FAKE_SLURM_STATE"

log_call() {
    local line
    line=$(printf '%q ' "$@")
    # flock: several submissions and status queries may log at once.
    flock "$FAKE_SLURM_LOG.lock" sh -c 'printf "%s\n" "$1" >> "$2"' _ "${line% }" "$FAKE_SLURM_LOG"
}

# Print "<jobid>|<STATE>" for every job whose name is $1.
jobs_named() {
    local file name state _pid
    for file in "$FAKE_SLURM_STATE"/*.state; do
        [ -e "$file" ] || continue
        IFS='|' read -r name state _pid < "$file"
        if [ "$name" = "$1" ]; then
            printf '%s|%s\n' "$(basename "$file" .state)" "$state"
        fi
    done
}
