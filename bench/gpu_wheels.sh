#!/usr/bin/env bash
# Fetch, on a machine that reaches PyPI, the wheels that bench/gpu_check.sh installs on a GPU machine
# that reaches nothing: every requirement in pyproject.toml (dependencies, the test extra, the build
# system) with what they need in turn, except torch, which the GPU machine brings with its CUDA build.
#
#   bash bench/gpu_wheels.sh            # into .whl/ (kept out of git through .git/info/exclude)
#   WHEELS=/some/dir PYTHON_VERSION=3.12 bash bench/gpu_wheels.sh
#
# The wheels are for CPython $PYTHON_VERSION (default 3.12, the GPU image's) on x86-64 Linux.
# Requirements already installed there are kept as they are: pip takes a wheel only for what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=${WHEELS:-.whl}
PYTHON_VERSION=${PYTHON_VERSION:-3.12}

mapfile -t requirements < <(python - <<'EOF'
import re
import tomllib

with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)
wanted = project["build-system"]["requires"] + project["project"]["dependencies"]
for extra in project["project"].get("optional-dependencies", {}).values():
    wanted += extra
seen = set()
for requirement in wanted:
    name = re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower()
    if name != "torch" and name not in seen:
        seen.add(name)
        print(requirement)
EOF
)

platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$tag")
done
python -m pip download -q --only-binary=:all: --implementation cp --python-version "$PYTHON_VERSION" \
    "${platforms[@]}" -d "$WHEELS" "${requirements[@]}"

if [ "$WHEELS" = .whl ]; then
    exclude=$(git rev-parse --git-path info/exclude)
    grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"
fi
echo "$(ls "$WHEELS" | wc -l) wheels, $(du -sh "$WHEELS" | cut -f1), in $WHEELS"
