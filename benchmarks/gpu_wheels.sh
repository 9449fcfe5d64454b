#!/usr/bin/env bash
# The Python packages cnnkit needs that the lent GPU machine's image lacks (it reaches no
# registry), as Python 3.12 manylinux wheels in .whl/ (ignored by git); gpu.sh installs them.
#   bash benchmarks/gpu_wheels.sh        # here, before carrying .whl to the device
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
version() { python3 -c "import importlib.metadata as m; print(m.version('$1'))"; }
mkdir -p .whl
# typing-extensions too: pydantic-core needs a newer one (Sentinel, 4.14) than an image may have
for name in pydantic pydantic-core annotated-types typing-inspection typing-extensions simplejpeg; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 -d .whl "$name==$(version "$name")"
done
ls -la .whl
