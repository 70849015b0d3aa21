# Source on a GPU machine whose python3 already has torch/transformers: puts every package's src on the path
# (every packages/*/src and apps/*/src of this checkout, so a new package needs no edit here).
_moeshard_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$(ls -d "$_moeshard_root"/packages/*/src "$_moeshard_root"/apps/*/src | tr '\n' ':')${PYTHONPATH:-}"
unset _moeshard_root
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
